"""The controller over Ray worker actors: global admission across workers, a worker dying mid-run."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray")

import rollout_sim  # noqa: E402
from ray import cloudpickle  # noqa: E402

from asyncwebrl.rollout.config import RolloutConfig  # noqa: E402
from asyncwebrl.rollout.controller import make_rollout_controller  # noqa: E402
from asyncwebrl.rollout.hosts import RolloutSpec  # noqa: E402

pytestmark = pytest.mark.slow
cloudpickle.register_pickle_by_value(rollout_sim)  # Ray workers do not have tests/ on their path


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def ray_spec() -> RolloutSpec:
    return RolloutSpec(
        make_workflow=lambda i, gate: rollout_sim.SimWorkflow(gate, rollout_sim.Tracker(), 2, i, 0.1, 0.01, 3),
        make_tasks=lambda i: rollout_sim.CountingTasks(i),
    )


def test_ray_workers_share_admission_and_survive_a_dead_worker(ray_session):
    cfg = RolloutConfig(consumer_batch_size=2, max_concurrent_rollouts=4, max_head_offpolicyness=1, workers=2)
    ctl = make_rollout_controller(ray_spec(), cfg, "ray", cpus_per_worker=0.1).start()
    seen: set[str] = set()
    try:
        def train(steps: int) -> None:
            for _ in range(steps):
                v = ctl.version
                batch = ctl.prepare_batch(timeout_s=60)
                for g in batch:
                    assert g.head_version >= v - 1
                    assert g.group_id not in seen
                    seen.add(g.group_id)
                ctl.update_weights(lambda: None)

        train(3)
        adm = ctl.stats().admission
        assert adm.running <= 4
        assert adm.enqueued == adm.accepted + adm.rejected + adm.running
        workers = {w.name for w in ctl.stats().workers}
        assert workers == {"rollout-worker0", "rollout-worker1"}

        ray.kill(ctl.hosts[0].handle, no_restart=True)  # a rollout worker process dies
        t0 = time.monotonic()
        train(3)  # the other worker carries on; the trainer does not hang
        assert time.monotonic() - t0 < 60
        st = ctl.stats()
        assert st.dead_workers == 1
        adm = st.admission
        assert adm.enqueued == adm.accepted + adm.rejected + adm.running
        assert adm.running <= 2  # only the surviving worker's slots can be running
    finally:
        ctl.shutdown()
