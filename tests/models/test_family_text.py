"""Text-only causal LMs: chat contents become plain strings, images are not taken, and the model
loads as a causal LM. The model is a tiny random one built here from the tiny Qwen's tokenizer."""

from __future__ import annotations

import shutil

import pytest
import torch

from asyncwebrl.models.prepare import resolve_model_path
from asyncwebrl.models.vlm import VLMAdapter, load_model


@pytest.fixture(scope="module")
def text_model(tmp_path_factory) -> str:
    from pathlib import Path

    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    src = Path(resolve_model_path("tiny-qwen2.5-vl"))
    out = tmp_path_factory.mktemp("text-lm")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / f, out / f)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(AutoTokenizer.from_pretrained(out)), hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    return str(out)


def test_a_text_model_reads_chat_contents_as_plain_text(text_model, screenshots):
    adapter = VLMAdapter(text_model)
    assert adapter.family == "text" and adapter.image_token_id is None
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Click"},
                                         {"type": "text", "text": " OK."}]}]
    text = adapter.chat_text(msgs)
    plain = adapter.tokenizer.apply_chat_template([{"role": "user", "content": "Click OK."}],
                                                  add_generation_prompt=True, tokenize=False)
    assert text == plain
    enc = adapter.encode(text, screenshots)  # a text policy's screenshots are dropped
    assert enc.input_ids == adapter.tokenizer(text, add_special_tokens=False)["input_ids"] and enc.images == {}
    with pytest.raises(ValueError, match="takes no images"):
        adapter.encode_with_images_for_ids(enc.input_ids, screenshots)
    turn = adapter.assistant_turn_ids("click [3]")
    assert adapter.tokenizer.decode(turn) == "click [3]<|im_end|>"


def test_a_text_model_loads_as_a_causal_lm(text_model):
    model = load_model(text_model)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    batch = VLMAdapter(text_model).collate([[1, 2, 3], [4]], [{}, {}])
    assert set(batch) == {"input_ids", "attention_mask"}
    with torch.no_grad():
        assert model(**batch).logits.shape[:2] == (2, 3)
