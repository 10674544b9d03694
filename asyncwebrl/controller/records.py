"""Typed records of a training run: one per step and one for the whole run.

The controller builds a `StepRecord` at the end of every step and a `RunSummary` at the end of the
run; everything downstream (metrics.jsonl, TensorBoard, the summary printout, `summary.json`, the
benchmarks, the tests) reads them by attribute. metrics.jsonl rows are `StepRecord.as_log()`, so the
viewer's keys are exactly these field names (a test checks that every key the plots read exists).

Rollout counters come from the rollout side's typed `RolloutStats`; nothing here reads a dict key
that could silently be missing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class StepRecord:
    """Figures of one training step (`step` counts finished steps, so the first record has step 1)."""

    step: int
    version: int
    # the batch the step trained on
    n_trajectories: int
    failed_trajectories: int
    reward_mean: float
    success_rate: float
    episode_len_mean: float
    invalid_rate: float
    no_effect_rate: float
    """share of the batch's steps whose valid action changed nothing on the page"""
    slow_steps: int
    """steps of the batch's episodes (failed ones too) that took at least env.slow_step_s"""
    generated_tokens: int
    staleness_hist: dict[str, int]
    n_groups: int
    zero_adv_groups: int
    """groups of this batch whose advantages were all zero (equal rewards: wasted rollout)"""
    zero_adv_frac: float
    skipped_groups: int = 0
    """drawn groups this step did not train on (rollout.dynamic_sampling: all-zero advantages); the
    batch figures above (n_trajectories, success_rate ...) cover every drawn group"""
    tasks_in_zone: int
    """training tasks whose success EMA lies in the adaptive sampler's productive zone"""
    # rollout side, cumulative over the run (RolloutStats)
    dropped_stale: int
    failed_episodes: int
    failed_rollouts: int
    rollout_idle_frac: float
    # trainer side
    trainer_idle_frac: float
    """cumulative share of wall time the trainer waited for data"""
    trajectories_per_s: float
    tokens_per_s: float
    # phase times of this step (s); checkpoint is its own phase, not part of step_time_s
    step_time_s: float
    """rollout wait + train + weight sync"""
    wait_s: float
    train_s: float
    weight_sync_s: float
    checkpoint_s: float
    """time the loop was blocked by a checkpoint at the end of this step (0 when none)"""
    wall_time_s: float
    duplicates: int
    servers_restarted: int
    servers_dropped: int
    server_recovery_s: float
    trainer: dict[str, float] = field(default_factory=dict)
    """the trainer's own figures of the update (loss, clip rates, KL, entropy ...)"""
    sync: dict[str, float] = field(default_factory=dict)
    """the weight refresh's own figures (bytes, buckets, broadcast time ...)"""

    def as_log(self) -> dict[str, Any]:
        """The flat row written to metrics.jsonl / TensorBoard (trainer figures unprefixed, as before)."""
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("trainer", "sync")}
        row.update({k: v for k, v in self.trainer.items() if k not in row})
        row.update({f"sync_{k}": v for k, v in self.sync.items()})
        return row


@dataclass(kw_only=True)
class EvalPoint:
    version: int
    success_rate: float
    heldout_success_rate: float | None = None
    """success on the held-out tasks (never trained on), same snapshot; None without held-out tasks"""
    per_task: dict[str, float] = field(default_factory=dict)
    heldout_per_task: dict[str, float] = field(default_factory=dict)
    shortcut_baseline: float | None = None
    """success of the best constant-action policy (`click [k]`, "first button" ...) on the same
    episodes (evaluation.shortcut); None when test_rollout.shortcut_baseline is off or it failed"""
    shortcut_policy: str | None = None
    """which constant policy that was"""
    gain_over_shortcut: float | None = None
    """success_rate - shortcut_baseline: what reading the page adds"""
    heldout_shortcut_baseline: float | None = None
    """the same on the held-out tasks"""


@dataclass(kw_only=True)
class RunSummary:
    """Headline figures of a finished run (summary.json, the printout, `train --record`)."""

    steps: int
    version: int
    wall_time_s: float
    window: int
    """steps in each of the first/last windows the training success is averaged over"""
    success_first: float
    success_last: float
    success_gain: float
    trajectories: int
    duplicates: int
    dropped_stale: int
    failed_episodes: int
    failed_rollouts: int
    lost_rollouts: int
    trainer_idle_frac: float
    checkpoint_stall_s: float
    """the longest time the loop was blocked by one checkpoint"""
    setup_s: float = 0.0
    eval: list[EvalPoint] = field(default_factory=list)
    eval_first: float | None = None
    eval_last: float | None = None
    eval_gain: float | None = None
    heldout_eval_first: float | None = None
    heldout_eval_last: float | None = None
    shortcut_baseline: float | None = None
    """the best constant-action policy's success on the evaluation episodes (the last evaluation's)"""
    shortcut_policy: str | None = None
    """which constant policy that was (`click [k]`, `first ROLE`)"""
    gain_over_shortcut: float | None = None
    """eval_last - shortcut_baseline: a run whose greedy success only rises to the shortcut is not
    reading the page"""
    heldout_shortcut_baseline: float | None = None
    """the same baseline on the held-out tasks"""
    task_sampling: str = "uniform"
    """env.task_sampling.mode of the run"""
    zero_adv_groups: int = 0
    """consumed groups whose advantages were all zero, whole run"""
    skipped_groups: int = 0
    """groups drawn but not trained on (rollout.dynamic_sampling), whole run"""
    task_success_ema: dict[str, float | None] = field(default_factory=dict)
    """per training task: success EMA at the end of the run (None = never consumed)"""
    task_share: dict[str, float] = field(default_factory=dict)
    """per training task: sampling share at the end of the run"""
    warm_start_demos: int = 0
    """successful demonstration episodes the warm start cloned (0 = no warm start in this run)"""
    warm_start_nll_first: float | None = None
    """token-mean NLL of the demonstrated actions over the warm start's first epoch"""
    warm_start_nll_last: float | None = None
    """... over its last epoch"""
    warm_start_s: float = 0.0
    """wall time of the warm start (demonstrations + behaviour cloning)"""

    @property
    def run_time_s(self) -> float:
        return self.setup_s + self.wall_time_s

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def as_figures(value: Any) -> dict[str, float]:
    """Numeric figures of a component's report (a dataclass or a mapping); others are left out."""
    if value is None:
        return {}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if not isinstance(value, dict):
        raise TypeError(f"expected a dataclass or a dict of figures, got {type(value).__name__}")
    return {k: v for k, v in value.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
