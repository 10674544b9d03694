"""`asyncwebrl bench env` runs end to end and writes its result with the overhead figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.browser
@pytest.mark.slow
def test_bench_env_smoke(tmp_path):
    env = dict(os.environ, ASYNCWEBRL_BENCH_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "asyncwebrl.cli", "bench", "env", "sessions=[1,2]", "duration_s=1",
                          "repeats=1"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].startswith("env overhead")
    doc = json.loads((tmp_path / "env.json").read_text())
    figs = doc["figures"]
    assert set(figs["levels"]) == {"1", "2"} and isinstance(figs["overhead"], float)
    assert all(lv["raw_steps_s"] > 0 and lv["ours_steps_s"] > 0 for lv in figs["levels"].values())
    assert figs["pss_mb_per_session"] > 0


def test_bench_env_rejects_bad_knobs():
    out = subprocess.run([sys.executable, "-m", "asyncwebrl.cli", "bench", "env", "sessions=[0]"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "sessions" in out.stderr
    out = subprocess.run([sys.executable, "-m", "asyncwebrl.cli", "bench", "env", "colour=1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "unknown benchmark knob" in out.stderr
