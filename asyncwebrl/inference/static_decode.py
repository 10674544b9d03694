"""Decode steps of a Qwen2-style decoder over a per-slot static KV cache, captured in CUDA graphs.

`StaticDecoder` runs one generation step for the first `n` slots of a fixed cache: embed the last
token of every slot, run the decoder layers (transformers' own modules' weights), write each slot's
new key/value at its own position, attend over the slot's valid prefix, and sample one token per
slot at its temperature (logprob of the temperature-scaled logits, as the engine reports it). On a
GPU the step is captured once per (batch bucket, length bucket) in a CUDA graph and replayed; the
per-layer elementwise work may be fused by torch.compile (two small functions per layer, dynamic in
the batch). On a CPU (tests) the same code runs eagerly.

Layout and invariants:
- `k`, `v`: [layers, slots + 1, kv_heads, max_len, head_dim]; slot i holds the KV of the scheduler's
  i-th running sequence, rows [0, n) are live (the scheduler compacts with `move`); the last slot is
  scratch (padded rows of a graphed prefill write there);
- text prefills of up to PREFILL_GRAPH_ROWS prompts replay CUDA graphs per (rows, length) bucket,
  captured on first use;
- the q/k/v projections and the gate/up projections are views into fused buffers (one GEMM each):
  the modules' parameters keep their names and shapes, so a weight written in place (`copy_`, what
  weight sync and disk loads do) is what the next replay reads; `weights_moved()` says whether a
  parameter was rebound since (then `refuse()` and recapture);
- decoding positions: a generated token's Qwen M-RoPE positions are equal in all three sections, so
  its rotation is plain 1-D RoPE at (length + rope_delta) with the model's own inv_freq;
- only full-attention decoders without q/k norms are supported (`supported()` says why not);
- `banned_tokens` (the image/video placeholder ids) are never sampled: a generated placeholder would
  make the trainer's teacher-forced forward count more image tokens than the images provide;
- a step's input token of row i is `last_tok[src[i]]` where src[i] >= 0 (the token the previous step
  sampled for that sequence, left on the device: steps can be launched before the host has read it),
  else the host-given id; every step writes its sampled tokens to `last_tok[:nb]` and (token, logprob)
  to `out[:, :nb]`; `launch` stages its inputs through a ring of `STAGING` pinned buffers copied
  asynchronously, so at most STAGING - 1 launched steps may be unread by the host at any time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STAGING = 3
PREFILL_GRAPH_ROWS = 8
"""text prefills of at most this many prompts replay CUDA graphs per (rows bucket, length bucket): their
time is host overhead (~20 ms eager for one 78-token prompt of a 3B decoder on an H200); larger ones
are GPU-bound and run eagerly"""
PREFILL_LEN_STEP = 32
"""prefill graphs pad the prompt length to a multiple of this"""
PREFILL_GRAPH_MAX_LEN = 2048
"""pinned input buffers in the ring (a buffer is refilled only after the step that read it was waited for)"""


def text_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (embed_tokens, layers, norm, rotary_emb) of a causal LM or a Qwen VLM."""
    inner = model.model
    return getattr(inner, "language_model", inner)


def supported(model: torch.nn.Module) -> str | None:
    """None when `StaticDecoder` can drive this model; else the reason it cannot."""
    try:
        lm = text_model(model)
        layer = lm.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(attn, name)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mlp, name)
        model.lm_head  # noqa: B018
        lm.rotary_emb.inv_freq  # noqa: B018
    except AttributeError as e:
        return f"not a Qwen2/Llama-style decoder ({e})"
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        return "attention with q/k norms (Qwen3) is not supported"
    cfg = lm.config
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])) or getattr(
            cfg, "use_sliding_window", False):
        return "sliding-window attention is not supported"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act} is not supported"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rope type {rope.get('rope_type')} is not supported"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen2/Llama RMSNorm: float32 statistics, weight applied in the input dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def sample_rows(logits: torch.Tensor, temps: torch.Tensor,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: Gumbel-max over log_softmax(logits / T) (greedy where T == 0), and its logprob
    under the temperature-scaled distribution (T == 0 counts as 1). No host sync; graph-capturable."""
    logits = logits.float()
    t = torch.where(temps > 0, temps, torch.ones_like(temps))
    lp_all = torch.log_softmax(logits / t[:, None], dim=-1)
    noise = torch.empty_like(lp_all).exponential_(generator=generator)
    tok = torch.where(temps > 0, (lp_all - noise.log()).argmax(-1), logits.argmax(-1))
    return tok, lp_all.gather(1, tok[:, None]).squeeze(1)


@dataclass
class _Graph:
    graph: Any
    tok: torch.Tensor
    lp: torch.Tensor
    logits: torch.Tensor


@dataclass
class _PrefillGraph:
    graph: Any
    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    idx: torch.Tensor
    out: torch.Tensor


class StaticDecoder:
    """Per-slot static KV cache + graph-captured decode steps (see module docstring)."""

    def __init__(self, model: torch.nn.Module, *, max_slots: int, max_len: int, use_graphs: bool,
                 compile_layers: bool = False, len_buckets: tuple[int, ...] | None = None,
                 generator: torch.Generator | None = None, banned_tokens: list[int] | None = None):
        reason = supported(model)
        if reason:
            raise ValueError(f"StaticDecoder: {reason}")
        self.model = model
        self.lm = text_model(model)
        cfg = self.lm.config
        p0 = next(model.parameters())
        self.device, self.dtype = p0.device, p0.dtype
        self.n_layers = len(self.lm.layers)
        attn0 = self.lm.layers[0].self_attn
        self.head_dim = int(getattr(attn0, "head_dim", cfg.hidden_size // cfg.num_attention_heads))
        self.n_q = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.max_slots = max_slots
        self.max_len = max_len
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.generator = generator
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b < max_slots) + (max_slots,)
        if len_buckets is None:
            len_buckets, b = [], 256
            while b < max_len:
                len_buckets.append(b)
                b *= 2
            len_buckets.append(max_len)
        self.len_buckets = tuple(sorted(set(min(x, max_len) for x in len_buckets)))
        # one slot past max_slots: the scratch slot that padded rows of a prefill graph write into
        shape = (self.n_layers, max_slots + 1, self.n_kv, max_len, self.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        dev = self.device
        self.ints = torch.zeros((4, max_slots), dtype=torch.long, device=dev)  # ids, kv_pos, rope_pos, src
        self.ids, self.kv_pos, self.rope_pos, self.src = self.ints[0], self.ints[1], self.ints[2], self.ints[3]
        self.src.fill_(-1)
        self.temps = torch.ones(max_slots, dtype=torch.float32, device=dev)
        self.last_tok = torch.zeros(max_slots, dtype=torch.long, device=dev)
        self.out = torch.zeros((2, max_slots), dtype=torch.float64, device=dev)  # sampled tokens, logprobs
        pin = dev.type == "cuda"
        self._staging = [(torch.zeros((4, max_slots), dtype=torch.long, pin_memory=pin),
                          torch.ones(max_slots, dtype=torch.float32, pin_memory=pin)) for _ in range(STAGING)]
        self._staged = 0
        self.rows = torch.arange(max_slots, device=dev)
        vocab = int(self.model.lm_head.weight.shape[0])
        banned = sorted({t for t in (banned_tokens or []) if t is not None and 0 <= t < vocab})
        self.banned = torch.tensor(banned, dtype=torch.long, device=dev) if banned else None
        self.span = torch.arange(max_len, device=dev)
        self.refuse()
        self._pre, self._post = self._layer_fns()
        if compile_layers:
            self._pre = torch.compile(self._pre, dynamic=True, fullgraph=True)
            self._post = torch.compile(self._post, dynamic=True, fullgraph=True)
        self.compiled = compile_layers
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.prefill_graphs: dict[tuple[int, int], _PrefillGraph] = {}
        self._pool = None
        self.capture_s = 0.0

    # ---- fused weights ----------------------------------------------------------------------------
    def refuse(self) -> None:
        """Make q/k/v and gate/up parameters views of one fused buffer each (values kept)."""
        self.fused: list[dict[str, torch.Tensor | None]] = []
        for layer in self.lm.layers:
            a, m = layer.self_attn, layer.mlp
            self.fused.append({
                "wqkv": _fuse([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                "bqkv": _fuse([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None,
                "wgu": _fuse([m.gate_proj.weight, m.up_proj.weight]),
            })
        # where each parameter is held, found once: reading them back is a dict lookup each, where
        # `model.parameters()` walks the module tree (over a millisecond for a 3B model, every refresh)
        self._slots = [(m._parameters, n) for m in self.model.modules() for n, p in m._parameters.items()
                       if p is not None]
        self._ptrs = self._param_ptrs()

    def _param_ptrs(self) -> list[int]:
        """The parameters' addresses, through their modules: a rebound `.data` and a replaced
        parameter both show (a module added since is not looked at)."""
        return [d[n].data_ptr() for d, n in self._slots]

    def weights_moved(self) -> bool:
        """Whether any parameter was rebound (not written in place) since the graphs were made."""
        return self._param_ptrs() != self._ptrs

    # ---- the step ---------------------------------------------------------------------------------
    def _layer_fns(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        nq, nkv, hd, eps = self.n_q, self.n_kv, self.head_dim, self.eps
        g = nq // nkv

        def pre(h, cos, sin, ln, wqkv, bqkv):
            x = rms_norm(h, ln, eps)
            qkv = F.linear(x, wqkv, bqkv)
            b = h.shape[0]
            q = qkv[:, : nq * hd].view(b, nq, hd)
            k = qkv[:, nq * hd: (nq + nkv) * hd].view(b, nkv, hd)
            v = qkv[:, (nq + nkv) * hd:].view(b, nkv, hd)
            c, s = cos[:, None, :], sin[:, None, :]
            q = q * c + _rotate_half(q) * s
            k = k * c + _rotate_half(k) * s
            return q.reshape(b, nkv, g, hd), k, v

        def post(h, attn, wo, ln, wgu, wdown):
            h = h + F.linear(attn.reshape(h.shape[0], nq * hd), wo)
            x = rms_norm(h, ln, eps)
            gu = F.linear(x, wgu)
            inter = gu.shape[-1] // 2
            return h + F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], wdown)

        return pre, post

    def _forward(self, n: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step for slots [0, n) attending over cache columns [0, length); reads the static inputs."""
        lm = self.lm
        kv_pos, rows, src = self.kv_pos[:n], self.rows[:n], self.src[:n]
        ids = torch.where(src >= 0, self.last_tok.index_select(0, src.clamp(min=0)), self.ids[:n])
        h = F.embedding(ids, lm.embed_tokens.weight)
        rot = lm.rotary_emb
        freqs = self.rope_pos[:n, None].float() * rot.inv_freq.float()[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        scale = float(getattr(rot, "attention_scaling", 1.0))
        cos, sin = (emb.cos() * scale).to(self.dtype), (emb.sin() * scale).to(self.dtype)
        mask = (self.span[None, :length] <= kv_pos[:, None])[:, None, None, :]
        # row r, kv head j writes at flat row ((r * n_kv + j) * max_len + kv_pos[r]) of a layer's cache
        # viewed as [-1, head_dim]: one index_copy_ per tensor (advanced indexing took several kernels)
        flat = ((rows[:, None] * self.n_kv + self.rows[None, : self.n_kv]) * self.max_len + kv_pos[:, None]).reshape(-1)
        hd = self.head_dim
        for i, layer in enumerate(lm.layers):
            f = self.fused[i]
            q, k, v = self._pre(h, cos, sin, layer.input_layernorm.weight, f["wqkv"], f["bqkv"])
            kc, vc = self.k[i], self.v[i]
            kc.view(-1, hd).index_copy_(0, flat, k.reshape(-1, hd))
            vc.view(-1, hd).index_copy_(0, flat, v.reshape(-1, hd))
            attn = F.scaled_dot_product_attention(q, kc[:n, :, :length], vc[:n, :, :length], attn_mask=mask,
                                                  scale=self.head_dim ** -0.5)
            h = self._post(h, attn, layer.self_attn.o_proj.weight, layer.post_attention_layernorm.weight,
                           f["wgu"], layer.mlp.down_proj.weight)
        h = rms_norm(h, lm.norm.weight, self.eps)
        logits = self.mask_banned(F.linear(h, self.model.lm_head.weight).float())
        tok, lp = sample_rows(logits, self.temps[:n], self.generator)
        self.last_tok[:n].copy_(tok)
        self.out[0, :n].copy_(tok)
        self.out[1, :n].copy_(lp)
        return tok, lp, logits

    def mask_banned(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits with the never-generated tokens (image/video placeholders) at -inf, in place."""
        if self.banned is not None:
            logits.index_fill_(1, self.banned, float("-inf"))
        return logits

    # ---- prefill of the text decoder ---------------------------------------------------------------
    def prefill_text(self, slots: list[int], *, inputs_embeds: torch.Tensor | None = None,
                     input_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                     **_: Any) -> Any:
        """Stand-in for the text model's forward during a prefill (same inputs: embeddings with the image
        features merged, the model's own M-RoPE position ids): the decoder layers through the same
        (compiled) layer functions, causal attention per right-padded row, each row's KV written
        straight into its cache slot. Returns the final hidden states as the text model would."""
        from transformers.modeling_outputs import BaseModelOutputWithPast

        lm = self.lm
        x = inputs_embeds if inputs_embeds is not None else lm.embed_tokens(input_ids)
        n, t, width = x.shape
        if t > self.max_len:
            raise ValueError(f"prefill of {t} positions exceeds the cache length {self.max_len}")
        if position_ids is None:
            position_ids = torch.arange(t, device=x.device)[None].expand(n, t)
        if position_ids.dim() == 3 and position_ids.shape[0] == 4:  # text positions prepended (newer transformers)
            position_ids = position_ids[1:]
        cos, sin = lm.rotary_emb(x, position_ids)
        if cos.dim() == 4:  # per-section cos/sin (older transformers): compose the M-RoPE layout here
            sec = list(self._mrope_section()) * 2
            cos = torch.cat([c[i % 3] for i, c in enumerate(cos.split(sec, dim=-1))], dim=-1)
            sin = torch.cat([c[i % 3] for i, c in enumerate(sin.split(sec, dim=-1))], dim=-1)
        cos, sin = cos.reshape(n * t, -1).to(self.dtype), sin.reshape(n * t, -1).to(self.dtype)
        if self.use_graphs and n <= PREFILL_GRAPH_ROWS and t <= PREFILL_GRAPH_MAX_LEN:
            h = self._prefill_replay(slots, x, cos, sin)
        else:
            h = self._prefill_layers(torch.tensor(slots, dtype=torch.long, device=self.device), x, cos, sin)
        return BaseModelOutputWithPast(last_hidden_state=h)

    def _prefill_layers(self, idx: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                        ) -> torch.Tensor:
        """The decoder layers over right-padded rows x [n, t, width] (row j's KV into slot idx[j]);
        returns the final normed hidden states [n, t, width]."""
        lm = self.lm
        n, t, width = x.shape
        nq, nkv, hd = self.n_q, self.n_kv, self.head_dim
        h = x.reshape(n * t, width)
        for i, layer in enumerate(lm.layers):
            f = self.fused[i]
            q, k, v = self._pre(h, cos, sin, layer.input_layernorm.weight, f["wqkv"], f["bqkv"])
            q = q.reshape(n, t, nq, hd).transpose(1, 2)
            k = k.reshape(n, t, nkv, hd).transpose(1, 2)
            v = v.reshape(n, t, nkv, hd).transpose(1, 2)
            self.k[i, :, :, :t].index_copy_(0, idx, k)
            self.v[i, :, :, :t].index_copy_(0, idx, v)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=hd ** -0.5)
            h = self._post(h, attn.transpose(1, 2).reshape(n * t, nq * hd), layer.self_attn.o_proj.weight,
                           layer.post_attention_layernorm.weight, f["wgu"], layer.mlp.down_proj.weight)
        return rms_norm(h, lm.norm.weight, self.eps).view(n, t, width)

    def _prefill_replay(self, slots: list[int], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                        ) -> torch.Tensor:
        """`_prefill_layers` from the graph of (rows bucket, length bucket): inputs copied into its static
        buffers (padded rows write their KV into the scratch slot; padded positions come after the real
        ones of each row, so causal attention keeps them out of the real outputs)."""
        n, t, width = x.shape
        nb = next(b for b in self.batch_buckets if b >= n)
        tb = -(-t // PREFILL_LEN_STEP) * PREFILL_LEN_STEP
        g = self.prefill_graphs.get((nb, tb)) or self._capture_prefill(nb, tb, width)
        g.x[:n, :t].copy_(x)
        g.cos.view(nb, tb, -1)[:n, :t].copy_(cos.reshape(n, t, -1))
        g.sin.view(nb, tb, -1)[:n, :t].copy_(sin.reshape(n, t, -1))
        g.idx.copy_(torch.tensor(slots + [self.max_slots] * (nb - n), dtype=torch.long), non_blocking=True)
        g.graph.replay()
        return g.out[:n, :t].clone()

    def _capture_prefill(self, nb: int, tb: int, width: int) -> _PrefillGraph:
        t0 = time.perf_counter()
        dev, hd = self.device, self.head_dim
        x = torch.zeros((nb, tb, width), dtype=self.dtype, device=dev)
        cos = torch.ones((nb * tb, hd), dtype=self.dtype, device=dev)
        sin = torch.zeros((nb * tb, hd), dtype=self.dtype, device=dev)
        idx = torch.full((nb,), self.max_slots, dtype=torch.long, device=dev)  # warm-up writes the scratch slot
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._prefill_layers(idx, x, cos, sin)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._prefill_layers(idx, x, cos, sin)
        g = _PrefillGraph(graph, x, cos, sin, idx, out)
        self.prefill_graphs[(nb, tb)] = g
        self.capture_s += time.perf_counter() - t0
        return g

    def _mrope_section(self) -> list[int]:
        cfg = self.lm.config
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        return list(rope["mrope_section"])

    def bucket(self, n: int, length: int) -> tuple[int, int]:
        if n > self.max_slots or length > self.max_len:
            raise ValueError(f"step of {n} slots x {length} positions exceeds the cache "
                             f"({self.max_slots} x {self.max_len})")
        return (next(b for b in self.batch_buckets if b >= n), next(b for b in self.len_buckets if b >= length))

    @torch.inference_mode()
    def step(self, ids: list[int], kv_pos: list[int], rope_pos: list[int], temps: list[float]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode one token for slots [0, len(ids)) from host-given input tokens: returns device tensors
        (tokens, logprobs, logits), each of at least len(ids) rows (rows past it belong to idle slots)."""
        return self.launch(ids, [-1] * len(ids), kv_pos, rope_pos, temps)

    @torch.inference_mode()
    def launch(self, ids: list[int], src: list[int], kv_pos: list[int], rope_pos: list[int], temps: list[float]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Enqueue one decode step without waiting for anything on the device: row i's input token is
        `last_tok[src[i]]` where src[i] >= 0, else ids[i]. Results as `step`'s, also in `out`."""
        n = len(ids)
        nb, lb = self.bucket(n, max(kv_pos) + 1)
        ints, temp = self._staging[self._staged % STAGING]
        self._staged += 1
        a, t = ints.numpy(), temp.numpy()  # whole buffers are copied: a strided copy would be synchronous
        a[0, :n], a[1, :n], a[2, :n], a[3, :n] = ids, kv_pos, rope_pos, src
        a[:3, n:nb], a[3, n:nb], t[:n], t[n:nb] = 0, -1, temps, 1.0
        self.ints.copy_(ints, non_blocking=True)
        self.temps.copy_(temp, non_blocking=True)
        if not self.use_graphs:
            return self._forward(nb, lb)
        g = self.graphs.get((nb, lb))
        if g is None:
            g = self._capture(nb, lb)
        g.graph.replay()
        return g.tok, g.lp, g.logits

    def _capture(self, nb: int, lb: int) -> _Graph:
        t0 = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up (and compilation) outside the capture
                self._forward(nb, lb)
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            tok, lp, logits = self._forward(nb, lb)
        g = _Graph(graph, tok, lp, logits)
        self.graphs[(nb, lb)] = g
        self.capture_s += time.perf_counter() - t0
        return g

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Capture every (batch, length) bucket now (at start-up, not in the first requests' way)."""
        if not self.use_graphs:
            return 0
        self.kv_pos.zero_()
        self.src.fill_(-1)
        for nb in self.batch_buckets:
            for lb in self.len_buckets:
                if (nb, lb) not in self.graphs:
                    self._capture(nb, lb)
        torch.cuda.synchronize()
        return len(self.graphs)

    def reset_graphs(self) -> None:
        self.graphs.clear()
        self.prefill_graphs.clear()
        self._pool = None

    # ---- cache writes -----------------------------------------------------------------------------
    @torch.inference_mode()
    def write_prefill(self, slots: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Store a prefill batch's KV ([rows, kv_heads, T, head_dim] per layer; row j -> slots[j])."""
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        t = keys[0].shape[-2]
        if t > self.max_len:
            raise ValueError(f"prefill of {t} positions exceeds the cache length {self.max_len}")
        for i in range(self.n_layers):
            self.k[i, :, :, :t].index_copy_(0, idx, keys[i].to(self.dtype))
            self.v[i, :, :, :t].index_copy_(0, idx, values[i].to(self.dtype))

    @torch.inference_mode()
    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot src's first `length` cache positions to slot dst (compaction)."""
        self.k[:, dst, :, :length].copy_(self.k[:, src, :, :length])
        self.v[:, dst, :, :length].copy_(self.v[:, src, :, :length])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _fuse(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Concatenate parameters along dim 0 into one buffer and rebind each to its (contiguous) view."""
    buf = torch.cat([p.data for p in params], dim=0)
    off = 0
    for p in params:
        n = p.shape[0]
        p.data = buf[off: off + n]
        off += n
    return buf
