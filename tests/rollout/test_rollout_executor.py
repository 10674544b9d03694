"""WorkflowExecutor: everlasting slots, pause gate, failure counting, clean shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from rollout_sim import CountingTasks, SimWorkflow, Tracker

from asyncwebrl.rollout.executor import WorkflowExecutor
from asyncwebrl.rollout.gate import GatedClient, ResumeGate
from asyncwebrl.rollout.staleness import StalenessManager


def _wait_for(cond, timeout=60.0):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


def _loop_turned(ex):
    """Return once the executor's event loop has run everything scheduled before this call."""
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), ex._loop).result(timeout=30)


def make(tracker, slots=4, fail_p=0.0, b=4, eta=100):
    gate = ResumeGate()
    wf = SimWorkflow(gate, tracker, n_samples=2, seed=1, fail_p=fail_p, step_s=0.004, max_steps=3)
    adm = StalenessManager(b, slots, eta)
    return WorkflowExecutor(wf, CountingTasks(), adm, slots, gate=gate, name="t"), adm


def test_slots_run_back_to_back_and_respect_concurrency():
    tr = Tracker()
    ex, adm = make(tr, slots=3)
    threads_before = threading.active_count()
    ex.start()
    _wait_for(lambda: ex.completed >= 30)
    ex.shutdown()
    st = ex.stats()
    assert tr.max_running <= 3
    assert st.completed >= 30 and st.failed == 0
    got = ex.get_results()
    assert len(got) == st.completed and len({g.group_id for g in got}) == len(got)
    # exactly-once bookkeeping: admitted = completed + failed + cancelled, and admission agrees
    assert st.admitted == st.completed + st.failed + st.cancelled
    assert adm.accepted == st.completed and adm.running == 0
    assert threading.active_count() <= threads_before  # the loop thread is gone


def test_failures_are_counted_and_slots_go_on():
    tr = Tracker()
    ex, adm = make(tr, slots=2, fail_p=0.4)
    ex.start()
    _wait_for(lambda: ex.completed >= 15)
    ex.shutdown()
    st = ex.stats()
    assert st.failed > 0 and st.failed == tr.failed
    assert st.admitted == st.completed + st.failed + st.cancelled
    assert adm.rejected == st.failed + st.cancelled
    assert "simulated episode crash" in (ex.last_error or "")


def test_pause_blocks_new_generation_and_resume_continues():
    tr = Tracker()
    ex, _ = make(tr, slots=4)
    ex.start()
    _wait_for(lambda: tr.generation_starts > 10)
    ex.pause()
    _loop_turned(ex)  # a step that passed the gate before pause() has counted itself by now
    n = tr.generation_starts
    for _ in range(20):  # twenty turns of the slots' loop, each long enough for every slot to ask again
        _loop_turned(ex)
        time.sleep(0.01)
    assert tr.generation_starts == n, "a generation request started while paused"
    ex.resume()
    _wait_for(lambda: tr.generation_starts > n + 5)
    ex.shutdown()


def test_admission_limits_output_until_version_moves():
    tr = Tracker()
    ex, adm = make(tr, slots=8, b=2, eta=0)
    ex.start()
    _wait_for(lambda: ex.completed >= 2)
    time.sleep(0.1)
    assert ex.completed == 2 and ex.admitted == 2  # (eta + v + 1) * B = 2 at version 0
    adm.set_version(1)
    ex.set_version(1)
    _wait_for(lambda: ex.completed >= 4)
    time.sleep(0.05)
    ex.shutdown()
    groups = ex.get_results()
    assert [g.head_version for g in groups] == [0, 0, 1, 1]


def test_gate_wait_returns_after_resume_from_another_thread():
    gate = ResumeGate()
    gate.pause()

    class Client:
        async def agenerate(self, x):
            return x * 2

    client = GatedClient(Client(), gate)

    async def main():
        task = asyncio.create_task(client.agenerate(21))
        await asyncio.sleep(0.05)
        assert not task.done()
        threading.Timer(0.05, gate.resume).start()
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(main()) == 42


def test_bad_workflow_output_is_a_counted_failure():
    adm = StalenessManager(1, 1, 10)

    async def wf(task, version):
        return "not a group"

    ex = WorkflowExecutor(wf, CountingTasks(), adm, 1, name="bad")
    ex.start()
    _wait_for(lambda: ex.failed >= 2)
    ex.shutdown()
    assert "expected RolloutGroup" in ex.last_error
    with pytest.raises(ValueError):
        WorkflowExecutor(wf, CountingTasks(), adm, 0)
