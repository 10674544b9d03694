"""Idefics3 / SmolVLM, the embedded default policy.

The transformers processor expands each `<image>` into a fixed run of `image_seq_len` image tokens
(with the row/column markers of its splitting) and produces padded pixel tiles with their masks.
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from asyncwebrl.models.families.base import Encoded, ModelFamily, register


@register
class Idefics3Family(ModelFamily):
    """Idefics3 and SmolVLM: the processor does the expansion; pixels are [1, tiles, C, H, W] per row."""

    name = "idefics3"
    model_types = ("idefics3", "smolvlm")

    def __init__(self, path: str):
        from transformers import AutoProcessor

        super().__init__(path)
        self.processor: Any = AutoProcessor.from_pretrained(path)
        self.tokenizer = self.processor.tokenizer
        self.image_processor = self.processor.image_processor
        self.image_token = "<image>"

    def encode_images(self, text: str, images: list[Image.Image]) -> Encoded:
        out = self.processor(text=text, images=[images], return_tensors="pt", add_special_tokens=False)
        return Encoded(
            out["input_ids"][0].tolist(),
            {"pixel_values": out["pixel_values"], "pixel_attention_mask": out["pixel_attention_mask"]},
        )

    def images_for_ids(self, input_ids: list[int], images: list[Image.Image]) -> dict[str, torch.Tensor]:
        image_token_id = self.image_token_id
        n_img = sum(1 for t in input_ids if t == image_token_id)
        per = self.processor.image_seq_len
        if n_img != per * len(images):
            raise ValueError(f"input_ids hold {n_img} image tokens; {len(images)} images need {per * len(images)}")
        out = self.image_processor(images=[images], return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "pixel_attention_mask": out["pixel_attention_mask"]}

    def batch_images(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     images: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        # rows hold different numbers of tiles: zero tiles with an all-False mask pad the short rows
        have = [im for im in images if im]
        n_img = max(im["pixel_values"].shape[1] for im in have)
        c, h, w = have[0]["pixel_values"].shape[2:]
        rows = input_ids.shape[0]
        pv = torch.zeros((rows, n_img, c, h, w), dtype=have[0]["pixel_values"].dtype)
        pm = torch.zeros((rows, n_img, h, w), dtype=torch.bool)
        for i, im in enumerate(images):
            if im:
                k = im["pixel_values"].shape[1]
                pv[i, :k] = im["pixel_values"][0]
                pm[i, :k] = im["pixel_attention_mask"][0].bool()
        return {"pixel_values": pv, "pixel_attention_mask": pm}
