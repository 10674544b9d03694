"""The synchronous baseline: rounds of fresh sessions, exactly B on-policy groups per round."""

from __future__ import annotations

import asyncio

import pytest
from rollout_sim import Tracker, sim_spec

from asyncwebrl.rollout.config import RolloutConfig
from asyncwebrl.rollout.controller import make_rollout_controller
from asyncwebrl.rollout.sync_pool import SyncRolloutPool


def test_rounds_return_b_on_policy_groups_and_nothing_runs_between_rounds():
    cfg = RolloutConfig(mode="sync", consumer_batch_size=3)
    tr = Tracker()
    pool = make_rollout_controller(sim_spec(tr, fail_p=0.25, seed=3), cfg, "local")
    assert isinstance(pool, SyncRolloutPool)
    pool.start()
    try:
        seen = set()
        for step in range(4):
            batch = pool.prepare_batch()
            assert len(batch) == 3
            assert all(s.versions == [step] for g in batch for t in g.trajectories for s in t.steps)
            assert not seen & {g.group_id for g in batch}
            seen |= {g.group_id for g in batch}
            assert tr.running == 0  # the round is over: no session keeps working while the trainer trains
            pool.update_weights(lambda: None)
        st = pool.stats()
        assert st.rounds == 4 and st.consumed_groups == 12
        assert st.failed_rollouts == tr.failed  # failed groups were counted and re-run
    finally:
        pool.shutdown()


class Session:
    """Counts how often a session (environment) is created and closed."""

    made = 0
    closed = 0

    def __init__(self):
        Session.made += 1

    async def close(self):
        Session.closed += 1


@pytest.mark.parametrize("warmup", [True, False])
def test_sync_warmup_relaunches_sessions_every_round(warmup):
    from asyncwebrl.records import StepSample, Trajectory, new_id
    from asyncwebrl.rollout.hosts import RolloutSpec
    from asyncwebrl.rollout.workflow import EpisodeGroupWorkflow

    async def episode(env, task, client, adapter, store, sampling, env_cfg, version, transport):
        await asyncio.sleep(0.01)  # the episodes of a round overlap: each needs its own session
        step = StepSample(prompt_ids=[1], output_ids=[2], behave_logprobs=[-1.0], versions=[version()])
        return Trajectory(traj_id=new_id(), task_id=task.group_key, steps=[step], reward=1.0)

    from rollout_sim import CountingTasks

    spec = RolloutSpec(
        make_workflow=lambda i, gate: EpisodeGroupWorkflow(Session, None, None, None, {}, None, 2, gate=gate,
                                                           episode_fn=episode),
        make_tasks=lambda i: CountingTasks(i),
    )
    Session.made = Session.closed = 0
    pool = SyncRolloutPool(spec, RolloutConfig(mode="sync", consumer_batch_size=2, sync_warmup=warmup)).start()
    for _ in range(3):
        pool.prepare_batch()
    pool.shutdown()
    # 2 groups x 2 episodes = 4 sessions per round
    assert Session.made == (12 if warmup else 4)
    assert Session.closed == Session.made
