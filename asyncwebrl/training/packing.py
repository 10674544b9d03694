"""Packed forward passes of the trainer: many samples in one row, no padding (Qwen2/2.5-VL).

A micro-batch of n samples becomes ONE sequence of sum(len) tokens. Attention stays within each
sample through variable-length attention over `cu_seqlens` (torch's flash varlen kernel on CUDA,
`torch.nn.attention.varlen.varlen_attn`; an exact per-sample causal SDPA loop elsewhere), so no
token attends across a sample boundary and no FLOP is spent on padding. Positions are per sample:
the text positions restart at 0 for each sample and the M-RoPE (t, h, w) positions are computed once
per sample on the host (`asyncwebrl.models.mrope.MRopeIndex`), never by the model per row.

The vision tower is frozen in training (`actor.freeze_vision`), so a screenshot's image embeddings
are the same in every pass of a step: `ImageEmbeddingCache` keeps them per sample (on the device)
from the first pass that computes them; later passes of the step skip the vision tower.

Invariant: for the same samples the packed forward gives the padded forward's logprobs at the
generated positions (tests/training/test_packing.py states the tolerances): same token ids, same
positions, same attention sets, same image embeddings.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from asyncwebrl.models.mrope import MRopeIndex
from asyncwebrl.models.vlm import VLMAdapter

ATTN_NAME = "awrl_packed"
"""the attention implementation registered with transformers for the language model when packing"""


def _varlen_spec():
    """torch's varlen attention and how to call it (looked up once, at import: the lookup stays out of
    a compiled layer's trace)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch without the varlen API
        return None, False, False
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, "enable_gqa" in params, "is_causal" in params


_VARLEN, _VARLEN_GQA, _VARLEN_CAUSAL = _varlen_spec()


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface: query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None).

    With `awrl_cu_seqlens` in kwargs the T positions are several samples back to back and each attends
    causally to its own sample only; without it (an unpacked call, e.g. the vision tower) this is
    transformers' own SDPA attention."""
    cu = kwargs.pop("awrl_cu_seqlens", None)
    max_len = kwargs.pop("awrl_max_seqlen", None)
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, H, D]
    if v.dtype in (torch.bfloat16, torch.float16) and q.dtype != v.dtype:
        # under autocast the rotary embedding (fp32 cos/sin of the fp32 residual stream) promotes q and k
        # back to fp32 while v stays in the compute dtype: attend in the compute dtype, as SDPA would
        q, k = q.to(v.dtype), k.to(v.dtype)
    n_rep = q.shape[1] // k.shape[1]
    if _VARLEN is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        kw: dict = {"scale": scaling}
        if _VARLEN_GQA:
            kw["enable_gqa"] = n_rep > 1
        elif n_rep > 1:
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        if _VARLEN_CAUSAL:
            kw["is_causal"] = True
        else:
            kw["window_size"] = (-1, 0)
        out = _VARLEN(q, k, v, cu, cu, max_len, max_len, **kw)
        return out.unsqueeze(0), None
    # exact reference path (CPU, fp32): one causal SDPA per sample
    bounds = cu.tolist()
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        qs, ks, vs = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling,
                                                   enable_gqa=n_rep > 1)[0].transpose(0, 1))
    return torch.cat(outs).unsqueeze(0), None


_registered = False


def enable_packing(hf) -> None:
    """Route the language model's attention through `packed_attention` (registered once per process).
    The vision tower keeps its own implementation."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(ATTN_NAME, packed_attention)
        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
        _registered = True
    base = getattr(hf, hf.base_model_prefix)
    base.language_model.config._attn_implementation = ATTN_NAME


def can_pack(adapter: VLMAdapter, hf) -> bool:
    """Whether this model has the packed path: its family computes the M-RoPE positions of a sample on
    the host (`ModelFamily.host_positions`: Qwen2/2.5-VL) and its text model can be driven directly."""
    base = getattr(hf, getattr(hf, "base_model_prefix", ""), None)
    return (adapter.model_family.host_positions(hf) is not None and hasattr(base, "language_model")
            and hasattr(base, "get_image_features"))


@dataclass
class PackedInputs:
    """One packed micro-batch, host side (moved to the device by the caller)."""

    input_ids: torch.Tensor
    """[1, T]"""
    position_ids: torch.Tensor
    """[4, 1, T]: text positions (restarting at 0 per sample), then M-RoPE t, h, w"""
    cu_seqlens: torch.Tensor
    """[n + 1] int32 sample boundaries"""
    max_len: int
    image_keys: list[int]
    """the sample index (into the step's samples) of each image-bearing sample, in sequence order"""

    def to(self, device: torch.device) -> PackedInputs:
        return PackedInputs(self.input_ids.to(device, non_blocking=True), self.position_ids.to(device, non_blocking=True),
                            self.cu_seqlens.to(device, non_blocking=True), self.max_len, self.image_keys)


def pack(seqs: list[list[int]], images: list[dict[str, torch.Tensor]], mrope: MRopeIndex,
         sample_ids: list[int]) -> PackedInputs:
    """Token ids of n samples back to back with their per-sample positions and boundaries."""
    pos, text = [], []
    for ids, im in zip(seqs, images, strict=True):
        p, _ = mrope(ids, im)
        pos.append(p)
        text.append(torch.arange(len(ids), dtype=torch.long))
    lens = [len(s) for s in seqs]
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)[None]
    position_ids = torch.cat([torch.cat(text)[None], torch.cat(pos, dim=1)], dim=0)[:, None, :]
    return PackedInputs(ids, position_ids, cu, max(lens), [k for k, im in zip(sample_ids, images, strict=True) if im])


class ImageEmbeddingCache:
    """Image embeddings of a step's samples, per sample index, from the first pass that computes them
    (the frozen vision tower gives the same answer in every pass of a step)."""

    def __init__(self) -> None:
        self.embeds: dict[int, torch.Tensor] = {}

    def clear(self) -> None:
        self.embeds.clear()

    def missing(self, keys: list[int]) -> list[int]:
        return [k for k in keys if k not in self.embeds]


def image_features(base, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
    """Per-image embeddings of the vision tower (no gradient: the tower is frozen)."""
    with torch.no_grad():
        out = base.get_image_features(pixel_values, grid_thw)
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    if isinstance(feats, torch.Tensor):
        sizes = (grid_thw.prod(-1) // base.visual.spatial_merge_size**2).tolist()
        feats = torch.split(feats, sizes)
    return [f.detach() for f in feats]


def packed_hidden(base, inputs: PackedInputs, image_embeds: torch.Tensor | None, image_token_id: int) -> torch.Tensor:
    """Last hidden states [1, T, h] of a packed micro-batch through the language model."""
    lm = base.language_model
    embeds = lm.embed_tokens(inputs.input_ids)
    if image_embeds is not None:
        mask = (inputs.input_ids == image_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(mask, image_embeds.to(embeds.dtype))
    out = lm(inputs_embeds=embeds, position_ids=inputs.position_ids, attention_mask={"full_attention": None},
             use_cache=False, awrl_cu_seqlens=inputs.cu_seqlens, awrl_max_seqlen=inputs.max_len)
    return out.last_hidden_state
