"""`asyncwebrl bench train` runs the production trainer on a web-shaped batch and writes its figures
(throughput, MFU against the measured matmul, the time split, the share of weights a step moved)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_train_tiny_shape_writes_its_figures(tmp_path):
    env = dict(os.environ, ASYNCWEBRL_BENCH_DIR=str(tmp_path), PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-m", "asyncwebrl.cli", "bench", "train", "shapes=tiny", "n_samples=4",
                          "steps=1"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tokens/s" in out.stdout.splitlines()[-1]
    fig = json.loads((tmp_path / "train.json").read_text())["figures"]["tiny"]
    assert fig["packing"] is True and fig["recipe"] == "fp32"
    assert fig["n_samples"] == 4 and fig["tokens"] > 4 * 200  # a web-shaped prompt: ~200 words + a screenshot
    assert fig["output_tokens"] == 4 * 16
    assert fig["tokens_per_s"] == pytest.approx(fig["tokens"] / fig["step_s"])
    assert fig["flops_per_step"] == pytest.approx(8 * fig["nonembedding_trainable_params"] * fig["tokens"])
    assert fig["mfu"] is None and 0 < fig["mfu_vs_matmul"]  # no datasheet peak on a CPU
    split = fig["split"]
    # one rank with packing embeds the screenshots up front: the vision tower is its own phase
    for phase in ("pixel_fetch_s", "image_processing_s", "vision_s", "forward_s", "backward_s", "optimizer_s", "prox_s"):
        assert split[phase] > 0, phase
    # the split is that of one extra step synchronized at every phase boundary; it accounts for all of it
    assert sum(split.values()) == pytest.approx(fig["profiled_step_s"], rel=0.05)
    assert fig["weights_changed_frac"] > 0.9  # Adam's first steps move (nearly) every weight
