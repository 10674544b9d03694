"""Gymnasium is an optional extra: the package imports without it, and the Gymnasium wrapper says
how to install it."""

import subprocess
import sys

BLOCK = "import sys; sys.modules['gymnasium'] = None; "


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, timeout=120)


def test_package_works_without_gymnasium():
    r = _run("import asyncwebrl.web.tasks, asyncwebrl.rollout.episode, asyncwebrl.cli; print('ok')")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_gym_wrapper_names_the_extra_when_gymnasium_is_missing():
    r = _run("import asyncwebrl.web.gym_env")
    assert r.returncode != 0
    assert "ImportError: asyncwebrl.web.gym_env needs Gymnasium" in r.stderr and "asyncwebrl[gym]" in r.stderr
