"""The policy's tokenizer and image path, one `VLMAdapter` per model folder: prompt building, image
token expansion, and the keyword arguments of a forward pass.

The inference server, the episode workflow and the trainer all go through `VLMAdapter`, so the
prompt token ids a server generated from are exactly the ids the trainer recomputes logprobs on
(invariant: `tokenize(messages, images)` is deterministic and image placeholders are expanded here,
on the rollout side, never implicitly by a processor elsewhere).

What differs between model families (Idefics3/SmolVLM, the embedded default; Qwen2-VL/Qwen2.5-VL;
Qwen3-VL; text-only causal LMs) lives in one class per family, in asyncwebrl/models/families/; the
adapter keeps the checks all families share and delegates the rest to `self.model_family`.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import torch
from PIL import Image

from asyncwebrl.models.families import Encoded, ModelFamily, family_for_config, load_family, read_config
from asyncwebrl.models.prepare import resolve_model_path

__all__ = ["Encoded", "VLMAdapter", "decode_image", "detect_family", "encode_image_b64", "load_model"]


def decode_image(data: str | bytes | Image.Image) -> Image.Image:
    """A PIL RGB image from raw bytes, base64 text, or a data URI; ValueError when undecodable."""
    if isinstance(data, Image.Image):
        return data.convert("RGB")
    try:
        if isinstance(data, str):
            if data.startswith("data:"):
                data = data.split(",", 1)[1]
            data = base64.b64decode(data, validate=False)
        img = Image.open(io.BytesIO(data))
        img.load()
        return img.convert("RGB")
    except Exception as e:  # PIL raises many types for corrupt data
        raise ValueError(f"undecodable image ({type(e).__name__}: {e})") from e


def encode_image_b64(img: Image.Image | bytes, fmt: str = "PNG") -> str:
    if isinstance(img, bytes):
        return base64.b64encode(img).decode()
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return base64.b64encode(buf.getvalue()).decode()


def detect_family(path: str) -> str:
    """The name of the model family that serves the model folder (or hub id) `path`."""
    return family_for_config(read_config(path)).name


class VLMAdapter:
    """Tokenizer + image processor of a model folder, and the family's forward conventions."""

    def __init__(self, path: str):
        self.path = resolve_model_path(path)
        self.model_family: ModelFamily = load_family(self.path)
        """the model family (models/families/): what differs between families is asked of it"""
        self.family: str = self.model_family.name
        """the family's registered name, e.g. 'idefics3'"""
        self.tokenizer = self.model_family.tokenizer
        self.processor = self.model_family.processor
        self.image_processor = self.model_family.image_processor
        self.image_token = self.model_family.image_token
        self.image_token_id = self.model_family.image_token_id
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    # ---- prompts -------------------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id}
        for tok in ("<|im_end|>", "<end_of_utterance>", "<|endoftext|>"):
            tid = self.tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id:
                ids.add(tid)
        return sorted(i for i in ids if i is not None)

    def chat_text(self, messages: list[dict[str, Any]]) -> str:
        messages = self.model_family.text_messages(messages)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def assistant_turn_ids(self, text: str) -> list[int]:
        """The token ids a policy emits to answer `text` in one assistant turn: the text as the chat
        template renders it after the generation prompt, through the first end-of-turn token (the
        token rollout generation stops on, `eos_token_ids`). A template that ends the turn with no such
        token gets the tokenizer's EOS appended; one that does not extend the generation prompt
        (unusual) gives the plain text's tokens plus EOS."""
        probe = [{"role": "user", "content": [{"type": "text", "text": "."}]}]
        turn = self.model_family.text_messages(probe + [{"role": "assistant", "content": [{"type": "text", "text": text}]}])
        head = self.chat_text(probe)
        full = self.tokenizer.apply_chat_template(turn, tokenize=False)
        tail = full[len(head):] if full.startswith(head) else text
        ids = self.tokenizer(tail, add_special_tokens=False)["input_ids"]
        stops = set(self.eos_token_ids)
        for i, t in enumerate(ids):
            if t in stops:
                return ids[: i + 1]
        eos = self.tokenizer.eos_token_id
        return ids + [eos if eos is not None else self.eos_token_ids[0]]

    def encode(self, text: str, images: list[Image.Image] | None = None) -> Encoded:
        """Token ids with every image placeholder expanded, and the image tensors for forward."""
        images = images or []
        if not self.model_family.takes_images or not images:
            if self.image_token is not None and self.image_token in text:
                raise ValueError("prompt has image placeholders but no images were given")
            return Encoded(self.tokenizer(text, add_special_tokens=False)["input_ids"], {})
        return self.model_family.encode_images(text, images)

    def encode_with_images_for_ids(self, input_ids: list[int], images: list[Image.Image]) -> dict[str, torch.Tensor]:
        """Image tensors for already-expanded `input_ids` (the server and trainer path); checks that
        the number of image tokens matches what the images produce."""
        if not images:
            if self.image_token_id is not None and self.image_token_id in input_ids:
                raise ValueError("input_ids contain image tokens but no image_data was given")
            return {}
        return self.model_family.images_for_ids(input_ids, images)

    # ---- batching ------------------------------------------------------------------------------
    def collate(self, seqs: list[list[int]], images: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Right-padded batch of sequences with their image tensors, ready for `model(**batch)`."""
        pad = self.tokenizer.pad_token_id
        n = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), n), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), n), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
        batch: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": mask}
        if any(images):
            batch.update(self.model_family.batch_images(ids, mask, images))
        return batch


def load_model(path: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"):
    """The policy as a transformers model (image-text-to-text, or causal LM for text models)."""
    path = resolve_model_path(path)
    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    cls = family_for_config(read_config(path)).auto_model()
    model = cls.from_pretrained(path, dtype=dt)
    return model.to(device)
