"""Flat bucket plans: size bound, order, alignment, and a pack -> views round trip that is bit-exact."""

from __future__ import annotations

import pytest
import torch

from asyncwebrl.weights.buckets import bucket_from_request, plan_buckets
from asyncwebrl.weights.group import WeightSyncError


def meta(named):
    return [(n, t.dtype, tuple(t.shape)) for n, t in named]


def test_plan_respects_the_size_and_keeps_order():
    named = [(f"t{i}", torch.zeros(256 * (i + 1))) for i in range(6)]  # 1, 2, ... 6 KiB of float32
    buckets = plan_buckets(meta(named), 5 * 1024)
    assert [n for b in buckets for n in b.names] == [n for n, _ in named]
    assert [len(b.slots) for b in buckets] == [2, 1, 1, 1, 1]  # [1,2] [3] [4] [5] [6 alone, over the size]
    assert all(b.nbytes <= 5 * 1024 or len(b.slots) == 1 for b in buckets)


def test_pack_and_views_round_trip_bit_exact_for_mixed_dtypes():
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(3, generator=g).to(torch.bfloat16)),  # 6 bytes: the next float32 would misalign
             ("b", torch.randn(300, 7, generator=g)), ("c", torch.randn(5, 5, generator=g).to(torch.float16)),
             ("d", torch.randint(0, 99, (17,), generator=g)), ("e", torch.tensor([True, False]))]
    buckets = plan_buckets(meta(named), 2**20)
    # a tensor that would start misaligned opens the next bucket: [a] [b c] [d e]
    assert [b.names for b in buckets] == [["a"], ["b", "c"], ["d", "e"]]
    assert all(s.start % s.dtype.itemsize == 0 for b in buckets for s in b.slots)
    got = {}
    tensors = iter(t for _, t in named)
    for b in buckets:
        buf = torch.empty(b.nbytes, dtype=torch.uint8)
        b.pack([next(tensors) for _ in b.slots], buf)
        # the receiver rebuilds the layout from the announcement alone
        rx = bucket_from_request(b.names, b.dtypes, b.shapes)
        got.update(rx.views(buf.clone()))
    for n, t in named:
        assert got[n].dtype == t.dtype and torch.equal(got[n], t), n


def test_bad_announcements_are_clear_errors():
    with pytest.raises(WeightSyncError, match="not aligned"):
        bucket_from_request(["a", "b"], ["bfloat16", "float32"], [[3], [2]])
    with pytest.raises(WeightSyncError, match="unknown dtype"):
        bucket_from_request(["a"], ["float99"], [[3]])
    with pytest.raises(WeightSyncError, match="negative"):
        bucket_from_request(["a"], ["float32"], [[-1]])
