"""`asyncwebrl bench soak`: many MiniWoB episodes through the production training path; does memory
stay flat?

Workload: the system of `asyncwebrl train` (scheduler.type=local: the controller, its in-process
trainer rank running `train_step` on every batch, the in-process PixelStore, a real embedded
inference server process, the async rollout controller with real Chromium + MiniWoB++).
The policy is the model being trained (`model`, default the embedded default; `tiny-qwen2.5-vl` for a
quick run), served by the inference server; screenshots are put by the episodes and freed by the
trainer rank after each step, as in every training run. `episodes` sets the number of training steps
(episodes / (batch_size x n_samples)).

Memory: PSS (proportional set size) of the Chromium process trees, the inference server process and
the controller process (which hosts the trainer rank and the PixelStore), and the bytes the
PixelStore holds, sampled every
`sample_every_s` together with the number of episodes consumed. Headline: `slope_mb_per_1k_episodes`
per component, the least-squares slope of PSS against episodes after the first `warmup_frac` of the
run (flat memory = slope near 0). Beside it `floor_slope_mb_per_1k_episodes`: the slope of the
per-window minima (10 windows), the memory a process falls back to; a leak raises the floor, a
sawtooth of freed-and-reused heap does not; and `peak_growth_mb`, the peak of the second half minus
the peak of the first (a bounded process: <= 0).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from asyncwebrl.bench.common import parse_overrides, print_table
from asyncwebrl.results import write_result

DEFAULTS: dict[str, Any] = {
    "episodes": 10000,
    "model": "default",
    "tasks": "click-test,click-button,click-link,focus-text",
    "max_steps": 3,
    "concurrency": 4,
    "n_samples": 2,
    "batch_size": 2,
    "max_new_tokens": 8,
    "sample_every_s": 2.0,
    "warmup_frac": 0.2,
    "store_mb": 256,
    "seed": 1,
}
COMPONENTS = ("browsers", "pixelstore", "inference_server", "controller")


def _pss_tree(pids: list[int], children: bool = True) -> int:
    """Total PSS (bytes) of the given processes and (with `children`) all their descendants (each
    counted once)."""
    import psutil

    seen: set[int] = set()
    total = 0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root] + (root.children(recursive=True) if children else [])
        except psutil.Error:
            continue
        for p in procs:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            try:
                total += p.memory_full_info().pss
            except psutil.Error:
                pass
    return total


def slope_per_1k(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs, times 1000 (MB per 1k episodes when xs are episodes)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0
    return 1000.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def floor_slope_per_1k(xs: list[float], ys: list[float], windows: int = 10) -> float:
    """Slope of the minimum of ys in each of `windows` equal spans of xs (MB per 1k episodes)."""
    if len(xs) < 2 or xs[-1] <= xs[0]:
        return 0.0
    span = (xs[-1] - xs[0]) / windows
    px, py = [], []
    for w in range(windows):
        lo, hi = xs[0] + w * span, xs[0] + (w + 1) * span
        inside = [y for x, y in zip(xs, ys, strict=True) if lo <= x < hi or (w == windows - 1 and x == hi)]
        if inside:
            px.append((lo + hi) / 2)
            py.append(min(inside))
    return slope_per_1k(px, py)


def peak_growth(ys: list[float]) -> float:
    """Peak of the second half minus peak of the first half: how much the envelope of a bounded
    sawtooth rose over the run (0 or less: the highest memory was already reached early)."""
    if len(ys) < 2:
        return 0.0
    half = len(ys) // 2
    return max(ys[half:]) - max(ys[:half])


class MemorySampler:
    """PSS of each component against episodes done, sampled on a thread."""

    def __init__(self, components: dict[str, Any], episodes_done, every_s: float):
        self.components = components
        """name -> (callable returning the root pids, whether their descendants count), or a callable
        returning the bytes the component holds (the in-process PixelStore)"""
        self.episodes_done = episodes_done
        self.every_s = every_s
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="soak-pss", daemon=True)

    def sample(self) -> None:
        row = {"t": time.monotonic(), "episodes": float(self.episodes_done())}
        for name, c in self.components.items():
            row[name] = (c() if callable(c) else _pss_tree(c[0](), c[1])) / 2**20
        self.samples.append(row)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def __enter__(self) -> MemorySampler:
        self.sample()
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join(30)
        self.sample()


def soak_config(knobs: dict[str, Any], root: Path) -> Any:
    from asyncwebrl.config import load_run_config

    per_step = int(knobs["batch_size"]) * int(knobs["n_samples"])
    steps = max(1, -(-int(knobs["episodes"]) // per_step))
    return load_run_config(None, [
        f"cluster.fileroot={root}", f"total_train_steps={steps}", f"actor.path={knobs['model']}",
        "scheduler.type=local", "rollout.mode=async", "env.type=miniwob", f"env.tasks={knobs['tasks']}",
        f"env.max_steps={int(knobs['max_steps'])}", f"rollout.consumer_batch_size={int(knobs['batch_size'])}",
        f"rollout.max_concurrent_rollouts={int(knobs['concurrency'])}", f"gconfig.n_samples={int(knobs['n_samples'])}",
        f"gconfig.max_new_tokens={int(knobs['max_new_tokens'])}", f"pixelstore.capacity_mb={int(knobs['store_mb'])}",
        "test_rollout.enabled=false", "stats.progress_bar=false", "stats.tensorboard=false",
        "stats.keep_episodes=4", "checkpoint.every_n_steps=0", f"seed={int(knobs['seed'])}",
    ])


def run_soak(knobs: dict[str, Any], root: Path) -> dict[str, Any]:
    import os

    from asyncwebrl.controller.main import Controller
    from asyncwebrl.controller.rundir import RunDir
    from asyncwebrl.controller.system import build_system
    from asyncwebrl.web.browser import browser_root_pids

    cfg = soak_config(knobs, root)
    run = RunDir(cfg.run_dir, keep_episodes=cfg.stats.keep_episodes, tensorboard=False, seed=cfg.seed)
    system = build_system(cfg, run)
    store, server = system.pixel_store, system.server_handles[0]
    try:
        ctl = Controller(cfg, system, run)
        components = {
            "browsers": (lambda: browser_root_pids(cfg.env.headless_shell), True),
            "pixelstore": lambda: store.stats()["bytes"],  # inside the controller process
            "inference_server": (lambda: [server.pid], True),
            "controller": (lambda: [os.getpid()], False),  # hosts the trainer rank
        }
        t0 = time.monotonic()
        reported = [0]

        def progress(c: Controller) -> None:
            if c.state.trajectories // 500 > reported[0]:
                reported[0] = c.state.trajectories // 500
                print(f"soak: {c.state.trajectories} episodes, step {c.state.step}, "
                      f"{time.monotonic() - t0:.0f} s", flush=True)

        ctl.step_hooks.append(progress)
        with MemorySampler(components, lambda: ctl.state.trajectories, float(knobs["sample_every_s"])) as mem:
            summary = ctl.train()
        wall = time.monotonic() - t0
        stats = system.rollout.stats()
        store_stats = store.stats()
    finally:
        system.shutdown()
        run.close()
    return {"samples": mem.samples, "summary": summary, "wall_s": wall, "rollout": stats, "store": store_stats,
            "successes": list(ctl.state.successes)}


def summarize(res: dict[str, Any], warmup_frac: float) -> dict[str, Any]:
    samples = res["samples"]
    total = res["summary"].trajectories
    after = [s for s in samples if s["episodes"] >= warmup_frac * total] or samples
    figs: dict[str, Any] = {}
    for comp in COMPONENTS:
        xs = [s["episodes"] for s in after]
        ys = [s[comp] for s in after]
        figs[comp] = {
            "slope_mb_per_1k_episodes": round(slope_per_1k(xs, ys), 3),
            "floor_slope_mb_per_1k_episodes": round(floor_slope_per_1k(xs, ys), 3),
            "peak_growth_mb": round(peak_growth(ys), 1),
            "pss_mb_start": round(after[0][comp], 1), "pss_mb_end": round(after[-1][comp], 1),
            "pss_mb_max": round(max(s[comp] for s in samples), 1),
        }
    figs["slope_mb_per_1k_episodes"] = {c: figs[c]["slope_mb_per_1k_episodes"] for c in COMPONENTS}
    figs["floor_slope_mb_per_1k_episodes"] = {c: figs[c]["floor_slope_mb_per_1k_episodes"] for c in COMPONENTS}
    figs["peak_growth_mb"] = {c: figs[c]["peak_growth_mb"] for c in COMPONENTS}
    return figs


def main(overrides: list[str]) -> int:
    knobs = parse_overrides(overrides, DEFAULTS)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="soak-") as d:
        res = run_soak(knobs, Path(d))
    figs = summarize(res, float(knobs["warmup_frac"]))
    summary, rollout, store = res["summary"], res["rollout"], res["store"]
    episodes = summary.trajectories
    figs.update({
        "episodes": episodes, "steps": summary.steps,
        "failed_episodes": rollout.failed_episodes,
        "success_rate": sum(res["successes"]) / max(1, len(res["successes"])),
        "wall_s": round(res["wall_s"], 1), "episodes_per_s": round(episodes / max(1e-9, res["wall_s"]), 2),
        "lost_rollouts": rollout.lost_rollouts, "store_bytes_end": int(store["bytes"]),
        "store_bytes_put": int(store["bytes_put"]), "store_items_at_end": int(store["items"]),
        "policy": f"the trained model ({knobs['model']}) on the embedded hf server; controller -> trainer rank",
        "samples": [{k: round(v, 2) for k, v in s.items() if k != "t"} for s in res["samples"]],
    })
    rows = [{"component": c, "pss_mb_start": figs[c]["pss_mb_start"], "pss_mb_end": figs[c]["pss_mb_end"],
             "slope_mb_per_1k": figs[c]["slope_mb_per_1k_episodes"]} for c in COMPONENTS]
    path = write_result("soak", knobs, figs)
    worst = max(figs["slope_mb_per_1k_episodes"].items(), key=lambda kv: abs(kv[1]))
    print(f"{episodes} episodes in {figs['steps']} training steps, {figs['wall_s']} s "
          f"({figs['episodes_per_s']} ep/s), {figs['failed_episodes']} failed")
    print_table(rows, "slope_mb_per_1k_episodes: " + ", ".join(
        f"{c} {figs[c]['slope_mb_per_1k_episodes']}" for c in COMPONENTS) + f" (largest |slope|: {worst[0]}) -> {path}")
    return 0
