"""The learning benchmarks read every step back from the row the controller logs (StepRecord.as_log):
a renamed field must fail here, not turn into a silent zero in bench/results."""

from __future__ import annotations

import pytest

from asyncwebrl.bench.arms import ArmResult, EvalRow, StepRow
from asyncwebrl.controller.records import StepRecord


def _record(step: int, clip: float, coupled: float, tokens: float, success: float) -> StepRecord:
    return StepRecord(
        step=step, version=step, n_trajectories=8, failed_trajectories=0, reward_mean=success,
        success_rate=success, episode_len_mean=1.0, invalid_rate=0.0, no_effect_rate=0.0, slow_steps=0,
        generated_tokens=int(tokens),
        staleness_hist={"1": 2}, n_groups=2, zero_adv_groups=1, zero_adv_frac=0.5, tasks_in_zone=3,
        dropped_stale=0, failed_episodes=0, failed_rollouts=0, rollout_idle_frac=0.1, trainer_idle_frac=0.2,
        trajectories_per_s=1.0, tokens_per_s=5.0, step_time_s=10.0, wait_s=1.0, train_s=8.0, weight_sync_s=1.0,
        checkpoint_s=0.0, wall_time_s=10.0 * step, duplicates=0, servers_restarted=0, servers_dropped=0,
        server_recovery_s=0.0, trainer={"clip_rate": clip, "clip_rate_coupled": coupled, "n_tokens": tokens},
    )


def test_arm_figures_come_from_the_logged_rows():
    rows = [{"kind": "train", "time": 10.0 * i, **_record(i, c, k, n, s).as_log()}
            for i, (c, k, n, s) in enumerate([(0.0, 0.1, 100, 0.5), (0.1, 0.3, 300, 0.25)], start=1)]
    arm = ArmResult(name="a", seed=1, overrides=[], run_dir="", wall_s=20.0, setup_s=1.0,
                    steps=[StepRow.from_record(r) for r in rows],
                    evals=[EvalRow.from_record({"version": 0, "success_rate": 0.5, "per_task": {"t": 0.5}})])
    assert arm.clip_rate == pytest.approx((0.0 * 100 + 0.1 * 300) / 400)  # token-weighted
    assert arm.clip_rate_coupled == pytest.approx((0.1 * 100 + 0.3 * 300) / 400)
    assert arm.successes_per_s == pytest.approx((0.5 * 8 + 0.25 * 8) / 20.0)
    assert arm.zero_adv_frac == pytest.approx(0.5)
    assert arm.eval_first == 0.5 and arm.brief()["clip_rate"] == arm.clip_rate
    broken = dict(rows[0])
    del broken["clip_rate_coupled"]
    with pytest.raises(KeyError):
        StepRow.from_record(broken)
