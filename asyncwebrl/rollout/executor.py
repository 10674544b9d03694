"""The everlasting workflow executor: long-lived rollout slots that never drain at step boundaries.

An executor owns one asyncio event loop on a background thread and C slot coroutines. Each slot loops
until shutdown: wait for the resume gate -> ask admission for capacity -> take the next task from the
task sampler -> run the workflow (one rollout = one GRPO group) -> put the group on the results queue.
When a rollout ends, the slot starts the next one at once; the environments the workflow holds stay
warm across training steps.

Invariant (exactly-once): every rollout admitted by `admission.try_submit()` ends in exactly one of
  - `on_accept()` and exactly one put of its group on the results queue, or
  - `on_reject()` and one count in `failed` (the workflow raised or returned no usable group) or
    `cancelled` (shutdown interrupted it).
A failing rollout is logged and counted; the slot goes on with the next task.

The executor's weight version (a group's `submit_version`, and what `version()` gives the workflow)
is a cached, read-only copy of the one owner (`weights.version.PolicyVersion`): the executor may run
in a Ray worker process, so it takes the owner's value only through the rollout controller's
`publish_version` (`set_version`, never backwards).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from asyncwebrl.loop_thread import LoopThread
from asyncwebrl.records import RolloutGroup
from asyncwebrl.rollout.gate import ResumeGate
from asyncwebrl.rollout.stats import ExecutorStats
from asyncwebrl.web.base import Task
from asyncwebrl.weights.version import check_copy_moves_forward

log = logging.getLogger(__name__)

VersionGetter = Callable[[], int]
Workflow = Callable[[Task, VersionGetter], Awaitable[RolloutGroup]]


class TaskSource(Protocol):
    def next(self) -> Task: ...
    # optional: set_weights(weights: dict[str, float] | None) for adaptive task sampling


class Admission(Protocol):
    """What the executor needs from the staleness manager; methods may return awaitables (Ray refs)."""

    def try_submit(self) -> Any: ...
    def on_accept(self) -> Any: ...
    def on_reject(self) -> Any: ...


async def _resolve(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class WorkflowExecutor:
    """Runs `slots` rollout slots forever on its own event-loop thread (see module docstring)."""

    def __init__(
        self,
        workflow: Workflow,
        tasks: TaskSource,
        admission: Admission,
        slots: int,
        *,
        gate: ResumeGate | None = None,
        name: str = "executor",
        admission_poll_s: float = 0.01,
        admission_poll_max_s: float = 0.1,
    ):
        if slots < 1:
            raise ValueError(f"executor needs >= 1 slot, got {slots}")
        self.workflow = workflow
        self.tasks = tasks
        self.admission = admission
        self.slots = slots
        self.gate = gate or ResumeGate()
        self.name = name
        self._poll_s = admission_poll_s
        self._poll_max_s = admission_poll_max_s
        self._results: queue.Queue[RolloutGroup] = queue.Queue()
        self._version = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: LoopThread | None = None
        self._slot_tasks: list[asyncio.Task] = []
        self._kick: asyncio.Event | None = None
        self._stopping = False
        self._started_at = 0.0
        self._busy_s = 0.0
        self._busy_since: dict[int, float] = {}
        self.admitted = 0
        self.completed = 0
        self.failed = 0
        self.cancelled = 0
        self.trajectories = 0
        self.failed_trajectories = 0
        self.last_error: str | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, timeout_s: float = 10.0) -> None:
        if self._runner is not None:
            raise RuntimeError(f"executor {self.name} already started")
        self._runner = LoopThread(f"{self.name}-loop")
        self._loop = self._runner.loop
        try:
            self._runner.run(self._begin(), timeout_s)
        except TimeoutError as e:
            raise RuntimeError(f"executor {self.name}: event loop did not start within {timeout_s} s") from e

    async def _begin(self) -> None:
        loop = asyncio.get_running_loop()
        self._kick = asyncio.Event()
        self._started_at = time.monotonic()
        self._slot_tasks = [loop.create_task(self._slot(i), name=f"{self.name}-slot{i}") for i in range(self.slots)]

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Cancel every slot (in-flight rollouts count as cancelled), close the workflow, stop the loop."""
        if self._runner is None:
            return
        self._stopping = True
        self.gate.resume()  # wake paused slots so they can see the stop flag
        fut = self._runner.submit(self._stop_slots())
        try:
            fut.result(timeout_s)
        except Exception as e:  # noqa: BLE001 - shutdown must finish; report what went wrong
            log.warning("executor %s: unclean shutdown: %r", self.name, e)
        if not self._runner.stop(timeout_s):
            log.warning("executor %s: loop thread did not stop within %s s", self.name, timeout_s)
        self._runner = None

    async def _stop_slots(self) -> None:
        for t in self._slot_tasks:
            t.cancel()
        await asyncio.gather(*self._slot_tasks, return_exceptions=True)
        closer = getattr(self.workflow, "aclose", None)
        if closer is not None:
            try:
                await asyncio.wait_for(closer(), 30)
            except Exception as e:  # noqa: BLE001
                log.warning("executor %s: workflow close failed: %r", self.name, e)
        # stragglers the workflow spawned (cleanup of cancelled episodes): cancel and reap, no leaked tasks
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        if rest:
            await asyncio.wait(rest, timeout=10)

    # -- control from other threads -----------------------------------------------------------
    def pause(self) -> None:
        self.gate.pause()

    def resume(self) -> None:
        self.gate.resume()
        self._wake()

    def set_version(self, version: int) -> None:
        """Take the owner's value (the rollout controller's publish path only)."""
        with self._lock:
            check_copy_moves_forward(self._version, version, f"executor {self.name}")
            self._version = version
        self._wake()

    def version(self) -> int:
        return self._version

    def set_task_weights(self, weights: dict[str, float] | None) -> None:
        """Sampling weights per task id for the task source (adaptive sampling); None = uniform."""
        setter = getattr(self.tasks, "set_weights", None)
        if setter is None:
            raise TypeError(f"executor {self.name}: task source {type(self.tasks).__name__} takes no sampling weights")
        setter(weights)

    def _wake(self) -> None:
        """Capacity may have grown: wake slots waiting for admission."""
        loop, kick = self._loop, self._kick
        if loop is None or kick is None or loop.is_closed():
            return

        def pulse() -> None:
            kick.set()
            loop.call_soon(kick.clear)

        try:
            loop.call_soon_threadsafe(pulse)
        except RuntimeError:
            pass

    # -- results ------------------------------------------------------------------------------
    def get_results(self, max_n: int = 1_000_000, timeout_s: float = 0.0) -> list[RolloutGroup]:
        """Up to `max_n` finished groups; waits up to `timeout_s` for the first one."""
        out: list[RolloutGroup] = []
        try:
            out.append(self._results.get(timeout=timeout_s) if timeout_s > 0 else self._results.get_nowait())
        except queue.Empty:
            return out
        while len(out) < max_n:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                break
        return out

    def stats(self) -> ExecutorStats:
        now = time.monotonic()
        with self._lock:
            busy = self._busy_s + sum(now - t for t in self._busy_since.values())
            return ExecutorStats(
                name=self.name,
                slots=self.slots,
                admitted=self.admitted,
                completed=self.completed,
                failed=self.failed,
                cancelled=self.cancelled,
                trajectories=self.trajectories,
                failed_trajectories=self.failed_trajectories,
                pending_results=self._results.qsize(),
                busy_s=busy,
                elapsed_s=(now - self._started_at) if self._started_at else 0.0,
                paused=self.gate.paused,
            )

    # -- the slot loop ------------------------------------------------------------------------
    async def _admit(self) -> None:
        """Block (cooperatively) until admission grants a rollout."""
        wait = self._poll_s
        while True:
            await self.gate.wait()
            if self._stopping:
                raise asyncio.CancelledError
            if await _resolve(self.admission.try_submit()):
                return
            assert self._kick is not None
            try:
                await asyncio.wait_for(self._kick.wait(), wait)
                wait = self._poll_s
            except TimeoutError:
                wait = min(wait * 2, self._poll_max_s)

    async def _slot(self, index: int) -> None:
        consecutive_failures = 0
        while not self._stopping:
            await self._admit()
            with self._lock:
                self.admitted += 1
                self._busy_since[index] = time.monotonic()
            submit_version = self._version
            try:
                task = self.tasks.next()
                group = await self.workflow(task, self.version)
                if not isinstance(group, RolloutGroup):
                    raise TypeError(f"workflow returned {type(group).__name__}, expected RolloutGroup")
                n_failed = sum(1 for t in group.trajectories if t.failed)
                if not group.trajectories or n_failed == len(group.trajectories):
                    with self._lock:
                        self.failed_trajectories += n_failed
                    raise RuntimeError(f"every episode of group {group.group_id} ({task.group_key}) failed")
            except asyncio.CancelledError:
                self._end_busy(index)
                with self._lock:
                    self.cancelled += 1
                await _resolve(self.admission.on_reject())
                raise
            except Exception as e:  # noqa: BLE001 - a failing rollout must not kill the slot
                self._end_busy(index)
                with self._lock:
                    self.failed += 1
                    self.last_error = f"{type(e).__name__}: {e}"
                log.warning("executor %s slot %d: rollout failed: %s", self.name, index, self.last_error)
                await _resolve(self.admission.on_reject())
                self._wake()
                # a workflow that fails instantly (dead server, broken sampler) must not spin the loop
                consecutive_failures += 1
                await asyncio.sleep(min(1.0, 0.005 * 2 ** min(consecutive_failures, 8)))
                continue
            consecutive_failures = 0
            group.submit_version = submit_version
            self._end_busy(index)
            # dispatch the accept before emitting and await it after: a cancellation in between (shutdown)
            # can then neither lose the group nor leave it counted as running
            ack = self.admission.on_accept()
            with self._lock:
                self.completed += 1
                self.trajectories += len(group.trajectories)
                self.failed_trajectories += n_failed
            self._results.put(group)
            self._wake()
            await _resolve(ack)

    def _end_busy(self, index: int) -> None:
        with self._lock:
            t0 = self._busy_since.pop(index, None)
            if t0 is not None:
                self._busy_s += time.monotonic() - t0
