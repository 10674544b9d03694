"""The whole system for a few steps: real Chromium + MiniWoB++, embedded inference servers, the
FSDP trainer, the Ray PixelStore, test rollout on checkpoints, under the Ray scheduler."""

import json
import urllib.request

import pytest

from asyncwebrl.config import load_run_config
from asyncwebrl.controller.main import Controller
from asyncwebrl.controller.rundir import RunDir, read_jsonl
from asyncwebrl.controller.system import build_system

pytestmark = [pytest.mark.slow, pytest.mark.browser]


def _get(url, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
        return json.loads(r.read())


def test_training_steps_move_weights_to_servers_and_eval_runs_on_checkpoints(tmp_path):
    steps = 2
    cfg = load_run_config(None, [
        f"cluster.fileroot={tmp_path}", f"total_train_steps={steps}", "rollout.consumer_batch_size=1",
        "gconfig.n_samples=2", "env.max_steps=2", "env.tasks=click-test,click-button",
        "test_rollout.enabled=true", "test_rollout.n_episodes=2", "test_rollout.tasks=click-test",
        "test_rollout.heldout_tasks=click-link", "test_rollout.heldout_n_episodes=1", "env.task_sampling.mode=adaptive",
        "env.task_sampling.prior=eval", "checkpoint.every_n_steps=1", "stats.progress_bar=false", "actor.mb_max_tokens=2048",
    ])
    run = RunDir(cfg.run_dir, keep_episodes=8)
    system = build_system(cfg, run)
    try:
        ctl = Controller(cfg, system, run)
        summary = ctl.train()
        assert summary.steps == steps and summary.version == steps

        # weights reached every train-rollout server: same version, bit-identical to the trainer's
        from asyncwebrl.inference.engine import params_checksum
        from asyncwebrl.models.vlm import load_model
        from asyncwebrl.training.checkpoint import latest_complete_checkpoint

        ckpt = latest_complete_checkpoint(run.root / "checkpoints")
        assert ckpt is not None and json.loads((ckpt / "trainer_state.json").read_text())["version"] == steps
        want = params_checksum(load_model(str(ckpt)).named_parameters())
        for addr in system.server_addresses:
            got = _get(addr + "/weights_checksum", system.api_key)
            assert got["weight_version"] == str(steps)
            assert got["sha256"] == want
            # every refresh told the server: pause, update session, continue (one bracket per step)
            events = _get(addr + "/server_info", system.api_key)["control_events"]
            for e in ("/pause_generation", "/begin_weight_update", "/end_weight_update", "/continue_generation"):
                assert events.count(e) >= steps, (e, events)

        # evaluation ran on a checkpoint, tagged with its version
        done = system.test_rollout.evaluate_latest_blocking(timeout_s=600)
        assert done["evaluated"]
        evals = [r for r in read_jsonl(run.root / "metrics.jsonl") if r["kind"] == "eval"]
        assert evals and evals[-1]["version"] == steps and evals[-1]["n_episodes"] == 2
        # the held-out task was evaluated on the same snapshot, and never trained on
        assert list(evals[-1]["heldout_per_task"]) == ["miniwob/click-link"] and evals[-1]["heldout_n_episodes"] == 1
        trained = {g for r in read_jsonl(run.root / "metrics.jsonl") if r["kind"] == "curriculum"
                   for g in r if g.startswith("groups.") and r[g] > 0}
        assert trained and trained <= {"groups.miniwob/click-test", "groups.miniwob/click-button"}
        # adaptive sampling started from the evaluation of version 0 (its only evaluated task has a prior)
        prior = [r for r in read_jsonl(run.root / "metrics.jsonl") if r["kind"] == "curriculum_prior"]
        assert len(prior) == 1 and prior[0]["folded"] == 1.0
        v0 = next(r for r in evals if r["version"] == 0)
        cur = [r for r in read_jsonl(run.root / "metrics.jsonl") if r["kind"] == "curriculum"]
        assert cur[0]["prior.miniwob/click-test"] == v0["per_task"]["miniwob/click-test"]
        assert "prior.miniwob/click-button" not in cur[0]

        # nothing lost, nothing duplicated
        stats = system.rollout.stats()
        assert stats.consumed_groups == steps * cfg.rollout.consumer_batch_size
        assert stats.lost_rollouts == 0 and stats.failed_episodes == summary.failed_episodes == 0
        assert summary.duplicates == 0
        train = [r for r in read_jsonl(run.root / "metrics.jsonl") if r["kind"] == "train"]
        assert [r["version"] for r in train] == list(range(1, steps + 1))
        assert all(r["n_trajectories"] == 2 for r in train)
        # the refresh's own figures reach the logs, and checkpoints blocked the loop only briefly
        assert all(r["sync_transfer_s"] > 0 and r["sync_n_buckets"] >= 1 and r["sync_bytes"] > 0 for r in train)
        assert 0 < summary.checkpoint_stall_s == max(r["checkpoint_s"] for r in train)
        assert all(0 <= r["zero_adv_groups"] <= cfg.rollout.consumer_batch_size for r in train)
        # the adaptive tracker is in the checkpoint, with the groups the trainer consumed
        extra = json.loads((ckpt / "extra_state.json").read_text())
        assert sum(t["groups"] for t in extra["curriculum"]["tasks"].values()) == steps * cfg.rollout.consumer_batch_size
        assert all(max(map(int, r["staleness_hist"])) <= cfg.rollout.max_head_offpolicyness for r in train)
        # the viewer sample of episodes holds real screenshots
        kept = read_jsonl(run.root / "episodes" / "index.jsonl")
        assert kept and (run.root / kept[0]["dir"] / "step_0.png").stat().st_size > 100
        # ... and the goal the model read (the viewer shows it above the steps)
        assert json.loads((run.root / kept[0]["dir"] / "episode.json").read_text())["instruction"].startswith("Click")
    finally:
        system.shutdown()
        run.close()
