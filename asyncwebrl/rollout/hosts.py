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
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from asyncwebrl.rollout.executor import TaskSource, Workflow, WorkflowExecutor
from asyncwebrl.rollout.gate import ResumeGate
from asyncwebrl.rollout.staleness import StalenessManager
from asyncwebrl.rollout.stats import AdmissionStats, ExecutorStats
from asyncwebrl.rollout.trajectory import RolloutGroup

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
    """The executor on a background thread of this process."""

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
class StalenessActor:
    """The run's one StalenessManager as a Ray actor (executors on every worker ask it)."""

    def __init__(self, batch_size: int, concurrency: int, eta: int):
        self.m = StalenessManager(batch_size, concurrency, eta)

    def try_submit(self, owner: int = 0) -> bool:
        return self.m.try_submit(owner)

    def on_accept(self, owner: int = 0) -> None:
        self.m.on_accept(owner)

    def on_reject(self, owner: int = 0) -> None:
        self.m.on_reject(owner)

    def release_owner(self, owner: int, delivered: int) -> int:
        return self.m.release_owner(owner, delivered)

    def on_drop(self) -> None:
        self.m.on_drop()

    def set_version(self, v: int) -> None:
        self.m.set_version(v)

    def reseed(self, v: int) -> None:
        self.m.reseed(v)

    def snapshot(self) -> AdmissionStats:
        return self.m.snapshot()


class RemoteStaleness:
    """Controller-side proxy of StalenessActor with the StalenessManager's sync methods."""

    def __init__(self, handle: Any, timeout_s: float = 30.0):
        self.handle = handle
        self.timeout_s = timeout_s

    def _get(self, ref: Any) -> Any:
        import ray

        return ray.get(ref, timeout=self.timeout_s)

    def on_drop(self) -> None:
        self._get(self.handle.on_drop.remote())

    def set_version(self, v: int) -> None:
        self._get(self.handle.set_version.remote(v))

    def reseed(self, v: int) -> None:
        self._get(self.handle.reseed.remote(v))

    def release_owner(self, owner: int, delivered: int) -> int:
        return self._get(self.handle.release_owner.remote(owner, delivered))

    def snapshot(self) -> AdmissionStats:
        return self._get(self.handle.snapshot.remote())


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
    """Worker-side admission through the StalenessActor; returns ObjectRefs the executor awaits."""

    def __init__(self, handle: Any, owner: int):
        self.handle, self.owner = handle, owner

    def try_submit(self) -> Any:
        return self.handle.try_submit.remote(self.owner)

    def on_accept(self) -> Any:
        return self.handle.on_accept.remote(self.owner)

    def on_reject(self) -> Any:
        return self.handle.on_reject.remote(self.owner)


class RolloutWorkerActor:
    """Ray actor body hosting one executor (threaded actor: fetch long-polls while control calls run)."""

    def __init__(self, spec: RolloutSpec, index: int, slots: int, staleness_handle: Any):
        self.host = LocalExecutorHost(spec, index, slots, ActorAdmission(staleness_handle, index))

    def start(self) -> None:
        self.host.start()

    def pause(self) -> None:
        self.host.pause()

    def resume(self) -> None:
        self.host.resume()

    def set_version(self, v: int) -> None:
        self.host.set_version(v)

    def set_task_weights(self, weights: dict[str, float] | None) -> None:
        self.host.set_task_weights(weights)

    def fetch(self, max_n: int, timeout_s: float) -> list[RolloutGroup]:
        return self.host.fetch(max_n, timeout_s)

    def stats(self) -> ExecutorStats:
        return self.host.stats()

    def shutdown(self) -> None:
        self.host.shutdown()


class RayExecutorHost:
    """Controller-side handle of one RolloutWorkerActor, with timeouts on every call."""

    def __init__(self, handle: Any, call_timeout_s: float = 60.0):
        self.handle = handle
        self.call_timeout_s = call_timeout_s

    def _get(self, ref: Any, timeout_s: float | None = None) -> Any:
        import ray

        return ray.get(ref, timeout=timeout_s or self.call_timeout_s)

    def start(self) -> None:
        self._get(self.handle.start.remote())

    def pause(self) -> None:
        self._get(self.handle.pause.remote())

    def resume(self) -> None:
        self._get(self.handle.resume.remote())

    def set_version(self, version: int) -> None:
        self._get(self.handle.set_version.remote(version))

    def set_task_weights(self, weights: dict[str, float] | None) -> None:
        self._get(self.handle.set_task_weights.remote(weights))

    def fetch(self, max_n: int, timeout_s: float) -> list[RolloutGroup]:
        return self._get(self.handle.fetch.remote(max_n, timeout_s), timeout_s + self.call_timeout_s)

    def stats(self) -> ExecutorStats:
        return self._get(self.handle.stats.remote())

    def shutdown(self) -> None:
        import ray

        try:
            self._get(self.handle.shutdown.remote())
        finally:
            ray.kill(self.handle, no_restart=True)


def launch_ray_hosts(spec: RolloutSpec, workers: int, concurrency: int, batch_size: int, eta: int,
                     cpus_per_worker: float = 0.2,
                     resources: dict[str, float] | None = None,
                     startup_timeout_s: float = 600.0) -> tuple[list[RayExecutorHost], RemoteStaleness, Any]:
    """Start the StalenessActor and `workers` RolloutWorkerActors; returns (hosts, staleness, actor)."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError("scheduler.type=ray needs a running Ray (ray.init first)")
    stale_actor = ray.remote(StalenessActor).options(num_cpus=0, max_concurrency=64).remote(batch_size, concurrency, eta)
    worker_cls = ray.remote(RolloutWorkerActor)
    hosts = []
    for i, slots in enumerate(split_slots(concurrency, workers)):
        h = worker_cls.options(num_cpus=cpus_per_worker, max_concurrency=8, resources=resources or {},
                               name=None).remote(spec, i, slots, stale_actor)
        hosts.append(RayExecutorHost(h))
    # the workers exist (imports done, env factory built) before the first timed control call: on a
    # crowded or remote node that takes longer than a control call may
    ray.get([h.handle.stats.remote() for h in hosts], timeout=startup_timeout_s)
    return hosts, RemoteStaleness(stale_actor), stale_actor
