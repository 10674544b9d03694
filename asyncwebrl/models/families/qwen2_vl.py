"""Qwen2-VL and Qwen2.5-VL: dynamic-resolution images, multimodal rotary positions (M-RoPE).

The transformers processor is bypassed (its __init__ needs torchvision for the video path, which
screenshots never use): the tokenizer and the PIL image processor are driven directly. One image of
grid (t, h, w) with merge size m becomes t*h*w / m^2 `<|image_pad|>` tokens, as the processor would
expand it. The prompt's M-RoPE positions follow transformers' layout and can be computed on the host
(models/mrope.py, checked against transformers' own).
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from asyncwebrl.models.families.base import Encoded, ModelFamily, register
from asyncwebrl.models.mrope import MRopeIndex


@register
class Qwen2VLFamily(ModelFamily):
    """Qwen2-VL / Qwen2.5-VL: images as flat patches with their grids; positions are M-RoPE."""

    name = "qwen2_vl"
    model_types = ("qwen2_vl", "qwen2_5_vl")
    uses_mrope = True

    def __init__(self, path: str):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        super().__init__(path)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
        self.image_token = "<|image_pad|>"
        self.merge: int = self.image_processor.merge_size

    def _tokens_per_image(self, grid: torch.Tensor) -> int:
        return int(grid.prod()) // self.merge**2

    def encode_images(self, text: str, images: list[Image.Image]) -> Encoded:
        img = self.image_processor(images=images, return_tensors="pt")
        grid = img["image_grid_thw"]
        parts = text.split(self.image_token)
        if len(parts) - 1 != len(images):
            raise ValueError(f"prompt has {len(parts) - 1} image placeholders but {len(images)} images")
        pieces = [parts[0]]
        for g, rest in zip(grid, parts[1:], strict=True):
            pieces.append(self.image_token * self._tokens_per_image(g))
            pieces.append(rest)
        ids = self.tokenizer("".join(pieces), add_special_tokens=False)["input_ids"]
        return Encoded(ids, {"pixel_values": img["pixel_values"], "image_grid_thw": grid})

    def images_for_ids(self, input_ids: list[int], images: list[Image.Image]) -> dict[str, torch.Tensor]:
        img = self.image_processor(images=images, return_tensors="pt")
        need = sum(self._tokens_per_image(g) for g in img["image_grid_thw"])
        image_token_id = self.image_token_id
        n_img = sum(1 for t in input_ids if t == image_token_id)
        if n_img != need:
            raise ValueError(f"input_ids hold {n_img} image tokens; the images need {need}")
        return {"pixel_values": img["pixel_values"], "image_grid_thw": img["image_grid_thw"]}

    def batch_images(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     images: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        have = [im for im in images if im]
        return {
            "pixel_values": torch.cat([im["pixel_values"] for im in have]),
            "image_grid_thw": torch.cat([im["image_grid_thw"] for im in have]),
            "mm_token_type_ids": (input_ids == self.image_token_id).long() * attention_mask,
        }

    def decode_position_ids(self, positions: torch.Tensor, rope_deltas: list[int]) -> torch.Tensor:
        # a generated token is text: its three M-RoPE positions are equal, shifted by the row's delta;
        # the first row is the plain text position transformers' attention mask path reads
        mpos = positions + torch.tensor(rope_deltas, dtype=torch.long, device=positions.device)[:, None]
        return torch.stack([positions, mpos, mpos, mpos])

    def host_positions(self, inner_model: Any) -> MRopeIndex | None:
        return MRopeIndex(inner_model, self.image_token_id)
