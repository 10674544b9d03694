"""The static-layout Qwen2.5-VL vision tower (models/vision_graph.py) against transformers' own tower on
the tiny model: same features for one image, several images of one grid (bucketed into a padded static
batch, as the CUDA graphs run it), mixed grids, partial windows and two frames; layouts are cached."""

from __future__ import annotations

import pytest
import torch

from asyncwebrl.models.prepare import resolve_model_path
from asyncwebrl.models.vision_attention import batch_vision_attention
from asyncwebrl.models.vision_graph import install
from asyncwebrl.models.vlm import load_model


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    m = load_model(resolve_model_path("tiny-qwen2.5-vl")).eval()
    original = m.model.visual.forward
    assert batch_vision_attention(m) > 0
    return m, original


def _features(out):
    return getattr(out, "pooler_output", out)


@pytest.mark.parametrize("static", [False, True], ids=["eager-layouts", "bucketed-static-batch"])
def test_features_equal_transformers_tower(model, static):
    m, original = model
    runner = install(m, use_graphs=static, max_images=8)
    assert runner is not None and runner.stats["vision_check_rel_diff"] < 1e-5 and runner.linear_patch
    try:
        gen = torch.Generator().manual_seed(1)
        cases = [[(1, 16, 12)], [(1, 16, 12)] * 3, [(1, 16, 12)] * 5, [(1, 8, 10), (1, 14, 6)], [(2, 8, 8)],
                 [(2, 8, 8)] * 2, [(1, 16, 12)]]
        for grids in cases:
            n = sum(t * h * w for t, h, w in grids)
            pixels = torch.randn((n, 3 * 2 * 14 * 14), generator=gen)
            thw = torch.tensor(grids)
            with torch.no_grad():
                want = _features(original(pixels, grid_thw=thw))
                got = _features(m.model.visual(pixels, grid_thw=thw))
            assert got.shape == want.shape
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), grids
        if static:  # one-grid calls ran from the padded buckets (3 and 5 images: buckets 4 and 8); mixed eagerly
            assert runner.stats["vision_graph_calls"] == 6 and runner.stats["vision_eager_calls"] == 1
            assert runner.stats["vision_graphs"] == 2 * len(runner.buckets)  # two grids
        else:
            assert runner.stats["vision_eager_calls"] == len(cases)
        assert runner.layout(((1, 16, 12),)) is runner.layout(((1, 16, 12),))  # cached
    finally:
        m.model.visual.forward = original


def test_batches_past_the_graph_patch_budget_run_eagerly(model):
    m, original = model
    runner = install(m, use_graphs=True, max_images=8)
    runner.max_graph_patches = 4 * 16 * 12  # buckets 1, 2, 4 of this grid; 8 would hold too much
    try:
        for n in (3, 6):
            pixels = torch.randn((n * 16 * 12, 3 * 2 * 14 * 14), generator=torch.Generator().manual_seed(n))
            thw = torch.tensor([(1, 16, 12)] * n)
            with torch.no_grad():
                want = _features(original(pixels, grid_thw=thw))
                got = _features(m.model.visual(pixels, grid_thw=thw))
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
        assert runner.stats["vision_graphs"] == 3  # buckets 1, 2, 4
        assert runner.stats["vision_graph_calls"] == 1 and runner.stats["vision_eager_calls"] == 1
    finally:
        m.model.visual.forward = original


def test_not_installed_where_it_does_not_apply():
    m = load_model(resolve_model_path("tiny-qwen2.5-vl")).eval()
    assert install(m.model.language_model, use_graphs=False, max_images=4) is None


def test_aligned_mlps_compute_the_modules_mlp_and_follow_weight_writes():
    """Vision MLPs of an unaligned width (Qwen2.5-VL: 3420) run over zero-padded weight copies
    (models/aligned_mlp.py): same outputs, and weights written in place are seen after refresh()."""
    import torch.nn.functional as F
    from torch import nn

    from asyncwebrl.models.aligned_mlp import install_aligned_mlps

    class MLP(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(12, width), nn.Linear(12, width)
            self.down_proj, self.act_fn = nn.Linear(width, 12), nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    class Block(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.mlp = MLP(width)

    def plain(blocks, x):  # the unpadded computation from the parameters themselves
        for b in blocks:
            m = b.mlp
            x = x + F.linear(F.silu(F.linear(x, m.gate_proj.weight, m.gate_proj.bias))
                             * F.linear(x, m.up_proj.weight, m.up_proj.bias), m.down_proj.weight, m.down_proj.bias)
        return x

    torch.manual_seed(0)
    x = torch.randn(5, 12)
    aligned_width = [Block(16), Block(16)]
    assert install_aligned_mlps(aligned_width, lambda: plain(aligned_width, x), 1e-5) is None
    blocks = [Block(20), Block(20)]

    def run():
        h = x
        for b in blocks:
            h = h + b.mlp(h)
        return h

    with torch.no_grad():
        al = install_aligned_mlps(blocks, run, 1e-5)
        assert al is not None and al.pad % 64 == 0 and al.pad > 20
        assert "forward" in blocks[0].mlp.__dict__  # the padded path is what runs
        assert torch.allclose(run(), plain(blocks, x), atol=1e-6)
        names = sorted(n for n, _ in nn.ModuleList(blocks).named_parameters())
        assert len(names) == 12  # the modules' parameters are untouched (weight sync writes them by name)
        for b in blocks:
            b.mlp.up_proj.weight.mul_(-2.0)  # a weight write in place
        stale = run()
        al.refresh()
        assert torch.allclose(run(), plain(blocks, x), atol=1e-6)
        assert not torch.allclose(stale, run(), atol=1e-3)
