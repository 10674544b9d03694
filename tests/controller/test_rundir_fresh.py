"""A fresh run (recover=off) into a directory holding an earlier run starts clean: the earlier run is
kept beside it as `<dir>.prev`, and the new run's evaluations are its own."""

from pathlib import Path

from asyncwebrl.controller.main import _eval_records
from asyncwebrl.controller.rundir import RunDir, set_aside_previous


def _earlier_run(root: Path) -> None:
    run = RunDir(root, tensorboard=False)
    run.log_metrics("eval", 30, {"version": 30, "success_rate": 0.9})
    run.close()
    (root / "checkpoints" / "version_00000030").mkdir(parents=True)


def test_second_fresh_run_does_not_see_the_first(tmp_path: Path) -> None:
    root = tmp_path / "runs" / "default"
    _earlier_run(root)
    assert [e.version for e in _eval_records(root)] == [30]

    prev = set_aside_previous(root)
    assert prev == root.with_name("default.prev")
    assert (prev / "checkpoints" / "version_00000030").is_dir()  # nothing of the earlier run is lost
    run = RunDir(root, tensorboard=False)
    run.log_metrics("eval", 0, {"version": 0, "success_rate": 0.2})
    run.close()
    assert [e.version for e in _eval_records(root)] == [0]
    assert not (root / "checkpoints").exists()

    # a third run replaces the older .prev with the second run
    assert set_aside_previous(root) == prev
    assert [e.version for e in _eval_records(prev)] == [0]


def test_nothing_to_set_aside(tmp_path: Path) -> None:
    assert set_aside_previous(tmp_path / "absent") is None
    (tmp_path / "empty").mkdir()
    assert set_aside_previous(tmp_path / "empty") is None
    assert (tmp_path / "empty").is_dir()
