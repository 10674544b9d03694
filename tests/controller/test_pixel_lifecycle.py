"""PixelStore lifecycle through the production path: controller -> trainer rank -> train_step.

Every screenshot a consumed batch referenced is gone from the store once its step returned, and the
store holds only the in-flight working set between steps (a store that is never freed fills up)."""

import pytest

from asyncwebrl.config import load_run_config
from asyncwebrl.controller.main import Controller
from asyncwebrl.controller.rundir import RunDir
from asyncwebrl.controller.system import build_system

pytestmark = pytest.mark.slow


def _cfg(tmp_path, steps: int, extra: list[str] = ()):
    return load_run_config(None, [
        f"cluster.fileroot={tmp_path}", f"total_train_steps={steps}", "actor.path=tiny-qwen2.5-vl",
        "scheduler.type=local", "env.type=synthetic", "env.max_steps=2", "env.history_k=2",
        "rollout.consumer_batch_size=2", "gconfig.n_samples=2", "test_rollout.enabled=false",
        "stats.progress_bar=false", "stats.tensorboard=false", "stats.keep_episodes=2",
        "checkpoint.every_n_steps=0", "pixelstore.capacity_mb=1", *extra,
    ])


def test_trainer_rank_frees_every_reference_of_a_consumed_batch(tmp_path):
    steps = 4
    cfg = _cfg(tmp_path, steps)
    run = RunDir(cfg.run_dir, keep_episodes=2, tensorboard=False)
    system = build_system(cfg, run)
    consumed, held_after_step = [], []
    try:
        store = system.pixel_store
        prepare = system.rollout.prepare_batch

        def recording_prepare(*a, **kw):  # a probe on the real rollout controller, not a replacement
            groups = prepare(*a, **kw)
            consumed.append([k for g in groups for t in g.trajectories for k in t.all_pixel_keys()])
            return groups

        system.rollout.prepare_batch = recording_prepare
        ctl = Controller(cfg, system, run)
        ctl.step_hooks.append(lambda c: c.state.step and held_after_step.append(store.stats()["bytes"]))
        summary = ctl.train()
        assert summary.steps == steps
        stats = store.stats()
        keys = {k for batch in consumed for k in batch}
        # history_k=2: a screenshot shared by two steps' windows is two references, both freed
        assert any(len(b) > len(set(b)) for b in consumed), "the run never reused a screenshot in a window"
        assert keys and store.count_missing(sorted(keys)) == len(keys)
        assert stats["missing"] == 0  # nothing was freed before the trainer read it
        # between steps the store holds only episodes still in flight: far less than went through it
        assert stats["bytes_put"] > 0 and max(held_after_step) < stats["bytes_put"] / 2
    finally:
        system.shutdown()
        run.close()
