"""Config of the test-rollout group (evaluation on checkpoints, SPEC section 5)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class TestRolloutConfig:
    enabled: bool = False
    """run evaluation on checkpoints with a separate inference group"""
    n_gpus: int = 0
    """devices of the test-rollout group (0 = CPU)"""
    tasks: str = ""
    """evaluation tasks (subset or comma-separated names); '' = the training tasks (env.tasks)"""
    n_episodes: int = 16
    """episodes per evaluated checkpoint"""
    heldout_tasks: str = ""
    """held-out MiniWoB tasks the trainer never samples, evaluated beside the training tasks ('' = none;
    ignored for env types other than miniwob)"""
    heldout_n_episodes: int = 0
    """episodes of the held-out tasks per evaluated checkpoint (0 = n_episodes)"""
    shortcut_baseline: bool = True
    """also play the constant-action policies (`click [k]`, "first button" ...) on the same episodes,
    once per evaluation set, and report the best one's success (`shortcut_baseline`) and
    `gain_over_shortcut` with every evaluation"""
    temperature: float = 0.0
    """evaluation sampling temperature (0 = greedy)"""
    poll_interval_s: float = 2.0
    """how often the checkpoint root is scanned"""
    flush_after_s: float = 120.0
    """when evaluation has waited this long for a new checkpoint, the trainer writes one at its next step
    boundary (0 = only the checkpoint.every_n_steps checkpoints are evaluated). Where evaluation shares
    the cores with training, every early checkpoint is an evaluation round taken from the trainer"""

    def validate(self) -> None:
        if self.n_gpus < 0 or self.n_episodes < 1:
            raise ValueError("test_rollout.n_gpus must be >= 0 and test_rollout.n_episodes >= 1")
        if self.flush_after_s < 0:
            raise ValueError("test_rollout.flush_after_s must be >= 0 (0 = evaluate the periodic checkpoints only)")
        if self.heldout_n_episodes < 0:
            raise ValueError("test_rollout.heldout_n_episodes must be >= 0 (0 = n_episodes)")
