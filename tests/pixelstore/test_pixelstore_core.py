"""The in-process PixelStore's own knobs (the shared contract is in test_contract.py): eviction of
orphans by age, and the store a run's scheduler gets."""

from __future__ import annotations

import time

import pytest

from asyncwebrl.config import load_run_config
from asyncwebrl.pixelstore import make_pixel_store
from asyncwebrl.pixelstore.store import InProcessPixelStore


def test_orphans_older_than_max_age_go_whatever_their_refcount():
    s = InProcessPixelStore("mem", 10_000, put_timeout_s=1.0, max_age_s=0.2)
    old = s.put(b"orphan", refs=3)  # a consumer that died holds these references forever
    time.sleep(1.3)  # past the age and the once-a-second sweep
    new = s.put(b"fresh")
    assert s.get([old, new]) == [None, b"fresh"]
    assert s.stats()["evictions"] == 1 and s.stats()["bytes"] == len(b"fresh")


def test_close_drops_everything_and_the_store_takes_puts_again():
    s = InProcessPixelStore("mem", 100, put_timeout_s=5.0)
    s.put(b"x" * 100)
    s.close()
    assert s.stats()["items"] == 0
    assert s.get([s.put(b"y" * 100)]) == [b"y" * 100]


def test_scheduler_local_gets_the_in_process_store_sized_by_config():
    cfg = load_run_config(None, ["pixelstore.capacity_mb=1", "pixelstore.max_age_s=30"]).pixelstore
    s = make_pixel_store(cfg, "local", "t")
    assert isinstance(s, InProcessPixelStore)
    assert s.capacity_bytes == 2**20 and s.max_age_s == 30 and s.put(b"k").startswith("local:")
    with pytest.raises(ValueError, match="unknown scheduler"):
        make_pixel_store(cfg, "slurm", "t")
    with pytest.raises(ValueError, match="prefix"):
        InProcessPixelStore("a:b")
