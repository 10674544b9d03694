"""Qwen3-VL, the family added as one file (models/families/qwen3_vl.py): the adapter's encoding
equals transformers' Qwen3-VL processor's, and decoded tokens get transformers' M-RoPE positions."""

from __future__ import annotations

import pytest
import torch

from asyncwebrl.models.prepare import resolve_model_path
from asyncwebrl.models.vlm import VLMAdapter, load_model


@pytest.fixture(scope="module")
def adapter() -> VLMAdapter:
    return VLMAdapter("tiny-qwen3-vl")


def test_the_family_serves_the_model(adapter):
    assert adapter.family == "qwen3_vl"
    assert type(adapter.model_family).__module__ == "asyncwebrl.models.families.qwen3_vl"


def test_encode_equals_the_hf_processor(adapter, screenshots, two_image_chat, qwen_reference_processor):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    processor = qwen_reference_processor(Qwen3VLProcessor, resolve_model_path("tiny-qwen3-vl"))
    text = adapter.chat_text(two_image_chat)
    enc = adapter.encode(text, screenshots)
    ref = processor(text=[text], images=screenshots, return_tensors="pt")
    assert enc.input_ids == ref["input_ids"][0].tolist()
    assert torch.equal(enc.images["pixel_values"], ref["pixel_values"])
    assert torch.equal(enc.images["image_grid_thw"], ref["image_grid_thw"])
    again = adapter.encode_with_images_for_ids(enc.input_ids, screenshots)
    assert all(torch.equal(again[k], enc.images[k]) for k in enc.images)
    batch = adapter.collate([enc.input_ids], [enc.images])
    assert torch.equal(batch["mm_token_type_ids"], ref["mm_token_type_ids"].long())


def test_decoded_tokens_get_transformers_positions(adapter, screenshots, two_image_chat):
    model = load_model("tiny-qwen3-vl")
    inner = model.model
    assert adapter.model_family.host_positions(inner) is None  # the prefill's positions are the model's
    enc = adapter.encode(adapter.chat_text(two_image_chat), screenshots)
    batch = adapter.collate([enc.input_ids], [enc.images])
    inner.rope_deltas = None
    with torch.no_grad():
        model(**batch, logits_to_keep=1)
    delta = int(inner.rope_deltas.reshape(-1)[0])
    nxt = adapter.tokenizer.convert_tokens_to_ids("click")
    ids = torch.tensor([enc.input_ids + [nxt]])
    ref, _ = inner.get_rope_index(ids, (ids == adapter.image_token_id).int(), enc.images["image_grid_thw"],
                                  attention_mask=torch.ones_like(ids))
    n = len(enc.input_ids)
    step = adapter.model_family.decode_position_ids(torch.tensor([[n]]), [delta])
    assert step[0].item() == n and torch.equal(step[1:, 0, 0], ref[:, 0, n])
