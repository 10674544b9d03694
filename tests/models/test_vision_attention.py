"""Batched vision attention (one SDPA over all windows/images) computes what transformers' per-chunk
loop computes: same image features for equal and unequal image sizes."""

from __future__ import annotations

import torch
from PIL import Image

from asyncwebrl.models.prepare import resolve_model_path
from asyncwebrl.models.vision_attention import batch_vision_attention
from asyncwebrl.models.vlm import VLMAdapter, load_model


def _features(model, adapter, images):
    img = adapter.image_processor(images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.model.get_image_features(img["pixel_values"], img["image_grid_thw"])
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    return torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats


def test_batched_vision_attention_equals_the_per_chunk_loop():
    path = resolve_model_path("tiny-qwen2.5-vl")
    adapter = VLMAdapter(path)
    model = load_model(path).eval()
    same = [Image.new("RGB", (160, 210), (30, 120, 220)), Image.new("RGB", (160, 210), (200, 10, 20))]
    mixed = [same[0], Image.new("RGB", (300, 120), (5, 200, 90))]
    ref = [_features(model, adapter, imgs) for imgs in (same, mixed)]
    assert batch_vision_attention(model) > 0
    got = [_features(model, adapter, imgs) for imgs in (same, mixed)]
    for a, b in zip(ref, got, strict=True):
        assert a.shape == b.shape
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    assert all(m._awrl_batched for m in model.modules() if hasattr(m, "_awrl_batched"))  # no silent fallback
