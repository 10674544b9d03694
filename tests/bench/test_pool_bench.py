"""`asyncwebrl bench pool` as a user runs it, with a tiny budget: table, headline, JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_pool_smoke(tmp_path):
    cmd = [sys.executable, "-m", "asyncwebrl.cli", "bench", "pool", "steps=2", "capacity_steps=2", "train_step_s=0.2",
           "step_latency_ms=5", "warmup_ms=20", "standin_gen_ms=5", "batch_size=2", "concurrency=2", "n_samples=2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "ASYNCWEBRL_BENCH_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("speedup async/sync = ") and "STAND-IN" in last
    doc = json.loads((tmp_path / "pool.json").read_text())
    f = doc["figures"]
    assert doc["name"] == "pool" and f["speedup"] > 0 and f["policy"].startswith("GENERATION STAND-IN")
    assert set(f["phases"]) == {"capacity", "async", "sync"}
    assert f["phases"]["async"]["trajectories"] == 2 * 2 * 2
    bad = subprocess.run([sys.executable, "-m", "asyncwebrl.cli", "bench", "pool", "polcy=x"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "unknown benchmark knob 'polcy'" in bad.stderr
