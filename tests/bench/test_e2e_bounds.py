"""bench e2e's bounds: the phase-overlap bound, and the pool bound that also counts the tail the
everlasting pool removes (sync step / max(T + S, trajectories per step / the pool's full rate))."""

from __future__ import annotations

import dataclasses

import pytest

from asyncwebrl.bench import e2e


def _mode(mode: str, rollout: float, train: float, sync_s: float, pool_rate: float | None = None) -> e2e.ModeResult:
    n = 5
    step = rollout + train + sync_s
    return e2e.ModeResult(
        mode=mode, run_dir="/tmp/x", setup_s=1.0, wall_s=n * step, steps=n, trajectories=64 * n,
        generated_tokens=100 * n, step_times_s=[step * 2] + [step] * (n - 1),
        phase_times_s={"rollout_wait": [rollout] * n, "train": [train] * n, "weight_sync": [sync_s] * n},
        checkpoint_s_total=0.0, checkpoint_stall_s=0.0, trainer_idle_frac=0.1, rollout_idle_frac=0.2,
        cpu_busy_frac=None, failed_episodes=0, dropped_stale=0, staleness_hist={"0": 3},
        success_vs_time=[[1.0, 0.5]], pool_full_rate_traj_s=pool_rate)


def test_pool_bound_counts_the_tail_and_both_shares_are_reported():
    sync = _mode("sync", rollout=20.0, train=10.0, sync_s=1.0)
    # the pool makes 64 trajectories in 8 s with every session busy: training (11 s) is the limit
    asy = _mode("async", rollout=0.0, train=10.0, sync_s=1.0, pool_rate=8.0)
    asy = dataclasses.replace(asy, step_times_s=[20.0] + [15.5] * 4)
    f = e2e.E2EFigures.of(sync, asy)
    assert f.ideal_overlap_bound == pytest.approx(31 / 21)  # the phase bound keeps the 20 s rollout
    assert f.pool_bound == pytest.approx(31 / 11)  # the pool bound does not: max(T + S, 64 / 8)
    assert f.share_of_ideal == pytest.approx((31 / 15.5) / (31 / 21))
    assert f.share_of_pool_bound == pytest.approx((31 / 15.5) / (31 / 11))
    # a slow pool (64 trajectories take 16 s) is the limit instead
    slow = dataclasses.replace(asy, pool_full_rate_traj_s=4.0)
    assert e2e.E2EFigures.of(sync, slow).pool_bound == pytest.approx(31 / 16)
    # no rate measured (an old record): no pool bound, never a made-up one
    assert e2e.E2EFigures.of(sync, dataclasses.replace(asy, pool_full_rate_traj_s=None)).pool_bound is None


def test_decode_rates_split_by_what_the_trainer_did():
    s = e2e.DecodeSampler([], None, lambda: 0.0)
    s.samples = [(0.0, 0), (1.0, 100), (2.0, 200), (3.0, 250), (4.0, 300)]
    timeline = [{"phase": "rollout_wait", "start": 0.0, "end": 2.0}, {"phase": "train", "start": 2.0, "end": 4.0}]
    assert s.rates(timeline) == (pytest.approx(50.0), pytest.approx(100.0))
