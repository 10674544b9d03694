"""Where executors live: in this process (scheduler.type=local) or in Ray actors (scheduler.type=ray).

A host runs one `WorkflowExecutor` built from a `RolloutSpec` (its own environments, task stream and
slots) and offers the controller the same small API either way: start, pause, resume, set_version,
fetch(max_n, timeout_s), stats, shutdown.

Completion signalling is Ray-native: the controller long-polls `fetch` (an actor method returning the
finished `RolloutGroup`s). We chose this over an HTTP callback because the groups are plain
dataclasses that Ray serializes anyway, a group leaves the worker only when the controller has
received it (the reply of `fetch`), and there is no extra server, port or auth to run per worker.

Admission is global: every executor asks the one StalenessManager (a Ray actor under Ray, the object
itself locally), so C and the staleness budget hold across all workers, not per worker.

Versions: a host's `set_version` gives its executor the owner's value (`weights.version`); it is
called only by the rollout controller's `publish_version`. Under Ray the executor and the staleness
manager live in other processes, so they hold cached, read-only copies; the controller side reaches
them through `ActorProxy`, which forwards calls without a method of its own per call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from asyncwebrl.records import RolloutGroup
from asyncwebrl.rollout.executor import TaskSource, Workflow, WorkflowExecutor
from asyncwebrl.rollout.gate import ResumeGate
from asyncwebrl.rollout.staleness import StalenessManager
from asyncwebrl.rollout.stats import ExecutorStats

log = logging.getLogger(__name__)


@dataclass
class RolloutSpec:
    """How a worker builds its rollout machinery; the callables must be picklable for Ray."""

    make_workflow: Callable[[int, ResumeGate], Workflow]
    """(worker index, resume gate) -> workflow; wrap the inference client with the gate (GatedClient)"""
    make_tasks: Callable[[int], TaskSource]
    """worker index -> task stream (seed it by the index so workers do not repeat each other)"""


class ExecutorHost(Protocol):
    def start(self) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def set_version(self, version: int) -> None: ...
    def set_task_weights(self, weights: dict[str, float] | None) -> None: ...
    def fetch(self, max_n: int, timeout_s: float) -> list[RolloutGroup]: ...
    def stats(self) -> ExecutorStats: ...
    def shutdown(self) -> None: ...


def split_slots(total: int, workers: int) -> list[int]:
    """Spread `total` slots over workers as evenly as possible (every worker gets >= 1)."""
    base, extra = divmod(max(total, workers), workers)
    return [base + (1 if i < extra else 0) for i in range(workers)]


class LocalExecutorHost:
    """The executor on a background thread of this process (and, as `RolloutWorkerActor`, the body
    of a Ray worker)."""

    def __init__(self, spec: RolloutSpec, index: int, slots: int, admission: Any):
        """`admission`: a StalenessManager (shared by all local hosts) or a worker-side adapter."""
        if isinstance(admission, StalenessManager):
            admission = OwnedAdmission(admission, index)
        gate = ResumeGate()
        self.executor = WorkflowExecutor(spec.make_workflow(index, gate), spec.make_tasks(index), admission,
                                         slots, gate=gate, name=f"rollout-worker{index}")

    def start(self) -> None:
        self.executor.start()

    def pause(self) -> None:
        self.executor.pause()

    def resume(self) -> None:
        self.executor.resume()

    def set_version(self, version: int) -> None:
        """The executor's cached copy of the owner's version (rollout controller's publish path)."""
        self.executor.set_version(version)

    def set_task_weights(self, weights: dict[str, float] | None) -> None:
        self.executor.set_task_weights(weights)

    def fetch(self, max_n: int, timeout_s: float) -> list[RolloutGroup]:
        return self.executor.get_results(max_n, timeout_s)

    def stats(self) -> ExecutorStats:
        return self.executor.stats()

    def shutdown(self) -> None:
        self.executor.shutdown()


# -------------------------------------------------------------------------------------------------
# Ray
# -------------------------------------------------------------------------------------------------
class ActorProxy:
    """The controller side of a Ray actor: `proxy.name(*args)` is `ray.get(handle.name.remote(*args))`
    bounded by `timeout_s`. One proxy instead of a forwarding method per call (the staleness actor,
    which is the StalenessManager class itself, and the rollout workers)."""

    def __init__(self, handle: Any, timeout_s: float):
        self.handle = handle
        self.timeout_s = timeout_s

    def _get(self, ref: Any, timeout_s: float | None = None) -> Any:
        import ray

        return ray.get(ref, timeout=timeout_s or self.timeout_s)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_") or name in ("handle", "timeout_s"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        method = getattr(self.handle, name)
        return lambda *args: self._get(method.remote(*args))


class OwnedAdmission:
    """Admission on behalf of worker `owner` (so a dead worker's share can be released)."""

    def __init__(self, manager: Any, owner: int):
        self.m, self.owner = manager, owner

    def try_submit(self) -> Any:
        return self.m.try_submit(self.owner)

    def on_accept(self) -> Any:
        return self.m.on_accept(self.owner)

    def on_reject(self) -> Any:
        return self.m.on_reject(self.owner)


class ActorAdmission:
    """Worker-side admission through the staleness actor; returns ObjectRefs the executor awaits."""

    def __init__(self, handle: Any, owner: int):
        self.handle, self.owner = handle, owner

    def try_submit(self) -> Any:
        return self.handle.try_submit.remote(self.owner)

    def on_accept(self) -> Any:
        return self.handle.on_accept.remote(self.owner)

    def on_reject(self) -> Any:
        return self.handle.on_reject.remote(self.owner)


class RolloutWorkerActor(LocalExecutorHost):
    """Ray actor body hosting one executor (threaded actor: fetch long-polls while control calls run);
    its admission goes to the run's one staleness actor."""

    def __init__(self, spec: RolloutSpec, index: int, slots: int, staleness_handle: Any):
        super().__init__(spec, index, slots, ActorAdmission(staleness_handle, index))


class RayExecutorHost(ActorProxy):
    """Controller-side handle of one RolloutWorkerActor, with timeouts on every call (the ExecutorHost
    calls go through `ActorProxy`; fetch long-polls, shutdown kills the actor)."""

    def __init__(self, handle: Any, call_timeout_s: float = 60.0):
        super().__init__(handle, call_timeout_s)

    def fetch(self, max_n: int, timeout_s: float) -> list[RolloutGroup]:
        return self._get(self.handle.fetch.remote(max_n, timeout_s), timeout_s + self.timeout_s)

    def shutdown(self) -> None:
        import ray

        try:
            self._get(self.handle.shutdown.remote())
        finally:
            ray.kill(self.handle, no_restart=True)


def launch_ray_hosts(spec: RolloutSpec, workers: int, concurrency: int, batch_size: int, eta: int,
                     cpus_per_worker: float = 0.2,
                     resources: dict[str, float] | None = None,
                     startup_timeout_s: float = 600.0) -> tuple[list[RayExecutorHost], ActorProxy, Any]:
    """Start the staleness actor (the StalenessManager class itself as a Ray actor) and `workers`
    RolloutWorkerActors; returns (hosts, the staleness actor's proxy, the staleness actor)."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError("scheduler.type=ray needs a running Ray (ray.init first)")
    stale_actor = ray.remote(StalenessManager).options(num_cpus=0, max_concurrency=64).remote(batch_size, concurrency, eta)
    worker_cls = ray.remote(RolloutWorkerActor)
    hosts = []
    for i, slots in enumerate(split_slots(concurrency, workers)):
        h = worker_cls.options(num_cpus=cpus_per_worker, max_concurrency=8, resources=resources or {},
                               name=None).remote(spec, i, slots, stale_actor)
        hosts.append(RayExecutorHost(h))
    # the workers exist (imports done, env factory built) before the first timed control call: on a
    # crowded or remote node that takes longer than a control call may
    ray.get([h.handle.stats.remote() for h in hosts], timeout=startup_timeout_s)
    return hosts, ActorProxy(stale_actor, 30.0), stale_actor
