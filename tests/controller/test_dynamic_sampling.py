"""rollout.dynamic_sampling through the production path: controller -> real rollout controller and
staleness budget -> trainer rank, on the synthetic environment with the tiny model.

A group whose episodes all got the same reward has all-zero advantages; with dynamic sampling the
trainer does not train on it and draws another. What a user would notice if this broke: the run stalls
(skipped groups keep their staleness budget, so the pool stops producing at eta), the trainer trains on
groups without a signal, screenshots of skipped groups pile up in the PixelStore, or the records do not
say how many groups were skipped."""

import pytest

from asyncwebrl.config import load_run_config
from asyncwebrl.controller.main import Controller
from asyncwebrl.controller.rundir import RunDir, read_jsonl
from asyncwebrl.controller.system import build_system
from asyncwebrl.rollout.curriculum import zero_advantage

pytestmark = pytest.mark.slow


def test_dynamic_sampling_trains_only_on_groups_with_a_signal_and_never_stalls(tmp_path):
    steps, draws = 3, 3
    cfg = load_run_config(None, [
        f"cluster.fileroot={tmp_path}", f"total_train_steps={steps}", "actor.path=tiny-qwen2.5-vl",
        "scheduler.type=local", "env.type=synthetic", "env.max_steps=2", "rollout.consumer_batch_size=1",
        "gconfig.n_samples=2", "rollout.max_head_offpolicyness=0", "rollout.dynamic_sampling=true",
        f"rollout.dynamic_sampling_max_draws={draws}", "rollout.batch_timeout_s=120",
        "test_rollout.enabled=false", "stats.progress_bar=false", "stats.tensorboard=false",
        "stats.keep_episodes=2", "checkpoint.every_n_steps=0",
        # no penalty: the untrained tiny model's episodes nearly all score 0, so most groups carry no signal
        "env.invalid_action_penalty=0", "env.no_effect_penalty=0",
    ])
    run = RunDir(cfg.run_dir, keep_episodes=2, tensorboard=False)
    system = build_system(cfg, run)
    drawn, trained = [], []
    try:
        prepare, train_step = system.rollout.prepare_batch, system.trainer.train_step

        def recording_prepare(*a, **kw):  # probes on the real components, not replacements
            groups = prepare(*a, **kw)
            drawn.append(groups)
            return groups

        def recording_train(groups, *a, **kw):
            trained.append(list(groups))
            return train_step(groups, *a, **kw)

        system.rollout.prepare_batch, system.trainer.train_step = recording_prepare, recording_train
        summary = Controller(cfg, system, run).train()

        assert summary.steps == steps and len(trained) == steps
        n_drawn = sum(len(b) for b in drawn)
        n_trained = sum(len(b) for b in trained)
        assert summary.skipped_groups == n_drawn - n_trained > 0
        rows = [r for r in read_jsonl(run.root / "metrics.jsonl") if r["kind"] == "train"]
        assert sum(r["skipped_groups"] for r in rows) == summary.skipped_groups
        assert sum(r["n_groups"] for r in rows) == n_drawn  # the step figures cover every drawn group
        assert system.rollout.stats().consumed_groups == n_drawn
        for r, batch in zip(rows, trained, strict=True):
            if r["n_groups"] < draws * cfg.rollout.consumer_batch_size:
                # the step stopped drawing early, so it found a signal in every group it trained on
                assert not any(zero_advantage(g) for g in batch)
            else:
                assert len(batch) >= 1  # the cap: trained on what had a signal, or the last batch drawn
        # at eta=0 the pool admits one group per version: every draw past the first needed a skipped
        # group's budget back, or the run would have stalled into batch_timeout_s
        assert max(r["n_groups"] for r in rows) > (cfg.rollout.max_head_offpolicyness + 1)
        # skipped groups' screenshots were freed as trained ones are
        keys = sorted({k for b in drawn for g in b for t in g.trajectories for k in t.all_pixel_keys()})
        assert keys and system.pixel_store.count_missing(keys) == len(keys)
    finally:
        system.shutdown()
        run.close()


def test_dynamic_sampling_needs_a_positive_draw_cap():
    with pytest.raises(ValueError, match="dynamic_sampling_max_draws"):
        load_run_config(None, ["rollout.dynamic_sampling=true", "rollout.dynamic_sampling_max_draws=0"])
