"""Command line of a production SGLang server (`python -m sglang.launch_server ...`) for GPU nodes.

The rollout side speaks the same native HTTP API to SGLang and to the embedded `hf` server, so the
only SGLang-specific piece is how a server is started. One server per device (tp=1, SPEC section 1);
the scheduler sets CUDA_VISIBLE_DEVICES. SGLang needs CUDA, so on this project's CPU machines only
the command line is built and checked.

Invariant: the command binds 127.0.0.1 unless a host is given, always has tp size 1, and never
carries the API key (launchers put it in $ASYNCWEBRL_API_KEY; see `api_key_from_env`).

Example (what `sglang_command(SGLangLaunch(model_path="/models/qwen2.5-vl-3b", port=30001))` gives):
    python -m sglang.launch_server --model-path /models/qwen2.5-vl-3b --host 127.0.0.1 --port 30001
        --tp-size 1 --mem-fraction-static 0.8 --dtype bfloat16 --enable-multimodal --random-seed 0
        --log-level warning
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from asyncwebrl.net import LOOPBACK


@dataclass(kw_only=True)
class SGLangLaunch:
    """Everything the system sets when it starts one SGLang server."""

    model_path: str
    """HF model folder or hub id"""
    port: int
    """HTTP port"""
    host: str = LOOPBACK
    """bind address (loopback unless the rollout workers are on other nodes)"""
    mem_fraction_static: float = 0.8
    """fraction of GPU memory for weights + KV cache"""
    dtype: str = "bfloat16"
    """parameter / activation dtype: auto, float16, bfloat16, float32"""
    context_length: int | None = None
    """longest prompt + generation (None: the model's own)"""
    max_running_requests: int | None = None
    """most requests decoded together (None: SGLang's choice)"""
    api_key_from_env: bool = False
    """require 'Authorization: Bearer KEY' with the key taken from $ASYNCWEBRL_API_KEY inside the
    process (SGLang reads it from argv only; a -c shim appends it there, so /proc/PID/cmdline never
    shows it)"""
    allow_auto_truncate: bool = False
    """clamp max_new_tokens to the context instead of refusing the request"""
    enable_multimodal: bool = True
    """vision-language models (screenshots)"""
    random_seed: int = 0
    """sampling seed of the server"""
    weight_version: str | None = None
    """initial weight version the server reports (SGLang >= 0.5)"""
    log_level: str = "warning"
    """SGLang log level"""
    python: str = field(default_factory=lambda: sys.executable)
    """interpreter of the GPU node's environment"""
    extra_args: list[str] = field(default_factory=list)
    """further launch_server flags, passed through verbatim"""

    def validate(self) -> None:
        if not self.model_path:
            raise ValueError("sglang launch: model_path is empty")
        if not 0 < self.port < 65536:
            raise ValueError(f"sglang launch: port {self.port} is not in 1..65535")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError("sglang launch: mem_fraction_static must be in (0, 1)")
        if self.dtype not in ("auto", "float16", "bfloat16", "float32", "half"):
            raise ValueError(f"sglang launch: unknown dtype '{self.dtype}'")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError("sglang launch: context_length must be >= 1")


_KEY_FROM_ENV = ("import os, runpy, sys; sys.argv += ['--api-key', os.environ.pop('ASYNCWEBRL_API_KEY')]; "
                 "runpy.run_module('sglang.launch_server', run_name='__main__')")
"""runs SGLang's launcher with the key appended to its in-process argv only"""


def sglang_command(launch: SGLangLaunch | None = None, /, **fields: Any) -> list[str]:
    """argv of `python -m sglang.launch_server` for one tp=1 server; pass an SGLangLaunch or its
    fields as keywords (`sglang_command(model_path=..., port=..., api_key=None)`)."""
    if launch is None:
        launch = SGLangLaunch(**fields)
    elif fields:
        raise TypeError("give an SGLangLaunch or keyword fields, not both")
    launch.validate()
    cmd = [
        *([launch.python, "-c", _KEY_FROM_ENV] if launch.api_key_from_env else [launch.python, "-m", "sglang.launch_server"]),
        "--model-path", launch.model_path,
        "--host", launch.host,
        "--port", str(launch.port),
        "--tp-size", "1",
        "--mem-fraction-static", str(launch.mem_fraction_static),
        "--dtype", launch.dtype,
    ]
    if launch.enable_multimodal:
        cmd.append("--enable-multimodal")
    if launch.context_length is not None:
        cmd += ["--context-length", str(launch.context_length)]
    if launch.max_running_requests is not None:
        cmd += ["--max-running-requests", str(launch.max_running_requests)]
    if launch.allow_auto_truncate:
        cmd.append("--allow-auto-truncate")
    if launch.weight_version is not None:
        cmd += ["--weight-version", str(launch.weight_version)]
    cmd += ["--random-seed", str(launch.random_seed), "--log-level", launch.log_level]
    return cmd + list(launch.extra_args)


def hf_command(model_path: str, port: int, *, host: str = LOOPBACK, device: str = "cpu",
               dtype: str = "float32", key_scope: str | None = None, max_batch_size: int = 32,
               max_context_len: int = 4096, threads: int = 0, weight_sync_timeout_s: float | None = None,
               parent_pid: int | None = None, allow_auto_truncate: bool = False,
               weights_roots: list[str] | tuple[str, ...] = (),
               trainer_addresses: list[str] | tuple[str, ...] = ()) -> list[str]:
    """argv of the embedded server (`asyncwebrl serve --backend hf ...`), the same shape for schedulers.
    The key is not in it: the launcher passes it in $ASYNCWEBRL_API_KEY."""
    cmd = [sys.executable, "-m", "asyncwebrl.cli", "serve", "--backend", "hf", "--model", model_path,
           "--host", host, "--port", str(port), "--device", device, "--dtype", dtype,
           "--max-batch-size", str(max_batch_size), "--max-context-len", str(max_context_len),
           "--threads", str(threads)]
    if key_scope:
        cmd += ["--key-scope", key_scope]
    if allow_auto_truncate:
        cmd.append("--allow-auto-truncate")
    for r in weights_roots:
        cmd += ["--weights-root", str(r)]
    for t in trainer_addresses:
        cmd += ["--trainer-address", str(t)]
    if weight_sync_timeout_s:
        cmd += ["--weight-sync-timeout", str(weight_sync_timeout_s)]
    if parent_pid:
        cmd += ["--parent-pid", str(parent_pid)]
    return cmd
