"""Atomic checkpoints: a kill at any moment of a write leaves the previous checkpoint usable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from asyncwebrl.training.checkpoint import (
    MODEL_FILE,
    complete_checkpoints,
    latest_complete_checkpoint,
    read_checkpoint,
    write_checkpoint,
)

WRITER = """
import sys, torch
from asyncwebrl.training.checkpoint import write_checkpoint
root = sys.argv[1]
state = {f"w{i}": torch.full((1024, 1024), float(i)) for i in range(24)}  # ~100 MB per checkpoint
v = 1
while True:
    for t in state.values():
        t.fill_(float(v))
    write_checkpoint(root, v, v, state, None, {"step": v}, {"v": v}, keep_last=2)
    print(v, flush=True)
    v += 1
"""


def test_simulated_crash_mid_write_keeps_previous(tmp_path):
    write_checkpoint(tmp_path, 1, 1, {"w": torch.ones(3)}, None, extra_state={"pos": 10})
    with pytest.raises(RuntimeError, match="simulated crash"):
        write_checkpoint(tmp_path, 2, 2, {"w": torch.full((3,), 2.0)}, None, _crash_after_model=True)
    latest = latest_complete_checkpoint(tmp_path)
    assert latest.name == "version_00000001"
    ck = read_checkpoint(latest)
    assert ck["extra_state"] == {"pos": 10} and torch.equal(ck["model"]["w"], torch.ones(3))


def test_incomplete_folder_is_refused(tmp_path):
    (tmp_path / "version_00000009").mkdir()
    assert latest_complete_checkpoint(tmp_path) is None
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        read_checkpoint(tmp_path / "version_00000009")


def test_keep_last_prunes_old_checkpoints(tmp_path):
    for v in range(1, 6):
        write_checkpoint(tmp_path, v, v, {"w": torch.full((2,), float(v))}, None, keep_last=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["version_00000004", "version_00000005"]


@pytest.mark.slow
def _wait_for(pred, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.001)
    return False


def _in_write(root, stage):
    """True while the writer is inside a later write: a `.tmp-` folder exists and (for `stage`
    "model") already holds the model file."""
    tmps = [p for p in root.iterdir() if p.name.startswith(".tmp-")] if root.exists() else []
    if stage == "started":
        return bool(tmps)
    return any((t / MODEL_FILE).exists() for t in tmps)


def test_kill_during_write_leaves_a_usable_checkpoint(tmp_path):
    """SIGKILL the writer while a write is under way (found by watching for its `.tmp-` folder, so
    the kill does not depend on this machine's disk speed), at three different points of it."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    hit_mid_write = 0
    for stage in ("started", "model", "started-late"):
        root = tmp_path / f"run-{stage}"
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root)], stdout=subprocess.PIPE, env=env, text=True)
        try:
            first = proc.stdout.readline()  # one complete checkpoint exists
            assert first.strip() == "1"
            if stage == "started-late":
                assert proc.stdout.readline().strip() == "2"  # a later write, after a prune ran
            point = stage.removesuffix("-late")
            assert _wait_for(lambda r=root, s=point: _in_write(r, s)), "the writer never began another write"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        hit_mid_write += any(p.name.startswith(".tmp-") for p in root.iterdir())
        latest = latest_complete_checkpoint(root)
        assert latest is not None
        ck = read_checkpoint(latest)
        v = ck["version"]
        # self-consistent: every tensor holds the value of its own version
        assert all(torch.all(t == float(v)) for t in ck["model"].values())
        assert ck["extra_state"] == {"v": v} and ck["optimizer"] == {"step": v}
    assert hit_mid_write >= 1, "no kill landed inside a write; the test proved nothing"
