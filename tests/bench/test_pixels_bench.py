"""`asyncwebrl bench pixels` with a tiny budget: store mode keeps screenshots out of Ray's object store."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_pixels_smoke(tmp_path):
    cmd = [sys.executable, "-m", "asyncwebrl.cli", "bench", "pixels", "concurrency=[4]", "steps=2",
           "batch_rollouts=2", "object_store_mb=200", "store_capacity_mb=64"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400,
                         env={**os.environ, "ASYNCWEBRL_BENCH_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1].startswith("object_store_bytes_per_step (store) = ")
    f = json.loads((tmp_path / "pixels.json").read_text())["figures"]
    # keys, not screenshots: far fewer bytes per step than the PNG itself
    assert f["object_store_bytes_per_step"] < 0.1 * f["png_bytes_mean"]["page"]
    assert f["object_store_bytes_per_step_vanilla"] > f["png_bytes_mean"]["page"] * 0.5
    assert f["fp32_pixel_values_bytes"]["qwen3vl_fullres_page"] == 23_592_960
