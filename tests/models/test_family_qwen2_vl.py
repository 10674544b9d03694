"""Qwen2/2.5-VL: the adapter's encoding equals transformers' processor's, and the positions computed
on the host and for decoded tokens equal transformers' M-RoPE positions."""

from __future__ import annotations

import pytest
import torch

from asyncwebrl.models.prepare import resolve_model_path
from asyncwebrl.models.vlm import VLMAdapter, load_model


@pytest.fixture(scope="module")
def adapter() -> VLMAdapter:
    return VLMAdapter("tiny-qwen2.5-vl")


def test_encode_equals_the_hf_processor(adapter, screenshots, two_image_chat, qwen_reference_processor):
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor

    processor = qwen_reference_processor(Qwen2_5_VLProcessor, resolve_model_path("tiny-qwen2.5-vl"))
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


def test_positions_equal_transformers_m_rope(adapter, screenshots, two_image_chat):
    inner = load_model("tiny-qwen2.5-vl").model
    enc = adapter.encode(adapter.chat_text(two_image_chat), screenshots)
    nxt = adapter.tokenizer.convert_tokens_to_ids("click")
    ids = torch.tensor([enc.input_ids + [nxt]])
    ref, ref_delta = inner.get_rope_index(ids, (ids == adapter.image_token_id).int(), enc.images["image_grid_thw"],
                                          attention_mask=torch.ones_like(ids))
    host = adapter.model_family.host_positions(inner)
    pos, delta = host(enc.input_ids, enc.images)
    n = len(enc.input_ids)
    assert torch.equal(pos, ref[:, 0, :n])
    assert delta == int(ref_delta.reshape(-1)[0]) != 0
    # the position ids the engine hands the model for the first generated token
    step = adapter.model_family.decode_position_ids(torch.tensor([[n]]), [delta])
    assert step[0].item() == n and torch.equal(step[1:, 0, 0], ref[:, 0, n])
