"""Vision-tower MLPs over zero-padded weight copies whose widths are multiples of `ALIGN` (GPU prefill).

Qwen2.5-VL's vision MLP has an intermediate width of 3420, not a multiple of 8: the activations' rows
are then not 16-byte aligned and cuBLAS falls back to sm80 kernels on an H200 (measured: 44 of the
~100 ms vision tower of a 64-screenshot prefill, ~230 TFLOP/s). `AlignedMLPs` runs each block's MLP
over copies of its weights padded to the next multiple of `ALIGN` (gate and up stacked into one
GEMM), installed as the MLP module's `forward`.

Invariants:
- exact up to summation order: padded units have zero weights and zero bias, so they compute
  act(0) * 0 = 0 and meet zero columns of the padded down projection, so only the GEMMs' summation
  order changes; `install_aligned_mlps` keeps them only where the tower's output stays within
  max(tol, NOISE_FACTOR x noise) of the unpadded one, noise being what the unpadded tower itself changes
  by when the same image is encoded in a batch with another (other GEMM shapes, other rounding: what
  batching a prefill changes anyway);
- the modules' parameters are untouched (weight sync writes them by name): `refresh()` copies them
  into the padded buffers in place (so captured graphs see the new values) and must follow any weight
  write; the engine calls it whenever exclusive model access ends;
- widths that are already multiples of `ALIGN` are left alone (nothing installed).
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ALIGN = 64
NOISE_FACTOR = 4.0


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class AlignedMLPs:
    """Padded weight copies of a list of gated MLPs (gate_proj, up_proj, down_proj, act_fn)."""

    def __init__(self, mlps: list[torch.nn.Module]):
        self.mlps = mlps
        m0 = mlps[0]
        self.inter = int(m0.gate_proj.weight.shape[0])
        self.pad = _padded(self.inter)
        self.bufs: list[dict[str, torch.Tensor | None]] = []
        for m in mlps:
            w = m.gate_proj.weight
            hidden = w.shape[1]
            gu = torch.zeros((2 * self.pad, hidden), dtype=w.dtype, device=w.device)
            bgu = torch.zeros(2 * self.pad, dtype=w.dtype, device=w.device) if m.gate_proj.bias is not None else None
            down = torch.zeros((m.down_proj.weight.shape[0], self.pad), dtype=w.dtype, device=w.device)
            self.bufs.append({"gu": gu, "bgu": bgu, "down": down})
        self.refresh()
        self.rel_diff = 0.0
        """relative difference of the tower's output from the unpadded one, measured at install"""
        self.noise = 0.0
        """the unpadded tower's own batch-vs-alone relative difference, measured at install"""

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the modules' current weights into the padded buffers (in place)."""
        p, n = self.pad, self.inter
        for m, b in zip(self.mlps, self.bufs, strict=True):
            b["gu"][:n].copy_(m.gate_proj.weight)
            b["gu"][p: p + n].copy_(m.up_proj.weight)
            if b["bgu"] is not None:
                b["bgu"][:n].copy_(m.gate_proj.bias)
                b["bgu"][p: p + n].copy_(m.up_proj.bias)
            b["down"][:, :n].copy_(m.down_proj.weight)

    def install(self) -> None:
        for m, b in zip(self.mlps, self.bufs, strict=True):
            m.forward = types.MethodType(_make_forward(b, self.pad), m)

    def uninstall(self) -> None:
        for m in self.mlps:
            if "forward" in m.__dict__:
                del m.forward


def _make_forward(b: dict[str, torch.Tensor | None], pad: int) -> Callable[..., torch.Tensor]:
    def forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        gu = F.linear(x, b["gu"], b["bgu"])
        return F.linear(self.act_fn(gu[..., :pad]) * gu[..., pad:], b["down"], self.down_proj.bias)

    return forward


def install_aligned_mlps(blocks: Any, run: Callable[[], torch.Tensor], tol: float,
                         noise: Callable[[], float] | None = None) -> AlignedMLPs | None:
    """Pad the MLPs of `blocks` where their width is unaligned and `run()` (the tower on a test input)
    stays within max(tol, NOISE_FACTOR x noise()) of its unpadded output (noise() measured before the
    padding: see the module docstring); None otherwise (nothing changed)."""
    mlps = [blk.mlp for blk in blocks]
    try:
        m0 = mlps[0]
        if not all(hasattr(m0, k) for k in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return None
        if int(m0.gate_proj.weight.shape[0]) % 8 == 0:
            return None
        ref = run().float()
        yardstick = noise() if noise is not None else 0.0
        aligned = AlignedMLPs(mlps)
        aligned.install()
    except Exception:
        log.warning("aligned vision MLPs unavailable", exc_info=True)
        return None
    try:
        got = run().float()
        rel = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
    except Exception:
        log.warning("aligned vision MLPs failed their check", exc_info=True)
        rel = float("inf")
    limit = max(tol, NOISE_FACTOR * yardstick)
    if not rel <= limit:
        aligned.uninstall()
        log.warning("aligned vision MLPs differ from the modules' (relative %.2e, limit %.2e); not used", rel, limit)
        return None
    aligned.rel_diff, aligned.noise = rel, yardstick
    return aligned
