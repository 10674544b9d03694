"""Will the trainer and the inference server fit on one device? (the shared-device layout, issue 31)

`sglang[rollout]:d1|fsdp[actor]:d1` keeps the train-rollout server and the trainer rank resident on
the same GPU at once. `inference.mem_fraction_static` is the server's share of the device (its
weights and KV cache; SGLang allocates exactly that much); the trainer gets the rest, and its rank
caps itself there (`torch.cuda.set_per_process_memory_fraction`) so the server's share stays free.

The estimate, from the model folder's own tensors (safetensors headers) and its text config:
- trainer: parameters in `actor.dtype` (+ a bf16 compute copy with `actor.mixed_precision`),
  gradients and AdamW's two moments of the trainable parameters (the vision tower frozen with
  `actor.freeze_vision`), activations of one micro-batch of `actor.mb_max_tokens` tokens (per token
  and layer ~ 12 hidden + 4 intermediate values in the compute dtype, a layer's worth with gradient
  checkpointing, plus fp32 logits and their gradient), and the CUDA context;
- server: weights in `inference.dtype`, the KV cache of `max_batch_size` sequences of
  `max_context_len` tokens (embedded hf backend; SGLang: the share itself), and the CUDA context.
Calibrated on the 3B-shaped trainer on one H200 (fp32 master weights, bf16 compute, packed
micro-batches): its tensors peak at 94.8 GiB at mb_max_tokens 8192 and 116.7 GiB at 12288
(bench/results/train_gpu.json, train_gpu_mb12k.json), which the estimate gives within 4 GiB; beside
the server at 8192 tokens the allocator held another 25.6 GiB of blocks on 86 GiB of tensors and the
trainer hit a cap of 111.8 GiB, so the trainer's tensors get 20% on top (the estimate then refuses
that share, 0.2, and allows 0.10-0.19).

Invariant: a layout that this estimate says cannot fit is refused before any process starts, with
every number of the estimate in the message and the range of shares that would fit, if one exists.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from asyncwebrl.configtree import ConfigError

GiB = 2**30
CONTEXT_BYTES = int(1.5 * GiB)
"""CUDA context, cuBLAS/NCCL workspaces of one process"""
FRAGMENTATION = 0.2
"""the caching allocator's blocks beyond the tensors the trainer holds at its peak"""
SERVER_WORKSPACE = int(3.5 * GiB)
"""the embedded server beyond weights and KV cache: CUDA graphs, vision-tower activations, decode
buffers (measured: 13.7 GiB in use by the 3B-shaped server at 64 x 1024 tokens, 10.2 GiB of weights,
KV cache and context)"""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def shares_device(alloc) -> bool:
    """True when allocation_mode colocates the rollout and actor roles ('|'): the shared-device layout."""
    return any({a.role for a in c.allocs} >= {"rollout", "actor"} for c in alloc.components)


@dataclass(frozen=True)
class ModelShape:
    params: int
    trainable: int
    """parameters the trainer updates (vision tower excluded when it is frozen)"""
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_heads: int
    head_dim: int


def _safetensors_params(folder: Path) -> list[tuple[str, int]] | None:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    out = []
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for x in info["shape"]:
                numel *= int(x)
            out.append((name, numel))
    return out


def model_shape(path: str, freeze_vision: bool = True) -> ModelShape:
    """The shape of the model folder at `path` (config.json and the safetensors headers)."""
    folder = Path(path)
    cfg = json.loads((folder / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    hidden, layers = int(text["hidden_size"]), int(text["num_hidden_layers"])
    inter, vocab = int(text.get("intermediate_size", 4 * hidden)), int(text["vocab_size"])
    heads = int(text.get("num_attention_heads", 1))
    kv = int(text.get("num_key_value_heads", heads))
    head_dim = int(text.get("head_dim") or hidden // heads)
    tensors = _safetensors_params(folder)
    if tensors is None:  # no weights yet: the text model's own count (the vision tower unknown)
        per_layer = 2 * hidden * hidden + 2 * hidden * kv * head_dim + 3 * hidden * inter
        total = layers * per_layer + vocab * hidden * (1 if text.get("tie_word_embeddings", True) else 2)
        return ModelShape(total, total, layers, hidden, inter, vocab, kv, head_dim)
    total = sum(n for _, n in tensors)
    vision = sum(n for name, n in tensors if "visual" in name or "vision" in name)
    return ModelShape(total, total - vision if freeze_vision else total, layers, hidden, inter, vocab, kv, head_dim)


@dataclass(frozen=True)
class Footprint:
    """Bytes each resident role needs on one shared device, and what the layout gives it."""

    device_bytes: int
    server_share: float
    trainer_weights: int
    trainer_grads: int
    trainer_optimizer: int
    trainer_activations: int
    server_weights: int
    server_kv: int
    server_fixed: int | None = None
    """SGLang: its share is what it takes (weights + KV); None for the embedded server"""

    @property
    def trainer_total(self) -> int:
        tensors = self.trainer_weights + self.trainer_grads + self.trainer_optimizer + self.trainer_activations
        return int(tensors * (1 + FRAGMENTATION)) + CONTEXT_BYTES

    @property
    def server_total(self) -> int:
        if self.server_fixed is not None:
            return self.server_fixed
        return self.server_weights + self.server_kv + CONTEXT_BYTES + SERVER_WORKSPACE

    @property
    def server_cap(self) -> int:
        return int(self.server_share * self.device_bytes)

    @property
    def trainer_cap(self) -> int:
        return self.device_bytes - self.server_cap

    @property
    def fits(self) -> bool:
        server_ok = self.server_weights + CONTEXT_BYTES + SERVER_WORKSPACE <= self.server_cap \
            if self.server_fixed is not None \
            else self.server_total <= self.server_cap
        return server_ok and self.trainer_total <= self.trainer_cap

    def share_range(self) -> tuple[float, float] | None:
        """(lowest, highest) inference.mem_fraction_static that would fit, or None."""
        server_min = (self.server_weights + (0 if self.server_fixed is not None else self.server_kv)
                      + CONTEXT_BYTES + SERVER_WORKSPACE)
        lo, hi = server_min / self.device_bytes, 1 - self.trainer_total / self.device_bytes
        return (lo, hi) if lo <= hi else None

    def describe(self) -> str:
        g = lambda b: f"{b / GiB:.1f} GiB"  # noqa: E731
        server = (f"server {g(self.server_total)} (weights {g(self.server_weights)}, KV cache {g(self.server_kv)}, "
                  f"workspace {g(SERVER_WORKSPACE)}, CUDA context {g(CONTEXT_BYTES)})" if self.server_fixed is None else
                  f"server {g(self.server_total)} (SGLang takes its whole share; weights {g(self.server_weights)})")
        return (f"{server}; trainer {g(self.trainer_total)} (weights {g(self.trainer_weights)}, gradients "
                f"{g(self.trainer_grads)}, optimizer {g(self.trainer_optimizer)}, activations at mb_max_tokens "
                f"{g(self.trainer_activations)}, allocator {FRAGMENTATION:.0%}, CUDA context {g(CONTEXT_BYTES)}); device {g(self.device_bytes)}: "
                f"server share {self.server_share:.2f} = {g(self.server_cap)}, trainer the rest = {g(self.trainer_cap)}")


def estimate(cfg, device_bytes: int, shape: ModelShape | None = None) -> Footprint:
    """The footprint of a RunConfig's shared-device layout on a device of `device_bytes`."""
    if shape is None:
        from asyncwebrl.models.prepare import resolve_model_path

        shape = model_shape(resolve_model_path(cfg.actor.path), cfg.actor.freeze_vision)
    a, inf = cfg.actor, cfg.inference
    wb = DTYPE_BYTES[a.dtype]
    mixed = a.mixed_precision if a.mixed_precision is not None else (cfg.cluster.n_gpus_per_node > 0
                                                                      and a.dtype == "float32")
    compute_b = 2 if (mixed or a.dtype != "float32") else 4
    weights = shape.params * wb + (shape.params * 2 if mixed else 0)
    grads = shape.trainable * wb
    optimizer = 2 * shape.trainable * wb
    per_token_layer = (12 * shape.hidden + 4 * shape.intermediate) * compute_b
    layers_live = 1 if a.gradient_checkpointing else shape.layers
    ckpt_inputs = shape.layers * shape.hidden * compute_b if a.gradient_checkpointing else 0
    acts = a.mb_max_tokens * (layers_live * per_token_layer + ckpt_inputs + shape.vocab * 8)
    backend = cfg.allocation.rollout.backend
    server_w = shape.params * DTYPE_BYTES[inf.dtype]
    kv = (shape.layers * 2 * shape.kv_heads * shape.head_dim * DTYPE_BYTES[inf.dtype] * inf.max_batch_size
          * inf.max_context_len)
    fixed = int(inf.mem_fraction_static * device_bytes) if backend == "sglang" else None
    return Footprint(device_bytes=device_bytes, server_share=inf.mem_fraction_static, trainer_weights=weights,
                     trainer_grads=grads, trainer_optimizer=optimizer, trainer_activations=acts,
                     server_weights=server_w, server_kv=kv if fixed is None else 0, server_fixed=fixed)


def check_fit(cfg, device_bytes: int, shape: ModelShape | None = None) -> Footprint:
    """The estimate, or ConfigError with its numbers when the layout cannot fit (module docstring)."""
    fp = estimate(cfg, device_bytes, shape)
    if fp.fits:
        return fp
    rng = fp.share_range()
    hint = (f"set inference.mem_fraction_static between {rng[0]:.2f} and {rng[1]:.2f}" if rng else
            "no share fits both: lower actor.mb_max_tokens, turn on actor.gradient_checkpointing, lower "
            "inference.max_batch_size / max_context_len, or give the roles their own devices ('+')")
    raise ConfigError(f"allocation_mode '{cfg.allocation_mode}' puts the trainer and the inference server on "
                      f"the same device, and they do not fit: {fp.describe()}. {hint}")


def check_fit_here(cfg) -> Footprint | None:
    """`check_fit` on this machine's first GPU for a shared-device layout with GPUs; None when there
    is nothing to check here (no shared device, no GPU visible, or the model folder is not local yet)."""
    if not shares_device(cfg.allocation) or cfg.cluster.n_gpus_per_node == 0:
        return None
    from asyncwebrl.models.prepare import resolve_model_path

    try:
        path = resolve_model_path(cfg.actor.path)
    except FileNotFoundError:
        return None
    if not (Path(path) / "config.json").is_file():
        return None
    if cfg.cluster.device_memory_gb:
        device_bytes = int(cfg.cluster.device_memory_gb * GiB)
    else:
        import torch

        if not torch.cuda.is_available():
            return None
        device_bytes = torch.cuda.get_device_properties(0).total_memory
    return check_fit(cfg, device_bytes, model_shape(path, cfg.actor.freeze_vision))
