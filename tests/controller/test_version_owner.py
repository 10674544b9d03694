"""The weight version has one owner, through the production path: controller -> trainer rank ->
refresh bracket -> two servers, two rollout executors, the staleness manager (scheduler.type=local).

After every refresh each holder reports the owner's value: the loop, the rollout controller, the
staleness manager, each executor, each server (`/model_info` weight_version, SGLang's string) and the
trainer; a run resumed from a checkpoint at version k continues at k+1 on all of them."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from asyncwebrl.config import load_run_config
from asyncwebrl.controller.main import Controller, find_resume
from asyncwebrl.controller.rundir import RunDir, read_jsonl
from asyncwebrl.controller.system import build_system
from asyncwebrl.weights.bracket import RefreshBracket

pytestmark = pytest.mark.slow
STEPS = 2


def _cfg(root, steps: int):
    return load_run_config(None, [
        f"cluster.fileroot={root}", f"total_train_steps={steps}", "actor.path=tiny-qwen2.5-vl",
        "scheduler.type=local", "cluster.n_inference_servers=2", "rollout.workers=2",
        "rollout.max_concurrent_rollouts=2", "rollout.max_head_offpolicyness=1",
        "env.type=synthetic", "env.max_steps=1", "rollout.consumer_batch_size=1", "gconfig.n_samples=2",
        "gconfig.max_new_tokens=8", "test_rollout.enabled=false", "stats.progress_bar=false",
        "stats.tensorboard=false", "checkpoint.every_n_steps=1", "recover=auto",
    ])


def _model_info(addr: str, key: str) -> dict:
    req = urllib.request.Request(addr + "/model_info", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def holders(ctl: Controller) -> dict[str, int]:
    """Every place that reports the weight version, read from outside as a user would."""
    s = ctl.sys
    out = {"owner": s.version.value, "rollout controller": s.rollout.version,
           "staleness manager": s.rollout.staleness.version, "admission stats": s.rollout.stats().admission.version,
           "trainer": s.trainer.ranks[0].actor.version}
    for i, h in enumerate(s.rollout.hosts):
        out[f"executor {i}"] = h.executor.version()
    for a in s.server_addresses:
        out[f"server {a}"] = int(_model_info(a, s.api_key)["weight_version"])
    return out


@dataclass
class Seen:
    at_step: list[dict[str, int]]
    """the holders at the start of every step"""
    end: dict[str, int]
    """the holders once the run finished"""
    start: int
    """the owner's start value"""
    records: list[dict]
    run_root: Path


def _run(root, steps: int) -> Seen:
    """The production run (as `asyncwebrl train` builds it), watched from a step hook; also checks that
    the bracket advances the very owner the rollout side reads."""
    cfg = _cfg(root, steps)
    run = RunDir(cfg.run_dir, keep_episodes=0, tensorboard=False)
    resume_from, resume_version = find_resume(cfg, run.root)
    system = build_system(cfg, run, resume_version=resume_version)
    at_step: list[dict[str, int]] = []
    try:
        ctl = Controller(cfg, system, run)
        assert ctl.clock is system.version is system.rollout.clock
        assert isinstance(ctl._bracket(), RefreshBracket) and ctl._bracket().clock is system.version
        ctl.step_hooks.append(lambda c: at_step.append(holders(c)))
        summary = ctl.train(resume_from)
        assert summary.version == system.version.value
        end = holders(ctl)
    finally:
        system.shutdown()
        run.close()
    return Seen(at_step, end, system.version.start, read_jsonl(run.root / "metrics.jsonl"), run.root)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("version-owner")
    return root, _run(root, STEPS)


def test_every_holder_reports_the_owners_version_after_each_refresh(first_run):
    _, seen_run = first_run
    at_step, end, records = seen_run.at_step, seen_run.end, seen_run.records
    # before step s the loop has made s refreshes; every holder says so, none counts on its own
    for s, seen in enumerate([*at_step, end]):
        assert set(seen.values()) == {s}, (s, seen)
    assert len(end) == 5 + 2 + 2  # owner, controller, staleness, admission, trainer; 2 executors; 2 servers
    train = [r for r in records if r["kind"] == "train"]
    assert [r["version"] for r in train] == list(range(1, STEPS + 1))
    # every train step's refresh went through the bracket: the servers were told each version once
    assert all(r["sync_total_s"] > 0 for r in train)


def test_resume_from_checkpoint_at_k_continues_at_k_plus_one(first_run):
    from asyncwebrl.training.checkpoint import latest_complete_checkpoint

    root, first = first_run
    k = first.end["owner"]
    assert k == STEPS and first.start == 0
    second = _run(root, STEPS + 1)  # recover=auto: the same trial, one step more
    assert second.run_root == first.run_root and second.start == k
    resume = [r for r in second.records if r["kind"] == "resume"]
    assert resume and resume[-1]["version"] == k
    # at the first step after resume every holder (servers and trainer included) is at k, not 0
    assert len(second.at_step) == 1 and set(second.at_step[0].values()) == {k}, second.at_step
    assert set(second.end.values()) == {k + 1}, second.end
    last_resume = max(i for i, r in enumerate(second.records) if r["kind"] == "resume")
    assert [r["version"] for r in second.records[last_resume:] if r["kind"] == "train"] == [k + 1]
    ckpt = latest_complete_checkpoint(second.run_root / "checkpoints")
    assert json.loads((ckpt / "trainer_state.json").read_text())["version"] == k + 1
