"""`asyncwebrl record-latency FILE`: record a `LatencyTable` on real Chromium playing real MiniWoB++ tasks
(what each sample measures is in `asyncwebrl.web.latency`)."""

from __future__ import annotations

import asyncio
import os
import platform
import random
import statistics
import time

from asyncwebrl.web.actions import parse_action
from asyncwebrl.web.browser import BrowserPool
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.env_factory import make_env
from asyncwebrl.web.latency import LatencyTable
from asyncwebrl.web.oracles import ORACLES, EpisodeOracle
from asyncwebrl.web.tasks import TaskSampler, resolve_task_names


async def record_latency(episodes: int = 48, concurrency: int = 8, tasks: str = "miniwob-easy",
                         max_steps: int = 4, episodes_per_session: int = 3, seed: int = 0) -> LatencyTable:
    """Play `episodes` MiniWoB episodes in real Chromium, `concurrency` sessions at a time."""
    cfg = EnvConfig(type="miniwob", tasks=tasks, max_steps=max_steps)
    sampler = TaskSampler(resolve_task_names(tasks), seed=seed, max_steps=max_steps)
    rng = random.Random(seed)
    pool = BrowserPool(cfg)
    steps: list[float] = []
    resets: list[float] = []
    firsts: list[float] = []
    t0 = time.perf_counter()
    launch_env = make_env(cfg, pool=pool)
    await launch_env.reset(sampler.next())
    launch_ms = (time.perf_counter() - t0) * 1000
    await launch_env.close()
    left = [episodes]

    async def worker() -> None:
        while left[0] > 0:
            env = make_env(cfg, pool=pool)
            try:
                for k in range(episodes_per_session):
                    if left[0] <= 0:
                        break
                    left[0] -= 1
                    task = sampler.next()
                    t = time.perf_counter()
                    obs = await env.reset(task)
                    (firsts if k == 0 else resets).append((time.perf_counter() - t) * 1000)
                    name = task.task_id.split("/", 1)[-1]
                    oracle = EpisodeOracle(task.task_id) if name in ORACLES else None  # the episode's memory
                    for _ in range(max_steps):
                        if oracle is not None:
                            text = oracle(obs)
                        else:
                            text = f"mouse_click({rng.randrange(cfg.viewport_width)}, {rng.randrange(cfg.viewport_height)})"
                        t = time.perf_counter()
                        obs, res = await env.step(parse_action(text))
                        steps.append((time.perf_counter() - t) * 1000)
                        if res.done:
                            break
            finally:
                await env.close()

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await pool.close()
    med = statistics.median(resets) if resets else 0.0
    return LatencyTable(
        step_ms=[round(x, 2) for x in steps], reset_ms=[round(x, 2) for x in resets],
        first_reset_ms=[round(x, 2) for x in firsts],
        warmup_ms=[round(max(0.0, x - med), 2) for x in firsts], browser_launch_ms=round(launch_ms, 1),
        source={"what": "real Chromium (headless shell) playing MiniWoB++ tasks", "tasks": tasks,
                "episodes": episodes, "concurrency": concurrency, "max_steps": max_steps,
                "episodes_per_session": episodes_per_session, "machine": platform.node(),
                "cores": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})


def record_latency_main(out: str, episodes: int, concurrency: int, tasks: str, seed: int) -> int:
    table = asyncio.run(record_latency(episodes, concurrency, tasks, seed=seed))
    table.save(out)
    for name, s in table.summary().items():
        print(f"{name:15s} " + "  ".join(f"{k}={v}" for k, v in s.items()))
    print(f"browser launch {table.browser_launch_ms:.0f} ms; wrote {out}; replay it with "
          f"env.type=synthetic env.synthetic_latency_file={out}")
    return 0
