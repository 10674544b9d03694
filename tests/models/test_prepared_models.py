"""The prepared models: the default policy answers sensibly, the tiny Qwen models run with images."""

import pytest
import torch
from PIL import Image

from asyncwebrl.models.prepare import resolve_model_path
from asyncwebrl.models.vlm import VLMAdapter, load_model


def _screenshot():
    img = Image.new("RGB", (160, 210), (240, 240, 240))
    img.paste((30, 90, 200), (40, 80, 120, 110))
    return img


def test_default_model_answers_a_plain_text_question(default_model_path):
    adapter = VLMAdapter("default")
    model = load_model("default")
    assert adapter.family == "idefics3"
    text = adapter.chat_text([{"role": "user", "content": "What is the capital of France?"}])
    enc = adapter.encode(text)
    ids = torch.tensor([enc.input_ids])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    answer = adapter.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_default_model_generates_from_a_screenshot_prompt():
    adapter = VLMAdapter("default")
    model = load_model("default")
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Click the button."}]}]
    enc = adapter.encode(adapter.chat_text(msgs), [_screenshot()])
    assert enc.input_ids.count(adapter.image_token_id) == 16  # short prompts on CPU
    batch = adapter.collate([enc.input_ids], [enc.images])
    out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > len(enc.input_ids)


@pytest.mark.parametrize("name, family", [("tiny-qwen2.5-vl", "qwen2_vl"), ("tiny-qwen3-vl", "qwen3_vl")])
def test_tiny_qwen_forward_with_an_image(name, family):
    adapter = VLMAdapter(name)
    model = load_model(name)
    assert adapter.family == family
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Click OK."}]}]
    img = _screenshot()
    enc = adapter.encode(adapter.chat_text(msgs), [img])
    images = adapter.encode_with_images_for_ids(enc.input_ids, [img])
    batch = adapter.collate([enc.input_ids, enc.input_ids[:-2]], [images, images])
    assert "mm_token_type_ids" in batch
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape[:2] == batch["input_ids"].shape
    assert torch.isfinite(logits).all()


def test_image_token_count_mismatch_is_a_clear_error():
    adapter = VLMAdapter("default")
    with pytest.raises(ValueError, match="image tokens"):
        adapter.encode_with_images_for_ids([1, 2, adapter.image_token_id], [_screenshot()])


def test_unprepared_alias_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("ASYNCWEBRL_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="prepare-model"):
        resolve_model_path("default")


def test_any_hf_folder_works_in_place_of_the_default():
    path = resolve_model_path("tiny-qwen2.5-vl")
    assert VLMAdapter(path).family == "qwen2_vl"
