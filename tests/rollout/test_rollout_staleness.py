"""StalenessManager: the SPEC section 4 admission rule under arbitrary interleavings."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncwebrl.rollout.staleness import StalenessManager


@settings(max_examples=200, deadline=None)
@given(
    b=st.integers(1, 6),
    c=st.integers(1, 12),
    eta=st.integers(0, 3),
    ops=st.lists(st.sampled_from(["submit", "accept", "reject", "bump", "consume"]), max_size=200),
)
def test_admission_never_exceeds_concurrency_or_staleness_budget(b, c, eta, ops):
    m = StalenessManager(b, c, eta)
    consumed = 0
    for op in ops:
        if op == "submit":
            before = m.capacity()
            ok = m.try_submit()
            assert ok == (before > 0)
        elif op == "accept" and m.running:
            m.on_accept()
        elif op == "reject" and m.running:
            m.on_reject()
        elif op == "consume" and m.accepted - consumed >= b:
            consumed += b
        elif op == "bump" and consumed >= (m.version + 1) * b:
            m.set_version(m.version + 1)  # the trainer steps only after consuming a batch
        assert m.running <= c
        assert m.accepted + m.running <= (eta + m.version + 1) * b
        assert m.enqueued == m.accepted + m.rejected + m.running


def test_capacity_formula_and_reseed():
    m = StalenessManager(consumer_batch_size=4, max_concurrent_rollouts=16, max_head_offpolicyness=1)
    assert m.capacity(0) == 8  # (1 + 0 + 1) * 4 - 0
    for _ in range(8):
        assert m.try_submit()
    assert not m.try_submit()  # the staleness budget, not concurrency, is the limit here
    for _ in range(8):
        m.on_accept()
    assert m.capacity(0) == 0 and m.capacity(1) == 4
    m.reseed(10)
    assert m.accepted == 40 and m.running == 0 and m.capacity() == 8


def test_drop_hands_the_budget_back():
    m = StalenessManager(2, 4, 0)
    assert m.try_submit() and m.try_submit() and not m.try_submit()
    m.on_accept()
    m.on_accept()
    assert m.capacity() == 0
    m.on_drop()
    assert m.capacity() == 1 and m.rejected == 1


def test_double_completion_and_bad_config_raise():
    m = StalenessManager(1, 1, 0)
    with pytest.raises(RuntimeError, match="double completion"):
        m.on_accept()
    with pytest.raises(ValueError):
        StalenessManager(0, 1, 0)
    with pytest.raises(ValueError):
        m.set_version(-1)


def test_try_submit_is_atomic_across_threads():
    m = StalenessManager(consumer_batch_size=50, max_concurrent_rollouts=37, max_head_offpolicyness=5)
    granted = []

    def grab():
        n = 0
        for _ in range(200):
            n += m.try_submit()
        granted.append(n)

    ts = [threading.Thread(target=grab) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sum(granted) == 37 == m.running
