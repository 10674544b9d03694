"""`asyncwebrl bench env`: environment steps/s (screenshot + action + reward) of our MiniWoB env
at 1/8/32 concurrent sessions, against a raw Playwright loop doing the same work, in one run and on
the same browser process; plus peak memory (PSS) per session.

Both sides click a checkbox of click-checkboxes (a click that does not end the episode), read the
reward globals and take a viewport screenshot each step, and restart the episode every
`reset_every` steps. Ours additionally extracts the element list (it is what the agent reads) and
goes through the navigation policy, the invalid-action checks and the StepResult bookkeeping.
Per level and repeat: raw alone, ours alone (absolute steps/s; order alternates between repeats),
then raw and ours PAIRED - n sessions of each stepping in the same window on the same browser, so
load from other processes on a shared machine hits both sides alike.

Headline: overhead = 1 - ours/raw steps/s of the paired runs (mean over levels; target < 10%);
`overhead_alone` is the same ratio from the separate runs (noisier on a shared machine).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import psutil

from asyncwebrl.bench.common import parse_overrides, print_table
from asyncwebrl.results import write_result
from asyncwebrl.web.base import Task
from asyncwebrl.web.browser import BrowserPool
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.miniwob import _START_JS, MiniWoBEnv, miniwob_server
from asyncwebrl.web.observe import take_screenshot

DEFAULTS: dict[str, Any] = {
    "sessions": [1, 8, 32],
    "duration_s": 5.0,
    "repeats": 2,
    # each repeat = raw alone, ours alone, raw+ours paired
    "task": "click-checkboxes",
    "reset_every": 10,
}

_BOXES_JS = """() => Array.from(document.querySelectorAll('#boxes input')).map(e => {
  const r = e.getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2]; })"""
_REWARD_JS = "() => [WOB_DONE_GLOBAL, WOB_REWARD_GLOBAL, WOB_RAW_REWARD_GLOBAL]"


class PssSampler:
    """Peak PSS of the browser's process tree, sampled on a thread."""

    def __init__(self, pid: int, every_s: float = 0.25):
        self.pid, self.every_s = pid, every_s
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        total = 0
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        for p in procs:
            try:
                total += p.memory_full_info().pss
            except psutil.Error:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.sample())
            self._stop.wait(self.every_s)

    def __enter__(self) -> PssSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join(5)


class StartLine:
    """All sessions finish warming up (context, page load), then the measured window opens at once."""

    def __init__(self, n: int, duration_s: float):
        self.n, self.duration_s = n, duration_s
        self.ready = 0
        self.go = asyncio.Event()
        self.deadline = float("inf")

    async def wait(self) -> None:
        self.ready += 1
        if self.ready == self.n:
            self.deadline = time.monotonic() + self.duration_s
            self.go.set()
        await asyncio.wait_for(self.go.wait(), timeout=300)


async def _raw_session(browser, url: str, cfg: EnvConfig, line: StartLine, reset_every: int, seed: int) -> int:
    # raw Playwright: no network fence (the browser-wide proxy of a pool refuses everything, so the
    # baseline context bypasses any proxy for every host)
    ctx = await browser.new_context(viewport={"width": cfg.viewport_width, "height": cfg.viewport_height},
                                    proxy={"server": "http://127.0.0.1:9", "bypass": "*"})
    page = await ctx.new_page()
    steps = 0
    try:
        await page.goto(url, wait_until="load")
        await line.wait()
        ep = 0
        while time.monotonic() < line.deadline:
            await page.evaluate(_START_JS, [seed * 1000 + ep, int(cfg.episode_time_limit_s * 1000)])
            boxes = await page.evaluate(_BOXES_JS)
            await take_screenshot(page)
            ep += 1
            for i in range(reset_every):
                if time.monotonic() >= line.deadline:
                    break
                x, y = boxes[i % len(boxes)]
                await page.mouse.click(x, y)
                await page.evaluate(_REWARD_JS)
                await take_screenshot(page)
                steps += 1
    finally:
        await ctx.close()
    return steps


async def _our_session(pool: BrowserPool, task: str, cfg: EnvConfig, line: StartLine, reset_every: int,
                       seed: int) -> int:
    env = MiniWoBEnv(cfg, pool=pool)
    steps = 0
    try:
        await env.reset(Task(f"miniwob/{task}", seed=seed * 1000 - 1))  # context + page load: warm-up
        await line.wait()
        ep = 0
        while time.monotonic() < line.deadline:
            obs = await env.reset(Task(f"miniwob/{task}", seed=seed * 1000 + ep))
            boxes = [e["id"] for e in obs.elements if e["role"] == "checkbox"]
            ep += 1
            for i in range(reset_every):
                if time.monotonic() >= line.deadline:
                    break
                _, res = await env.step({"type": "click", "element": boxes[i % len(boxes)]})
                if res.invalid:
                    raise RuntimeError(f"benchmark action was invalid: {res.info}")
                steps += 1
                if res.done:  # a page may end its episode early (a time limit, a solved task): next episode
                    break
    finally:
        await env.close()
    return steps


async def _phase(kinds: list[str], n: int, pool: BrowserPool, knobs: dict[str, Any],
                 cfg: EnvConfig) -> tuple[dict[str, float], int]:
    """n sessions of each kind in `kinds`, all stepping in the same window; steps/s per kind, peak PSS."""
    url = f"{miniwob_server().origin}/miniwob/{knobs['task']}.html"
    # warm-up (context creation, first page load) is not stepped time: the clock starts when all are ready
    line = StartLine(n * len(kinds), float(knobs["duration_s"]))
    coros = []
    for kind in kinds:
        for s in range(n):
            if kind == "raw":
                coros.append(_raw_session(pool._browser, url, cfg, line, knobs["reset_every"], s))
            else:
                coros.append(_our_session(pool, knobs["task"], cfg, line, knobs["reset_every"], s))
    with PssSampler(pool.browser_pid()) as pss:
        counts = await asyncio.gather(*coros)
    rates = {k: sum(counts[i * n:(i + 1) * n]) / float(knobs["duration_s"]) for i, k in enumerate(kinds)}
    return rates, pss.peak


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


async def _run(knobs: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    cfg = EnvConfig(recycle_context_every=10**9)
    pool = BrowserPool(cfg)
    rows: list[dict[str, Any]] = []
    figures: dict[str, Any] = {"levels": {}}
    try:
        warm = MiniWoBEnv(cfg, pool=pool)  # launches the browser and the page server
        await warm.reset(Task(f"miniwob/{knobs['task']}", seed=0))
        await warm.close()
        await asyncio.sleep(0.5)
        baseline = PssSampler(pool.browser_pid()).sample()
        figures["browser_pss_mb_idle"] = round(baseline / 2**20, 1)
        overheads, alt_overheads = [], []
        for n in knobs["sessions"]:
            alone: dict[str, list[float]] = {"raw": [], "ours": []}
            paired: dict[str, list[float]] = {"raw": [], "ours": []}
            pss_ours = 0
            for rep in range(int(knobs["repeats"])):
                for kind in (["raw", "ours"] if rep % 2 == 0 else ["ours", "raw"]):
                    rates, peak = await _phase([kind], n, pool, knobs, cfg)
                    alone[kind].append(rates[kind])
                    if kind == "ours":
                        pss_ours = max(pss_ours, peak)
                rates, _ = await _phase(["raw", "ours"], n, pool, knobs, cfg)
                for k in rates:
                    paired[k].append(rates[k])
            raw, ours = _mean(alone["raw"]), _mean(alone["ours"])
            overhead = 1.0 - _mean(paired["ours"]) / _mean(paired["raw"])
            overheads.append(overhead)
            alt_overheads.append(1.0 - ours / raw)
            per_session = (pss_ours - baseline) / n / 2**20
            rows.append({"sessions": n, "raw_steps_s": round(raw, 1), "ours_steps_s": round(ours, 1),
                         "overhead_alone": round(alt_overheads[-1], 3), "overhead_paired": round(overhead, 3),
                         "pss_mb_per_session": round(per_session, 1), "pss_mb_peak": round(pss_ours / 2**20, 1)})
            figures["levels"][str(n)] = {**rows[-1], "paired_raw_steps_s": round(_mean(paired["raw"]), 1),
                                         "paired_ours_steps_s": round(_mean(paired["ours"]), 1)}
        figures["overhead"] = round(_mean(overheads), 4)
        figures["overhead_max"] = round(max(overheads), 4)
        figures["overhead_alone"] = round(_mean(alt_overheads), 4)
        figures["pss_mb_per_session"] = rows[-1]["pss_mb_per_session"]
        figures["steps_s_ours_max"] = max(r["ours_steps_s"] for r in rows)
    finally:
        await pool.close()
    return rows, figures


def main(overrides: list[str]) -> int:
    knobs = parse_overrides(overrides, DEFAULTS)
    if isinstance(knobs["sessions"], int):
        knobs["sessions"] = [knobs["sessions"]]
    if not knobs["sessions"] or any(int(n) < 1 for n in knobs["sessions"]):
        raise SystemExit("sessions must be a list of positive integers, e.g. sessions=[1,8,32]")
    if float(knobs["duration_s"]) <= 0 or int(knobs["repeats"]) < 1 or int(knobs["reset_every"]) < 1:
        raise SystemExit("duration_s must be > 0, repeats and reset_every >= 1")
    load_before = os.getloadavg()[0]
    rows, figures = asyncio.run(_run(knobs))
    # the machine may be shared: the load says how much the ratios can be trusted
    figures["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    figures["cores"] = os.cpu_count()
    path = write_result("env", knobs, figures)
    top = rows[-1]
    print_table(rows, f"env overhead {figures['overhead']:.1%} (paired, mean over {len(rows)} levels; alone at "
                      f"{top['sessions']} sessions ours {top['ours_steps_s']} vs raw {top['raw_steps_s']} steps/s); "
                      f"{figures['pss_mb_per_session']} MB PSS per session -> {path}")
    return 0
