"""Measured browser latencies for the synthetic env to replay (`asyncwebrl record-latency FILE`).

GPU boxes have no Chromium, so the web-shaped workload replays latencies measured here on real
Chromium playing real MiniWoB++ tasks: each sample is one wall-clock duration of
- `step_ms`: one action (act + settle + observation: state read and screenshot);
- `reset_ms`: one page load of a new task on a warm session (goto, task start, first observation);
- `first_reset_ms`: the first reset of a fresh session (new browser context + page + page load);
- `warmup_ms`: first_reset_ms minus the median reset_ms, the per-session warm-up a synchronous
  pool pays again every round when it relaunches its sessions;
- `browser_launch_ms`: starting Chromium itself (once per recording).
Sessions run `concurrency` at a time, as in a rollout pool, so the samples include the contention
of concurrent sessions on this machine's cores.

Invariant: a `LatencyTable` is the recorded samples themselves (no fitted distribution): the
synthetic env draws uniformly from them, so every quantile it replays was observed.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class LatencyTable:
    """Recorded latency samples in milliseconds (see module docstring)."""

    step_ms: list[float]
    reset_ms: list[float]
    first_reset_ms: list[float]
    warmup_ms: list[float]
    browser_launch_ms: float = 0.0
    source: dict[str, Any] = field(default_factory=dict)

    def validate(self, where: str = "latency table") -> None:
        for name in ("step_ms", "reset_ms", "warmup_ms"):
            vals = getattr(self, name)
            if not vals or any(not isinstance(v, int | float) or v < 0 for v in vals):
                raise ValueError(f"{where}: {name} must be a non-empty list of durations >= 0 ms")

    @classmethod
    def load(cls, path: str | Path) -> LatencyTable:
        p = Path(path)
        try:
            raw = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the latency file {p}: {e}") from None
        keys = {f for f in cls.__dataclass_fields__}
        unknown = set(raw) - keys - {"summary"}
        if unknown:
            raise ValueError(f"latency file {p}: unknown keys {sorted(unknown)}")
        try:
            table = cls(**{k: v for k, v in raw.items() if k in keys})
        except TypeError as e:
            raise ValueError(f"latency file {p}: {e}") from None
        table.validate(str(p))
        return table

    def draw(self, kind: str, rng: random.Random) -> float:
        """One recorded sample of `kind` (step, reset, warmup), in seconds."""
        return rng.choice(getattr(self, f"{kind}_ms")) / 1000.0

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for name in ("step_ms", "reset_ms", "first_reset_ms", "warmup_ms"):
            v = sorted(getattr(self, name))
            if v:
                out[name] = {"n": len(v), "median": round(statistics.median(v), 1),
                             "p90": round(v[int(0.9 * (len(v) - 1))], 1), "max": round(v[-1], 1),
                             "mean": round(statistics.fmean(v), 1)}
        return out

    def save(self, path: str | Path) -> None:
        d = asdict(self)
        d["summary"] = self.summary()
        Path(path).write_text(json.dumps(d, indent=1) + "\n")


async def record_latency(episodes: int = 48, concurrency: int = 8, tasks: str = "miniwob-easy",
                         max_steps: int = 4, episodes_per_session: int = 3, seed: int = 0) -> LatencyTable:
    """Play `episodes` MiniWoB episodes in real Chromium, `concurrency` sessions at a time."""
    from asyncwebrl.web.actions import parse_action
    from asyncwebrl.web.browser import BrowserPool
    from asyncwebrl.web.config import EnvConfig
    from asyncwebrl.web.env_factory import make_env
    from asyncwebrl.web.oracles import ORACLES, oracle_action
    from asyncwebrl.web.tasks import TaskSampler, resolve_task_names

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
                    for _ in range(max_steps):
                        if name in ORACLES:
                            text = oracle_action(task.task_id, obs)
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
    import os
    import platform

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
