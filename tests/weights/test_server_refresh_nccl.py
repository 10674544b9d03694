"""Weight update over NCCL between a trainer process on one GPU and a server on another (needs 2
CUDA devices; CPU machines skip it, the gloo path in test_weights.py covers the same contract)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from asyncwebrl.scheduling.servers import free_port, launch_server, wait_healthy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


def test_nccl_broadcast_lands_bit_exactly_in_a_gpu_server(tmp_path):
    from asyncwebrl.models.prepare import resolve_model_path

    model = resolve_model_path("tiny-qwen2.5-vl")
    srv = launch_server(wait=False, model=model, device="cuda:0", dtype="bfloat16", log_path=str(tmp_path / "log"))
    key_env = {**os.environ, "ASYNCWEBRL_API_KEY": srv.api_key}  # trainer_proc sends the server's key
    try:
        wait_healthy(srv.address, 300, proc=srv)
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("trainer_proc.py")), "--server", srv.address,
             "--model", model, "--port", str(free_port()), "--version", "3", "--backend", "nccl",
             "--device", "cuda:1", "--dtype", "bfloat16"], capture_output=True, text=True, timeout=300, env=key_env)
        assert proc.returncode == 0, proc.stderr[-3000:] + srv.log_tail()
        sent = json.loads(proc.stdout.strip().splitlines()[-1])
        assert all(r["success"] for r in sent["replies"]), sent
        with urllib.request.urlopen(srv.address + "/weights_checksum", timeout=60) as r:
            served = json.loads(r.read())
        assert served == {"sha256": sent["checksum"], "weight_version": "3"}
    finally:
        srv.stop()
