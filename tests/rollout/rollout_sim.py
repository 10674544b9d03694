"""A simulated rollout workload for the pool's tests: episodes whose steps take random time and
whose generation calls pass the resume gate and record the weight version they ran under, exactly as
the real episode loop's generation requests do. Everything else (executor, admission, controller,
threads) is the real code."""

from __future__ import annotations

import asyncio
import random
import threading
from dataclasses import dataclass, field

from asyncwebrl.records import RolloutGroup, StepSample, Trajectory, new_id
from asyncwebrl.rollout.gate import ResumeGate
from asyncwebrl.rollout.hosts import RolloutSpec
from asyncwebrl.web.base import Task


@dataclass
class Tracker:
    """What the simulated rollouts did, seen from outside (thread-safe)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    running: int = 0
    max_running: int = 0
    generation_starts: int = 0
    started_groups: int = 0
    emitted: list[str] = field(default_factory=list)
    failed: int = 0

    def enter(self) -> None:
        with self.lock:
            self.running += 1
            self.started_groups += 1
            self.max_running = max(self.max_running, self.running)

    def leave(self) -> None:
        with self.lock:
            self.running -= 1


class CountingTasks:
    def __init__(self, index: int = 0):
        self.index = index
        self.n = 0

    def next(self) -> Task:
        self.n += 1
        return Task(task_id=f"sim/w{self.index}", seed=self.n, max_steps=8)


class SimWorkflow:
    def __init__(self, gate: ResumeGate, tracker: Tracker, n_samples: int, seed: int, fail_p: float,
                 step_s: float, max_steps: int):
        self.gate, self.tracker = gate, tracker
        self.n_samples, self.fail_p, self.step_s, self.max_steps = n_samples, fail_p, step_s, max_steps
        self.rng = random.Random(seed)

    async def _episode(self, task: Task, version) -> Trajectory:
        steps = []
        for _ in range(self.rng.randint(1, self.max_steps)):
            await self.gate.wait()  # what GatedClient does before every generation request
            with self.tracker.lock:
                self.tracker.generation_starts += 1
            v = version()
            await asyncio.sleep(self.rng.random() * self.step_s)
            steps.append(StepSample(prompt_ids=[1, 2], output_ids=[3], behave_logprobs=[-0.1], versions=[v]))
        return Trajectory(traj_id=new_id("t-"), task_id=task.group_key, steps=steps, reward=0.0)

    async def __call__(self, task: Task, version) -> RolloutGroup:
        self.tracker.enter()
        try:
            if self.rng.random() < self.fail_p:
                await asyncio.sleep(self.rng.random() * self.step_s)
                with self.tracker.lock:
                    self.tracker.failed += 1
                raise RuntimeError("simulated episode crash")
            trajs = await asyncio.gather(*(self._episode(task, version) for _ in range(self.n_samples)))
            g = RolloutGroup(group_id=new_id("g-"), task_id=task.group_key, trajectories=list(trajs))
            with self.tracker.lock:
                self.tracker.emitted.append(g.group_id)
            return g
        finally:
            self.tracker.leave()


def sim_spec(tracker: Tracker, n_samples: int = 2, fail_p: float = 0.0, step_s: float = 0.004,
             max_steps: int = 4, seed: int = 0) -> RolloutSpec:
    return RolloutSpec(
        make_workflow=lambda i, gate: SimWorkflow(gate, tracker, n_samples, seed * 100 + i, fail_p, step_s, max_steps),
        make_tasks=lambda i: CountingTasks(i),
    )
