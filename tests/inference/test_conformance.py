"""`asyncwebrl serve` passes the SGLang conformance script (asyncwebrl.inference.conformance): batch
prompts, images, logprob shapes, streaming, error shape, control endpoints. The server is the real CLI
in its own process (tiny model, loopback, key in its environment); the script is run as a user would,
`python -m asyncwebrl.inference.conformance URL`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from asyncwebrl.httpguard import new_key
from asyncwebrl.net import free_port
from asyncwebrl.scheduling.servers import wait_healthy

pytestmark = pytest.mark.slow


def test_asyncwebrl_serve_speaks_sglangs_documented_api(tmp_path):
    from asyncwebrl.models.prepare import resolve_model_path

    port, key = free_port(), new_key()
    env = {**os.environ, "ASYNCWEBRL_API_KEY": key}
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([sys.executable, "-m", "asyncwebrl", "serve", "--model", resolve_model_path("tiny-qwen2.5-vl"),
                             "--port", str(port), "--max-context-len", "256", "--parent-pid", str(os.getpid())],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", 300, proc=proc)
        out = subprocess.run([sys.executable, "-m", "asyncwebrl.inference.conformance", f"http://127.0.0.1:{port}"],
                             env=env, capture_output=True, text=True, timeout=600)
        lines = out.stdout.strip().splitlines()
        assert out.returncode == 0, out.stdout + out.stderr
        passed = {ln.split()[1].rstrip(":") for ln in lines if ln.startswith("PASS ")}
        assert {"batch_text", "batch_input_ids_rid", "image_batch", "generate_input_ids_logprobs", "stream",
                "error_shape_bad_param", "error_shape_context", "control_needs_key"} <= passed, out.stdout
        assert not [ln for ln in lines if ln.startswith("FAIL ")]
        # without the key the same script fails (its control checks are not vacuous)
        nokey = {k: v for k, v in env.items() if k != "ASYNCWEBRL_API_KEY"}
        out = subprocess.run([sys.executable, "-m", "asyncwebrl.inference.conformance", f"http://127.0.0.1:{port}"],
                             env=nokey, capture_output=True, text=True, timeout=600)
        assert out.returncode == 1 and "FAIL generate_text" in out.stdout
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
