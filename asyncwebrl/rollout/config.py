"""Config of the rollout side: the pool, staleness control, and generation parameters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class RolloutConfig:
    mode: Literal["async", "sync"] = "async"
    """async = everlasting rollout pool; sync = WebGym-style synchronous pool (SPEC section 9)"""
    max_head_offpolicyness: int = 1
    """eta: how many versions the head token of a consumed trajectory may lag the trainer (0 = on-policy)"""
    max_concurrent_rollouts: int | None = None
    """C: rollouts (groups) running at once; None means consumer_batch_size"""
    consumer_batch_size: int = 4
    """B: rollouts the trainer consumes per step; one rollout = one GRPO group of gconfig.n_samples episodes of the same task"""
    pixel_transport: Literal["store", "object_store"] = "store"
    """store = screenshots go to the PixelStore and trajectories carry keys; object_store = pixels ride in trajectories"""
    workers: int = 1
    """rollout worker processes (Ray actors) that host the episode slots"""
    request_timeout_s: float = 120.0
    """HTTP timeout of one generation request"""
    max_retries: int = 3
    """retries of a failed generation request before failing over to another server"""
    sync_warmup: bool = True
    """sync mode: relaunch browser sessions every round (the WebGym cost the async pool removes)"""
    batch_timeout_s: float = 3600.0
    """prepare_batch waits at most this long for a batch before raising (a dead pool never hangs the trainer)"""
    restart_dead_servers: bool = False
    """the controller restarts a train-rollout server found dead at a step and re-joins it to the weight group (else training goes on without it)"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: the trainer skips groups whose episodes all got the same reward (all-zero
    GRPO advantages, no learning signal) and draws more until consumer_batch_size groups carry a signal.
    Skipped groups still feed task sampling and the step's rollout figures; they are not trained on"""
    dynamic_sampling_max_draws: int = 4
    """with dynamic_sampling: at most this many times consumer_batch_size groups drawn per step; past it
    the step trains on the groups with a signal it has (or, if none, on the last batch drawn), so a run
    whose tasks are all solved or all hopeless never stalls"""

    @property
    def concurrency(self) -> int:
        return self.max_concurrent_rollouts or self.consumer_batch_size

    def validate(self) -> None:
        if self.max_head_offpolicyness < 0:
            raise ValueError("rollout.max_head_offpolicyness (eta) must be >= 0")
        if self.consumer_batch_size < 1:
            raise ValueError("rollout.consumer_batch_size must be >= 1")
        if self.max_concurrent_rollouts is not None and self.max_concurrent_rollouts < 1:
            raise ValueError("rollout.max_concurrent_rollouts must be >= 1 (or null for consumer_batch_size)")
        if self.workers < 1:
            raise ValueError("rollout.workers must be >= 1")
        if self.batch_timeout_s <= 0:
            raise ValueError("rollout.batch_timeout_s must be > 0")
        if self.dynamic_sampling_max_draws < 1:
            raise ValueError("rollout.dynamic_sampling_max_draws must be >= 1 (groups drawn per step, in units of "
                             "consumer_batch_size)")


@dataclass(kw_only=True)
class GenerationConfig:
    n_samples: int = 4
    """rollouts per task, the GRPO group size"""
    max_new_tokens: int = 16
    """generation budget per step (one action)"""
    temperature: float = 1.0
    """sampling temperature of training rollouts"""
    top_p: float = 1.0
    """nucleus sampling threshold"""
    top_k: int = -1
    """top-k sampling (-1 = off)"""
    stop: list[str] | None = None
    """extra stop strings"""

    def validate(self) -> None:
        if self.n_samples < 1:
            raise ValueError("gconfig.n_samples must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError("gconfig.max_new_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("gconfig.temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("gconfig.top_p must be in (0, 1]")
