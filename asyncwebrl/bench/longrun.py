"""`asyncwebrl bench longrun`: hundreds of training steps through the production path; does the
PixelStore give its bytes back?

Workload: the real system of `asyncwebrl train` (controller -> Ray trainer rank -> `train_step`, the
async rollout controller with its Ray worker, the embedded inference server, the Ray PixelStore),
rollout.mode=async, a tiny model (`tiny-qwen2.5-vl` by default: random weights, the real Qwen2.5-VL
code path), and the synthetic web env replaying RECORDED full-size (1280x768) MiniWoB++ pages: real
screenshots at the WebGym size, without a browser per step, so 200+ steps fit a small CPU box. The
pages are recorded with `asyncwebrl record-screens` into a cache folder on first use.

The store is sized so that a leak shows: `steps_to_fill_if_leaking` (capacity over the bytes the run
puts per step) must lie within the first fifth of the run. Done when `failed_episodes` is 0,
`store_bytes_put_total` >= 5 x `store_capacity_bytes` and `store_bytes_end` <= capacity / 4.

Memory: PSS of every process of the run (this controller process and all its descendants: Ray's
own processes, the Ray workers hosting the trainer rank, rollout worker and PixelStore, the inference
server) after the first step and at the end.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from asyncwebrl.bench.common import parse_overrides, print_table
from asyncwebrl.results import write_result

DEFAULTS: dict[str, Any] = {
    "steps": 200,
    "model": "tiny-qwen2.5-vl",
    "scheduler": "ray",
    "capacity_mb": 0.25,
    "width": 1280,
    "height": 768,
    "record_episodes": 24,
    "screens_dir": "",
    "batch_size": 1,
    "n_samples": 1,
    "max_steps": 1,
    "eta": 1,
    "max_new_tokens": 4,
    "recompute_logprob": False,
    "seed": 1,
}


@dataclass
class ProcessMemory:
    """PSS of one process of the run, after the first step and at the end."""

    pid: int
    role: str
    pss_mb_start: float
    pss_mb_end: float | None
    """None: the process was gone at the end"""


@dataclass
class LongrunFigures:
    steps: int
    episodes: int
    """trajectories the trainer consumed"""
    failed_episodes: int
    """episodes that ended failed (the typed rollout statistics, `RolloutStats.failed_episodes`)"""
    dropped_stale: int
    store_capacity_bytes: int
    store_bytes_put_total: int
    store_bytes_peak: int
    store_bytes_end: int
    """bytes held when the last step returned (the in-flight working set)"""
    store_bytes_after_step_max: int
    """most bytes held at the start of any step (after the previous step freed its batch)"""
    store_items_end: int
    store_blocked_puts: int
    store_missing: int
    steps_to_fill_if_leaking: float
    """capacity / bytes put per step: when a store that never freed would be full"""
    screenshot_bytes_mean: float
    wall_s: float
    step_s_mean: float
    processes: list[ProcessMemory] = field(default_factory=list)
    pss_mb_total_start: float = 0.0
    pss_mb_total_end: float = 0.0
    store_bytes_after_step: list[int] = field(default_factory=list)

    def done(self) -> dict[str, bool]:
        return {
            "no_failed_episodes": self.failed_episodes == 0,
            "put_total_ge_5x_capacity": self.store_bytes_put_total >= 5 * self.store_capacity_bytes,
            "end_le_quarter_capacity": self.store_bytes_end <= self.store_capacity_bytes / 4,
            "leak_would_overflow_in_first_fifth": self.steps_to_fill_if_leaking <= self.steps / 5,
        }


def recorded_screens(folder: Path, episodes: int, width: int, height: int) -> Path:
    """A folder of recorded full-size MiniWoB++ pages; recorded now (real Chromium, `asyncwebrl
    record-screens` in a child process, so no browser outlives it into the measured run) if absent."""
    if folder.is_dir() and any(folder.glob("*.png")):
        return folder
    import subprocess
    import sys

    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    subprocess.run([sys.executable, "-m", "asyncwebrl", "record-screens", str(tmp), "--episodes", str(episodes),
                    "--width", str(width), "--height", str(height)], check=True, timeout=900)
    try:
        tmp.rename(folder)
    except OSError:  # another process recorded it meanwhile
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _role(p) -> str:
    try:
        cmd = " ".join(p.cmdline())
    except Exception:  # noqa: BLE001 - the process is gone
        return "?"
    for marker in ("ray::", "asyncwebrl serve", "asyncwebrl.cli serve", "asyncwebrl.pixelstore", "raylet", "gcs_server", "dashboard",
                   "log_monitor", "runtime_env", "monitor.py"):
        i = cmd.find(marker)
        if i >= 0:
            return cmd[i:i + 48].split(" --")[0]
    return p.name() + (" (controller)" if p.pid == os.getpid() else "")


def process_pss() -> dict[int, tuple[str, float]]:
    """pid -> (role, PSS MB) of this process and all its descendants."""
    import psutil

    me = psutil.Process()
    out: dict[int, tuple[str, float]] = {}
    for p in [me] + me.children(recursive=True):
        try:
            out[p.pid] = (_role(p), p.memory_full_info().pss / 2**20)
        except Exception:  # noqa: BLE001 - exited meanwhile, or not ours to read
            pass
    return out


def run_config(knobs: dict[str, Any], root: Path, screens: Path) -> Any:
    from asyncwebrl.config import load_run_config

    return load_run_config(None, [
        f"cluster.fileroot={root}", f"total_train_steps={int(knobs['steps'])}", f"actor.path={knobs['model']}",
        f"scheduler.type={knobs['scheduler']}", "rollout.mode=async",
        f"rollout.consumer_batch_size={int(knobs['batch_size'])}", f"gconfig.n_samples={int(knobs['n_samples'])}",
        f"rollout.max_head_offpolicyness={int(knobs['eta'])}", f"gconfig.max_new_tokens={int(knobs['max_new_tokens'])}",
        f"actor.recompute_logprob={str(bool(knobs['recompute_logprob'])).lower()}",
        "env.type=synthetic", f"env.synthetic_replay_dir={screens}", f"env.viewport_width={int(knobs['width'])}",
        f"env.viewport_height={int(knobs['height'])}", f"env.max_steps={int(knobs['max_steps'])}",
        f"pixelstore.capacity_mb={float(knobs['capacity_mb'])}", "pixelstore.put_timeout_s=30",
        "test_rollout.enabled=false", "stats.progress_bar=false",
        "stats.tensorboard=false", "stats.keep_episodes=8", "checkpoint.every_n_steps=0", f"seed={int(knobs['seed'])}",
    ])


def run_longrun(knobs: dict[str, Any], root: Path) -> LongrunFigures:
    from asyncwebrl.controller.main import Controller
    from asyncwebrl.controller.rundir import RunDir
    from asyncwebrl.controller.system import build_system

    screens_dir = Path(knobs["screens_dir"] or Path.home() / ".cache" / "asyncwebrl" /
                       f"screens-miniwob-{int(knobs['width'])}x{int(knobs['height'])}")
    screens = recorded_screens(screens_dir, int(knobs["record_episodes"]), int(knobs["width"]), int(knobs["height"]))
    pngs = list(screens.glob("*.png"))
    cfg = run_config(knobs, root, screens)
    run = RunDir(cfg.run_dir, keep_episodes=cfg.stats.keep_episodes, tensorboard=False, seed=cfg.seed)
    system = build_system(cfg, run)
    store = system.pixel_store
    after_step: list[int] = []
    pss_start: dict[int, tuple[str, float]] = {}

    def probe(ctl: Controller) -> None:
        if ctl.state.step >= 1:  # the previous step has returned and freed its batch
            after_step.append(int(store.stats()["bytes"]))
        if ctl.state.step == 1:
            pss_start.update(process_pss())

    try:
        ctl = Controller(cfg, system, run)
        ctl.step_hooks.append(probe)
        t0 = time.monotonic()
        summary = ctl.train()
        wall = time.monotonic() - t0
        st = store.stats()
        pss_end = process_pss()
        rstats = system.rollout.stats()
    finally:
        system.shutdown()
        run.close()
    steps = summary.steps
    put_per_step = st["bytes_put"] / max(1, steps)
    procs = [ProcessMemory(pid, role, round(mb, 1), round(pss_end[pid][1], 1) if pid in pss_end else None)
             for pid, (role, mb) in sorted(pss_start.items())]
    procs += [ProcessMemory(pid, role, 0.0, round(mb, 1)) for pid, (role, mb) in sorted(pss_end.items())
              if pid not in pss_start and mb > 1.0]
    return LongrunFigures(
        steps=steps, episodes=summary.trajectories, failed_episodes=rstats.failed_episodes,
        dropped_stale=rstats.dropped_stale,
        store_capacity_bytes=int(st["capacity_bytes"]), store_bytes_put_total=int(st["bytes_put"]),
        store_bytes_peak=int(st["peak_bytes"]), store_bytes_end=int(st["bytes"]),
        store_bytes_after_step_max=max(after_step, default=0), store_items_end=int(st["items"]),
        store_blocked_puts=int(st["blocked_puts"]), store_missing=int(st["missing"]),
        steps_to_fill_if_leaking=round(st["capacity_bytes"] / max(1.0, put_per_step), 1),
        screenshot_bytes_mean=round(sum(p.stat().st_size for p in pngs) / max(1, len(pngs)), 1),
        wall_s=round(wall, 1), step_s_mean=round(wall / max(1, steps), 2), processes=procs,
        pss_mb_total_start=round(sum(mb for _, mb in pss_start.values()), 1),
        pss_mb_total_end=round(sum(mb for _, mb in pss_end.values()), 1),
        store_bytes_after_step=after_step,
    )


def main(overrides: list[str]) -> int:
    knobs = parse_overrides(overrides, DEFAULTS)
    with tempfile.TemporaryDirectory(prefix="longrun-") as d:
        figs = run_longrun(knobs, Path(d))
    done = figs.done()
    doc = asdict(figs)
    doc["done"] = done
    path = write_result("longrun", knobs, doc)
    rows = [{"process": p.role, "pid": p.pid, "pss_mb_start": p.pss_mb_start, "pss_mb_end": p.pss_mb_end}
            for p in figs.processes]
    print_table(rows, f"{figs.steps} steps, {figs.episodes} episodes ({figs.failed_episodes} failed); store: put "
                      f"{figs.store_bytes_put_total / 2**20:.1f} MB through {figs.store_capacity_bytes / 2**20:.1f} MB "
                      f"({figs.store_bytes_put_total / figs.store_capacity_bytes:.1f}x), peak "
                      f"{figs.store_bytes_peak / 2**10:.0f} kB, end {figs.store_bytes_end / 2**10:.0f} kB; "
                      f"done: {all(done.values())} -> {path}")
    return 0 if all(done.values()) else 1
