"""Config of the update engine (the FSDP actor) and the PPO objective (SPEC sections 5, 6)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class ActorConfig:
    path: str = "default"
    """policy model: 'default' (the prepared embedded model), a local HF folder, or a hub id"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """parameter (master weight) and AdamW state dtype of the trainer. Keep float32: with bf16
    parameters, AdamW updates of lr ~1e-5 round away (measured on an H200, 3B: 0.66% of a matrix's
    entries changed by one step); bfloat16/float16 are refused unless `allow_low_precision_params`"""
    mixed_precision: bool | None = None
    """bf16 compute over the fp32 master weights (FSDP2 MixedPrecisionPolicy across ranks: bf16
    parameters in forward/backward, fp32 gradient reduction; autocast on one rank). None = on for a
    CUDA trainer, off on CPU: the GPU recipe"""
    allow_low_precision_params: bool = False
    """accept dtype=bfloat16/float16 parameters with AdamW anyway (no Kahan summation or stochastic
    rounding here: most small updates are lost; for memory experiments only)"""
    packing: bool = True
    """packed micro-batches (no padding, per-sample varlen attention, the frozen vision tower run once
    per sample per step) where the model family supports it (Qwen2/2.5-VL); others run padded"""
    prox_mb_max_tokens: int = 0
    """token budget of a pi_prox micro-batch (no gradients, no activations kept); 0 = 2 x mb_max_tokens"""
    freeze_vision: bool = True
    """keep the vision tower and connector frozen (train the language model only)"""
    gradient_checkpointing: bool = False
    """activation checkpointing of decoder layers"""
    compile_layers: bool | None = None
    """`torch.compile` each language-model decoder layer (dynamic shapes, compiled once for all layers):
    fuses the norms, rotary embedding and gated activation that run as separate memory-bound kernels
    in eager mode, at the cost of a compile of a minute or so in the first step. None = on for a
    trainer of one CUDA rank (the GPU recipe), off on CPU and across FSDP ranks (not measured there)"""
    cpu_threads: int = 0
    """torch threads of a CPU trainer rank (0 = every core; fewer leaves cores to rollout when they share a machine)"""
    lr: float = 1e-5
    """AdamW learning rate"""
    lr_warmup_steps: int = 0
    """linear warm-up: train step k (1-based) uses lr * min(1, k / lr_warmup_steps); 0 = none. Adam's
    first steps move every weight by about lr whatever the gradient's size (its second-moment estimate
    has seen one or two gradients), which is what flips a small policy in one step"""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """after the warm-up: keep `lr`, or decay it (linearly or on a half cosine) to lr * min_lr_ratio at
    step `lr_decay_steps`, and hold it there"""
    lr_decay_steps: int = 0
    """the step at which a decaying schedule reaches its floor (default.yaml sets ${total_train_steps});
    the decay runs from the end of the warm-up to here"""
    min_lr_ratio: float = 0.0
    """the decayed schedule's floor, as a fraction of lr"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_betas: list[float] = None  # type: ignore[assignment]
    """AdamW betas (default [0.9, 0.999])"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    mb_max_tokens: int = 4096
    """micro-batch token budget of one forward/backward"""
    ppo_n_minibatches: int = 1
    """optimizer steps per training step (the batch is split into this many minibatches)"""
    temperature: float | None = None
    """temperature of the trainer's logprobs; None = gconfig.temperature (must match generation)"""
    recompute_logprob: bool = True
    """recompute pi_prox logprobs with an extra forward pass before the update (false: no extra pass,
    pi_prox comes from the log-linear approximation)"""
    use_decoupled_loss: bool = True
    """decoupled PPO (clip only pi_theta/pi_prox, weight by pi_prox/pi_behave); false = coupled PPO"""
    prox_logp_method: Literal["recompute", "loglinear", "metrics"] = "recompute"
    """how pi_prox is obtained: forward pass, log-linear interpolation, or both with the error logged"""
    behave_imp_weight_cap: float = 5.0
    """cap of the behaviour importance weight pi_prox/pi_behave"""
    behave_imp_weight_mode: Literal["mask", "clamp"] = "mask"
    """tokens whose weight exceeds the cap are masked out or clamped to the cap"""
    eps_clip: float = 0.2
    """PPO clip epsilon (lower side)"""
    eps_clip_higher: float | None = None
    """PPO clip epsilon on the upper side (None = eps_clip)"""
    entropy_coef: float = 0.0
    """entropy bonus: the loss subtracts entropy_coef x the token-mean entropy of the (temperature-scaled)
    policy at the generated tokens' positions; 0 = none (and the entropy is then computed without a
    gradient, as a statistic only). Keeps a small policy from collapsing onto one answer, after which
    every GRPO group has all-zero advantages and teaches nothing"""
    entropy_target: float | None = None
    """with entropy_coef > 0: the bonus acts only on a micro-batch whose token-mean entropy is below this
    (a floor, c x max(0, target - H)); None = always (a plain bonus). Unbounded, the bonus overshoots:
    measured 2026-12-02 at entropy_coef 0.03, entropy 0.3 -> 1.4 and 69% unparsable actions by step 19"""
    kl_coef: float = 0.0
    """beta of the KL term to a frozen reference policy (the model the run started from, held by every
    trainer rank in the compute dtype and run once more per step); 0 = off (ppo.py states the term)"""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """per-token estimator of the KL term: k1 (the log-ratio) or k3 (exp(d) - d - 1, never negative)"""
    group_adv_norm: bool = True
    """GRPO: normalize rewards within the n_samples rollouts of a task"""
    adv_std_norm: bool = True
    """divide group-centred advantages by the group std"""
    step_normalizer: Literal["none", "episode_length", "constant"] = "none"
    """per-step sample weight: none, 1/|tau| (episode length), or a constant 1/k"""
    step_normalizer_k: int = 10
    """k of the constant 1/k per-step normalizer"""
    wasted_steps_never_reinforced: bool = False
    """a step whose action was invalid or changed nothing on the page carries min(A, 0) instead of its
    episode's advantage A: the episode's luck does not reinforce it (a chance click after two junk
    `type` actions still pays 0.8, and without this GRPO pushes the junk typing up with the click),
    while a failed episode still pushes it down. Steps that ran and changed the page keep A"""
    skip_zero_grad_steps: bool = False
    """a mini-batch whose gradient is exactly zero (every sample's advantage 0 and no KL or entropy term)
    leaves the weights and the optimizer state as they are. AdamW otherwise keeps moving the weights along
    its momentum on such a step (docs/results-log.md, "60 steps, second seed"); the lr schedule still
    counts the step. Off until measured"""
    weight_update_mode: Literal["xccl", "disk"] = "xccl"
    """how weights reach the train-rollout servers: broadcast group (NCCL/gloo) or checkpoint on disk"""
    weight_chunked_mem_mb: int = 2048
    """flat bucket size (MiB) of one broadcast: the fastest of 512/1024/2048 on 2x H200 for 1.5B and 8B
    (bench/results/weightsync_gpu.json, per_bucket_mb)"""
    weight_pause_mode: Literal["in_place", "retract", "abort"] = "in_place"
    """/pause_generation mode during a refresh (SGLang's): keep in-flight requests in place, retract
    them to the queue, or abort them (the client resubmits, keeping per-token logprobs and versions)"""
    weight_update_timeout_s: float = 120.0
    """a weight update not done in this time is an error, never a hang"""

    def __post_init__(self) -> None:
        if self.adam_betas is None:
            self.adam_betas = [0.9, 0.999]

    def lr_at(self, step: int) -> float:
        """Learning rate of train step `step` (1-based): the linear warm-up of `lr_warmup_steps`, then
        `lr` held or decayed by `lr_schedule` to `lr * min_lr_ratio` at `lr_decay_steps`. A function of
        the step count alone, which checkpoints keep, so a resumed run goes on where it was without a
        scheduler state."""
        w = self.lr_warmup_steps
        if w > 0 and step < w:
            return self.lr * step / w
        if self.lr_schedule == "constant":
            return self.lr
        # a decay that ends before the warm-up does (a run shorter than the ramp) is the floor after it
        frac = min(1.0, max(0.0, (step - w) / max(1, self.lr_decay_steps - w)))
        shape = 1.0 - frac if self.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape)

    def validate(self) -> None:
        if self.lr <= 0:
            raise ValueError("actor.lr must be > 0")
        if self.lr_warmup_steps < 0:
            raise ValueError("actor.lr_warmup_steps must be >= 0 (0 = no warm-up)")
        if self.lr_schedule != "constant" and self.lr_decay_steps < 1:
            raise ValueError(f"actor.lr_schedule={self.lr_schedule} needs actor.lr_decay_steps >= 1 "
                             f"(got {self.lr_decay_steps})")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError("actor.min_lr_ratio must be in [0, 1]")
        if self.cpu_threads < 0:
            raise ValueError("actor.cpu_threads must be >= 0 (0 = every core)")
        if self.eps_clip <= 0:
            raise ValueError("actor.eps_clip must be > 0")
        if self.behave_imp_weight_cap <= 1:
            raise ValueError("actor.behave_imp_weight_cap must be > 1")
        if self.weight_chunked_mem_mb < 1:
            raise ValueError("actor.weight_chunked_mem_mb must be >= 1")
        if self.prox_logp_method != "recompute" and not self.use_decoupled_loss:
            raise ValueError("actor.prox_logp_method only matters with actor.use_decoupled_loss=true")
        if self.prox_logp_method == "metrics" and not self.recompute_logprob:
            raise ValueError("actor.prox_logp_method=metrics compares against a recompute: needs "
                             "actor.recompute_logprob=true")
        if self.mb_max_tokens < 1:
            raise ValueError("actor.mb_max_tokens must be >= 1")
        if self.prox_mb_max_tokens < 0:
            raise ValueError("actor.prox_mb_max_tokens must be >= 0 (0 = 2 x mb_max_tokens)")
        if self.dtype != "float32" and not self.allow_low_precision_params:
            raise ValueError(
                f"actor.dtype={self.dtype} keeps the parameters and AdamW state in {self.dtype}: updates of "
                f"lr {self.lr:g} round away (measured: 0.66% of weights changed by a step). Use the GPU recipe "
                "actor.dtype=float32 with actor.mixed_precision=true (bf16 compute, fp32 master weights; the "
                "default on CUDA), or set actor.allow_low_precision_params=true to accept the lost updates")
        if not self.kl_coef >= 0:
            raise ValueError(f"actor.kl_coef must be >= 0, got {self.kl_coef}")
        if not self.entropy_coef >= 0:
            raise ValueError(f"actor.entropy_coef must be >= 0, got {self.entropy_coef}")
        if self.entropy_target is not None and not self.entropy_target > 0:
            raise ValueError(f"actor.entropy_target must be > 0 or null, got {self.entropy_target}")
        if self.ppo_n_minibatches < 1:
            raise ValueError("actor.ppo_n_minibatches must be >= 1")
        if self.max_grad_norm <= 0:
            raise ValueError("actor.max_grad_norm must be > 0")
        if self.eps_clip_higher is not None and self.eps_clip_higher <= 0:
            raise ValueError("actor.eps_clip_higher must be > 0 (or null)")
        if self.step_normalizer_k < 1:
            raise ValueError("actor.step_normalizer_k must be >= 1")
        if self.weight_pause_mode not in ("in_place", "retract", "abort"):
            raise ValueError("actor.weight_pause_mode must be in_place, retract or abort")
        if self.weight_update_timeout_s <= 0:
            raise ValueError("actor.weight_update_timeout_s must be > 0")
        if len(self.adam_betas) != 2:
            raise ValueError("actor.adam_betas must hold two numbers")


@dataclass(kw_only=True)
class CheckpointConfig:
    every_n_steps: int = 5
    """write an atomic checkpoint every N training steps (0 = only at the end)"""
    keep_last: int = 2
    """complete checkpoints kept on disk"""

    def validate(self) -> None:
        if self.every_n_steps < 0 or self.keep_last < 1:
            raise ValueError("checkpoint.every_n_steps must be >= 0 and checkpoint.keep_last >= 1")


@dataclass(kw_only=True)
class WarmStartConfig:
    """Behaviour cloning on demonstrations before the first RL step (`asyncwebrl.training.warm_start`).

    Off by default. When on, a fresh run (never a resume) collects successful demonstration episodes
    through the rollout's own episode loop on the production env, minimises the token-mean NLL of the
    demonstrated action tokens on the trainer ranks, and hands the result to the inference servers as
    version 0: checkpoints, evaluation and staleness count from there.
    """

    enabled: bool = False
    """run the warm start before the first RL step of a fresh run (a resumed run never redoes it)"""
    source: Literal["oracle", "episodes"] = "oracle"
    """oracle = scripted MiniWoB solvers (asyncwebrl.web.oracles) play fresh episodes; episodes = replay
    the successful episodes of a run's episodes/ folder (index.jsonl + episode.json) on the env"""
    episodes_dir: str | None = None
    """source=episodes: a run's episodes/ folder (or the run folder holding it)"""
    n_demos: int = 10
    """successful demonstration episodes per task (oracle: played until reached, at most 3x as many
    attempts; episodes: at most this many recorded successes per task are replayed)"""
    epochs: int = 3
    """passes over the demonstrations"""
    lr: float = 5e-5
    """AdamW learning rate of the warm start (its own optimizer: RL starts with fresh AdamW state)"""
    batch_size: int = 16
    """demonstration steps per optimizer step"""
    bf16: bool | None = None
    """the cloning passes under bf16 autocast (matmuls in bf16; weights, gradients and AdamW state stay
    in actor.dtype). None = where the device multiplies bf16 natively (a CUDA device; a CPU with AVX-512
    or newer, `warm_start.native_bf16`): 1.6x faster passes on the 2-core CPU. A no-op under actor.mixed_precision"""
    tasks: str = ""
    """tasks to demonstrate (subset or comma-separated names); '' = the training tasks (env.tasks)"""
    concurrency: int = 2
    """browser sessions collecting demonstrations at once"""
    seed: int = 7
    """seed of the demonstration episodes (offset from the evaluation seeds) and of the epoch shuffles"""

    def validate(self) -> None:
        if self.n_demos < 1:
            raise ValueError("warm_start.n_demos must be >= 1 (demonstration episodes per task)")
        if self.epochs < 1:
            raise ValueError("warm_start.epochs must be >= 1")
        if not self.lr > 0:
            raise ValueError("warm_start.lr must be > 0")
        if self.batch_size < 1:
            raise ValueError("warm_start.batch_size must be >= 1")
        if self.concurrency < 1:
            raise ValueError("warm_start.concurrency must be >= 1")
        if self.source == "oracle" and self.episodes_dir is not None:
            raise ValueError("warm_start.episodes_dir is read only with warm_start.source=episodes "
                             "(source=oracle plays fresh oracle episodes); drop it or set source=episodes")
        if self.source == "episodes" and self.enabled:
            from pathlib import Path

            if not self.episodes_dir:
                raise ValueError("warm_start.source=episodes needs warm_start.episodes_dir (a run's episodes/ folder)")
            d = Path(self.episodes_dir)
            if not (d / "index.jsonl").is_file() and (d / "episodes" / "index.jsonl").is_file():
                d = d / "episodes"
            if not (d / "index.jsonl").is_file():
                raise ValueError(f"warm_start.episodes_dir {self.episodes_dir} holds no index.jsonl: give a run's "
                                 "episodes/ folder (written when stats.keep_episodes > 0)")
