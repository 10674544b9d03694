"""Checkpoints written behind the trainer: the caller blocks only for the snapshot, later in-place
updates do not leak into the files, a reader sees only complete checkpoints while a write is under
way, at most one write is in flight, and a process killed during a background write leaves the
previous checkpoint usable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import torch

from asyncwebrl.training.checkpoint import (
    CheckpointWriter,
    latest_complete_checkpoint,
    prune,
    read_checkpoint,
)


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g).to(torch.bfloat16)}


def test_background_write_snapshots_and_publishes_complete_only(tmp_path):
    w = CheckpointWriter()
    w.submit(tmp_path, 1, 1, state(1), None, {"step": torch.tensor(3.0)}, {"pos": 1})
    assert w.wait().name == "version_00000001"

    release, reached = threading.Event(), threading.Event()

    def hold():  # the writer thread stops here with everything but the COMPLETE marker on disk
        reached.set()
        assert release.wait(60)

    live = state(2)
    want = {k: v.clone() for k, v in live.items()}
    t0 = time.perf_counter()
    path = w.submit(tmp_path, 2, 2, live, None, None, {"pos": 2}, _before_publish=hold)
    blocked_s = time.perf_counter() - t0
    for v in live.values():  # training goes on mutating its tensors in place
        v.add_(1.0)
    assert reached.wait(60)
    assert w.busy and blocked_s < 5.0
    assert latest_complete_checkpoint(tmp_path).name == "version_00000001"  # the test rollout's view

    # at most one write in flight: the next submit waits for this one to publish
    third = threading.Thread(target=lambda: w.submit(tmp_path, 3, 3, state(3), None))
    third.start()
    time.sleep(0.5)
    assert third.is_alive()
    release.set()
    third.join(60)
    assert not third.is_alive()
    w.wait()
    got = read_checkpoint(path)
    assert all(torch.equal(got["model"][k], want[k]) for k in want)  # the snapshot, not the mutated tensors
    assert latest_complete_checkpoint(tmp_path).name == "version_00000003"


CHILD = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from asyncwebrl.training.checkpoint import CheckpointWriter
    root = Path(sys.argv[1])
    w = CheckpointWriter()
    w.submit(root, 1, 1, {"w": torch.full((512, 512), 1.0)}, None, None, {"pos": 1})
    w.wait()
    def stall():
        (root / "reached").write_text("1")
        time.sleep(120)
    w.submit(root, 2, 2, {"w": torch.full((512, 512), 2.0)}, None, None, {"pos": 2}, _before_publish=stall)
    time.sleep(120)
""")


def test_kill_during_background_write_leaves_previous_checkpoint_usable(tmp_path):
    root = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH", "")] if p))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(root)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not (root / "reached").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)  # as a crash or an OOM kill would
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert any(p.name.startswith(".tmp-version_00000002") for p in root.iterdir())  # the write was under way
    latest = latest_complete_checkpoint(root)
    assert latest.name == "version_00000001"
    got = read_checkpoint(latest)
    assert torch.equal(got["model"]["w"], torch.full((512, 512), 1.0)) and got["extra_state"] == {"pos": 1}
    prune(root, keep_last=1)
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())
