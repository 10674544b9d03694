"""Qwen VL M-RoPE position ids of one prompt, computed on the host by the model's own `get_rope_index`.

Inside a batched forward transformers computes these row by row on the model's device, with several
device-to-host reads per row (~600 synchronizations for a prefill of 64 screenshots, measured on an
H200, during which the GPU idles). The positions depend only on the token ids and the image grids, so
the engine computes them per request when it prepares it (server threads, CPU tensors, no device) and
passes them to the prefill.

Invariants: the values are transformers' own (its `get_rope_index`, called with the arguments its
signature names, for one unpadded row); `batch_positions` right-pads rows to the batch length (pad
columns hold 0: they are never attended to by a real position and their outputs are discarded). Where
transformers' signature or output is not understood, `MRopeIndex` is unavailable (`reason` says why)
and the model computes positions itself.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


class MRopeIndex:
    """Per-prompt M-RoPE position ids from a Qwen VL model's `get_rope_index` (see module docstring)."""

    def __init__(self, inner_model: Any, image_token_id: int | None):
        self.reason: str | None = None
        self._fn = getattr(inner_model, "get_rope_index", None)
        self.image_token_id = image_token_id
        if self._fn is None or image_token_id is None:
            self.reason = "the model has no get_rope_index or no image token"
            return
        self._params = set(inspect.signature(self._fn).parameters)

    @property
    def available(self) -> bool:
        return self.reason is None

    @torch.inference_mode()
    def __call__(self, ids: list[int], images: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """([3, len(ids)] long position ids, rope delta) of one prompt; CPU tensors only."""
        x = torch.tensor([ids], dtype=torch.long)
        cand = {
            "attention_mask": torch.ones_like(x),
            "mm_token_type_ids": (x == self.image_token_id).long(),
            "image_grid_thw": images.get("image_grid_thw"),
        }
        kw = {k: v for k, v in cand.items() if k in self._params and v is not None}
        pos, delta = self._fn(x, **kw)
        if pos.dim() != 3 or pos.shape[0] != 3 or pos.shape[-1] != len(ids):
            raise ValueError(f"get_rope_index returned positions of shape {tuple(pos.shape)} for {len(ids)} tokens")
        return pos[:, 0].contiguous(), int(torch.as_tensor(delta).reshape(-1)[0])


def batch_positions(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    """[3, len(rows), length] position ids: each row's [3, L] positions, right-padded with zeros."""
    out = torch.zeros((3, len(rows), length), dtype=torch.long)
    for i, p in enumerate(rows):
        out[:, i, : p.shape[-1]] = p
    return out
