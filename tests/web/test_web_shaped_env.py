"""The web-shaped synthetic workload: heavy-tailed episode lengths (median ~4, p95 >= 20, cap 30) that
an episode really lasts, and latencies replayed from a file measured on real Chromium."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

import pytest

from asyncwebrl.web.base import Task
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.latency import LatencyTable
from asyncwebrl.web.synthetic import SyntheticWebEnv

RECORDED = Path(__file__).resolve().parents[2] / "bench" / "data" / "web_latency.json"


def _cfg(**kw) -> EnvConfig:
    return EnvConfig(type="synthetic", synthetic_step_latency_ms=0.0, synthetic_length_median=4, max_steps=30, **kw)


def test_episode_lengths_are_heavy_tailed_and_capped():
    env = SyntheticWebEnv(_cfg())
    lens = sorted(env.episode_shape(Task(f"synthetic/t{i % 7}", seed=i, max_steps=30))[1] for i in range(3000))
    assert 3 <= statistics.median(lens) <= 5
    assert lens[int(0.95 * len(lens))] >= 20
    assert max(lens) == 30 and min(lens) >= 1


def test_an_episode_lasts_its_drawn_length_and_succeeds_only_if_every_step_progressed():
    async def play(task, good):
        env = SyntheticWebEnv(_cfg())
        obs = await env.reset(task)
        n = 0
        while True:
            act = env.oracle_action() if good else {"type": "click", "element": -1}
            obs, res = await env.step(act)
            n += 1
            if res.done:
                return n, res.success, env.episode_shape(task)[1]

    task = Task("synthetic/x", seed=11, max_steps=30)
    n, ok, length = asyncio.run(play(task, good=True))
    assert n == length and ok
    n, ok, length = asyncio.run(play(task, good=False))
    assert n == length and not ok


def test_latencies_are_replayed_from_the_file_and_warm_up_only_on_a_fresh_env(tmp_path):
    f = tmp_path / "lat.json"
    # a warm-up an order of magnitude above the other delays: a loaded machine's scheduling noise
    # (tens of ms) cannot make a warm reset look like a fresh one, or the reverse
    LatencyTable(step_ms=[30.0], reset_ms=[20.0], first_reset_ms=[1020.0], warmup_ms=[1000.0]).save(f)
    env = SyntheticWebEnv(_cfg(synthetic_latency_file=str(f)))

    async def timed(coro):
        t = time.perf_counter()
        await coro
        return time.perf_counter() - t

    task = Task("synthetic/x", seed=1, max_steps=30)
    first = asyncio.run(timed(env.reset(task)))
    step = asyncio.run(timed(env.step({"type": "click", "element": -1})))
    second = asyncio.run(timed(env.reset(task)))
    assert first >= 1.02 and step >= 0.03 and second >= 0.02  # every replayed delay is slept in full
    assert second < first - 0.5 and step < first - 0.5  # the warm-up is paid by the fresh env only


def test_a_bad_latency_file_is_a_clear_error(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"step_ms": [], "reset_ms": [1], "first_reset_ms": [1], "warmup_ms": [1]}))
    with pytest.raises(ValueError, match="step_ms must be a non-empty list"):
        _cfg(synthetic_latency_file=str(f)).validate()
    with pytest.raises(ValueError, match="cannot read the latency file"):
        _cfg(synthetic_latency_file=str(tmp_path / "missing.json")).validate()


def test_the_recorded_chromium_latencies_load():
    table = LatencyTable.load(RECORDED)
    s = table.summary()
    assert s["step_ms"]["n"] >= 20 and s["reset_ms"]["n"] >= 10 and s["warmup_ms"]["n"] >= 5
    assert table.source["what"].startswith("real Chromium")
