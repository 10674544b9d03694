"""Config of the test-rollout group (evaluation on checkpoints, SPEC section 5)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class TestRolloutConfig:
    enabled: bool = False
    """run evaluation on checkpoints with a separate inference group"""
    n_gpus: int = 0
    """devices of the test-rollout group (0 = CPU)"""
    tasks: str = "miniwob-easy"
    """evaluation task subset"""
    n_episodes: int = 16
    """episodes per evaluated checkpoint"""
    temperature: float = 0.0
    """evaluation sampling temperature (0 = greedy)"""
    poll_interval_s: float = 2.0
    """how often the checkpoint root is scanned"""

    def validate(self) -> None:
        if self.n_gpus < 0 or self.n_episodes < 1:
            raise ValueError("test_rollout.n_gpus must be >= 0 and test_rollout.n_episodes >= 1")
