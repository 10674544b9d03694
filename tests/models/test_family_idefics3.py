"""Idefics3 / SmolVLM (the default policy): the adapter's encoding is transformers' processor's."""

from __future__ import annotations

import pytest
import torch

from asyncwebrl.models.prepare import resolve_model_path
from asyncwebrl.models.vlm import VLMAdapter


@pytest.fixture(scope="module")
def adapter() -> VLMAdapter:
    return VLMAdapter("default")


def test_encode_equals_the_hf_processor(adapter, screenshots, two_image_chat):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(resolve_model_path("default"))
    text = adapter.chat_text(two_image_chat)
    enc = adapter.encode(text, screenshots)
    ref = processor(text=text, images=[screenshots], return_tensors="pt", add_special_tokens=False)
    assert enc.input_ids == ref["input_ids"][0].tolist()
    assert enc.input_ids.count(adapter.image_token_id) == 2 * processor.image_seq_len
    assert torch.equal(enc.images["pixel_values"], ref["pixel_values"])
    assert torch.equal(enc.images["pixel_attention_mask"], ref["pixel_attention_mask"])
    # the server and trainer path, from the ids, gives the same pixels
    again = adapter.encode_with_images_for_ids(enc.input_ids, screenshots)
    assert all(torch.equal(again[k], enc.images[k]) for k in enc.images)


def test_a_batch_pads_rows_with_fewer_tiles(adapter, screenshots, two_image_chat):
    one = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Click OK."}]}]
    a = adapter.encode(adapter.chat_text(one), screenshots[:1])
    b = adapter.encode(adapter.chat_text(two_image_chat), screenshots)
    batch = adapter.collate([a.input_ids, b.input_ids, a.input_ids[:4]], [a.images, b.images, {}])
    assert batch["pixel_values"].shape[:2] == (3, b.images["pixel_values"].shape[1])
    assert torch.equal(batch["pixel_values"][1], b.images["pixel_values"][0])
    assert not batch["pixel_attention_mask"][2].any()  # the text-only row has no image tiles
    assert adapter.model_family.decode_position_ids(torch.tensor([[7]]), [0]).tolist() == [[7]]  # 1-D positions
