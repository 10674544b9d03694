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
