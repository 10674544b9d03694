"""The rollout controller: owns the executors, the pending-results queue, and weight-update brackets.

The trainer side sees only `prepare_batch`, `pause`/`resume`, `publish_version`, `set_task_weights`,
`update_weights(fn)`, `stats` and `shutdown`; how rollouts are produced (everlasting executors here, the synchronous pool in
sync_pool.py) stays behind that interface. The controller never imports training code: the weight
transfer itself is the `fn` passed to `update_weights` (an xccl broadcast from the trainer, or a disk
reload through the inference client).

Completion signalling is Ray-native (see hosts.py): one collector thread per host long-polls the
host's `fetch` and moves finished groups onto the pending queue.

Invariants:
- every group a host emits is either returned by exactly one `prepare_batch` call or dropped and
  counted (`dropped_stale`); dropped groups get their budget back in the staleness manager and their
  pixels freed through `on_drop_group`;
- a returned group's head version is >= version - eta (eta = 0: exactly the trainer's version);
- `update_weights` is bracketed: no new episode or generation request starts between `pause()` and
  `resume()`, and the version moves only if the transfer succeeded.

Versions: `clock` is the run's one `PolicyVersion` (given by `build_system`, else the controller's
own); the controller reads it and never advances it (the refresh bracket does). `publish_version` is
the ONE path that copies its value to the staleness manager and every executor (read-only copies,
possibly in Ray processes); `start()` publishes the start value once (a resumed run's checkpoint
version, with the staleness budget reseeded as if that many batches were consumed).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from asyncwebrl.records import RolloutGroup
from asyncwebrl.rollout.hosts import (
    ExecutorHost,
    LocalExecutorHost,
    RolloutSpec,
    launch_ray_hosts,
    split_slots,
)
from asyncwebrl.rollout.staleness import StalenessManager
from asyncwebrl.rollout.stats import ExecutorStats, RolloutStats
from asyncwebrl.weights.version import PolicyVersion

log = logging.getLogger(__name__)


class RolloutUnavailable(RuntimeError):
    """prepare_batch could not get enough fresh groups (timeout, or every worker is dead)."""


def group_staleness_version(group: RolloutGroup) -> int:
    """The version staleness is judged on: head version, or the admission version if no token was generated."""
    head = group.head_version
    return head if head >= 0 else group.submit_version


class RolloutController:
    """Everlasting async rollout behind `prepare_batch` (rollout.mode=async)."""

    def __init__(
        self,
        hosts: list[ExecutorHost],
        staleness: Any,
        *,
        batch_size: int,
        eta: int,
        on_drop_group: Callable[[RolloutGroup], None] | None = None,
        batch_timeout_s: float = 3600.0,
        poll_s: float = 0.5,
        owned_actors: list[Any] | None = None,
        clock: PolicyVersion | None = None,
    ):
        if not hosts:
            raise ValueError("RolloutController needs at least one executor host")
        self.hosts = hosts
        self.staleness = staleness
        self.batch_size = batch_size
        self.eta = eta
        self.on_drop_group = on_drop_group
        self.batch_timeout_s = batch_timeout_s
        self.poll_s = poll_s
        self._owned_actors = owned_actors or []
        self._pending: queue.Queue[RolloutGroup] = queue.Queue()
        self.clock = clock if clock is not None else PolicyVersion()
        """the version's owner: read here, advanced only by the refresh bracket"""
        self._stop = threading.Event()
        self._collectors: list[threading.Thread] = []
        self._dead_hosts: set[int] = set()
        self._lock = threading.Lock()
        self.started_at = 0.0
        self.dropped_stale = 0
        self.task_weight_push_failures = 0
        self.lost_rollouts = 0
        """rollouts of workers that died (in flight or finished but not delivered)"""
        self._received_by: dict[int, int] = {}
        self._last_worker_stats: dict[int, ExecutorStats] = {}
        """each worker's newest counters, so a dead worker's failures still count"""
        self.consumed_groups = 0
        self.consumed_trajectories = 0
        self.received_groups = 0
        self.staleness_hist: Counter[int] = Counter()
        self.wait_s = 0.0
        """time prepare_batch spent waiting for groups (trainer idle time on the rollout)"""
        self.paused_s = 0.0
        self._paused_since: float | None = None

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def local(cls, spec: RolloutSpec, rollout_cfg: Any, **kwargs: Any) -> RolloutController:
        """Executors on threads of this process (scheduler.type=local)."""
        staleness = StalenessManager(rollout_cfg.consumer_batch_size, rollout_cfg.concurrency,
                                     rollout_cfg.max_head_offpolicyness)
        hosts = [LocalExecutorHost(spec, i, n, staleness)
                 for i, n in enumerate(split_slots(rollout_cfg.concurrency, rollout_cfg.workers))]
        kwargs.setdefault("batch_timeout_s", getattr(rollout_cfg, "batch_timeout_s", 3600.0))
        return cls(hosts, staleness, batch_size=rollout_cfg.consumer_batch_size,
                   eta=rollout_cfg.max_head_offpolicyness, **kwargs)

    @classmethod
    def ray(cls, spec: RolloutSpec, rollout_cfg: Any, cpus_per_worker: float = 0.2,
            worker_resources: dict[str, float] | None = None, **kwargs: Any) -> RolloutController:
        """Executors in `rollout.workers` Ray actors sharing one staleness actor (scheduler.type=ray);
        `worker_resources`: custom node resources each worker needs (pins workers to nodes)."""
        hosts, staleness, actor = launch_ray_hosts(spec, rollout_cfg.workers, rollout_cfg.concurrency,
                                                   rollout_cfg.consumer_batch_size,
                                                   rollout_cfg.max_head_offpolicyness, cpus_per_worker,
                                                   resources=worker_resources)
        kwargs.setdefault("batch_timeout_s", getattr(rollout_cfg, "batch_timeout_s", 3600.0))
        return cls(hosts, staleness, batch_size=rollout_cfg.consumer_batch_size,
                   eta=rollout_cfg.max_head_offpolicyness, owned_actors=[actor], **kwargs)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> RolloutController:
        """Publish the start version (reseeding the staleness budget), then start the hosts."""
        self.staleness.reseed(self.clock.value)
        self._each_host("set_version", self.clock.value)
        self.started_at = time.monotonic()
        for h in self.hosts:
            h.start()
        for i, h in enumerate(self.hosts):
            t = threading.Thread(target=self._collect, args=(i, h), name=f"rollout-collector{i}", daemon=True)
            t.start()
            self._collectors.append(t)
        return self

    def _collect(self, index: int, host: ExecutorHost) -> None:
        failures = 0
        while not self._stop.is_set() and index not in self._dead_hosts:
            try:
                groups = host.fetch(1024, self.poll_s)
                failures = 0
            except Exception as e:  # noqa: BLE001 - a dead worker is counted, never hangs the trainer
                if self._stop.is_set():  # shutdown() took the worker down under this fetch
                    return
                failures += 1
                log.warning("rollout worker %d: fetch failed (%d): %r", index, failures, e)
                if failures >= 3:
                    self._mark_dead(index, e)
                    return
                time.sleep(min(2.0, 0.2 * failures))
                continue
            for g in groups:
                with self._lock:
                    self.received_groups += 1
                    self._received_by[index] = self._received_by.get(index, 0) + 1
                self._pending.put(g)

    def _mark_dead(self, index: int, why: BaseException) -> None:
        """Worker `index` is gone: stop using it and give its lost rollouts' budget back."""
        with self._lock:
            if index in self._dead_hosts:
                return
            self._dead_hosts.add(index)
            delivered = self._received_by.get(index, 0)
        lost = 0
        try:
            lost = self.staleness.release_owner(index, delivered)
        except Exception as e:  # noqa: BLE001
            log.warning("releasing dead worker %d's admissions failed: %r", index, e)
        with self._lock:
            self.lost_rollouts += lost
        log.error("rollout worker %d considered dead (%r); %d of its rollouts lost", index, why, lost)

    def _each_host(self, method: str, *args: Any) -> None:
        """Call `method` on every live host; a host that fails the call is marked dead (never hangs)."""
        for i, h in enumerate(self.hosts):
            if i in self._dead_hosts:
                continue
            try:
                getattr(h, method)(*args)
            except Exception as e:  # noqa: BLE001
                self._mark_dead(i, e)
        if len(self._dead_hosts) == len(self.hosts):
            raise RolloutUnavailable(f"every rollout worker is dead (last call: {method})")

    def shutdown(self) -> None:
        self._stop.set()
        for i, h in enumerate(self.hosts):
            if i in self._dead_hosts:
                continue
            try:
                h.shutdown()
            except Exception as e:  # noqa: BLE001
                log.warning("rollout worker shutdown failed: %r", e)
        for t in self._collectors:
            t.join(self.poll_s + 5)
        self._collectors.clear()
        if self._owned_actors:
            import ray

            for a in self._owned_actors:
                try:
                    ray.kill(a, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass

    # -- the trainer-facing API ---------------------------------------------------------------
    @property
    def version(self) -> int:
        """The owner's value (not a copy)."""
        return self.clock.value

    def prepare_batch(self, batch_size: int | None = None, timeout_s: float | None = None) -> list[RolloutGroup]:
        """Block until `batch_size` groups fresh enough for the current version are ready; drop and
        count stale ones."""
        n = batch_size or self.batch_size
        v = self.clock.value
        deadline = time.monotonic() + (self.batch_timeout_s if timeout_s is None else timeout_s)
        out: list[RolloutGroup] = []
        t0 = time.monotonic()
        try:
            while len(out) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RolloutUnavailable(
                        f"prepare_batch got {len(out)} of {n} groups within its timeout; stats: {self._brief()}"
                    )
                if len(self._dead_hosts) == len(self.hosts):
                    raise RolloutUnavailable(f"every rollout worker is dead; stats: {self._brief()}")
                try:
                    g = self._pending.get(timeout=min(left, 0.5))
                except queue.Empty:
                    continue
                sv = group_staleness_version(g)
                if sv < v - self.eta:
                    self._drop(g)
                    continue
                out.append(g)
        except BaseException:
            for g in reversed(out):  # hand them back: nothing admitted may be lost
                self._requeue_front(g)
            raise
        finally:
            self.wait_s += time.monotonic() - t0
        with self._lock:
            self.consumed_groups += len(out)
            self.consumed_trajectories += sum(len(g.trajectories) for g in out)
            for g in out:
                self.staleness_hist[v - group_staleness_version(g)] += 1
        return out

    def _requeue_front(self, g: RolloutGroup) -> None:
        with self._pending.mutex:
            self._pending.queue.appendleft(g)
            self._pending.not_empty.notify()

    def discard(self, groups: list[RolloutGroup]) -> None:
        """Delivered groups the trainer will not train on (rollout.dynamic_sampling: no learning signal):
        like a stale drop, each hands its staleness budget back, so the pool produces replacements at
        this version, and its screenshots are freed. Counted by the caller, not as stale."""
        for g in groups:
            self._release(g)

    def _drop(self, g: RolloutGroup) -> None:
        with self._lock:
            self.dropped_stale += 1
        self._release(g)

    def _release(self, g: RolloutGroup) -> None:
        try:
            self.staleness.on_drop()
        except Exception as e:  # noqa: BLE001
            log.warning("staleness on_drop failed: %r", e)
        if self.on_drop_group is not None:
            try:
                self.on_drop_group(g)
            except Exception as e:  # noqa: BLE001 - freeing pixels must not stop the trainer
                log.warning("on_drop_group failed for %s: %r", g.group_id, e)

    def pause(self) -> None:
        self._each_host("pause")
        self._paused_since = time.monotonic()

    def resume(self) -> None:
        self._each_host("resume")
        if self._paused_since is not None:
            self.paused_s += time.monotonic() - self._paused_since
            self._paused_since = None

    def publish_version(self) -> None:
        """Copy the owner's value to the staleness manager and every live executor (the refresh
        bracket calls this after advancing the owner): the ONE path by which those copies move."""
        v = self.clock.value
        self.staleness.set_version(v)
        self._each_host("set_version", v)

    def set_task_weights(self, weights: dict[str, float] | None) -> None:
        """Push task-sampling weights (from the trainer-side curriculum) to every live worker's task sampler.
        A worker that misses one push keeps its previous weights (a hint, not a barrier): the failure is
        logged and counted, and a dead worker is found by its collector."""
        for i, h in enumerate(self.hosts):
            if i in self._dead_hosts:
                continue
            try:
                h.set_task_weights(weights)
            except Exception as e:  # noqa: BLE001
                with self._lock:
                    self.task_weight_push_failures += 1
                log.warning("rollout worker %d: task-weight push failed: %r", i, e)

    def update_weights(self, fn: Callable[[], Any]) -> Any:
        """The refresh bracket (`asyncwebrl.weights.bracket`) on this gate alone: pause -> fn() ->
        advance the owner, publish -> resume; the version moves (by one) only if fn succeeded."""
        from asyncwebrl.weights.bracket import RefreshBracket

        return RefreshBracket(self).refresh(fn)[1]

    # -- statistics ---------------------------------------------------------------------------
    def _brief(self) -> dict:
        return {"version": self.clock.value, "pending": self._pending.qsize(), "dropped_stale": self.dropped_stale,
                "dead_workers": sorted(self._dead_hosts), "admission": self.staleness.snapshot()}

    def stats(self) -> RolloutStats:
        elapsed = time.monotonic() - self.started_at if self.started_at else 0.0
        workers: list[ExecutorStats] = []
        for i, h in enumerate(self.hosts):
            if i in self._dead_hosts:
                continue
            try:
                w = h.stats()
            except Exception as e:  # noqa: BLE001
                log.warning("rollout worker %d stats failed: %r", i, e)
                continue
            self._last_worker_stats[i] = w
            workers.append(w)
        last = list(self._last_worker_stats.values())  # live workers' fresh figures, dead workers' last
        slot_s = sum(w.slots * w.elapsed_s for w in workers)
        busy_s = sum(w.busy_s for w in workers)
        with self._lock:
            return RolloutStats(
                mode="async",
                version=self.clock.value,
                elapsed_s=elapsed,
                consumed_groups=self.consumed_groups,
                consumed_trajectories=self.consumed_trajectories,
                received_groups=self.received_groups,
                pending_groups=self._pending.qsize(),
                dropped_stale=self.dropped_stale,
                staleness_hist=dict(sorted(self.staleness_hist.items())),
                rollout_idle_fraction=max(0.0, 1 - busy_s / slot_s) if slot_s > 0 else 0.0,
                trainer_wait_s=self.wait_s,
                paused_s=self.paused_s,
                failed_rollouts=sum(w.failed for w in last),
                failed_episodes=sum(w.failed_trajectories for w in last),
                dead_workers=len(self._dead_hosts),
                lost_rollouts=self.lost_rollouts,
                admission=self.staleness.snapshot(),
                workers=workers,
            )


def make_rollout_controller(spec: RolloutSpec, rollout_cfg: Any, scheduler_type: str, **kwargs: Any) -> Any:
    """The rollout side a run uses: the async controller, or the synchronous pool for rollout.mode=sync."""
    if rollout_cfg.mode == "sync":
        from asyncwebrl.rollout.sync_pool import SyncRolloutPool

        keep = ("on_drop_group", "batch_timeout_s", "clock")  # placement knobs do not apply
        return SyncRolloutPool(spec, rollout_cfg, **{k: v for k, v in kwargs.items() if k in keep})
    if scheduler_type == "ray":
        return RolloutController.ray(spec, rollout_cfg, **kwargs)
    if scheduler_type == "local":
        return RolloutController.local(spec, rollout_cfg, **kwargs)
    raise ValueError(f"unknown scheduler type {scheduler_type!r} (local | ray)")
