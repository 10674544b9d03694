"""The one server launcher: healthy on return, and no server outlives the process that launched it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from asyncwebrl.models.prepare import resolve_model_path
from asyncwebrl.scheduling.servers import launch_server


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie of ours does not count
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"


def test_server_exits_when_its_launcher_is_sigkilled(tmp_path):
    model = resolve_model_path("tiny-qwen2.5-vl")
    launcher = textwrap.dedent(f"""
        import sys, time
        from asyncwebrl.scheduling.servers import launch_server
        srv = launch_server(model={model!r}, log_path={str(tmp_path / "server.log")!r}, startup_timeout=300)
        print(srv.pid, srv.address, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    try:
        pid, address = proc.stdout.readline().split()
        pid = int(pid)
        assert _alive(pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(pid), "the server outlived its SIGKILLed launcher"
        assert "launcher" in (tmp_path / "server.log").read_text()
    finally:
        proc.kill()


def test_a_server_that_cannot_start_fails_with_its_log(tmp_path):
    with pytest.raises(RuntimeError, match="exited with code") as e:
        launch_server(model=str(tmp_path / "no-such-model"), log_path=tmp_path / "log", startup_timeout=120)
    assert "no-such-model" in str(e.value)  # the log's tail explains why
