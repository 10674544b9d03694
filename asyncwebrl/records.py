"""The bottom floor's records: what crosses from rollout to training (and to the viewer).

Rollout produces them, training consumes them, and neither imports the other: both import this module.

Invariant: a `Trajectory` never holds decoded pixels in `store` transport mode, only PixelStore
keys; in `object_store` mode (the vanilla baseline) each step carries its encoded screenshots
inline in `pixels`. Every generated token has a behaviour logprob and the weight version that
produced it (prompt tokens are not versioned).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


def new_id(prefix: str = "") -> str:
    return prefix + uuid.uuid4().hex[:16]


@dataclass
class StepSample:
    """One step of an episode, and one training sample: its own context window and action tokens."""

    prompt_ids: list[int]
    """prompt token ids with image placeholders already expanded (what the server saw)"""
    output_ids: list[int]
    """generated token ids (the loss is taken on these)"""
    behave_logprobs: list[float]
    """logprob of each generated token under the policy that produced it"""
    versions: list[int]
    """weight version that produced each generated token"""
    pixel_keys: list[str] = field(default_factory=list)
    """PixelStore keys of the screenshots in this step's prompt, in prompt order"""
    pixels: list[bytes] | None = None
    """object_store transport only: the encoded screenshots themselves"""
    action_text: str = ""
    """decoded model output"""
    action: dict[str, Any] | None = None
    """parsed action (None when invalid)"""
    invalid: bool = False
    """the output did not parse or could not be executed"""
    no_effect: bool = False
    """the action ran but changed nothing on the page (the env's StepResult.no_effect)"""
    step_reward: float = 0.0
    """reward observed after this step (MiniWoB: 0 until done)"""

    @property
    def head_version(self) -> int:
        return self.versions[0] if self.versions else -1


@dataclass
class Trajectory:
    """One episode of one task."""

    traj_id: str
    task_id: str
    """task name (and seed): episodes with equal task_id form a GRPO group"""
    steps: list[StepSample]
    reward: float
    """outcome reward used for training (binary success for MiniWoB, plus penalties)"""
    raw_reward: float = 0.0
    """the environment's raw reward (MiniWoB's time-discounted reward)"""
    success: bool = False
    truncated: bool = False
    """the step budget ran out"""
    failed: bool = False
    """the episode broke (browser crash, server failure); it carries no training signal"""
    n_invalid: int = 0
    n_no_effect: int = 0
    """valid steps whose action changed nothing on the page"""
    start_time: float = 0.0
    end_time: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def head_version(self) -> int:
        """Version of the first generated token of the episode (staleness is measured on it)."""
        for s in self.steps:
            if s.versions:
                return s.versions[0]
        return -1

    @property
    def n_tokens(self) -> int:
        return sum(len(s.output_ids) for s in self.steps)

    def all_pixel_keys(self) -> list[str]:
        keys: list[str] = []
        for s in self.steps:
            keys.extend(s.pixel_keys)
        return keys


@dataclass
class RolloutGroup:
    """One rollout as the staleness manager counts it: n_samples episodes of the same task."""

    group_id: str
    task_id: str
    trajectories: list[Trajectory]
    submit_version: int = 0
    """trainer version when the rollout was admitted"""

    @property
    def head_version(self) -> int:
        heads = [t.head_version for t in self.trajectories if t.head_version >= 0]
        return min(heads) if heads else -1


@dataclass
class TrainSample:
    """One step of one episode as the trainer consumes it."""

    prompt_ids: list[int]
    output_ids: list[int]
    behave_logprobs: list[float]
    versions: list[int]
    advantage: float
    """episode advantage times the per-step normalizer"""
    pixel_keys: list[str] = field(default_factory=list)
    pixels: list[bytes] | None = None
    """inline screenshots (object_store transport); None = fetch `pixel_keys` from the store"""
    prox_logprobs: list[float] | None = None
    """pi_prox logprobs (filled by the recompute pass)"""
    ref_logprobs: list[float] | None = None
    """the reference policy's logprobs (filled by the trainer's reference pass when the KL term is on)"""
    traj_id: str = ""

    @property
    def n_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def validate(self) -> None:
        n = len(self.output_ids)
        if n == 0:
            raise ValueError(f"sample of trajectory {self.traj_id!r} has no output tokens")
        if len(self.behave_logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"sample of trajectory {self.traj_id!r}: {n} output tokens but {len(self.behave_logprobs)} "
                f"behaviour logprobs and {len(self.versions)} versions"
            )
        if not self.prompt_ids:
            raise ValueError(f"sample of trajectory {self.traj_id!r} has an empty prompt")
