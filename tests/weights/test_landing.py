"""The receiver's landing (`weights.ipc.copy_into`) with a kept payload's memo: each refresh of the
same payload lands the sender's current values, bit-exactly, also after the server's parameters moved
to other memory (a disk load that rebinds them) — a remembered destination is never written once it
is not the parameter any more. On a GPU the repeated landing is one captured CUDA graph; that test
runs on the GPU box (bench/gpu_tests.sh) and skips here."""

from __future__ import annotations

import pytest
import torch

from asyncwebrl.weights import ipc
from asyncwebrl.weights.group import WeightSyncError


def _model(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"embed": (64, 16), "layer.0.w": (16, 16), "layer.0.norm": (16,), "head": (64, 16)}
    return {n: torch.randn(s, generator=g).to(device) for n, s in shapes.items()}


def _land_three_times(device: str) -> dict:
    params = _model(device)
    src = {n: torch.zeros_like(p) for n, p in params.items()}
    named = list(src.items())
    memo: dict = {}
    for step in range(3):
        for t in src.values():
            t.normal_()
        assert ipc.copy_into(params, named, memo) == sum(t.numel() * t.element_size() for t in src.values())
        for n in params:
            assert torch.equal(params[n], src[n]), f"{n} after landing {step}"
    # the server's parameter moves (a load that rebinds it): the next landing goes to the new memory
    # (the same tensor object, its storage swapped, as `param.data = loaded` does)
    p = params["layer.0.w"]
    old = p.data
    before = old.clone()
    p.data = torch.full_like(old, 7.0)
    for t in src.values():
        t.normal_()
    ipc.copy_into(params, named, memo)
    assert torch.equal(params["layer.0.w"], src["layer.0.w"])
    assert torch.equal(old, before), "a remembered destination that is no parameter any more was written"
    return memo


def test_repeated_landing_follows_the_sender_and_the_parameters():
    memo = _land_three_times("cpu")
    assert "graph" not in memo  # a CPU lands with one multi-tensor copy


def test_a_payload_that_does_not_fit_changes_nothing_even_with_a_memo():
    params = _model("cpu")
    before = {n: p.clone() for n, p in params.items()}
    bad = [("embed", torch.ones(64, 16)), ("layer.0.w", torch.ones(8, 16))]
    with pytest.raises(WeightSyncError, match="shape of 'layer.0.w'"):
        ipc.copy_into(params, bad, {})
    assert all(torch.equal(params[n], before[n]) for n in params)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu_tests.sh runs it)")
def test_repeated_landing_on_a_gpu_replays_one_captured_graph():
    memo = _land_three_times("cuda")
    assert memo.get("graph") is not None, "the repeated same-device landing was not captured"
