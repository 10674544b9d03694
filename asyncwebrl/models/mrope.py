"""Qwen2/2.5-VL M-RoPE position ids of one prompt with still images, computed on the host.

Inside a batched forward transformers computes these row by row on the model's device, with several
device-to-host reads per row (~600 synchronizations for a prefill of 64 screenshots, measured on an
H200, during which the GPU idles); transformers' own function run on CPU tensors costs ~1.2 ms of
GIL-holding Python per prompt, which a burst of 64 requests pays serially in the server's threads. The
positions depend only on the token ids and the image grids, so the engine computes them per request
when it prepares it (numpy, ~tens of microseconds) and passes them to the prefill.

The layout (as transformers defines it for Qwen2/2.5-VL): a text token's three positions are equal and
count up from the previous token's; an image of grid (1, h, w) with merge size m holds (h/m)(w/m)
tokens whose positions are (p, p + row, p + column) from the position p after the preceding text, and
the text after it resumes at p + max(h/m, w/m). The rope delta is max position + 1 - prompt length.

Invariants: checked against transformers' own positions (tests/inference, and at engine start by the
lean-prefill check, whose first-layer keys are rotated by them); anything outside this layout (video
tokens, an image with more than one temporal patch, token counts that do not match the grids) raises
ValueError and the model computes positions itself. `batch_positions` right-pads rows to the batch
length (pad columns hold 0: no real position attends to them and their outputs are discarded).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class MRopeIndex:
    """Per-prompt M-RoPE position ids of a Qwen2/2.5-VL model (see module docstring)."""

    def __init__(self, inner_model: Any, image_token_id: int | None):
        self.reason: str | None = None
        cfg = inner_model.config
        self.image_token_id = image_token_id
        self.video_token_id = getattr(cfg, "video_token_id", None)
        self.merge = int(getattr(getattr(cfg, "vision_config", None), "spatial_merge_size", 0) or 0)
        if image_token_id is None or self.merge < 1:
            self.reason = "no image token id or spatial merge size in the model config"

    @property
    def available(self) -> bool:
        return self.reason is None

    def __call__(self, ids: list[int], images: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """([3, len(ids)] long position ids, rope delta) of one prompt."""
        x = np.asarray(ids, dtype=np.int64)
        n = len(x)
        if self.video_token_id is not None and (x == self.video_token_id).any():
            raise ValueError("video tokens: positions are left to the model")
        grids = images.get("image_grid_thw")
        grids = [] if grids is None else [tuple(int(v) for v in g) for g in grids.reshape(-1, 3).tolist()]
        starts = np.flatnonzero(x == self.image_token_id)
        pos = np.empty((3, n), dtype=np.int64)
        p = i = k = 0
        while i < n:
            j = int(starts[np.searchsorted(starts, i)]) if np.searchsorted(starts, i) < len(starts) else n
            if j > i:  # a text run
                pos[:, i:j] = p + np.arange(j - i)
                p += j - i
                i = j
                continue
            if k >= len(grids):
                raise ValueError(f"more image tokens than the {len(grids)} image grids account for")
            t, h, w = grids[k]
            k += 1
            hh, ww = h // self.merge, w // self.merge
            if t != 1 or hh * self.merge != h or ww * self.merge != w:
                raise ValueError(f"image grid {(t, h, w)} is outside the still-image layout")
            cnt = hh * ww
            if i + cnt > n or not (x[i:i + cnt] == self.image_token_id).all():
                raise ValueError(f"image {k - 1}: {cnt} image tokens expected at position {i}")
            pos[0, i:i + cnt] = p
            pos[1, i:i + cnt] = p + np.repeat(np.arange(hh), ww)
            pos[2, i:i + cnt] = p + np.tile(np.arange(ww), hh)
            p += max(hh, ww)
            i += cnt
        if k != len(grids):
            raise ValueError(f"{len(grids)} image grids but {k} images in the prompt")
        return torch.from_numpy(pos), int(pos.max()) + 1 - n if n else 0


def batch_positions(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    """[3, len(rows), length] position ids: each row's [3, L] positions, right-padded with zeros."""
    out = torch.zeros((3, len(rows), length), dtype=torch.long)
    for i, p in enumerate(rows):
        out[:, i, : p.shape[-1]] = p
    return out
