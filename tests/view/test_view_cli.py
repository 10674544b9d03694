"""`asyncwebrl view RUN_DIR [--serve --port N]` as a user runs it: a real subprocess, a real HTTP server."""

from __future__ import annotations

import queue
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

from asyncwebrl.controller.rundir import RunDir
from asyncwebrl.view.report import make_server

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncwebrl.cli", "view", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def _small_run(root: Path) -> None:
    rd = RunDir(root, tensorboard=False)
    for s in range(3):
        rd.log_metrics("train", s, {"reward_mean": 0.1 * s, "success_rate": 0.2 * s})
        rd.log_phase(s, "train", 2.0 * s, 2.0 * s + 1.5)
    rd.close()


def test_cli_writes_the_report(tmp_path):
    _small_run(tmp_path / "run")
    res = _cli(str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr
    assert "report:" in res.stdout and "0 episodes" in res.stdout
    index = tmp_path / "run" / "report" / "index.html"
    assert "AsyncWebRL run report" in index.read_text()
    assert (tmp_path / "run" / "report" / "plots" / "learning_step.png").is_file()
    assert (tmp_path / "run" / "report" / "assets" / "viewer.js").is_file()


def test_cli_rejects_a_missing_or_wrong_run_dir(tmp_path):
    res = _cli(str(tmp_path / "no-such-run"))
    assert res.returncode == 2 and "does not exist" in res.stderr and "Traceback" not in res.stderr
    f = tmp_path / "file.txt"
    f.write_text("x")
    res = _cli(str(f))
    assert res.returncode == 2 and "not a directory" in res.stderr and "Traceback" not in res.stderr


def test_server_binds_loopback_only(tmp_path):
    server = make_server(tmp_path, 0)
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.server_close()


def _read_lines(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(line)


def test_serve_until_ctrl_c(tmp_path):
    _small_run(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "-m", "asyncwebrl.cli", "view", str(tmp_path / "run"), "--serve",
                             "--port", "0"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
    try:
        url = None
        while url is None:
            line = lines.get(timeout=120)
            if line.startswith("serving "):
                url = line.split()[1]
        assert url.startswith("http://127.0.0.1:")
        # generous timeouts: on a loaded 2-core box the first request and the shutdown can take seconds
        with urllib.request.urlopen(url, timeout=60) as r:
            assert r.status == 200 and "AsyncWebRL run report" in r.read().decode()
        with urllib.request.urlopen(url.replace("index.html", "plots/learning_step.png"), timeout=60) as r:
            assert r.read(8) == b"\x89PNG\r\n\x1a\n"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_serve_on_a_busy_port_fails_clearly(tmp_path):
    _small_run(tmp_path / "run")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        res = _cli(str(tmp_path / "run"), "--serve", "--port", str(port))
    assert res.returncode == 1 and f"cannot serve on 127.0.0.1:{port}" in res.stderr
    assert "Traceback" not in res.stderr
    res = _cli(str(tmp_path / "run"), "--serve", "--port", "70000")
    assert res.returncode == 1 and "out of range" in res.stderr
