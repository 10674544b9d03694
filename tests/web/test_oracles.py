"""Scripted oracles solve their MiniWoB tasks through the normal step path (proves the reward path
and the action grammar end to end); the multi-step ones (miniwob-medium and its held-out cousins)
within the steps each task needs, under ids drawn anew for every observation."""

from __future__ import annotations

import asyncio

import pytest

from asyncwebrl.web.actions import parse_action
from asyncwebrl.web.base import Env, Task
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.miniwob import MiniWoBEnv
from asyncwebrl.web.oracles import ORACLES, EpisodeOracle, oracle_action
from asyncwebrl.web.tasks import MINIWOB_MEDIUM, MINIWOB_ORACLE, resolve_task_names

pytestmark = pytest.mark.browser
SESSIONS = 4


async def run_oracle_episode(env: Env, task: Task) -> tuple[bool, int]:
    """One episode with the oracle's action text through env.step; (success, steps)."""
    oracle = EpisodeOracle(task.task_id)
    obs = await env.reset(task)
    for n in range(1, max(task.max_steps, 16) + 1):
        obs, res = await env.step(parse_action(oracle(obs)))
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


MOST_STEPS = {
    "enter-text": 2, "enter-password": 3, "login-user": 3, "click-checkboxes": 7, "click-option": 2,
    "click-button-sequence": 2, "click-collapsible": 2, "click-tab-2-easy": 1,
    "enter-text-2": 2, "click-checkboxes-transfer": 4, "click-tab-2": 3,
}
"""the most steps a solved episode may take: one per field, box, section or tab, plus the submit"""
SEEDS = 8


def test_every_multistep_task_has_an_oracle():
    held = resolve_task_names("miniwob-medium-heldout")
    assert set(MINIWOB_MEDIUM) <= set(MINIWOB_ORACLE) <= set(ORACLES)
    assert set(held) <= set(ORACLES) and not set(held) & set(MINIWOB_MEDIUM)
    assert set(MOST_STEPS) == set(MINIWOB_MEDIUM) | set(held)


def test_multistep_oracles_solve_their_tasks_under_drawn_ids(runner):
    async def go() -> dict[str, list[tuple[bool, int]]]:
        results: dict[str, list[tuple[bool, int]]] = {}

        async def session(names: list[str]) -> None:
            env = MiniWoBEnv(EnvConfig(element_ids="drawn", recycle_context_every=100))
            try:
                for name in names:
                    for seed in range(SEEDS):
                        task = Task(f"miniwob/{name}", seed=500 + seed)
                        results.setdefault(name, []).append(await run_oracle_episode(env, task))
            finally:
                await env.close()

        names = sorted(MOST_STEPS)
        await asyncio.gather(session(names[0::2]), session(names[1::2]))
        return results

    results = runner.run(go(), timeout=600)
    solved = {name: sum(ok for ok, _ in r) for name, r in results.items()}
    # one miss in SEEDS is allowed: under load an accordion may still slide when Submit is observed
    assert all(n >= SEEDS - 1 for n in solved.values()), solved
    too_long = {name: [n for ok, n in r if ok and n > MOST_STEPS[name]] for name, r in results.items()}
    assert not any(too_long.values()), too_long


def test_a_remembering_oracle_starts_over_without_its_memory(runner):
    """click-button-sequence looks the same after ONE is clicked: the episode's memory says what comes
    next, and an oracle called without one answers as at the start of an episode."""
    async def go():
        env = MiniWoBEnv(EnvConfig(element_ids="drawn"))
        try:
            obs = await env.reset(Task("miniwob/click-button-sequence", seed=3))
            memory: dict = {}
            first = oracle_action("click-button-sequence", obs, memory)
            second = oracle_action("click-button-sequence", obs, memory)
            fresh = oracle_action("click-button-sequence", obs)
            return obs, first, second, fresh
        finally:
            await env.close()

    obs, first, second, fresh = runner.run(go())
    name_of = {f"click [{e['id']}]": e["name"] for e in obs.elements}
    assert (name_of[first], name_of[second], name_of[fresh]) == ("ONE", "TWO", "ONE")
