"""Starting inference server processes on given devices: the one launcher every caller uses
(schedulers, the supervisor, evaluation, benchmarks, tests).

An embedded (`hf`) server is the `asyncwebrl serve` command in its own process; an `sglang` server
is SGLang's launcher command. Either way the address is known only once `/health` answers.
Invariants: `launch_server(wait=True)` returns a healthy `ServerProcess`; `stop()` leaves no process
behind; every launched server has a key (the caller's, or a fresh random one), handed over in the
child's environment ($ASYNCWEBRL_API_KEY), never on its command line, and kept in
`ServerProcess.api_key` for the clients that control it; an embedded server whose launcher dies (even by SIGKILL) exits on its own, because it
watches its parent (`--parent-pid`) — servers live in their own process group, so no signal from
the launcher's group reaches them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from asyncwebrl.httpguard import new_key
from asyncwebrl.net import (
    LOOPBACK,
    WILDCARDS,
    advertised_address,
    answers_health,
    bind_address,
    collective_interface_env,
    free_port,
)

KEY_ENV = "ASYNCWEBRL_API_KEY"

__all__ = ["ServerProcess", "free_port", "launch_server", "server_command", "wait_healthy"]


@dataclass
class ServerProcess:
    address: str
    """http://host:port"""
    device: str
    proc: subprocess.Popen | None = field(default=None, repr=False)
    log_path: Path | None = None
    api_key: str | None = field(default=None, repr=False)
    """the server's key: control endpoints always need it (every endpoint when the caller chose it)"""

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

    def log_tail(self, n: int = 4000) -> str:
        if not self.log_path or not Path(self.log_path).exists():
            return ""
        return Path(self.log_path).read_text(errors="replace")[-n:]


def server_command(backend: str, model: str, host: str, port: int, device: str, dtype: str,
                   key_scope: str | None, max_batch_size: int, mem_fraction: float = 0.8,
                   threads: int = 0, weight_sync_timeout_s: float | None = None,
                   max_context_len: int = 4096, parent_pid: int | None = None, allow_auto_truncate: bool = False,
                   weights_roots: list[str] | tuple[str, ...] = (),
                   trainer_addresses: list[str] | tuple[str, ...] = ()) -> list[str]:
    """argv of one server; the key goes in the environment (KEY_ENV), never here."""
    if backend == "sglang":
        from asyncwebrl.inference.sglang_launcher import sglang_command

        return sglang_command(model_path=model, host=host, port=port, dtype=dtype, mem_fraction_static=mem_fraction,
                              api_key_from_env=True, context_length=max_context_len,
                              max_running_requests=max_batch_size, allow_auto_truncate=allow_auto_truncate)
    if backend != "hf":
        raise ValueError(f"no launcher for inference backend '{backend}' (use hf or sglang)")
    from asyncwebrl.inference.sglang_launcher import hf_command

    return hf_command(model, port, host=host, device=device, dtype=dtype, key_scope=key_scope,
                      max_batch_size=max_batch_size, max_context_len=max_context_len, threads=threads,
                      weight_sync_timeout_s=weight_sync_timeout_s, parent_pid=parent_pid,
                      allow_auto_truncate=allow_auto_truncate, weights_roots=weights_roots,
                      trainer_addresses=trainer_addresses)


def wait_healthy(address: str, timeout_s: float = 300.0, *, proc: ServerProcess | subprocess.Popen | None = None,
                 api_key: str | None = None) -> None:
    """Poll GET /health until 200. RuntimeError (with the log's tail) if the process exits first,
    TimeoutError when the time runs out."""
    popen = proc.proc if isinstance(proc, ServerProcess) else proc
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if popen is not None and popen.poll() is not None:
            tail = proc.log_tail() if isinstance(proc, ServerProcess) else ""
            raise RuntimeError(f"inference server at {address} exited with code {popen.returncode} "
                               f"before it was healthy" + (f":\n{tail}" if tail else ""))
        if answers_health(address, api_key, timeout_s=5):
            return
        time.sleep(0.3)
    raise TimeoutError(f"inference server at {address} not healthy after {timeout_s:.0f} s")


def launch_server(*, backend: str = "hf", model: str, device: str = "cpu", dtype: str = "float32",
                  host: str = LOOPBACK, port: int = 0, api_key: str | None = None,
                  max_batch_size: int = 32, max_context_len: int = 4096, log_dir: Path | None = None,
                  log_path: Path | str | None = None, startup_timeout: float = 300.0, cpu_threads: int = 0,
                  weight_sync_timeout_s: float | None = None, env: dict[str, str] | None = None,
                  wait: bool = True, name: str = "server", allow_auto_truncate: bool = True,
                  weights_roots: list[str] | tuple[str, ...] = (),
                  trainer_addresses: list[str] | tuple[str, ...] = (), multi_node: bool = False,
                  niceness: int = 0) -> ServerProcess:
    """Start one server process on `device` ('cpu' or 'cuda:N': the server then sees only GPU N, as
    cuda:0). Its log goes to `log_path`, or to `log_dir/NAME-PORT.log`, or nowhere. With `wait` it
    returns once /health answers (stopping the process if it never does). `host` 'node' binds this
    node's address (loopback unless `multi_node`, then Ray's node IP); a wildcard bind is advertised
    at the node's address.

    Key: `api_key` guards every endpoint but /health; without one a fresh random key guards the
    control endpoints of a loopback server (generation stays open to this machine's programs) and
    every endpoint of a server on any other address. Either way it is in
    `ServerProcess.api_key`. `allow_auto_truncate` (on: the rollout's budgets assume it) clamps
    max_new_tokens to the context; `weights_roots` are the folders update_weights_from_disk may read;
    `trainer_addresses` the hosts init_weights_update_group may dial besides loopback; `niceness` >
    0 runs the server at that lower priority (roles sharing CPU cores: scheduling/budget.py)."""
    host = bind_address(host, multi_node)
    port = port or free_port(LOOPBACK if host in WILDCARDS else host)
    key = api_key or new_key()
    full_env = {**os.environ, **(env or {}), KEY_ENV: key}
    if multi_node and host not in WILDCARDS:  # its collectives (the weight group) use the same interface
        full_env.update(collective_interface_env(host))
    if device.startswith("cuda:"):
        full_env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        device_arg = "cuda:0"
    else:
        device_arg = device
    from asyncwebrl.inference.policy import is_loopback

    scope = "control" if api_key is None and is_loopback(host) else "all"  # off-box clients always need the key
    cmd = server_command(backend, model, host, port, device_arg, dtype, scope,
                         max_batch_size, threads=cpu_threads, weight_sync_timeout_s=weight_sync_timeout_s,
                         max_context_len=max_context_len, parent_pid=os.getpid(),
                         allow_auto_truncate=allow_auto_truncate, weights_roots=weights_roots,
                         trainer_addresses=trainer_addresses)
    if log_path is None and log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        log_path = Path(log_dir) / f"{name}-{port}.log"
    out = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115 (the child owns it)
    try:
        proc = subprocess.Popen(cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=(lambda: os.nice(niceness)) if niceness > 0 else None)
    finally:
        if out is not subprocess.DEVNULL:
            out.close()
    sp = ServerProcess(address=f"http://{advertised_address(host, multi_node)}:{port}", device=device, proc=proc,
                       log_path=Path(log_path) if log_path is not None else None, api_key=key)
    if wait:
        try:
            wait_healthy(sp.address, startup_timeout, proc=sp, api_key=key)
        except BaseException:
            sp.stop()
            raise
    return sp
