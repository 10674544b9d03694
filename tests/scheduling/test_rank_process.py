"""A trainer rank in a process of its own (scheduler.trainer_process=own): a real TrainerRank on the tiny
model, served from a spawned process. Its failures reach the controller as what they are: the rank's
exception with the rank's traceback, and a rank process that died as RankProcessDied, never a hang."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from asyncwebrl.net import LOOPBACK, free_port
from asyncwebrl.scheduling.rank_process import ProcessRank, RankProcessDied
from asyncwebrl.scheduling.trainer_host import TrainerRank
from asyncwebrl.training.config import ActorConfig


def _tiny() -> str:
    from asyncwebrl.models.prepare import resolve_model_path

    return str(Path(resolve_model_path("default")).parent / "tiny-qwen2.5-vl")


@pytest.mark.slow
def test_rank_process_answers_raises_and_reports_its_death(tmp_path):
    rank = ProcessRank(TrainerRank, ActorConfig(path=_tiny(), mb_max_tokens=1024), 0, 1, LOOPBACK, free_port(LOOPBACK), "cpu")
    try:
        pid = rank.pid()
        assert pid == rank.process.pid != os.getpid()
        assert len(rank.weights_checksum()) == 64
        with pytest.raises(ValueError, match="not a complete checkpoint") as err:  # the rank's own exception, its traceback attached
            rank.load_checkpoint(str(tmp_path / "no-such-checkpoint"))
        assert any("in the trainer rank process" in n for n in getattr(err.value, "__notes__", []))
        assert rank.process.is_alive()  # a failed call leaves the rank serving
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RankProcessDied, match="exited"):
            rank.weights_checksum()
    finally:
        rank.close()
    assert not rank.process.is_alive()
