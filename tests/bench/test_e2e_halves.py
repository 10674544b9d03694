"""bench e2e split over calls: a kept half comes back whole, and halves of different workloads never mix."""

from __future__ import annotations

import dataclasses

import pytest

from asyncwebrl.bench import e2e
from asyncwebrl.bench.common import parse_overrides


def _half(mode: str, step_s: float) -> e2e.ModeResult:
    n = 4
    return e2e.ModeResult(
        mode=mode, run_dir="/tmp/x", setup_s=1.0, wall_s=n * step_s, steps=n, trajectories=8 * n,
        generated_tokens=100 * n, step_times_s=[step_s * 2] + [step_s] * (n - 1),
        phase_times_s={"rollout_wait": [step_s / 2] * n, "train": [step_s / 2] * n, "weight_sync": [0.0] * n},
        checkpoint_s_total=0.0, checkpoint_stall_s=0.0, trainer_idle_frac=0.1, rollout_idle_frac=0.2,
        cpu_busy_frac=None, failed_episodes=0, dropped_stale=0, staleness_hist={"0": 3},
        success_vs_time=[[1.0, 0.5]], timeline=[{"phase": "train", "start": 0.0, "end": 1.0}])


def test_kept_half_round_trips_and_combines(tmp_path):
    knobs = parse_overrides(["steps=4", "mode_dir=" + str(tmp_path)], e2e.DEFAULTS)
    e2e.save_half(tmp_path, _half("sync", 10.0), knobs)
    e2e.save_half(tmp_path, _half("async", 4.0), dict(knobs, modes="async", out="elsewhere"))
    sync, asy = e2e.load_half(tmp_path, "sync", knobs), e2e.load_half(tmp_path, "async", knobs)
    assert sync == _half("sync", 10.0)
    assert e2e.E2EFigures.of(sync, asy).steady_state_speedup == pytest.approx(2.5)
    assert e2e.load_half(tmp_path / "nothing-here", "sync", knobs) is None
    busy = dataclasses.replace(sync, cpu_busy_frac=0.8)
    assert e2e.E2EFigures.of(busy, asy, shared_cores=True).shared_core_bound == pytest.approx(1.25)
    assert e2e.E2EFigures.of(busy, asy, shared_cores=False).shared_core_bound is None


def test_half_from_other_knobs_is_refused(tmp_path):
    knobs = parse_overrides(["steps=4"], e2e.DEFAULTS)
    e2e.save_half(tmp_path, _half("sync", 10.0), knobs)
    with pytest.raises(SystemExit, match="steps"):
        e2e.load_half(tmp_path, "sync", dict(knobs, steps=12))
    (tmp_path / "async.json").write_text("{not json")
    with pytest.raises(SystemExit, match="not a kept half"):
        e2e.load_half(tmp_path, "async", knobs)


def test_unknown_mode_is_refused():
    with pytest.raises(SystemExit, match="modes must name"):
        e2e.main(["modes=warp"])


@pytest.mark.slow
def test_half_from_a_runs_records_matches_the_bench_measured_half(tmp_path):
    """`from_run`: a half rebuilt from a finished run's own records (metrics.jsonl, timeline.jsonl)
    carries the same step and phase times, trajectories, tokens, staleness and idle figures as the
    half the bench measured around that run; only the bench process's own figures stay empty."""
    from pathlib import Path

    from asyncwebrl.models.prepare import resolve_model_path

    tiny = Path(resolve_model_path("default")).parent / "tiny-qwen2.5-vl"
    knobs = parse_overrides(["steps=2", "scheduler=local", "env=synthetic", f"model={tiny}", "batch=1",
                             "n_samples=2", "max_new_tokens=4", f"fileroot={tmp_path}",
                             "extra=actor.mb_max_tokens=2048"], e2e.DEFAULTS)
    measured = e2e.run_mode("sync", knobs)
    rebuilt = e2e.half_from_run("sync", Path(measured.run_dir))
    assert rebuilt.source == "run-records" and measured.source == "bench"
    for name in ("steps", "trajectories", "generated_tokens", "step_times_s", "phase_times_s", "staleness_hist",
                 "failed_episodes", "dropped_stale", "timeline"):
        assert getattr(rebuilt, name) == getattr(measured, name), name
    assert rebuilt.wall_s == pytest.approx(measured.wall_s, abs=0.5)
    assert rebuilt.trainer_idle_frac == pytest.approx(measured.trainer_idle_frac, abs=0.05)
    assert rebuilt.cpu_busy_frac is None and rebuilt.decode_tok_s_trainer_idle is None
    assert measured.end_s is not None and measured.end_s >= 0  # the loop ends at the last step
    both = e2e.half_from_run("sync", Path(measured.run_dir), kept=measured)  # the bench's own figures kept
    assert both.source == "run-records+bench" and both.cpu_busy_frac == measured.cpu_busy_frac
    assert both.machine == measured.machine and both.setup_s == measured.setup_s
    with pytest.raises(SystemExit, match="not of the run"):
        e2e.half_from_run("sync", Path(measured.run_dir), kept=_half("sync", 1.0))
    with pytest.raises(SystemExit, match="metrics.jsonl"):
        e2e.half_from_run("sync", tmp_path / "no-run")
