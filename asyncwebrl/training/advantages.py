"""Episode advantages (SPEC section 6): outcome reward per episode, GRPO-normalized within the group of
n_samples episodes of the same task, spread over the episode's steps.

Invariant: failed trajectories (`Trajectory.failed`) carry no training signal: they neither get an
advantage nor enter the group statistics. Every step of a surviving episode becomes one training
sample carrying the episode advantage times the per-step normalizer (1, 1/|tau| or 1/k); since the
PPO objective is positively homogeneous in A, scaling A is the same as weighting the sample.
"""

from __future__ import annotations

import math

from asyncwebrl.records import RolloutGroup, Trajectory

STD_EPS = 1e-6


def group_advantages(rewards: list[float], group_norm: bool = True, std_norm: bool = True) -> list[float]:
    """GRPO: reward minus the group mean, divided by the group std (population std, + eps).

    Without group normalization the advantage is the raw reward. A group of one, or of equal rewards,
    gives all-zero advantages when normalized (no signal, never a division blow-up).
    """
    if not rewards:
        return []
    if not group_norm:
        return [float(r) for r in rewards]
    mean = sum(rewards) / len(rewards)
    centred = [float(r) - mean for r in rewards]
    if not std_norm:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(centred))
    return [c / (std + STD_EPS) for c in centred]


def step_weight(n_steps: int, mode: str, k: int) -> float:
    """Per-step normalizer: none -> 1, episode_length -> 1/|tau|, constant -> 1/k."""
    if mode == "none":
        return 1.0
    if mode == "episode_length":
        return 1.0 / max(n_steps, 1)
    if mode == "constant":
        if k < 1:
            raise ValueError("step_normalizer_k must be >= 1")
        return 1.0 / k
    raise ValueError(f"unknown step_normalizer '{mode}' (none | episode_length | constant)")


def trajectory_advantages(
    group: RolloutGroup,
    group_norm: bool = True,
    std_norm: bool = True,
    step_normalizer: str = "none",
    step_normalizer_k: int = 10,
) -> list[tuple[Trajectory, float]]:
    """(trajectory, per-step advantage) for every non-failed trajectory with at least one step."""
    alive = [t for t in group.trajectories if not t.failed and t.steps]
    advs = group_advantages([t.reward for t in alive], group_norm, std_norm)
    return [(t, a * step_weight(len(t.steps), step_normalizer, step_normalizer_k)) for t, a in zip(alive, advs, strict=False)]
