"""What every environment offers the episode loop (browser MiniWoB/WebGym envs and the synthetic
web-like env alike), so the loop code path is the same for all of them.

Invariant: `step` never raises for a bad action; it reports `invalid=True` and the episode goes on.
Environment faults raise `EnvCrashed` (a crashed browser; `EnvDeadline`: a call that missed its
deadline or the episode's env budget; `SiteUnreachable`: the page the agent went to cannot be reached),
whatever the page did (a page error of any other type is wrapped, its cause named); the episode is then
reported failed and counted, and the environment is replaced. A task that is itself wrong raises
`TaskError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncwebrl.web.fence import BlockedRequest


class EnvCrashed(RuntimeError):
    """The environment broke under the episode (browser or page crash); the episode failed."""


class EnvDeadline(EnvCrashed):
    """An env call (reset/step) did not finish within its deadline: a page that never yields its main
    thread, a site that never answers. The session is discarded."""


class SiteUnreachable(EnvCrashed):
    """An allowed site did not answer or its name did not resolve: the episode cannot be judged."""


class TaskError(ValueError):
    """The task itself is wrong (its start URL is refused by its own policy, its predicate is not
    valid JavaScript): not a fault of the page, and not retried as one."""


@dataclass
class Task:
    """One task instance: which task, which seed, what budget."""

    task_id: str
    """unique name of the task family, e.g. 'miniwob/click-button' or 'demo/search'"""
    seed: int = 0
    """episode seed (equal seeds give equal episodes: a GRPO group shares it)"""
    max_steps: int = 4
    """step budget"""
    instruction: str = ""
    """instruction known before reset (WebGym tasks); MiniWoB fills it from the utterance"""
    spec: dict[str, Any] = field(default_factory=dict)
    """environment-specific fields (start_url, evaluator, allowed_origins, ...)"""

    @property
    def group_key(self) -> str:
        return f"{self.task_id}#{self.seed}"


@dataclass
class Observation:
    screenshot: bytes
    """PNG bytes of the viewport"""
    instruction: str
    """the natural-language goal"""
    elements: list[dict[str, Any]] = field(default_factory=list)
    """interactive elements: {id, role, name, box=[x, y, w, h]}"""
    url: str = ""


@dataclass
class StepResult:
    reward: float = 0.0
    """reward after this step (MiniWoB: nonzero only when done)"""
    raw_reward: float = 0.0
    done: bool = False
    success: bool = False
    invalid: bool = False
    """the action could not be executed (bad element id, off-screen, not allowed)"""
    screenshot_unchanged: bool = False
    no_effect: bool = False
    """the action ran but changed nothing observable (page, focus, URL, form state, screenshot), or it
    cannot act on its target (e.g. typing into a <select>); `info['error']` says which"""
    blocked: list[BlockedRequest] = field(default_factory=list)
    """connections the network fence refused (or found unreachable) since the previous step"""
    step_s: float = 0.0
    """wall seconds this env.step took (action, settle, observation, evaluation)"""
    slow: bool = False
    """the step took at least env.slow_step_s: a page that stalls (counted in the run's metrics)"""
    info: dict[str, Any] = field(default_factory=dict)


class Env(Protocol):
    async def reset(self, task: Task) -> Observation: ...

    async def step(self, action: dict[str, Any] | None) -> tuple[Observation, StepResult]:
        """Execute a parsed action (None = unparsable output: counted invalid, nothing executed)."""
        ...

    async def close(self) -> None: ...
