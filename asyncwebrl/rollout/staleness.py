"""Admission control of the everlasting rollout pool (SPEC section 4).

One rollout = one GRPO group. With B = consumer_batch_size, C = max concurrent rollouts,
eta = max_head_offpolicyness and v = the trainer's current version:

    concurrency_cap = max(1, C) - running
    staleness_cap   = (eta + v + 1) * max(1, B) - (accepted + running)
    capacity        = min(concurrency_cap, staleness_cap)

Invariant: `try_submit` admits a rollout only while capacity > 0, atomically (check and count under
one lock), so no interleaving of workers can exceed C running rollouts or the staleness budget.
Counters: `enqueued` (ever admitted), `running`, `accepted` (finished and kept), `rejected`
(failed, or dropped stale at collection). A rollout dropped at collection is moved from accepted to
rejected, so its slot in the staleness budget is handed back and the trainer cannot starve.

The version v here is a cached, read-only copy of the one owner (`weights.version.PolicyVersion`):
the manager may live in a Ray actor, so it cannot read the owner; it takes the owner's value only
from the rollout controller's `publish_version` (`set_version`, never backwards) and, when the
controller starts, `reseed` (the run's start version, a checkpoint's on resume).
"""

from __future__ import annotations

import threading

from asyncwebrl.rollout.stats import AdmissionStats
from asyncwebrl.weights.version import check_copy_moves_forward


class StalenessManager:
    """Thread-safe admission counters. Methods are cheap; call them from any thread."""

    def __init__(self, consumer_batch_size: int, max_concurrent_rollouts: int, max_head_offpolicyness: int):
        if consumer_batch_size < 1 or max_concurrent_rollouts < 1 or max_head_offpolicyness < 0:
            raise ValueError(
                "StalenessManager needs consumer_batch_size >= 1, max_concurrent_rollouts >= 1, "
                f"max_head_offpolicyness >= 0 (got {consumer_batch_size}, {max_concurrent_rollouts}, "
                f"{max_head_offpolicyness})"
            )
        self.batch_size = consumer_batch_size
        self.concurrency = max_concurrent_rollouts
        self.eta = max_head_offpolicyness
        self._lock = threading.Lock()
        self._version = 0
        self.enqueued = 0
        self.running = 0
        self.accepted = 0
        self.rejected = 0
        self._running_by: dict[int, int] = {}
        self._accepted_by: dict[int, int] = {}

    # -- the admission rule -------------------------------------------------------------------
    def capacity(self, version: int | None = None) -> int:
        with self._lock:
            return self._capacity(self._version if version is None else version)

    def _capacity(self, version: int) -> int:
        concurrency_cap = max(1, self.concurrency) - self.running
        staleness_cap = (self.eta + version + 1) * max(1, self.batch_size) - (self.accepted + self.running)
        return min(concurrency_cap, staleness_cap)

    def try_submit(self, owner: int = 0) -> bool:
        """Admit one rollout at the current version if capacity allows (check + count atomically).

        `owner` is the rollout worker that will run it, so a dead worker's share can be released.
        """
        with self._lock:
            if self._capacity(self._version) <= 0:
                return False
            self.enqueued += 1
            self.running += 1
            self._running_by[owner] = self._running_by.get(owner, 0) + 1
            return True

    # -- transitions --------------------------------------------------------------------------
    def on_accept(self, owner: int = 0) -> None:
        with self._lock:
            self._finish(owner, "on_accept")
            self.accepted += 1
            self._accepted_by[owner] = self._accepted_by.get(owner, 0) + 1

    def on_reject(self, owner: int = 0) -> None:
        with self._lock:
            self._finish(owner, "on_reject")
            self.rejected += 1

    def _finish(self, owner: int, what: str) -> None:
        if self.running <= 0 or self._running_by.get(owner, 0) <= 0:
            raise RuntimeError(f"StalenessManager.{what} without a running rollout of worker {owner} (double completion?)")
        self.running -= 1
        self._running_by[owner] -= 1

    def release_owner(self, owner: int, delivered: int) -> int:
        """Worker `owner` died: its running rollouts and its accepted-but-undelivered ones (accepted
        minus the `delivered` count the controller received) become rejected. Returns how many."""
        with self._lock:
            lost_running = self._running_by.pop(owner, 0)
            lost_accepted = max(0, self._accepted_by.pop(owner, 0) - delivered)
            self.running -= lost_running
            self.accepted -= lost_accepted
            self.rejected += lost_running + lost_accepted
            return lost_running + lost_accepted

    def on_drop(self) -> None:
        """An accepted rollout was dropped at collection (too stale): give its budget back."""
        with self._lock:
            if self.accepted <= 0:
                raise RuntimeError("StalenessManager.on_drop without an accepted rollout")
            self.accepted -= 1
            self.rejected += 1

    # -- versions -----------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        """Take the owner's value (the rollout controller's publish path only)."""
        with self._lock:
            check_copy_moves_forward(self._version, version, "the staleness manager")
            self._version = version

    def reseed(self, version: int) -> None:
        """Resume from a checkpoint at `version`: accepted = v * B (nothing is running yet)."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        with self._lock:
            self._version = version
            self.accepted = version * self.batch_size
            self.running = 0
            self._running_by.clear()
            self._accepted_by.clear()

    def snapshot(self) -> AdmissionStats:
        with self._lock:
            return AdmissionStats(
                version=self._version,
                enqueued=self.enqueued,
                running=self.running,
                accepted=self.accepted,
                rejected=self.rejected,
                capacity=self._capacity(self._version),
            )

