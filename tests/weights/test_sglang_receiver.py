"""Our sender against SGLang's OWN receiving code (the released wheel's rendezvous, flat bucket
layout and receive, see sglang_side.py), over gloo on CPU: the group forms and every tensor lands
bit-exactly, for several buckets of mixed dtypes, in SGLang's one-request-per-bucket form.
The wheel comes from `make setup` (pip download sglang==SGLANG_VERSION --no-deps)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asyncwebrl.inference.engine import params_checksum
from asyncwebrl.weights.control import ControlChannel
from asyncwebrl.weights.sender import WeightSender

SGLANG_VERSION = "0.5.23"
WHEEL_DIR = Path(os.environ.get("ASYNCWEBRL_SGLANG_WHEEL_DIR", Path.home() / ".cache" / "asyncwebrl" / "sglang-wheel"))


@pytest.fixture(scope="module")
def wheel() -> str:
    found = sorted(glob.glob(str(WHEEL_DIR / f"sglang-{SGLANG_VERSION}-*.whl")))
    if not found:
        pytest.fail(f"no sglang-{SGLANG_VERSION} wheel in {WHEEL_DIR}: run `make setup` (it downloads it, no install)")
    return found[-1]


@pytest.fixture()
def sglang_server(wheel, tmp_path):
    portfile = tmp_path / "port"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                       os.environ.get("PYTHONPATH", "")]))
    log = open(tmp_path / "sglang_side.log", "wb")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("sglang_side.py")), wheel, str(portfile)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while not portfile.exists() or not portfile.read_text():
            assert proc.poll() is None, (tmp_path / "sglang_side.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "SGLang side did not start"
            time.sleep(0.2)
        yield f"http://127.0.0.1:{portfile.read_text()}"
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


def test_sender_moves_weights_bit_exact_into_sglangs_own_receiver(sglang_server):
    g = torch.Generator().manual_seed(0)
    named = [("model.embed_tokens.weight", torch.randn(1000, 64, generator=g).to(torch.bfloat16)),
             ("model.layers.0.mlp.up_proj.weight", torch.randn(256, 64, generator=g)),
             ("model.layers.0.input_layernorm.weight", torch.randn(64, generator=g).to(torch.float16)),
             ("model.layers.0.self_attn.q_proj.weight", torch.randn(64, 64, generator=g).to(torch.bfloat16)),
             ("lm_head.weight", torch.randn(1000, 64, generator=g).to(torch.bfloat16))]
    sender = WeightSender([sglang_server], None, bucket_mb=0.1, timeout_s=60)
    try:
        sender.init_group()  # our rendezvous must meet SGLang's init_custom_process_group
        assert sender.announce_once is False  # no bucket_sizes extension: one request per bucket
        report = sender.transfer(named)
        assert report.n_buckets >= 3 and report.announcements == report.n_buckets
        c = ControlChannel([sglang_server], None, 30)
        try:
            got = c.run(c.acall(sglang_server, "/weights_checksum", None, method="GET"))
        finally:
            c.close()
        assert got["names"] == [n for n, _ in named]
        assert got["sha256"] == params_checksum(named)
    finally:
        sender.close()
