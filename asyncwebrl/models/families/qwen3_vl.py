"""Qwen3-VL (dense and MoE): Qwen2-VL's image path and M-RoPE decode positions.

What differs from Qwen2-VL is only what this file says: the config's model types, and that the
prompt's positions are left to the model (the host-side layout of models/mrope.py is checked against
Qwen2/2.5-VL only).
"""

from __future__ import annotations

from typing import Any

from asyncwebrl.models.families.base import register
from asyncwebrl.models.families.qwen2_vl import Qwen2VLFamily


@register
class Qwen3VLFamily(Qwen2VLFamily):
    """Qwen3-VL: images and decoding as Qwen2-VL; the model computes the prompt's M-RoPE positions."""

    name = "qwen3_vl"
    model_types = ("qwen3_vl", "qwen3_vl_moe")

    def host_positions(self, inner_model: Any) -> None:
        return None
