"""End to end on the real path: synthetic env -> the shared episode loop -> the embedded inference
server (the tiny Qwen2.5-VL test model: this test is about the rollout path, and the 2 shared cores
cannot afford the default model here) -> executor -> controller -> batches; a weight update through the server's
/update_weights_from_disk inside the production refresh bracket (gate and servers paused); pixels in the PixelStore, freed by the consumer."""

from __future__ import annotations

import asyncio
import random

import pytest

from asyncwebrl.pixelstore.store import InProcessPixelStore
from asyncwebrl.rollout.config import RolloutConfig
from asyncwebrl.rollout.controller import RolloutController
from asyncwebrl.rollout.workflow import EpisodeRolloutSpec
from asyncwebrl.web.base import Task
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.synthetic import SyntheticProfile, SyntheticWebEnv

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_path():
    from asyncwebrl.models.prepare import resolve_model_path

    return resolve_model_path("tiny-qwen2.5-vl")


@pytest.fixture(scope="module")
def server(model_path):
    from asyncwebrl.inference.engine import HFEngine
    from asyncwebrl.inference.server import ServerPolicy, launch_in_thread

    engine = HFEngine(model_path, max_batch_size=8)
    engine.start()
    srv = launch_in_thread(engine, policy=ServerPolicy(weight_roots=[model_path]))
    yield srv
    srv.stop()
    engine.stop()


def g_keys(group) -> list[str]:
    return [k for t in group.trajectories for k in t.all_pixel_keys()]


class Tasks:
    def __init__(self, index: int):
        self.rng = random.Random(index)

    def next(self) -> Task:
        return Task("synthetic/e2e", seed=self.rng.randrange(10**6), max_steps=2)


def test_controller_runs_real_episodes_and_updates_weights(server, model_path):
    from asyncwebrl.inference.client import InferenceClient

    env_cfg = EnvConfig(type="synthetic", synthetic_step_latency_ms=5.0, max_steps=2)
    from asyncwebrl.weights.bracket import RefreshBracket
    from asyncwebrl.weights.control import ControlChannel

    store = InProcessPixelStore("e2e", 64 * 2**20, 30.0)
    spec = EpisodeRolloutSpec(
        env_cfg=env_cfg, model_path=model_path,
        client_factory=lambda: InferenceClient([server.address], api_key=server.api_key, timeout_s=120),
        store=store, sampling={"max_new_tokens": 4, "temperature": 1.0}, n_samples=2, task_factory=Tasks,
        env_factory=lambda cfg: SyntheticWebEnv(cfg, SyntheticProfile()),
    )
    cfg = RolloutConfig(consumer_batch_size=1, max_concurrent_rollouts=2, max_head_offpolicyness=1)
    ctl = RolloutController.local(spec, cfg, batch_timeout_s=300,
                                  on_drop_group=lambda g: store.free(g_keys(g))).start()
    control = ControlChannel([server.address], api_key=server.api_key, timeout_s=300)
    bracket = RefreshBracket(ctl, control)  # the trainer loop's bracket: gate and servers paused
    updater = InferenceClient([server.address], api_key=server.api_key, timeout_s=300)
    try:
        for _ in range(2):
            v = ctl.version
            (group,) = ctl.prepare_batch()
            assert len(group.trajectories) == 2 and group.task_id.startswith("synthetic/e2e#")
            assert len({t.task_id for t in group.trajectories}) == 1  # one GRPO group = one task
            for t in group.trajectories:
                assert not t.failed, t.info
                assert 1 <= len(t.steps) <= 2
                for s in t.steps:
                    assert s.output_ids and len(s.output_ids) == len(s.behave_logprobs) == len(s.versions)
                    assert s.pixels is None and s.pixel_keys  # keys only, pixels in the store
                    assert all(x >= v - 1 for x in s.versions)
            keys = g_keys(group)
            assert store.count_missing(keys) == 0
            assert all(b.startswith(b"\x89PNG") for b in store.get(keys))
            store.free(keys)  # the trainer consumed them
            def transfer(target=v + 1):
                assert server.engine.paused  # the servers stop generating for the copy
                asyncio.run(updater.aupdate_weights_from_disk(model_path, target))

            bracket.refresh(transfer)
            assert server.engine.weight_version == str(v + 1) and not server.engine.paused
        st = ctl.stats()
        assert st.consumed_groups == 2 and st.failed_rollouts == 0
    finally:
        ctl.shutdown()
        control.close()
        asyncio.run(updater.aclose())
