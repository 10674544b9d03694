"""Training plots of a run (matplotlib, Agg, PNG files): learning curves, PPO health, staleness,
idle fractions, weight-sync times and the rollout/train/weight-sync timeline.

Invariant: every plot in `PLOTS` is either drawn from the metrics that exist or reported as
missing (None); a metric that was never logged, a non-numeric value or a run with one step never
raises. Figures are built with `matplotlib.figure.Figure` (no pyplot global state), so plotting is
safe in any thread and never opens a window.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from asyncwebrl.view.rundata import RunData

PHASE_ORDER = ["rollout", "rollout_wait", "train", "weight_sync", "eval", "checkpoint"]
PHASE_COLOURS = {
    "rollout": "#59a14f", "rollout_wait": "#bab0ac", "train": "#4e79a7", "weight_sync": "#e15759",
    "eval": "#f28e2b", "checkpoint": "#b07aa1",
}
_EXTRA_COLOURS = ["#76b7b2", "#edc948", "#ff9da7", "#9c755f"]


@dataclass
class PlotResult:
    key: str
    title: str
    file: str | None
    """file name under the report's plots/ folder; None = no data yet"""
    note: str = ""
    """one line under the plot: a headline number, or what is missing"""


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def series(records: list[dict[str, Any]], y: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(xs, ys) of the records where both fields are finite numbers."""
    xs, ys = [], []
    for r in records:
        a, b = _num(r.get(x)), _num(r.get(y))
        if a is not None and b is not None:
            xs.append(a)
            ys.append(b)
    return xs, ys


def _figure(h: float = 3.0, w: float = 6.4) -> Figure:
    fig = Figure(figsize=(w, h), dpi=100, layout="constrained")
    return fig


def _lines(ax, records, keys: list[str], x: str = "step", labels: dict[str, str] | None = None) -> int:
    drawn = 0
    for k in keys:
        xs, ys = series(records, k, x)
        if xs:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=(labels or {}).get(k, k))
            drawn += 1
    if drawn:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    return drawn


def _time_axis(records: list[dict[str, Any]]) -> tuple[str, float]:
    times = [t for t in (_num(r.get("time")) for r in records) if t is not None]
    if times and max(times) > 1200:
        return "wall time (min)", 60.0
    return "wall time (s)", 1.0


def plot_learning_vs_step(d: RunData) -> tuple[Figure, str] | None:
    fig = _figure()
    ax = fig.add_subplot()
    if not _lines(ax, d.train, ["reward_mean", "success_rate"]):
        return None
    ax.set_xlabel("training step")
    _, sr = series(d.train, "success_rate")
    note = f"last success rate {sr[-1]:.3f} (first {sr[0]:.3f})" if sr else ""
    return fig, note


def plot_learning_vs_time(d: RunData) -> tuple[Figure, str] | None:
    label, div = _time_axis(d.train)
    scaled = [{**r, "time": r["time"] / div} for r in d.train if _num(r.get("time")) is not None]
    fig = _figure()
    ax = fig.add_subplot()
    if not _lines(ax, scaled, ["reward_mean", "success_rate"], x="time"):
        return None
    ax.set_xlabel(label)
    return fig, ""


def plot_eval_by_version(d: RunData) -> tuple[Figure, str] | None:
    xs, ys = series(d.eval, "success_rate", "version")
    if not xs:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    ax.plot(xs, ys, marker="o", linewidth=2, label="success_rate (all tasks)", color="black")
    per_task: dict[str, tuple[list[float], list[float]]] = {}
    for r in d.eval:
        v, pt = _num(r.get("version")), r.get("per_task")
        if v is None or not isinstance(pt, dict):
            continue
        for task, val in pt.items():
            val = val.get("success_rate") if isinstance(val, dict) else val
            if _num(val) is not None:
                per_task.setdefault(str(task), ([], []))[0].append(v)
                per_task[str(task)][1].append(float(val))
    for task, (tx, ty) in sorted(per_task.items())[:10]:
        ax.plot(tx, ty, marker=".", linewidth=1, alpha=0.7, label=task)
    ax.set_xlabel("checkpoint version")
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best", ncol=2 if len(per_task) > 4 else 1)
    note = f"best {max(ys):.3f} at version {xs[ys.index(max(ys))]:.0f}; latest {ys[-1]:.3f}"
    if len(per_task) > 10:
        note += f" ({len(per_task) - 10} more tasks not drawn)"
    return fig, note


def plot_clip_rates(d: RunData) -> tuple[Figure, str] | None:
    fig = _figure()
    ax = fig.add_subplot()
    labels = {"clip_rate": "decoupled (clip of pi_theta/pi_prox)", "clip_rate_coupled": "coupled (pi_theta/pi_behave)"}
    if not _lines(ax, d.train, ["clip_rate", "clip_rate_coupled"], labels=labels):
        return None
    ax.set_xlabel("training step")
    ax.set_ylabel("fraction of tokens clipped")
    _, dec = series(d.train, "clip_rate")
    _, cou = series(d.train, "clip_rate_coupled")
    note = ""
    if dec and cou and sum(cou) > 0:
        note = f"mean decoupled / coupled clip rate = {sum(dec) / len(dec):.4f} / {sum(cou) / len(cou):.4f}"
        note += f" = {(sum(dec) / len(dec)) / (sum(cou) / len(cou)):.2f}x"
    return fig, note


def staleness_counts(d: RunData) -> dict[int, float]:
    """The staleness histograms of all training steps summed: version lag -> trajectories."""
    total: dict[int, float] = {}
    for r in d.train:
        h = r.get("staleness_hist")
        if not isinstance(h, dict):
            continue
        for lag, n in h.items():
            try:
                lag_i = int(float(lag))
            except (TypeError, ValueError):
                continue
            if _num(n) is not None:
                total[lag_i] = total.get(lag_i, 0.0) + float(n)
    return total


def plot_staleness(d: RunData) -> tuple[Figure, str] | None:
    counts = staleness_counts(d)
    if not counts:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    lags = sorted(counts)
    ax.bar([str(k) for k in lags], [counts[k] for k in lags], color="#4e79a7")
    ax.set_xlabel("version lag (trainer version - head version)")
    ax.set_ylabel("trajectories trained on")
    ax.grid(alpha=0.3, axis="y")
    n = sum(counts.values())
    mean = sum(k * c for k, c in counts.items()) / n if n else 0.0
    _, dropped = series(d.train, "dropped_stale")
    note = f"mean lag {mean:.2f} over {n:.0f} trajectories"
    if dropped:
        # dropped_stale may be cumulative or per step; the largest value is a lower bound either way
        note += f"; dropped as too stale: {max(dropped):.0f} (max logged)"
    return fig, note


def plot_idle(d: RunData) -> tuple[Figure, str] | None:
    fig = _figure()
    ax = fig.add_subplot()
    if not _lines(ax, d.train, ["trainer_idle_frac", "rollout_idle_frac"]):
        return None
    ax.set_xlabel("training step")
    ax.set_ylabel("fraction of time idle")
    ax.set_ylim(-0.05, 1.05)
    return fig, ""


def plot_weight_sync(d: RunData) -> tuple[Figure, str] | None:
    xs, ys = series(d.train, "weight_sync_s")
    source = "metrics"
    if not xs:
        syncs = [r for r in d.timeline if r["phase"] == "weight_sync" and _num(r.get("step")) is not None]
        xs = [float(r["step"]) for r in syncs]
        ys = [float(r["end"]) - float(r["start"]) for r in syncs]
        source = "timeline"
    if not xs:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    ax.bar(xs, ys, color=PHASE_COLOURS["weight_sync"], width=0.8)
    ax.set_xlabel("training step")
    ax.set_ylabel("weight sync (s)")
    ax.grid(alpha=0.3, axis="y")
    s = sorted(ys)
    return fig, f"median {s[len(s) // 2]:.3f} s, max {s[-1]:.3f} s over {len(s)} syncs (from {source})"


def _small_multiples(records: list[dict[str, Any]], keys: list[str]) -> Figure | None:
    present = [k for k in keys if series(records, k)[0]]
    if not present:
        return None
    cols = min(3, len(present))
    rows = math.ceil(len(present) / cols)
    fig = _figure(h=2.2 * rows, w=6.4 if cols < 3 else 8.0)
    for i, k in enumerate(present):
        ax = fig.add_subplot(rows, cols, i + 1)
        xs, ys = series(records, k)
        ax.plot(xs, ys, linewidth=1.2, marker="o" if len(xs) < 30 else None, markersize=2)
        ax.set_title(k, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    return fig


def plot_optimisation(d: RunData) -> tuple[Figure, str] | None:
    fig = _small_multiples(d.train, ["loss", "approx_kl", "entropy", "grad_norm", "behave_weight_mean",
                                     "behave_weight_max", "behave_weight_capped_frac"])
    return (fig, "x axis: training step") if fig else None


def plot_throughput(d: RunData) -> tuple[Figure, str] | None:
    fig = _small_multiples(d.train, ["trajectories_per_s", "tokens_per_s", "step_time_s", "version"])
    return (fig, "x axis: training step") if fig else None


KNOWN_TRAIN_METRICS = {
    "step", "time", "kind", "reward_mean", "success_rate", "clip_rate", "clip_rate_coupled", "staleness_hist",
    "dropped_stale", "trainer_idle_frac", "rollout_idle_frac", "weight_sync_s", "loss", "approx_kl", "entropy",
    "grad_norm", "behave_weight_mean", "behave_weight_max", "behave_weight_capped_frac", "trajectories_per_s",
    "tokens_per_s", "step_time_s", "version",
}
MAX_PANELS = 12


def _numeric_keys(records: list[dict[str, Any]], exclude: set[str]) -> list[str]:
    keys: list[str] = []
    for r in records:
        for k, v in r.items():
            if k not in exclude and k not in keys and _num(v) is not None:
                keys.append(k)
    return keys


def plot_other_train(d: RunData) -> tuple[Figure, str] | None:
    keys = _numeric_keys(d.train, KNOWN_TRAIN_METRICS)
    fig = _small_multiples(d.train, keys[:MAX_PANELS])
    if fig is None:
        return None
    more = f"; {len(keys) - MAX_PANELS} more not drawn" if len(keys) > MAX_PANELS else ""
    return fig, "x axis: training step" + more


def plot_rollout_pool(d: RunData) -> tuple[Figure, str] | None:
    keys = _numeric_keys(d.rollout, {"step", "time", "kind"})
    fig = _small_multiples(d.rollout, keys[:MAX_PANELS])
    if fig is None:
        return None
    more = f"; {len(keys) - MAX_PANELS} more not drawn" if len(keys) > MAX_PANELS else ""
    return fig, "kind=rollout records; x axis: training step" + more


def phase_totals(d: RunData) -> dict[str, float]:
    """Seconds spent in each timeline phase (summed over steps)."""
    out: dict[str, float] = {}
    for r in d.timeline:
        out[r["phase"]] = out.get(r["phase"], 0.0) + float(r["end"]) - float(r["start"])
    return out


def _lane_order(d: RunData) -> list[str]:
    phases = {r["phase"] for r in d.timeline}
    return [p for p in PHASE_ORDER if p in phases] + sorted(phases - set(PHASE_ORDER))


def _gantt(ax, records: list[dict[str, Any]], lanes: list[str]) -> None:
    extra = iter(_EXTRA_COLOURS * 8)
    for i, phase in enumerate(lanes):
        spans = [(float(r["start"]), max(float(r["end"]) - float(r["start"]), 1e-6))
                 for r in records if r["phase"] == phase]
        colour = PHASE_COLOURS.get(phase) or next(extra, "#999999")
        ax.broken_barh(spans, (i - 0.4, 0.8), facecolors=colour, edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.invert_yaxis()
    ax.grid(alpha=0.3, axis="x")


def plot_timeline(d: RunData, zoom_steps: int = 4) -> tuple[Figure, str] | None:
    if not d.timeline:
        return None
    lanes = _lane_order(d)
    steps = sorted({int(r["step"]) for r in d.timeline if _num(r.get("step")) is not None})
    zoom = len(steps) > zoom_steps + 2
    fig = _figure(h=0.45 * len(lanes) * (2 if zoom else 1) + 1.4, w=8.0)
    ax = fig.add_subplot(2 if zoom else 1, 1, 1)
    _gantt(ax, d.timeline, lanes)
    ax.set_title("whole run", fontsize=9)
    ax.set_xlabel("seconds since run start", fontsize=8)
    if zoom:
        last = set(steps[-zoom_steps:])
        recs = [r for r in d.timeline if _num(r.get("step")) is not None and int(r["step"]) in last]
        ax2 = fig.add_subplot(2, 1, 2)
        _gantt(ax2, recs, lanes)
        ax2.set_title(f"last {zoom_steps} steps ({min(last)}-{max(last)})", fontsize=9)
        ax2.set_xlabel("seconds since run start", fontsize=8)
    span = max(float(r["end"]) for r in d.timeline) - min(float(r["start"]) for r in d.timeline)
    totals = phase_totals(d)
    note = f"span {span:.1f} s; " + ", ".join(
        f"{p} {totals[p]:.1f} s ({100 * totals[p] / span:.0f}%)" if span > 0 else f"{p} {totals[p]:.1f} s"
        for p in lanes)
    return fig, note


PLOTS: list[tuple[str, str, Callable[[RunData], tuple[Figure, str] | None]]] = [
    ("learning_step", "Reward and success rate vs training step", plot_learning_vs_step),
    ("learning_time", "Reward and success rate vs wall time", plot_learning_vs_time),
    ("eval_version", "Evaluation success by checkpoint version", plot_eval_by_version),
    ("clip_rates", "Clip rate: decoupled vs coupled PPO", plot_clip_rates),
    ("staleness", "Staleness histogram (version lag of trained trajectories)", plot_staleness),
    ("idle", "Trainer and rollout idle fractions", plot_idle),
    ("weight_sync", "Weight-sync time per step", plot_weight_sync),
    ("timeline", "Timeline: rollout / train / weight sync / eval / checkpoint", plot_timeline),
    ("optimisation", "Optimisation health", plot_optimisation),
    ("throughput", "Throughput and step time", plot_throughput),
    ("rollout_pool", "Rollout pool statistics", plot_rollout_pool),
    ("other_train", "Other training metrics", plot_other_train),
]


def render_plots(d: RunData, out_dir: Path) -> list[PlotResult]:
    """Draw every plot into out_dir/<key>.png; plots without data come back with file=None."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for key, title, fn in PLOTS:
        try:
            got = fn(d)
        except Exception as e:  # a plot must never take the whole report down
            results.append(PlotResult(key, title, None, f"could not draw: {type(e).__name__}: {e}"))
            continue
        if got is None:
            results.append(PlotResult(key, title, None, "no data yet"))
            continue
        fig, note = got
        name = f"{key}.png"
        fig.savefig(out_dir / name)
        results.append(PlotResult(key, title, name, note))
    return results
