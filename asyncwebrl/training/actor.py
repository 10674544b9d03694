"""The update engine: one `FSDPActor` per trainer rank (SPEC sections 2, 5, 6).

Every rank is handed the SAME global batch; it takes its deterministic share (`shard_for_rank`),
fetches that share's pixels, recomputes pi_prox, and runs the decoupled PPO update with FSDP2
(`fully_shard` on each decoder layer and on the root) over gloo (CPU) or NCCL (GPU).

Invariants:
- every rank runs the same number of forward/backward passes per phase (ranks with fewer
  micro-batches run zero-weight filler passes), so FSDP collectives always pair up;
- each micro-batch's loss is its token sum over the global token count, scaled by world_size
  because FSDP averages gradients over ranks, so the update equals the single-process update on the
  whole batch;
- logits are computed only at the positions that predict generated tokens (hidden states are sliced
  before lm_head);
- a screenshot is decoded and processed once per step (`process_images`), whatever the number of
  passes; with packing (Qwen2/2.5-VL, `asyncwebrl.training.packing`) a micro-batch is one unpadded row
  and the frozen vision tower runs once per sample per step;
- precision: the parameters and AdamW state are `actor.dtype` (fp32 by default) and the compute is
  bf16 when `actor.mixed_precision` is on (FSDP2 `MixedPrecisionPolicy` across ranks, autocast on one
  rank); unset, it is on for CUDA and off for CPU (ActorConfig refuses bf16 parameters with AdamW);
- `version` is the version of the weights this rank holds: a copy, across the trainer's process
  boundary, of the one owner (`weights.version.PolicyVersion`) plus the update it has made and not yet
  seen published. The loop passes the owner's value to every `train_step`, which raises
  `VersionDrift` if the copy differs; a checkpoint stores the copy and resume restores it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from asyncwebrl.models.prepare import resolve_model_path
from asyncwebrl.models.vlm import VLMAdapter, load_model
from asyncwebrl.net import LOOPBACK
from asyncwebrl.pixelstore.base import PixelStore
from asyncwebrl.records import RolloutGroup
from asyncwebrl.training import checkpoint as ckpt
from asyncwebrl.training.config import ActorConfig
from asyncwebrl.training.packing import (
    ImageEmbeddingCache,
    can_pack,
    enable_packing,
    image_features,
    packed_hidden,
)
from asyncwebrl.training.ppo import PPOParams, PPOStats, loglinear_prox, micro_batch_loss
from asyncwebrl.training.samples import (
    ForwardBatch,
    TrainSample,
    build_forward_batch,
    consumed_pixel_keys,
    fetch_pixels,
    micro_batches,
    process_images,
    samples_from_groups,
    shard_for_rank,
)
from asyncwebrl.weights.version import VersionDrift

WRAP = "policy."
VISION_CHUNK = 64
"""samples per vision-tower pass when one rank embeds a step's screenshots up front (`FSDPActor._images`)"""


@dataclass
class BCStats:
    """One behaviour-cloning update (`FSDPActor.bc_step`), over the whole global batch."""

    nll: float
    """token-mean negative log-likelihood of the target tokens before the update"""
    n_tokens: int
    n_samples: int
    grad_norm: float


class PolicyWithLossHead(nn.Module):
    """The HF model, with a forward that returns token logprobs (and entropy) at chosen positions only."""

    def __init__(self, hf: nn.Module, temperature: float | None = 1.0, entropy_grad: bool = False,
                 image_token_id: int | None = None):
        super().__init__()
        self.policy = hf
        self.image_token_id = image_token_id
        # logprobs of the sampling distribution: the servers report log_softmax(logits / T) (SGLang's
        # convention), so pi_theta and pi_prox must be taken at the same T for the ratios to mean anything
        self.temperature = temperature if temperature and temperature > 0 else 1.0
        self.entropy_grad = entropy_grad
        """set when the loss carries an entropy bonus: the entropy is then differentiable"""

    def forward(self, inputs: dict[str, torch.Tensor], rows: torch.Tensor, cols: torch.Tensor,
                targets: torch.Tensor, packed=None, cached_images: list[torch.Tensor | None] | None = None,
                new_images: tuple[torch.Tensor, torch.Tensor, list[int]] | None = None):
        """(logp, entropy) at the loss positions; packed (`packed` given): also the image embeddings
        computed in this pass, one per sample that had none cached (`new_images`: pixel values, grids
        and images per sample of those samples), for the caller's cache."""
        base = getattr(self.policy, self.policy.base_model_prefix)
        new_feats: list[torch.Tensor] = []
        if packed is not None:
            if new_images is not None:
                per_image = iter(image_features(base, new_images[0], new_images[1]))
                new_feats = [torch.cat([next(per_image) for _ in range(c)]) for c in new_images[2]]
            fill = iter(new_feats)
            feats = [c if c is not None else next(fill) for c in (cached_images or [])]
            hidden = packed_hidden(base, packed, torch.cat(feats) if feats else None, self.image_token_id)
        else:
            hidden = base(**inputs, use_cache=False).last_hidden_state
        logits = self.policy.get_output_embeddings()(hidden[rows, cols]).float() / self.temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, targets[:, None]).squeeze(-1).clone()  # FSDP hooks dislike views
        with torch.set_grad_enabled(self.entropy_grad and torch.is_grad_enabled()):
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy, new_feats


VISION_PARTS = ("vision_model.", "connector.", "visual.", "vision_tower.", "multi_modal_projector.")


def freeze_vision(hf: nn.Module) -> int:
    """Stop gradients into the vision tower and the vision-to-text connector; returns how many tensors.
    The default model's vision side is random-init: policy-gradient updates on it only inflate the image
    embeddings the language model reads (measured: the policy collapsed to unparsable output in 4 steps)."""
    n = 0
    for name, p in hf.named_parameters():
        if any(part in name for part in VISION_PARTS):
            p.requires_grad_(False)
            n += 1
    return n


def _decoder_layers(hf: nn.Module) -> list[nn.Module]:
    dec = hf.get_decoder() if hasattr(hf, "get_decoder") else None
    layers = getattr(dec, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(hf).__name__} to shard")
    return list(layers)


class FSDPActor:
    """One trainer rank. world_size=1 runs the same code without a process group or sharding."""

    def __init__(self, cfg: ActorConfig, rank: int = 0, world_size: int = 1, master_addr: str = LOOPBACK,
                 master_port: int = 29500, device: str = "cpu", init_timeout_s: float = 300.0):
        cfg.validate()
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.device = torch.device(device)
        self.distributed = world_size > 1
        if self.device.type == "cuda":
            # the current device is this rank's GPU (NCCL groups and streams follow it), also for one
            # local rank on cuda:1 beside a server on cuda:0
            torch.cuda.set_device(self.device)
        if self.distributed and not dist.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world_size,
                timeout=datetime.timedelta(seconds=init_timeout_s),
            )
        self.model_path = resolve_model_path(cfg.path)
        self.adapter = VLMAdapter(self.model_path)
        hf = load_model(self.model_path, cfg.dtype, "cpu")
        hf.config.use_cache = False
        if cfg.gradient_checkpointing:
            if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5.2x
                hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.n_frozen = freeze_vision(hf) if cfg.freeze_vision else 0
        self.hf = hf
        self.packing = cfg.packing and cfg.freeze_vision and can_pack(self.adapter, hf)
        """packed micro-batches (one unpadded row each); needs the frozen vision tower (cached embeddings)"""
        self.mrope = None
        if self.packing:
            from asyncwebrl.models.mrope import MRopeIndex

            enable_packing(hf)
            self.mrope = MRopeIndex(hf, self.adapter.image_token_id)
        self.embed_cache = ImageEmbeddingCache()
        compile_layers = cfg.compile_layers if cfg.compile_layers is not None else (
            self.device.type == "cuda" and not self.distributed)
        if compile_layers:
            # in place, before any sharding: FSDP2 wraps the compiled layers as it would the eager ones
            for layer in _decoder_layers(hf):
                layer.compile(dynamic=True)
        if self.device.type == "cuda":
            from asyncwebrl.models.vision_attention import batch_vision_attention

            # one SDPA over all windows of a pass instead of one per window (thousands per step)
            batch_vision_attention(hf)
        self.mixed_precision = cfg.mixed_precision if cfg.mixed_precision is not None else self.device.type == "cuda"
        self.vision_dtype: torch.dtype | None = None
        """the frozen tower's dtype when one rank holds it in the compute dtype (mixed precision): it has
        no master weights to keep, and the servers run it in bf16 too; None = the parameters' dtype"""
        if self.mixed_precision and not self.distributed and self.packing and self.n_frozen:
            for p in hf.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
            self.vision_dtype = torch.bfloat16
        self.module = PolicyWithLossHead(hf, cfg.temperature, entropy_grad=cfg.entropy_coef > 0,
                                         image_token_id=self.adapter.image_token_id)
        self.autocast = False
        self.profile = False
        """set (the benchmark does) to synchronize the device at phase boundaries, so `times` is exact"""
        self.times: dict[str, float] = {}
        """seconds per phase of the last train_step: pixel_fetch, image_processing, vision (the frozen
        tower, when one rank embeds the screenshots up front), h2d, forward, backward, optimizer, prox
        (the pi_prox pass, all of it)"""
        self._in_prox = False
        if self.distributed:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh(self.device.type, (world_size,))
            mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if self.mixed_precision else MixedPrecisionPolicy())
            self.module.to(self.device)
            for layer in _decoder_layers(hf):
                fully_shard(layer, mesh=mesh, mp_policy=mp)
            fully_shard(self.module, mesh=mesh, mp_policy=mp)
            if hasattr(self.module, "set_reduce_scatter_unused_params"):  # torch >= 2.12
                # a text-only micro-batch skips the vision tower on one rank but not on another
                self.module.set_reduce_scatter_unused_params(True)
        else:
            self.module.to(self.device)
            self.autocast = self.mixed_precision
        self.optimizer = self._adamw(cfg.lr)
        self.ppo = PPOParams(
            eps_clip=cfg.eps_clip, eps_clip_higher=cfg.eps_clip_higher, use_decoupled_loss=cfg.use_decoupled_loss,
            behave_imp_weight_cap=cfg.behave_imp_weight_cap, behave_imp_weight_mode=cfg.behave_imp_weight_mode,
            entropy_coef=cfg.entropy_coef, entropy_target=cfg.entropy_target,
            kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
        )
        self.ref_module = self._reference() if cfg.kl_coef > 0 else None
        """the frozen reference policy of the KL term: the model the run started from, a full copy on
        every rank (no sharding: it is only ever run forward), in the compute dtype"""
        self.version = 0
        """the version of the weights held: 0, a checkpoint's, +1 per train_step (checked against the
        owner at each train_step the loop makes, see the module docstring)"""
        self.step = 0
        self.ckpt_writer = ckpt.CheckpointWriter()

    # ---- collectives (no-ops in single-process mode) --------------------------------------------
    def _all_sum(self, values: list[float]) -> list[float]:
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(t)
        return t.tolist()

    def _all_max(self, values: list[float]) -> list[float]:
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    # ---- timing ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _phase(self, name: str):
        """Add the wall time of the block to `times[name]` (inside the pi_prox pass, to `prox` only);
        with `profile` the device is synchronized first and last, so queued GPU work lands in its phase."""
        if self._in_prox and name != "prox":
            yield
            return
        if self.profile and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.profile and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t

    # ---- forward ----------------------------------------------------------------------------------
    def _images(self, samples: list[TrainSample], pixels: list[list[bytes]]) -> dict[int, dict[str, torch.Tensor]]:
        """Processed image tensors of each sample (by id), once for the whole step.

        One rank with packing also fills the step's image-embedding cache here, pipelined: the samples
        are processed on host threads in chunks of `VISION_CHUNK`, and each chunk's vision tower pass is
        queued on the device as soon as the chunk is ready, so the device embeds chunk k while the host
        decodes chunk k+1. The passes that follow then never run the vision tower. (Under FSDP the tower
        is sharded with the root, so there it runs inside the first pass's forward, as a cache miss.)"""
        up_front = self.packing and not self.distributed
        workers = min(8, os.cpu_count() or 1) if self.device.type == "cuda" else 1
        if not up_front:
            with self._phase("image_processing"):
                done = process_images(self.adapter, samples, pixels, workers)
            return {id(s): im for s, im in zip(samples, done, strict=True)}
        from concurrent.futures import ThreadPoolExecutor

        out: dict[int, dict[str, torch.Tensor]] = {}
        with ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(process_images, self.adapter, [s], [p]) for s, p in zip(samples, pixels, strict=True)]
            for a in range(0, len(samples), VISION_CHUNK):
                with self._phase("image_processing"):
                    chunk = [(id(s), f.result()[0]) for s, f in zip(samples[a:a + VISION_CHUNK], futures[a:a + VISION_CHUNK],
                                                                    strict=True)]
                out.update(chunk)
                with self._phase("vision"):
                    self._embed_images([(k, im) for k, im in chunk if im])
        return out

    def _embed_images(self, pairs: list[tuple[int, dict[str, torch.Tensor]]]) -> None:
        """The frozen vision tower over these samples' images, into the step's embedding cache (one rank)."""
        if not pairs:
            return
        base = getattr(self.hf, self.hf.base_model_prefix)
        low = self.vision_dtype is not None  # a bf16 tower runs as it is, without autocast's casts
        with torch.no_grad(), torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast and not low):
            pv = torch.cat([im["pixel_values"] for _, im in pairs]).to(self.device, non_blocking=True)
            if low:
                pv = pv.to(self.vision_dtype)
            grid = torch.cat([im["image_grid_thw"] for _, im in pairs]).to(self.device, non_blocking=True)
            per_image = iter(image_features(base, pv, grid))
            for k, im in pairs:
                self.embed_cache.embeds[k] = torch.cat([next(per_image) for _ in range(int(im["image_grid_thw"].shape[0]))])

    def _forward(self, samples: list[TrainSample], images: list[dict[str, torch.Tensor]],
                 module: nn.Module | None = None):
        module = module if module is not None else self.module
        if self.packing:
            return self._forward_packed(samples, images, module)
        fb = build_forward_batch(self.adapter, samples, images)
        with self._phase("h2d"):
            inputs = {k: v.to(self.device, non_blocking=True) for k, v in fb.inputs.items()}
            if "pixel_values" in inputs:
                inputs["pixel_values"] = inputs["pixel_values"].to(self.hf.dtype)
            rows, cols, targets = (t.to(self.device, non_blocking=True) for t in (fb.rows, fb.cols, fb.targets))
        with self._phase("forward"), torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logp, entropy, _ = module(inputs, rows, cols, targets)
        return fb, logp, entropy

    def _forward_packed(self, samples: list[TrainSample], images: list[dict[str, torch.Tensor]], module: nn.Module):
        keys = [id(s) for s in samples]
        fb: ForwardBatch = build_forward_batch(self.adapter, samples, images, self.mrope, keys)
        image_keys = fb.packed.image_keys
        missing = set(self.embed_cache.missing(image_keys))
        new = None
        with self._phase("h2d"):
            packed = fb.packed.to(self.device)
            rows, cols, targets = (t.to(self.device, non_blocking=True) for t in (fb.rows, fb.cols, fb.targets))
            if missing:
                ims = [images[keys.index(k)] for k in image_keys if k in missing]
                new = (torch.cat([im["pixel_values"] for im in ims]).to(self.device, non_blocking=True),
                       torch.cat([im["image_grid_thw"] for im in ims]).to(self.device, non_blocking=True),
                       [int(im["image_grid_thw"].shape[0]) for im in ims])
        cached = []
        for k in image_keys:
            f = self.embed_cache.embeds.get(k)
            if f is not None and f.is_inference() and not torch.is_inference_mode_enabled():
                f = self.embed_cache.embeds[k] = f.clone()  # made in the pi_prox pass: usable in autograd now
            cached.append(f)
        with self._phase("forward"), torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logp, entropy, feats = module({}, rows, cols, targets, packed=packed, cached_images=cached,
                                          new_images=new)
        for k, f in zip([k for k in image_keys if k in missing], feats, strict=True):
            self.embed_cache.embeds[k] = f
        return fb, logp, entropy

    def _reference(self) -> PolicyWithLossHead:
        """The KL term's reference: the starting model again, frozen, in the compute dtype (bf16 under
        mixed precision), with the policy's attention path (packed or padded)."""
        dtype = "bfloat16" if self.mixed_precision else self.cfg.dtype
        ref = load_model(self.model_path, dtype, "cpu")
        ref.config.use_cache = False
        for p in ref.parameters():
            p.requires_grad_(False)
        if self.packing:
            enable_packing(ref)
        if self.device.type == "cuda":
            from asyncwebrl.models.vision_attention import batch_vision_attention

            batch_vision_attention(ref)
        module = PolicyWithLossHead(ref, self.cfg.temperature, image_token_id=self.adapter.image_token_id)
        return module.to(self.device).eval()

    def reset_reference(self) -> None:
        """The KL term's reference becomes the policy as it is now: after a warm start, RL is held near
        where it starts (the warm-started version 0), not pulled back to the model before the
        demonstrations. Collective under FSDP (every rank gathers each parameter in turn)."""
        if self.ref_module is None:
            return
        ref = dict(self.ref_module.policy.named_parameters())
        with torch.no_grad():
            for name, t in self.iter_full_parameters():
                ref[name].copy_(t)

    def _filler(self) -> tuple[list[TrainSample], list[dict[str, torch.Tensor]]]:
        pad = self.adapter.tokenizer.pad_token_id
        s = TrainSample(prompt_ids=[pad], output_ids=[pad], behave_logprobs=[0.0], versions=[0], advantage=0.0)
        return [s], [{}]

    def _padded(self, mbs: list[list[int]]) -> list[list[int] | None]:
        """Micro-batches of this rank, padded with None (filler passes) to the max count over ranks."""
        n = int(self._all_max([float(len(mbs))])[0])
        return list(mbs) + [None] * (n - len(mbs))

    def compute_logprobs(self, samples: list[TrainSample], pixels: list[list[bytes]] | None = None,
                         pixel_store: PixelStore | None = None) -> list[list[float]]:
        """Logprobs of each sample's output tokens under the current weights (collective across
        ranks: every rank must call it, with its own samples). Pixels: given, inline in the samples,
        or fetched from `pixel_store`; a sample whose pixels are missing is a ValueError here."""
        if pixels is None:
            kept, pixels, dropped = fetch_pixels(samples, pixel_store)
            if dropped:
                raise ValueError(f"{dropped} of {len(samples)} samples have screenshots missing from the store")
        self.embed_cache.clear()
        try:
            return self._logprobs(samples, self._images(samples, pixels))
        finally:
            self.embed_cache.clear()

    def _logprobs(self, samples: list[TrainSample], images_of: dict[int, dict[str, torch.Tensor]],
                  module: nn.Module | None = None) -> list[list[float]]:
        """The pi_prox pass: no autograd at all (inference mode on one rank; no_grad under FSDP, whose
        unsharded parameters must stay usable by the training passes), and micro-batches of
        `prox_mb_max_tokens`, larger than the training ones since no activations are kept. `module`: the
        policy (default) or the frozen reference (the KL term's pass, the same way)."""
        module = module if module is not None else self.module
        budget = self.cfg.prox_mb_max_tokens or 2 * self.cfg.mb_max_tokens
        mbs = self._index_micro_batches(samples, budget)
        out: list[list[float] | None] = [None] * len(samples)
        parts: list[tuple[list[int], list[int], torch.Tensor]] = []
        was_training = module.training
        module.eval()
        grad_off = torch.no_grad() if self.distributed else torch.inference_mode()
        try:
            with grad_off:
                for mb in self._padded(mbs):
                    if mb is None:
                        self._forward(*self._filler(), module=module)
                        continue
                    mb_samples = [samples[i] for i in mb]
                    fb, logp, _ = self._forward(mb_samples, [images_of[id(s)] for s in mb_samples], module)
                    # kept on the device: one copy to the host at the end, not a synchronisation per
                    # micro-batch (the host packs the next micro-batch while the device runs this one)
                    parts.append((mb, fb.n_per_sample, logp.float()))
            for mb, n_per, logp in parts:
                for i, part in zip(mb, torch.split(logp.cpu(), n_per), strict=False):
                    out[i] = part.tolist()
        finally:
            module.train(was_training)
        return out  # type: ignore[return-value]

    def _train_passes(self, samples: list[TrainSample], images_of: dict[int, dict[str, torch.Tensor]]):
        """Forward passes with gradients over this rank's micro-batches of `samples`, padded to the max
        count over ranks: a filler pass backpropagates a zero loss here, so FSDP's collectives pair up.
        Yields (forward batch, logp, entropy) of each real micro-batch; the caller backpropagates it."""
        for mb in self._padded(self._index_micro_batches(samples, self.cfg.mb_max_tokens)):
            if mb is None:
                _, logp, _ = self._forward(*self._filler())
                with self._phase("backward"):
                    (logp.sum() * 0.0).backward()
                continue
            mb_samples = [samples[i] for i in mb]
            yield self._forward(mb_samples, [images_of[id(s)] for s in mb_samples])

    def _index_micro_batches(self, samples: list[TrainSample], budget: int) -> list[list[int]]:
        index = {id(s): i for i, s in enumerate(samples)}
        return [[index[id(s)] for s in mb] for mb in micro_batches(samples, budget, packed=self.packing)]

    # ---- the update -------------------------------------------------------------------------------
    def prepare(self, batch: list[RolloutGroup] | list[TrainSample]) -> list[TrainSample]:
        """Training samples (with advantages) from rollout groups; samples pass through."""
        if batch and isinstance(batch[0], RolloutGroup):
            c = self.cfg
            return samples_from_groups(batch, c.group_adv_norm, c.adv_std_norm, c.step_normalizer, c.step_normalizer_k,
                                       c.wasted_steps_never_reinforced)
        return list(batch)  # type: ignore[arg-type]

    def train_step(self, batch: list[RolloutGroup] | list[TrainSample], pixel_store: PixelStore | None = None,
                   free_pixels: bool = False, version: int | None = None) -> dict[str, float]:
        """One PPO training step on the global batch (every rank passes the same batch). Returns the
        metrics of the whole global batch on every rank; the version is incremented. With `free_pixels`
        rank 0 frees every PixelStore reference the batch holds once the update is done (the batch is
        consumed; `TrainerRank` always asks for it). `version`: the owner's value (the version the
        servers serve); the weights held must be that version, else `VersionDrift` before any update."""
        if version is not None and version != self.version:
            raise VersionDrift(f"trainer rank {self.rank} holds weights of version {self.version}, but the "
                               f"policy is at version {version}")
        t0 = time.perf_counter()
        self.times = {}
        self.embed_cache.clear()
        cfg = self.cfg
        samples = self.prepare(batch)
        n_mini = max(1, cfg.ppo_n_minibatches)
        minis = [samples[j::n_mini] for j in range(n_mini)]
        local = [shard_for_rank(m, self.rank, self.world_size) for m in minis]
        flat = [s for m in local for s in m]
        with self._phase("pixel_fetch"):
            kept, pixels, dropped = fetch_pixels(flat, pixel_store)
        images_of = self._images(kept, pixels)
        local = [[s for s in m if id(s) in images_of] for m in local]
        tokens = self._all_sum([float(sum(len(s.output_ids) for s in m)) for m in local] + [float(dropped)])
        mini_tokens, n_dropped = tokens[:-1], int(tokens[-1])

        # pi_prox: one extra forward pass with the weights at the start of this update
        method = cfg.prox_logp_method if cfg.use_decoupled_loss else "none"
        need_forward = cfg.use_decoupled_loss and cfg.recompute_logprob and method in ("recompute", "metrics")
        t_prox = time.perf_counter()
        if need_forward:
            flat = [s for m in local for s in m]
            with self._phase("prox"):
                self._in_prox = True
                try:
                    logprobs = self._logprobs(flat, images_of)
                finally:
                    self._in_prox = False
            for s, lp in zip(flat, logprobs, strict=False):
                s.prox_logprobs = lp
        t_prox = time.perf_counter() - t_prox
        if self.ref_module is not None:
            flat = [s for m in local for s in m]
            with self._phase("reference"):
                for s, lp in zip(flat, self._logprobs(flat, images_of, self.ref_module), strict=False):
                    s.ref_logprobs = lp

        stats = PPOStats()
        grad_norms = []
        lr = self.lr_at(self.step + 1)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.module.train()
        for j, mini in enumerate(local):
            self.optimizer.zero_grad(set_to_none=True)
            for fb, logp, entropy in self._train_passes(mini, images_of):
                behave = fb.behave.to(self.device)
                versions = fb.versions.to(self.device)
                if not cfg.use_decoupled_loss:
                    prox = behave
                elif method == "loglinear" or (method == "recompute" and not cfg.recompute_logprob):
                    prox = loglinear_prox(logp, behave, versions, self.version, self.version + j / n_mini)
                else:
                    prox = fb.prox.to(self.device)
                loss, st = micro_batch_loss(logp, prox, behave, fb.advantages.to(self.device), entropy, self.ppo,
                                            mini_tokens[j], fb.ref.to(self.device) if fb.ref is not None else None)
                # FSDP averages gradients over ranks; the loss is a share of the GLOBAL sum, so undo it
                with self._phase("backward"):
                    (loss * self.world_size).backward()
                if method == "metrics":
                    approx = loglinear_prox(logp, behave, versions, self.version, self.version + j / n_mini)
                    st.prox_err_sum = float((approx - prox).abs().sum())
                stats.add(st)
            with self._phase("optimizer"):
                grad_norms.append(self._clip_and_step(skip_zero=cfg.skip_zero_grad_steps))
        self.embed_cache.clear()
        self.version += 1
        self.step += 1
        if free_pixels and pixel_store is not None and self.rank == 0:
            # one free per reference: the batch is consumed, its screenshots go back to the store
            keys = consumed_pixel_keys(batch)
            if keys:
                pixel_store.free(keys)
        return self._finalize(stats, grad_norms, n_dropped, len(samples), t0, t_prox)

    def lr_at(self, step: int) -> float:
        """Learning rate of train step `step` (1-based), from the step count alone (ActorConfig.lr_at)."""
        return self.cfg.lr_at(step)

    def _clip_and_step(self, optimizer: torch.optim.Optimizer | None = None, skip_zero: bool = False) -> float:
        """Clip to max_grad_norm and step; the global gradient norm before clipping. With `skip_zero` a
        zero gradient (the same on every rank: the norm is global) leaves weights and optimizer state."""
        optimizer = optimizer or self.optimizer
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.max_grad_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        if not (skip_zero and float(norm) == 0.0):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # ---- behaviour cloning (the warm start, asyncwebrl.training.warm_start) -----------------------
    def new_bc_optimizer(self, lr: float) -> torch.optim.Optimizer:
        """A fresh AdamW over the trainable parameters for the warm start, so RL's own optimizer starts
        with no state from it (betas and weight decay as actor.*)."""
        return self._adamw(lr)

    def _adamw(self, lr: float) -> torch.optim.Optimizer:
        """AdamW over the trainable parameters; on CUDA the fused kernel (one launch for all tensors)."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        fused = self.device.type == "cuda" and not self.distributed
        return torch.optim.AdamW(params, lr=lr, betas=tuple(self.cfg.adam_betas), weight_decay=self.cfg.weight_decay,
                                 **({"fused": True} if fused else {}))

    def bc_step(self, samples: list[TrainSample], pixels: list[list[bytes]] | None = None,
                optimizer: torch.optim.Optimizer | None = None, bf16: bool = False) -> BCStats:
        """One behaviour-cloning update on the global batch (every rank passes the same samples): minimise
        the token mean, over every sample's output ids, of -log pi_theta(token | prompt, earlier tokens).

        The logprobs are the PPO forward's (`PolicyWithLossHead`, logits / actor.temperature): the
        sampling distribution rollout draws from is the one cloned. Ranks take their share, run the same
        number of micro-batches (filler passes), and each micro-batch's loss is its NLL sum over the
        GLOBAL token count times world_size, so the update equals the single-process one. `pixels`:
        aligned with `samples`, or None = inline in the samples. `bf16`: the passes under bf16 autocast
        (matmuls in bf16; weights, gradients and the optimizer state stay in actor.dtype); a no-op where
        the actor computes in bf16 already (actor.mixed_precision). The version does not change: the
        warm start's result is version 0."""
        if not samples:
            raise ValueError("bc_step needs at least one demonstration sample")
        for s in samples:
            s.validate()
        local = shard_for_rank(samples, self.rank, self.world_size)
        if pixels is None:
            kept, pix, dropped = fetch_pixels(local, None)
            if dropped:
                raise ValueError(f"{dropped} demonstration samples have no inline screenshots")
        else:
            if len(pixels) != len(samples):
                raise ValueError(f"bc_step: {len(samples)} samples but {len(pixels)} pixel lists")
            pos = {id(s): i for i, s in enumerate(samples)}
            kept, pix = local, [pixels[pos[id(s)]] for s in local]
        self.embed_cache.clear()
        images_of = self._images(kept, pix)
        n_tokens = self._all_sum([float(sum(len(s.output_ids) for s in local))])[0]
        opt = optimizer or self.optimizer
        opt.zero_grad(set_to_none=True)
        self.module.train()
        nll_sum = 0.0
        autocast, self.autocast = self.autocast, self.autocast or (bf16 and not self.mixed_precision)
        try:
            for _, logp, _ in self._train_passes(local, images_of):
                nll = -logp.float().sum()
                (nll / n_tokens * self.world_size).backward()
                nll_sum += float(nll.detach())
        finally:
            self.autocast = autocast
        grad_norm = self._clip_and_step(opt)
        self.embed_cache.clear()
        nll_sum = self._all_sum([nll_sum])[0]
        return BCStats(nll=nll_sum / n_tokens, n_tokens=int(n_tokens), n_samples=len(samples), grad_norm=grad_norm)

    def _finalize(self, stats: PPOStats, grad_norms: list[float], n_dropped: int, n_samples: int,
                  t0: float, t_prox: float) -> dict[str, float]:
        if self.distributed:
            summed = self._all_sum(stats.as_tensor().tolist())
            w_max = self._all_max([stats.w_max])[0]
            stats = PPOStats.from_tensor(torch.tensor(summed), w_max)
        out = stats.finalize()
        out.update(
            grad_norm=sum(grad_norms) / max(len(grad_norms), 1), n_samples=float(n_samples),
            # mini-batches whose zero gradient left the weights (actor.skip_zero_grad_steps)
            skipped_updates=float(sum(g == 0.0 for g in grad_norms) if self.cfg.skip_zero_grad_steps else 0),
            n_dropped_missing_pixels=float(n_dropped), version=float(self.version),
            time_prox_s=t_prox, time_step_s=time.perf_counter() - t0,
            lr=float(self.optimizer.param_groups[0]["lr"]),
            **{f"time_{k}_s": v for k, v in self.times.items() if k != "prox"},
        )
        return out

    # ---- weights out ------------------------------------------------------------------------------
    def parameter_meta(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(HF name, dtype, full shape) of every parameter, tied weights once, in `named_parameters()`
        order (local: no collective)."""
        return [(name, p.dtype, tuple(p.shape)) for name, p in self.hf.named_parameters()]

    def iter_full_parameters(self):
        """Yield (HF name, full tensor) in `parameter_meta` order, gathering one parameter at a time
        (collective under FSDP: every rank must run the iterator to the end; other ranks get their
        gathered copy too, and drop it). Nothing larger than one parameter is held at once here."""
        for name, p in self.hf.named_parameters():
            t = p.detach()
            if hasattr(t, "full_tensor"):
                t = t.full_tensor()
            yield name, t

    def resident_parameters(self) -> list[tuple[str, torch.Tensor]] | None:
        """(HF name, the parameter's own memory) in `parameter_meta` order when this one rank holds
        every parameter whole (no sharding): what the same-device refresh hands the server directly,
        with nothing gathered or copied. None under sharding (use `iter_full_parameters`)."""
        if self.distributed:
            return None
        out = []
        for name, p in self.hf.named_parameters():
            t = p.detach()
            if hasattr(t, "to_local"):
                t = t.to_local()
            if tuple(t.shape) != tuple(p.shape) or not t.is_contiguous():
                return None
            out.append((name, t))
        return out

    def full_named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) of every parameter, tied weights once, in `named_parameters()`
        order; collective under FSDP (every rank must call), only rank 0 gets tensors."""
        out = [(n, t) for n, t in self.iter_full_parameters()]
        return out if self.rank == 0 else []

    # ---- checkpoints ------------------------------------------------------------------------------
    def _optim_state_full(self) -> dict[str, Any] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        # parameter-name keyed, unsharded: the same file resumes at any world size
        return get_optimizer_state_dict(self.module, self.optimizer, options=StateDictOptions(
            full_state_dict=True, cpu_offload=self.distributed))

    def save_checkpoint(self, root: str | Path, extra_state: dict[str, Any] | None = None,
                        keep_last: int | None = None, background: bool = False) -> Path | None:
        """Atomic checkpoint `root/version_<v>` (collective; rank 0 writes and returns its path).
        With `background`, rank 0 returns once its snapshot is taken and the write goes on in the
        writer thread (at most one in flight; `flush_checkpoints` waits for it)."""
        params = self.full_named_parameters()
        optim = self._optim_state_full()
        path = None
        if self.rank == 0:
            if background:
                path = self.ckpt_writer.submit(root, self.version, self.step, dict(params), self.model_path,
                                               optim, extra_state, keep_last)
            else:
                self.ckpt_writer.wait()
                path = ckpt.write_checkpoint(root, self.version, self.step, dict(params), self.model_path,
                                             optim, extra_state, keep_last)
        if self.distributed:
            dist.barrier()
        return path

    def flush_checkpoints(self, timeout_s: float | None = None) -> Path | None:
        """Wait for the background write in flight (rank 0; a no-op elsewhere); raises its error."""
        return self.ckpt_writer.wait(timeout_s)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore model, optimizer, step and version from a complete checkpoint; returns its
        extra_state. Collective; every rank passes the same path."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        state = ckpt.read_checkpoint(path) if (self.rank == 0 or not self.distributed) else None
        if not self.distributed:
            missing, unexpected = self.hf.load_state_dict(state["model"], strict=False)
            self._check_keys(missing, unexpected)
            if state["optimizer"] is not None:
                set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"],
                                         options=StateDictOptions(full_state_dict=True))
            meta = state
        else:
            model_sd = {WRAP + k: v for k, v in state["model"].items()} if state else {}
            opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
            # set_*_state_dict(broadcast_from_rank0=True) mutates the dict it is given: pass copies
            set_model_state_dict(self.module, dict(model_sd), options=opts)
            has_optim = self._all_max([1.0 if state and state["optimizer"] is not None else 0.0])[0] > 0
            if has_optim:
                osd = state["optimizer"] if state else {}
                set_optimizer_state_dict(self.module, self.optimizer, osd, options=opts)
            box = [{"version": state["version"], "step": state["step"], "extra_state": state["extra_state"]}
                   if state else None]
            dist.broadcast_object_list(box, src=0)
            meta = box[0]
        self.version, self.step = int(meta["version"]), int(meta["step"])
        return dict(meta["extra_state"])

    def _check_keys(self, missing: list[str], unexpected: list[str]) -> None:
        tied = {n for n, _ in self.hf.named_parameters(remove_duplicate=False)} - {n for n, _ in self.hf.named_parameters()}
        bad_missing = [k for k in missing if k not in tied and k in dict(self.hf.named_parameters())]
        if bad_missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {bad_missing[:5]}, unexpected {unexpected[:5]}")

    def close(self) -> None:
        try:
            self.ckpt_writer.wait()
        except Exception:  # noqa: BLE001 - reported where it happened; closing must go on
            pass
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()
