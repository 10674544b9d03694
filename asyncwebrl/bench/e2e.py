"""`asyncwebrl bench e2e`: end-to-end training throughput, async everlasting pool vs the synchronous
pool, the same workload run twice in one invocation (SPEC sections 9, 11).

Both runs use the same config apart from `rollout.mode` (and the sync pool's per-round warm-up):
same model, tasks, batch, number of training steps. Reported per mode and as async/sync ratios:
wall time per step, trajectories/s, generated tokens/s, trainer and rollout idle fractions, the
per-step timeline, success vs wall time, staleness and dropped-stale counts. The ideal-overlap bound
is derived from the sync run's own phase times: with rollout time R, train time T and sync time S
per step, perfect overlap gives (R + T + S) / (max(R, T) + S).

Knobs (key=value): steps, batch, n_samples, eta, max_steps, tasks, env (miniwob|synthetic),
scheduler (ray|local), model, gpus (0 = CPU), extra (a ';'-separated list of config overrides).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from asyncwebrl.bench.common import RESULTS_DIR, parse_overrides, print_table, write_result

DEFAULTS = {
    "steps": 5,
    "batch": 2,
    "n_samples": 2,
    "eta": 1,
    "max_steps": 2,
    "tasks": "miniwob-easy",
    "env": "miniwob",
    "scheduler": "ray",
    "model": "default",
    "gpus": 0,
    "max_new_tokens": 8,
    "extra": "",
    "out": "e2e",
    "fileroot": "/tmp/asyncwebrl-bench",
}


def run_mode(mode: str, knobs: dict[str, Any]) -> dict[str, Any]:
    from asyncwebrl.config import load_run_config
    from asyncwebrl.controller.main import Controller
    from asyncwebrl.controller.rundir import RunDir, read_jsonl
    from asyncwebrl.controller.system import build_system

    overrides = [
        f"rollout.mode={mode}", f"total_train_steps={knobs['steps']}",
        f"rollout.consumer_batch_size={knobs['batch']}", f"gconfig.n_samples={knobs['n_samples']}",
        f"rollout.max_head_offpolicyness={knobs['eta']}", f"env.max_steps={knobs['max_steps']}",
        f"env.type={knobs['env']}", f"env.tasks={knobs['tasks']}", f"scheduler.type={knobs['scheduler']}",
        f"actor.path={knobs['model']}", f"cluster.n_gpus_per_node={knobs['gpus']}",
        f"gconfig.max_new_tokens={knobs['max_new_tokens']}",
        f"cluster.fileroot={knobs['fileroot']}", f"trial_name=bench-{mode}-{int(time.time())}",
        "test_rollout.enabled=false", "checkpoint.every_n_steps=0", "stats.progress_bar=false",
        "stats.keep_episodes=4",
    ]
    overrides += [o for o in str(knobs["extra"]).split(";") if o.strip()]
    cfg = load_run_config(None, overrides)
    run = RunDir(cfg.run_dir, keep_episodes=cfg.stats.keep_episodes, tensorboard=False)
    t0 = time.monotonic()
    system = build_system(cfg, run)
    setup_s = time.monotonic() - t0
    try:
        cpu0 = _cpu_times()
        summary = Controller(cfg, system, run).train()
        cpu_busy = _busy_fraction(cpu0, _cpu_times())
        rstats = system.rollout.stats()
    finally:
        system.shutdown()
        run.close()
    train = [r for r in read_jsonl(run.root / "metrics.jsonl") if r["kind"] == "train"]
    timeline = read_jsonl(run.root / "timeline.jsonl")
    wall = summary["wall_time_s"]
    trajs = sum(r["n_trajectories"] for r in train)
    tokens = sum(r["generated_tokens"] for r in train)
    return {
        "mode": mode,
        "run_dir": str(run.root),
        "setup_s": setup_s,
        "wall_s": wall,
        "steps": len(train),
        "wall_per_step_s": wall / max(1, len(train)),
        "trajectories_per_s": trajs / wall,
        "tokens_per_s": tokens / wall,
        "trainer_idle_frac": sum(r["wait_s"] for r in train) / wall,
        "cpu_busy_frac": cpu_busy,
        "rollout_idle_frac": rstats.get("rollout_idle_fraction", 0.0),
        "phase_means_s": {p: statistics.fmean([r[k] for r in train]) for p, k in
                          (("rollout_wait", "wait_s"), ("train", "train_s"), ("weight_sync", "weight_sync_s"))},
        "success_vs_time": [[round(r["time"], 2), r["success_rate"]] for r in train],
        "success_mean": statistics.fmean([r["success_rate"] for r in train]) if train else 0.0,
        "staleness_hist": rstats.get("staleness_hist", {}),
        "dropped_stale": rstats.get("dropped_stale", 0),
        "timeline": timeline,
    }


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores from /proc/stat; None off Linux."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _busy_fraction(a: tuple[int, int] | None, b: tuple[int, int] | None) -> float | None:
    """Share of the machine's CPU time that was busy between two `_cpu_times` readings: how much room
    overlap has when rollout and training share the cores."""
    if a is None or b is None or b[1] == a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1])


def ideal_overlap(sync: dict[str, Any]) -> float:
    """Speedup bound of perfect overlap from the sync run's own phases (see module docstring)."""
    ph = sync["phase_means_s"]
    r, t, s = ph["rollout_wait"], ph["train"], ph["weight_sync"]
    return (r + t + s) / max(1e-9, max(r, t) + s)


def plot_timeline(results: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"rollout_wait": "#4c9be8", "train": "#e8804c", "weight_sync": "#5cb85c", "checkpoint": "#999999",
              "eval": "#b05cc8"}
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 1.6 * len(results) + 0.8), sharex=True)
    axes = axes if len(results) > 1 else [axes]
    for ax, res in zip(axes, results, strict=False):
        for rec in res["timeline"]:
            ax.barh(0, rec["end"] - rec["start"], left=rec["start"], color=colors.get(rec["phase"], "#ccc"),
                    edgecolor="white", height=0.6)
        ax.set_yticks([0], [res["mode"]])
    axes[-1].set_xlabel("seconds since run start")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="upper center", ncol=len(colors), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(overrides: list[str] | None = None) -> int:
    knobs = parse_overrides(overrides, DEFAULTS)
    sync = run_mode("sync", knobs)
    # a partial record first: a long GPU run cut short still leaves the sync half behind
    write_result(knobs["out"], knobs, {"partial": "sync mode only; the async run did not finish",
                                       "modes": {"sync": {k: v for k, v in sync.items() if k != "timeline"}}})
    asy = run_mode("async", knobs)
    results = [sync, asy]
    speedup = asy["trajectories_per_s"] / max(1e-9, sync["trajectories_per_s"])
    figures = {
        "speedup": speedup,
        "step_time_ratio_sync_over_async": sync["wall_per_step_s"] / max(1e-9, asy["wall_per_step_s"]),
        "tokens_per_s_ratio": asy["tokens_per_s"] / max(1e-9, sync["tokens_per_s"]),
        "ideal_overlap_bound": ideal_overlap(sync),
        "anchors": {"asyncwebrl_paper_over_webgym": 2.9, "areal_async_over_sync": 2.77},
        "shared_core_note": (
            "on one machine rollout and training share the same cores: overlap removes idle waiting "
            "(browser latency, the long tail, per-round warm-up) but cannot add compute"
            if int(knobs["gpus"]) == 0 else "rollout and trainer on separate GPUs"),
        "modes": {r["mode"]: {k: v for k, v in r.items() if k != "timeline"} for r in results},
    }
    name = knobs["out"]
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    plot = RESULTS_DIR / f"{name}_timeline.png"
    try:
        plot_timeline(results, plot)
        figures["timeline_plot"] = plot.name
    except Exception as e:  # the numbers matter more than the picture
        figures["timeline_plot_error"] = repr(e)
    (RESULTS_DIR / f"{name}_timeline.json").write_text(json.dumps({r["mode"]: r["timeline"] for r in results}))
    write_result(name, knobs, figures)
    rows = [{"mode": r["mode"], "s/step": r["wall_per_step_s"], "traj/s": r["trajectories_per_s"],
             "tok/s": r["tokens_per_s"], "trainer_idle": r["trainer_idle_frac"],
             "rollout_idle": r["rollout_idle_frac"], "cpu_busy": r["cpu_busy_frac"], "success": r["success_mean"],
             "dropped_stale": r["dropped_stale"]} for r in results]
    print_table(rows, f"e2e speedup (async/sync trajectories/s): {speedup:.2f}x  "
                      f"(ideal overlap bound {figures['ideal_overlap_bound']:.2f}x)")
    return 0
