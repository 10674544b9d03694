"""Task registry (named MiniWoB subsets) and the deterministic task sampler the trainer checkpoints.

Invariant: the i-th task a `TaskSampler` hands out is a pure function of (its task list, seed, i,
and the sampling weights in force at draw i), so `state_dict()` = {seed, count} plus the weights
(the adaptive tracker's state, checkpointed by the controller) resume where a checkpoint left off.
Without weights the sampler makes shuffled passes (every task once per pass); with weights
(`set_weights`, pushed by the controller in `env.task_sampling.mode=adaptive`) draw i picks the task
whose slice of [0, 1) (slices sized by weight, in a seeded order) holds u_i = frac(u_0 + i / phi), the
golden-ratio Weyl sequence. Its points spread evenly, so over any N draws each task's count stays
within a few of N times its share, as shuffled passes do for uniform sampling. Independent weighted
draws did not: in a 24-step adaptive run (2026-12-01, 48 groups over 9 tasks, shares 0.06-0.19 all
run) the consumed groups per task ran from 1 to 12, so the arm was noisier than uniform, not better
aimed.
"""

from __future__ import annotations

import bisect
import itertools
import random
import threading
from typing import Any

from asyncwebrl.web.base import Task
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.env_factory import make_env  # noqa: F401  (re-exported: tasks + envs in one import)

_GOLDEN = (5**0.5 - 1) / 2
"""1 / phi: the Weyl step whose points fill [0, 1) most evenly (the three-gap theorem)"""

MINIWOB_EASY = [
    "click-test", "click-test-2", "click-button", "click-link", "click-dialog", "click-dialog-2",
    "focus-text", "focus-text-2", "click-tab",
]
"""single-step tasks on small screens: what a 135M policy can plausibly learn in a short run"""

MINIWOB_ORACLE = [
    "click-test", "click-test-2", "click-button", "click-link", "click-dialog", "click-dialog-2",
    "focus-text", "focus-text-2", "click-tab", "enter-text", "click-checkboxes", "click-option",
    "enter-password", "login-user", "click-button-sequence", "click-collapsible", "click-tab-2-easy",
]
"""tasks with a scripted oracle solver (asyncwebrl.web.oracles): miniwob-easy and miniwob-medium"""


MINIWOB_MEDIUM = [
    "enter-text", "enter-password", "login-user", "click-checkboxes", "click-option", "click-button-sequence",
    "click-collapsible", "click-tab-2-easy",
]
"""two- and three-step tasks reachable with click and type (fill a field and submit, tick boxes and
submit, open a section then click): give them env.max_steps >= 4; they start near zero for the 135M
default, so they pay off in runs longer than the 30-minute default"""

MINIWOB_HELDOUT = ["click-test-transfer", "click-widget"]
"""single-step cousins of miniwob-easy that the default run never trains on (its held-out evaluation)"""

MINIWOB_MEDIUM_HELDOUT = ["enter-text-2", "click-checkboxes-transfer", "click-tab-2"]
"""multi-step cousins of miniwob-medium that the multi-step recipe never trains on (its held-out
evaluation), each solvable with click and type within 4 steps (scripted oracles: at most 2, 4 and 3):
enter-text-2 is enter-text whose text must be retyped in upper or lower case (the instruction says
which); click-checkboxes-transfer is click-checkboxes on another layout, 0-3 boxes to tick; click-tab-2
is click-tab-2-easy with three tabs, the link possibly behind the second or third. login-user-popup
is left out: its popup takes 5 steps in about half of the episodes."""


def miniwob_all() -> list[str]:
    from asyncwebrl.web.miniwob import miniwob_html_dir

    return sorted(p.stem for p in (miniwob_html_dir() / "miniwob").glob("*.html"))


SUBSETS = {
    "miniwob-easy": lambda: list(MINIWOB_EASY),
    "miniwob-oracle": lambda: list(MINIWOB_ORACLE),
    "miniwob-medium": lambda: list(MINIWOB_MEDIUM),
    "miniwob-heldout": lambda: list(MINIWOB_HELDOUT),
    "miniwob-medium-heldout": lambda: list(MINIWOB_MEDIUM_HELDOUT),
    "miniwob-all": miniwob_all,
}


def resolve_task_names(spec: str | list[str]) -> list[str]:
    """Subset names and task names (comma-separated or a list) -> MiniWoB task names, checked."""
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not items:
        raise ValueError("env.tasks is empty; name a subset (miniwob-easy, miniwob-all) or tasks")
    known = set(miniwob_all())
    out: list[str] = []
    for it in items:
        if it in SUBSETS:
            out.extend(SUBSETS[it]())
            continue
        name = it.split("/", 1)[1] if it.startswith("miniwob/") else it
        if name not in known:
            raise ValueError(f"unknown MiniWoB task or subset '{it}'; subsets: {', '.join(SUBSETS)}")
        out.append(name)
    return list(dict.fromkeys(out))


class TaskSampler:
    """Endless, seeded stream of tasks: shuffled passes over the task list, or evenly spread weighted
    draws (module docstring); a fresh episode seed each draw."""

    def __init__(self, tasks: list[str] | list[Task], seed: int = 0, max_steps: int = 4, prefix: str = "miniwob/"):
        if not tasks:
            raise ValueError("TaskSampler needs at least one task")
        self.templates: list[Task] = [
            t if isinstance(t, Task) else Task(task_id=t if "/" in t else prefix + t, max_steps=max_steps)
            for t in tasks
        ]
        self.seed = int(seed)
        self.count = 0
        self._weights: list[float] | None = None
        self._lock = threading.Lock()

    @property
    def task_ids(self) -> list[str]:
        return [t.task_id for t in self.templates]

    def set_weights(self, weights: dict[str, float] | None) -> None:
        """Sampling weight per task id (missing ids get 0); None goes back to uniform shuffled passes."""
        if weights is None:
            with self._lock:
                self._weights = None
            return
        unknown = set(weights) - set(self.task_ids)
        if unknown:
            raise ValueError(f"sampling weights name tasks this sampler does not have: {sorted(unknown)[:5]}")
        w = [max(0.0, float(weights.get(t, 0.0))) for t in self.task_ids]
        if sum(w) <= 0:
            raise ValueError("sampling weights must have a positive sum")
        with self._lock:
            self._weights = w

    def _task_at(self, i: int) -> Task:
        n = len(self.templates)
        weights = self._weights
        if weights is None:
            epoch, pos = divmod(i, n)
            order = list(range(n))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            tpl = self.templates[order[pos]]
        else:
            tpl = self.templates[self._weighted_index(i, weights)]
        ep_seed = random.Random(f"{self.seed}:{i}").randrange(2**31)
        return Task(task_id=tpl.task_id, seed=ep_seed, max_steps=tpl.max_steps,
                    instruction=tpl.instruction, spec=dict(tpl.spec))

    def _weighted_index(self, i: int, weights: list[float]) -> int:
        """Low-discrepancy weighted draw (module docstring): a pure function of (seed, i, weights)."""
        rng = random.Random(f"w{self.seed}")
        order = list(range(len(weights)))
        rng.shuffle(order)  # a seeded slice order, so rollout hosts (different seeds) do not move in step
        u = (rng.random() + i * _GOLDEN) % 1.0
        ends = list(itertools.accumulate(weights[j] for j in order))
        k = bisect.bisect_right(ends, u * ends[-1])  # the first slice ending past the point
        if k == len(order):  # u * total rounded up to the total: the last slice with any weight
            k = bisect.bisect_left(ends, ends[-1])
        return order[k]

    def next(self) -> Task:
        with self._lock:
            i = self.count
            self.count += 1
        return self._task_at(i)

    def __iter__(self):
        return self

    def __next__(self) -> Task:
        return self.next()

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "count": self.count, "n_tasks": len(self.templates)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("n_tasks", len(self.templates)) != len(self.templates):
            raise ValueError(
                f"sampler state was saved over {state['n_tasks']} tasks, this sampler has {len(self.templates)}")
        self.seed = int(state["seed"])
        self.count = int(state["count"])


def make_task_sampler(env_cfg: EnvConfig, seed: int = 0) -> TaskSampler:
    """The task stream of a run's environment kind."""
    if env_cfg.type == "webgym":
        from asyncwebrl.web.webgym import load_task_file

        return TaskSampler(load_task_file(env_cfg.task_file), seed=seed)
    if env_cfg.type == "miniwob":
        return TaskSampler(resolve_task_names(env_cfg.tasks), seed=seed, max_steps=env_cfg.max_steps)
    names = [s.strip() for s in env_cfg.tasks.split(",") if s.strip()] or ["synthetic"]
    return TaskSampler(names, seed=seed, max_steps=env_cfg.max_steps, prefix="synthetic/")
