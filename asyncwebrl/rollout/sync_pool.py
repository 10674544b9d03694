"""The synchronous baseline pool (rollout.mode=sync, SPEC section 9): the WebGym design.

Each `prepare_batch` is one round: spawn fresh sessions (a new workflow with new environments, paying
their warm-up when `rollout.sync_warmup`), run B groups concurrently until every episode has finished
or hit its horizon, close the sessions, return the groups. Nothing runs between rounds, so the
trainer's step and the weight refresh happen while rollout is idle, and every round waits for its
slowest episode. Same `prepare_batch` / `update_weights` / `stats` interface as RolloutController, so
one benchmark can put the two side by side.

Invariants: every group of a round is generated entirely at the version given to that round
(on-policy by construction, eta plays no role); a group whose episodes all failed is counted and
re-run within the same round, so a round returns exactly B groups or raises.

Versions: the pool reads the run's one `PolicyVersion` (`clock`) and keeps no copy: the refresh
bracket advances it between rounds, so a round sees one value throughout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any

from asyncwebrl.loop_thread import LoopThread
from asyncwebrl.records import RolloutGroup
from asyncwebrl.rollout.gate import ResumeGate
from asyncwebrl.rollout.hosts import RolloutSpec
from asyncwebrl.rollout.stats import ExecutorStats, RolloutStats
from asyncwebrl.weights.version import PolicyVersion

log = logging.getLogger(__name__)


class SyncRolloutPool:
    """Round-based rollout behind the RolloutController interface."""

    def __init__(self, spec: RolloutSpec, rollout_cfg: Any, *, warmup: bool | None = None,
                 on_drop_group: Callable[[RolloutGroup], None] | None = None,
                 batch_timeout_s: float | None = None, max_round_retries: int = 3,
                 clock: PolicyVersion | None = None):
        self.spec = spec
        self.batch_size = rollout_cfg.consumer_batch_size
        self.warmup = rollout_cfg.sync_warmup if warmup is None else warmup
        self.batch_timeout_s = batch_timeout_s or getattr(rollout_cfg, "batch_timeout_s", 3600.0)
        self.on_drop_group = on_drop_group
        """frees a group's screenshots; a sync round never produces stale groups, so only `discard` calls it"""
        self.max_round_retries = max_round_retries
        self.gate = ResumeGate()
        self.tasks = spec.make_tasks(0)
        self._workflow: Any = None
        self._loop: LoopThread | None = None
        self.clock = clock if clock is not None else PolicyVersion()
        """the version's owner: read here, advanced only by the refresh bracket"""
        self.started_at = 0.0
        self.rounds = 0
        self.consumed_groups = 0
        self.consumed_trajectories = 0
        self.failed = 0
        self.failed_trajectories = 0
        self.busy_slot_s = 0.0
        """sum over groups of the time each group ran (its slot's busy time)"""
        self.round_slot_s = 0.0
        """sum over rounds of B x the round's wall time (slot-time the round held)"""
        self.warmup_s = 0.0
        self.wait_s = 0.0
        self.paused_s = 0.0
        self._paused_at: float | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> SyncRolloutPool:
        # one loop for the whole run: environments (Playwright pages) are bound to the loop that made them
        self._loop = LoopThread("sync-pool-loop")
        self.started_at = time.monotonic()
        return self

    def shutdown(self) -> None:
        if self._loop is None:
            return
        if self._workflow is not None:
            try:
                self._loop.run(self._close(self._workflow), 60)
            except Exception as e:  # noqa: BLE001
                log.warning("sync pool: closing sessions failed: %r", e)
            self._workflow = None
        self._loop.stop(10)
        self._loop = None

    @staticmethod
    async def _close(wf: Any) -> None:
        closer = getattr(wf, "aclose", None)
        if closer is not None:
            await asyncio.wait_for(closer(), 60)

    # -- one round ----------------------------------------------------------------------------
    async def _run_group(self, wf: Any) -> tuple[RolloutGroup | None, float]:
        t0 = time.monotonic()
        task = self.tasks.next()
        try:
            g = await wf(task, lambda: self.clock.value)
        except Exception as e:  # noqa: BLE001 - counted; the round re-runs it
            log.warning("sync round: rollout of %s failed: %r", task.group_key, e)
            return None, time.monotonic() - t0
        if not g.trajectories or all(t.failed for t in g.trajectories):
            self.failed_trajectories += len(g.trajectories)  # discarded, but its episodes still count
            return None, time.monotonic() - t0
        g.submit_version = self.clock.value
        return g, time.monotonic() - t0

    async def _round(self, n: int) -> list[RolloutGroup]:
        wf = self._workflow
        if wf is None or self.warmup:
            wf = self.spec.make_workflow(0, self.gate)
        out: list[RolloutGroup] = []
        try:
            for _ in range(self.max_round_retries + 1):
                t0 = time.monotonic()
                need = n - len(out)
                results = await asyncio.gather(*(self._run_group(wf) for _ in range(need)))
                self.round_slot_s += need * (time.monotonic() - t0)
                for g, busy in results:
                    self.busy_slot_s += busy
                    if g is None:
                        self.failed += 1
                    else:
                        self.failed_trajectories += sum(t.failed for t in g.trajectories)
                        out.append(g)
                if len(out) >= n:
                    break
            if len(out) < n:
                raise RuntimeError(f"sync round finished only {len(out)} of {n} groups after retries")
        finally:
            self.warmup_s += float(getattr(wf, "env_create_s", 0.0))
            if self.warmup:
                await self._close(wf)  # sessions die with the round: the next one warms up again
            else:
                self._workflow = wf
        return out

    def prepare_batch(self, batch_size: int | None = None, timeout_s: float | None = None) -> list[RolloutGroup]:
        n = batch_size or self.batch_size
        if self._loop is None:
            raise RuntimeError("SyncRolloutPool.prepare_batch before start()")
        t0 = time.monotonic()
        fut = self._loop.submit(self._round(n))
        try:
            groups = fut.result(timeout_s or self.batch_timeout_s)
        except concurrent.futures.TimeoutError as e:
            fut.cancel()
            raise RuntimeError(f"sync round did not finish within {timeout_s or self.batch_timeout_s} s") from e
        finally:
            self.wait_s += time.monotonic() - t0
        self.rounds += 1
        self.consumed_groups += len(groups)
        self.consumed_trajectories += sum(len(g.trajectories) for g in groups)
        return groups

    def discard(self, groups: list[RolloutGroup]) -> None:
        """Groups the trainer will not train on (rollout.dynamic_sampling): their screenshots are freed;
        a sync round has no staleness budget to hand back."""
        for g in groups:
            if self.on_drop_group is not None:
                self.on_drop_group(g)

    # -- the rest of the controller interface -------------------------------------------------
    @property
    def version(self) -> int:
        """The owner's value (not a copy)."""
        return self.clock.value

    def pause(self) -> None:
        self._paused_at = time.monotonic()
        self.gate.pause()

    def resume(self) -> None:
        self.gate.resume()
        if self._paused_at is not None:
            self.paused_s += time.monotonic() - self._paused_at
            self._paused_at = None

    def publish_version(self) -> None:
        """Nothing to copy: the pool's rounds read the owner directly."""

    def set_task_weights(self, weights: dict[str, float] | None) -> None:
        setter = getattr(self.tasks, "set_weights", None)
        if setter is None:
            raise TypeError(f"task source {type(self.tasks).__name__} takes no sampling weights")
        setter(weights)

    def update_weights(self, fn: Callable[[], Any]) -> Any:
        """The refresh bracket (`asyncwebrl.weights.bracket`) on this pool alone."""
        from asyncwebrl.weights.bracket import RefreshBracket

        return RefreshBracket(self).refresh(fn)[1]

    def stats(self) -> RolloutStats:
        elapsed = time.monotonic() - self.started_at if self.started_at else 0.0
        # slot-time: B slots exist for the whole run; they are busy only while their group runs
        slot_s = self.batch_size * elapsed
        pool = ExecutorStats(name="sync-pool", slots=self.batch_size, admitted=self.consumed_groups + self.failed,
                             completed=self.consumed_groups, failed=self.failed, cancelled=0,
                             trajectories=self.consumed_trajectories, failed_trajectories=self.failed_trajectories,
                             pending_results=0, busy_s=self.busy_slot_s, elapsed_s=elapsed, paused=self.gate.paused)
        return RolloutStats(
            mode="sync",
            version=self.clock.value,
            elapsed_s=elapsed,
            consumed_groups=self.consumed_groups,
            consumed_trajectories=self.consumed_trajectories,
            received_groups=self.consumed_groups,
            pending_groups=0,
            dropped_stale=0,
            staleness_hist={0: self.consumed_groups} if self.consumed_groups else {},
            rollout_idle_fraction=max(0.0, 1 - self.busy_slot_s / slot_s) if slot_s > 0 else 0.0,
            trainer_wait_s=self.wait_s,
            paused_s=self.paused_s,
            failed_rollouts=self.failed,
            failed_episodes=self.failed_trajectories,
            rounds=self.rounds,
            warmup_s=self.warmup_s,
            round_tail_idle_fraction=(max(0.0, 1 - self.busy_slot_s / self.round_slot_s)
                                      if self.round_slot_s else 0.0),
            workers=[pool],
        )
