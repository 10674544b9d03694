"""RolloutController invariants (SPEC section 4) with simulated timing, property-based.

The trainer loop here is the real call sequence: prepare_batch -> (train) -> update_weights(fn).
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_sim import Tracker, sim_spec

from asyncwebrl.rollout.config import RolloutConfig
from asyncwebrl.rollout.controller import RolloutController, RolloutUnavailable, make_rollout_controller


def run_training(cfg: RolloutConfig, tracker: Tracker, steps: int, fail_p: float, train_s: float, seed: int):
    dropped_groups = []
    ctl = RolloutController.local(sim_spec(tracker, fail_p=fail_p, seed=seed), cfg,
                                  on_drop_group=dropped_groups.append, batch_timeout_s=30)
    ctl.start()
    consumed = []
    starts_during_update = []
    try:
        for step in range(steps):
            v = ctl.version
            batch = ctl.prepare_batch()
            assert len(batch) == cfg.consumer_batch_size
            for g in batch:
                # consumed at version v: the head may lag by at most eta versions
                assert g.head_version >= v - cfg.max_head_offpolicyness, (g.head_version, v)
                assert g.head_version <= v
                if cfg.max_head_offpolicyness == 0:
                    assert all(s.versions == [v] for t in g.trajectories for s in t.steps)
            consumed.extend(batch)
            time.sleep(train_s)

            def transfer():
                n = tracker.generation_starts
                time.sleep(0.01)
                starts_during_update.append(tracker.generation_starts - n)

            ctl.update_weights(transfer)
            assert ctl.version == step + 1
    finally:
        stats = ctl.stats()
        ctl.shutdown()
    leftover = []
    for h in ctl.hosts:
        leftover.extend(h.fetch(10_000, 0.0))
    leftover.extend(ctl._pending.queue)
    return consumed, dropped_groups, leftover, stats, starts_during_update


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 4),
    c_extra=st.integers(0, 6),
    eta=st.integers(0, 2),
    workers=st.integers(1, 2),
    fail_p=st.sampled_from([0.0, 0.2]),
    seed=st.integers(0, 1000),
)
def test_no_stale_no_overrun_no_loss_no_duplicate(b, c_extra, eta, workers, fail_p, seed):
    cfg = RolloutConfig(consumer_batch_size=b, max_concurrent_rollouts=b + c_extra, max_head_offpolicyness=eta,
                        workers=workers)
    tr = Tracker()
    consumed, dropped, leftover, stats, during = run_training(cfg, tr, steps=4, fail_p=fail_p, train_s=0.01, seed=seed)
    # never more than C rollouts running at once, across all workers
    assert tr.max_running <= cfg.concurrency
    # no group duplicated; every emitted group is consumed, dropped (counted) or still pending
    ids = [g.group_id for g in consumed + dropped + leftover]
    assert len(ids) == len(set(ids))
    assert set(ids) == set(tr.emitted)
    assert stats.dropped_stale == len(dropped)
    # the weight-update bracket: no generation request started between pause and resume
    assert during == [0] * 4
    if eta == 0:
        assert stats.staleness_hist == {0: 4 * b}


def test_prepare_batch_times_out_with_a_clear_error_when_rollouts_all_fail():
    cfg = RolloutConfig(consumer_batch_size=2, max_head_offpolicyness=1)
    ctl = RolloutController.local(sim_spec(Tracker(), fail_p=1.0), cfg).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(RolloutUnavailable, match="0 of 2 groups"):
            ctl.prepare_batch(timeout_s=0.5)
        assert time.monotonic() - t0 < 5
        assert ctl.stats().failed_rollouts > 0
    finally:
        ctl.shutdown()


def test_failed_weight_transfer_keeps_version_and_resumes():
    cfg = RolloutConfig(consumer_batch_size=2, max_head_offpolicyness=1)
    tr = Tracker()
    ctl = RolloutController.local(sim_spec(tr), cfg).start()
    try:
        ctl.prepare_batch()

        def broken():
            raise ConnectionError("trainer died mid-broadcast")

        with pytest.raises(ConnectionError):
            ctl.update_weights(broken)
        assert ctl.version == 0
        n = tr.generation_starts
        ctl.update_weights(lambda: None)
        ctl.prepare_batch()
        assert tr.generation_starts > n  # resumed
    finally:
        ctl.shutdown()


def test_async_pool_keeps_rolling_while_the_trainer_trains():
    """The point of the everlasting pool: while the trainer is busy, rollouts for the next steps finish."""
    cfg = RolloutConfig(consumer_batch_size=2, max_concurrent_rollouts=4, max_head_offpolicyness=2)
    tr = Tracker()
    ctl = make_rollout_controller(sim_spec(tr), cfg, "local").start()
    try:
        ctl.prepare_batch()
        time.sleep(0.3)  # "training"
        st = ctl.stats()
        assert st.pending_groups >= 2  # the next batch is already waiting
        t0 = time.monotonic()
        ctl.prepare_batch()
        assert time.monotonic() - t0 < 0.05
    finally:
        ctl.shutdown()


def test_stale_groups_are_dropped_counted_and_replaced():
    cfg = RolloutConfig(consumer_batch_size=2, max_concurrent_rollouts=2, max_head_offpolicyness=1)
    tr = Tracker()
    dropped = []
    ctl = RolloutController.local(sim_spec(tr), cfg, on_drop_group=dropped.append).start()
    try:
        t0 = time.monotonic()
        while ctl.stats().pending_groups < 2 and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        for _ in range(3):  # everything made at version 0 is now 3 versions old (> eta = 1)
            ctl.update_weights(lambda: None)
        batch = ctl.prepare_batch(timeout_s=10)
        assert all(g.head_version >= 2 for g in batch)
        assert len(dropped) >= 2 and ctl.stats().dropped_stale == len(dropped)
    finally:
        ctl.shutdown()
