"""Qwen2.5-VL vision attention over all windows/images in one batched SDPA call (GPU prefill).

transformers' non-flash path of `Qwen2_5_VLVisionAttention` loops over the attention chunks
(windows of 4x4 merged patches in most blocks, whole images in the full-attention blocks) and
launches one SDPA per chunk: a prefill of 64 screenshots makes ~7,000 SDPA calls in the vision
tower, so launch overhead, not arithmetic, sets its time. `batch_vision_attention(model)` rebinds
each such module's forward to one that gathers the chunks into a padded batch [chunks, heads, L, d]
(key padding masked) and runs a single SDPA. Same function: each query attends exactly to the keys
of its own chunk. Anything unexpected (another transformers layout) falls back to the module's own
forward, once and for good, with a warning.

A `ChunkPlan` (the gather indices and key mask of one cu_seqlens) is normally built per call (one
host read of cu_seqlens); a cu_seqlens tensor carrying a plan in its `_awrl_plan` attribute (static
layouts, models/vision_graph.py) is attended with no host read at all, so the call can be captured
in a CUDA graph.
"""

from __future__ import annotations

import logging
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass
class ChunkPlan:
    """How the chunks [cu[i], cu[i+1]) of a packed sequence become one padded attention batch."""

    total: int
    """positions in the packed sequence"""
    n: int
    """non-empty chunks"""
    longest: int
    uniform: bool
    """all chunks equally long (a plain reshape, no padding)"""
    idx: torch.Tensor | None = None
    """[n, longest] packed position of each padded slot (clamped for pads)"""
    mask: torch.Tensor | None = None
    """[n, 1, 1, longest] True for real keys"""
    keep: torch.Tensor | None = None
    """flat indices of the real slots in [n * longest], in packed order"""


def chunk_plan(lengths: list[int], device: torch.device | str) -> ChunkPlan:
    """The plan of chunks of these lengths (zero-length chunks are skipped)."""
    lengths = [int(n) for n in lengths if n > 0]
    total, n, longest = sum(lengths), len(lengths), max(lengths)
    if all(x == longest for x in lengths):
        return ChunkPlan(total, n, longest, True)
    lens = torch.tensor(lengths, device=device)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(longest, device=device)
    valid = pos[None, :] < lens[:, None]  # [n, L]
    idx = (starts[:, None] + pos[None, :]).clamp(max=total - 1)
    keep = valid.reshape(-1).nonzero().squeeze(1)
    return ChunkPlan(total, n, longest, False, idx, valid[:, None, None, :], keep)


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      scale: float, plan: ChunkPlan | None = None) -> torch.Tensor:
    """Attention within consecutive chunks [cu[i], cu[i+1]) of q/k/v [S, heads, d]; returns [S, heads*d]."""
    s, h, d = q.shape
    if plan is None:
        plan = chunk_plan((cu_seqlens[1:] - cu_seqlens[:-1]).tolist(), q.device)
    if plan.total != s:
        raise ValueError(f"chunk plan covers {plan.total} positions, the sequence has {s}")
    n, longest = plan.n, plan.longest
    if plan.uniform:
        qb, kb, vb = (t.reshape(n, longest, h, d).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qb, kb, vb, scale=scale)
        return out.transpose(1, 2).reshape(s, h * d)
    qb, kb, vb = (t[plan.idx].transpose(1, 2) for t in (q, k, v))  # [n, h, L, d]
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=plan.mask, scale=scale)
    out = out.transpose(1, 2).reshape(n * longest, h, d).index_select(0, plan.keep)
    return out.reshape(s, h * d)


def _batched_forward(self: Any, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, *args: Any,
                     position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs: Any):
    if position_embeddings is None or args or not self._awrl_batched:
        return self._awrl_orig_forward(hidden_states, cu_seqlens, *args,
                                       position_embeddings=position_embeddings, **kwargs)
    try:
        s = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(s, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = position_embeddings
        q, k = self._awrl_rotary(q, k, cos, sin)
        plan = getattr(cu_seqlens, "_awrl_plan", None)
        return self.proj(chunked_attention(q, k, v, cu_seqlens, self.scaling, plan).to(hidden_states.dtype))
    except Exception:  # another transformers layout: its own code, from now on
        log.warning("batched vision attention failed; using transformers' per-chunk path", exc_info=True)
        self._awrl_batched = False
        return self._awrl_orig_forward(hidden_states, cu_seqlens, *args,
                                       position_embeddings=position_embeddings, **kwargs)


def batch_vision_attention(model: torch.nn.Module) -> int:
    """Rebind the forward of every Qwen2.5-VL vision attention that uses the per-chunk path; returns how many."""
    n = 0
    for m in model.modules():
        if type(m).__name__ != "Qwen2_5_VLVisionAttention":
            continue
        impl = str(getattr(m.config, "_attn_implementation", "sdpa"))
        rotary = getattr(sys.modules[type(m).__module__], "apply_rotary_pos_emb_vision", None)
        if "flash" in impl or rotary is None or not all(hasattr(m, a) for a in ("qkv", "proj", "num_heads", "scaling")):
            continue
        m._awrl_orig_forward = m.forward
        m._awrl_rotary = rotary
        m._awrl_batched = True
        m.forward = types.MethodType(_batched_forward, m)
        n += 1
    return n
