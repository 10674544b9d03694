"""Starting inference server processes on given devices, under either scheduler.

An embedded (`hf`) server is the `asyncwebrl serve` command in its own process; an `sglang` server
is SGLang's launcher command. Either way the address is known only once `/health` answers.
Invariant: a `ServerProcess` that exists is healthy at creation, and `stop()` leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    address: str
    """http://host:port"""
    device: str
    proc: subprocess.Popen | None = field(default=None, repr=False)
    log_path: Path | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if not self.proc or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def server_command(backend: str, model: str, host: str, port: int, device: str, dtype: str,
                   api_key: str | None, max_batch_size: int, mem_fraction: float = 0.8,
                   threads: int = 0, weight_sync_timeout_s: float | None = None) -> list[str]:
    if backend == "sglang":
        from asyncwebrl.inference.sglang_launcher import sglang_command

        return sglang_command(model_path=model, host=host, port=port, dtype=dtype,
                              mem_fraction_static=mem_fraction, api_key=api_key)
    if backend != "hf":
        raise ValueError(f"no launcher for inference backend '{backend}' (use hf or sglang)")
    cmd = [sys.executable, "-m", "asyncwebrl.cli", "serve", "--backend", "hf", "--model", model,
           "--host", host, "--port", str(port), "--device", device, "--dtype", dtype,
           "--max-batch-size", str(max_batch_size), "--threads", str(threads)]
    if weight_sync_timeout_s:
        cmd += ["--weight-sync-timeout", str(weight_sync_timeout_s)]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd


def wait_healthy(address: str, proc: subprocess.Popen | None, timeout: float, api_key: str | None = None) -> None:
    deadline = time.time() + timeout
    req = urllib.request.Request(address + "/health")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"inference server at {address} exited with code {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"inference server at {address} not healthy after {timeout:.0f} s")


def launch_server(*, backend: str = "hf", model: str, device: str = "cpu", dtype: str = "float32",
                  host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                  max_batch_size: int = 32, log_dir: Path | None = None, startup_timeout: float = 300.0,
                  cpu_threads: int = 0, weight_sync_timeout_s: float | None = None,
                  name: str = "server") -> ServerProcess:
    """Start one server process on `device` and wait until it answers /health."""
    port = port or free_port(host)
    env = dict(os.environ)
    if device.startswith("cuda:"):
        # The server sees exactly one device, as cuda:0.
        env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        device_arg = "cuda:0"
    else:
        device_arg = device
    cmd = server_command(backend, model, host, port, device_arg, dtype, api_key, max_batch_size,
                         threads=cpu_threads, weight_sync_timeout_s=weight_sync_timeout_s)
    log_path = None
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}-{port}.log"
        out = open(log_path, "ab")
    else:
        out = subprocess.DEVNULL
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://{host}:{port}"
    sp = ServerProcess(address=address, device=device, proc=proc, log_path=log_path)
    try:
        wait_healthy(address, proc, startup_timeout, api_key)
    except BaseException:
        sp.stop()
        raise
    return sp
