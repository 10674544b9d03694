"""Scripted oracles solve their MiniWoB tasks through the normal step path (proves the reward path
and the action grammar end to end)."""

from __future__ import annotations

import asyncio

import pytest

from asyncwebrl.web.actions import parse_action
from asyncwebrl.web.base import Env, Task
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.miniwob import MiniWoBEnv
from asyncwebrl.web.oracles import ORACLES, oracle_action

pytestmark = pytest.mark.browser
SESSIONS = 4


async def run_oracle_episode(env: Env, task: Task) -> tuple[bool, int]:
    """One episode with the oracle's action text through env.step; (success, steps)."""
    obs = await env.reset(task)
    for n in range(1, max(task.max_steps, 16) + 1):
        obs, res = await env.step(parse_action(oracle_action(task.task_id, obs)))
        if res.done:
            return res.success, n
    return False, n


async def _success_rates(jobs: list[tuple[str, int]]) -> dict[str, list[bool]]:
    queue: asyncio.Queue = asyncio.Queue()
    for j in jobs:
        queue.put_nowait(j)
    results: dict[str, list[bool]] = {}

    async def worker():
        # a context serves 100 episodes here: this test is about the reward path over 1200 episodes,
        # not isolation (tests/web/test_isolation.py), and a fresh context per episode costs ~0.3-1 s
        env = MiniWoBEnv(EnvConfig(recycle_context_every=100))
        try:
            while not queue.empty():
                name, seed = queue.get_nowait()
                ok, _ = await run_oracle_episode(env, Task(f"miniwob/{name}", seed=seed))
                results.setdefault(name, []).append(ok)
        finally:
            await env.close()

    await asyncio.gather(*(worker() for _ in range(SESSIONS)))
    return results


def test_at_least_eight_oracles():
    assert len(ORACLES) >= 8


def test_oracles_solve_100_seeds_split_over_tasks(runner):
    names = sorted(ORACLES)
    jobs = [(names[i % len(names)], 1000 + i) for i in range(100)]
    results = runner.run(_success_rates(jobs), timeout=300)
    total = [ok for oks in results.values() for ok in oks]
    assert len(total) == 100
    assert sum(total) / len(total) >= 0.95, {k: sum(v) / len(v) for k, v in results.items()}


@pytest.mark.slow
def test_each_oracle_solves_100_seeds(runner):
    jobs = [(name, seed) for name in sorted(ORACLES) for seed in range(100)]
    results = runner.run(_success_rates(jobs), timeout=900)
    rates = {k: sum(v) / len(v) for k, v in results.items()}
    assert all(len(v) == 100 for v in results.values())
    assert all(r >= 0.95 for r in rates.values()), rates
