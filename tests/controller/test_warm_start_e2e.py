"""The warm start through the production path (issue 19): `warm_start.enabled=true` on a fresh run
clones oracle demonstrations on the trainer rank, the inference servers serve exactly those weights as
version 0 before the first rollout, the version-0 checkpoint holds them, RL goes on from there, and a
run resumed from a checkpoint does not redo it (scheduler.type=local, real Chromium, default model)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from asyncwebrl.config import load_run_config
from asyncwebrl.controller.main import Controller, find_resume
from asyncwebrl.controller.rundir import RunDir, read_jsonl
from asyncwebrl.controller.system import build_system

pytestmark = [pytest.mark.slow, pytest.mark.browser]


def _cfg(root, steps: int):
    return load_run_config(None, [
        f"cluster.fileroot={root}", f"total_train_steps={steps}", "scheduler.type=local", "recover=auto",
        "env.tasks=click-test,click-button", "env.max_steps=1", "rollout.consumer_batch_size=1",
        "gconfig.n_samples=2", "test_rollout.enabled=false", "test_rollout.heldout_tasks=",
        "checkpoint.every_n_steps=1", "stats.progress_bar=false", "stats.tensorboard=false",
        "stats.keep_episodes=0", "warm_start.enabled=true", "warm_start.n_demos=1", "warm_start.epochs=1",
        "warm_start.lr=1e-4",
    ])


def _checksum(addr: str, key: str) -> dict:
    req = urllib.request.Request(addr + "/weights_checksum", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _run(root, steps: int):
    from asyncwebrl.inference.engine import params_checksum

    cfg = _cfg(root, steps)
    run = RunDir(cfg.run_dir, keep_episodes=0, tensorboard=False)
    resume_from, resume_version = find_resume(cfg, run.root)
    system = build_system(cfg, run, resume_version=resume_version)
    seen: list[dict] = []

    def before_step(ctl: Controller) -> None:
        if not seen:  # what the servers serve when the first rollout of this run was generated
            seen.append({"trainer": params_checksum(ctl.sys.trainer.ranks[0].actor.hf.named_parameters()),
                         "servers": [_checksum(a, ctl.sys.api_key) for a in ctl.sys.server_addresses]})

    try:
        ctl = Controller(cfg, system, run)
        ctl.step_hooks.append(before_step)
        summary = ctl.train(resume_from)
    finally:
        system.shutdown()
        run.close()
    return cfg, run.root, summary, seen[0], read_jsonl(run.root / "metrics.jsonl")


def test_warm_start_is_version_0_on_the_servers_and_is_not_redone_on_resume(tmp_path):
    from asyncwebrl.inference.engine import params_checksum
    from asyncwebrl.models.prepare import resolve_model_path
    from asyncwebrl.models.vlm import load_model
    from asyncwebrl.training.checkpoint import checkpoint_name

    cfg, root, summary, first, records = _run(tmp_path, 1)
    base = params_checksum(load_model(resolve_model_path(cfg.actor.path)).named_parameters())
    # the servers served the warm-started weights, as version 0, before the first rollout
    assert first["trainer"] != base
    assert all(s["sha256"] == first["trainer"] and s["weight_version"] == "0" for s in first["servers"])
    warm = [r for r in records if r["kind"] == "warm_start"]
    assert [r["step"] for r in warm] == [1] and warm[0]["demos"] == 2 and warm[0]["nll"] > 0
    assert summary.warm_start_demos == 2 and summary.warm_start_nll_first == pytest.approx(warm[0]["nll"])
    # version 0 on disk is the warm-started model; RL then made version 1 from it
    v0 = root / "checkpoints" / checkpoint_name(0)
    assert params_checksum(load_model(str(v0)).named_parameters()) == first["trainer"]
    assert [r["version"] for r in records if r["kind"] == "train"] == [1] and summary.version == 1

    # resume (recover=auto) from version 1: no second warm start, the servers get version 1's weights
    _, _, summary2, first2, records2 = _run(tmp_path, 2)
    assert len([r for r in records2 if r["kind"] == "warm_start"]) == 1
    assert [r["version"] for r in records2 if r["kind"] == "resume"] == [1]
    assert summary2.warm_start_demos == 0 and summary2.version == 2
    v1 = params_checksum(load_model(str(root / "checkpoints" / checkpoint_name(1))).named_parameters())
    assert all(s["sha256"] == v1 and s["weight_version"] == "1" for s in first2["servers"])
