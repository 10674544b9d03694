"""The typed record of rollout statistics (SPEC section 11: figures are read by attribute).

`RolloutStats` is built in one place per rollout side (`RolloutController.stats()` for the
everlasting pool, `SyncRolloutPool.stats()` for the synchronous baseline) from the executors'
`ExecutorStats`, and read by attribute everywhere downstream: the controller's per-step metrics and
run summary, the viewer, the benchmarks, the tests. It crosses process boundaries (Ray) as a plain
dataclass. A misspelt figure is an AttributeError at once, never a silent 0.

Counting rules (one definition for both modes):
  - `failed_episodes`: episodes that ended failed (browser crash, env error, dead server), whether
    their group was still delivered (some episodes succeeded) or the whole group was discarded;
  - `failed_rollouts`: rollouts (groups) that produced no usable group and were retried or dropped;
  - `dropped_stale`: delivered groups dropped at collection for exceeding the staleness bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class ExecutorStats:
    """Counters of one executor (one rollout worker's slots)."""

    name: str
    slots: int
    admitted: int
    completed: int
    failed: int
    """rollouts that raised or returned no usable group"""
    cancelled: int
    trajectories: int
    """trajectories of delivered groups"""
    failed_trajectories: int
    """failed episodes, in delivered groups and in groups discarded because every episode failed"""
    pending_results: int
    busy_s: float
    elapsed_s: float
    paused: bool

    @property
    def in_flight(self) -> int:
        return self.admitted - self.completed - self.failed - self.cancelled


@dataclass(frozen=True, kw_only=True)
class AdmissionStats:
    """The staleness manager's counters (SPEC section 4)."""

    version: int
    enqueued: int
    running: int
    accepted: int
    rejected: int
    capacity: int


@dataclass(frozen=True, kw_only=True)
class RolloutStats:
    """What the rollout side reports to the controller, in either mode."""

    mode: str
    """'async' (everlasting pool) or 'sync' (round-based baseline)"""
    version: int
    elapsed_s: float
    consumed_groups: int
    consumed_trajectories: int
    received_groups: int
    pending_groups: int
    dropped_stale: int
    staleness_hist: dict[int, int]
    rollout_idle_fraction: float
    """share of rollout slot-time not spent running an episode"""
    trainer_wait_s: float
    """time the trainer spent inside prepare_batch"""
    paused_s: float
    failed_rollouts: int
    failed_episodes: int
    dead_workers: int = 0
    lost_rollouts: int = 0
    """rollouts lost with a dead worker (admitted, never delivered)"""
    rounds: int = 0
    """sync mode: rounds run"""
    warmup_s: float = 0.0
    """sync mode: time spent starting fresh browser sessions"""
    round_tail_idle_fraction: float = 0.0
    """sync mode: share of a round's slot-time spent waiting for its slowest group"""
    admission: AdmissionStats | None = None
    workers: list[ExecutorStats] = field(default_factory=list)

    @property
    def trajectories_per_s(self) -> float:
        return self.consumed_trajectories / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def in_flight(self) -> int:
        return sum(w.in_flight for w in self.workers)
