"""`asyncwebrl bench e2e`: end-to-end training throughput, async everlasting pool vs the synchronous
pool, the same workload run twice in one invocation (SPEC sections 9, 11).

Both runs use the same config apart from `rollout.mode` (and the sync pool's per-round warm-up):
same model, tasks, batch, number of training steps. Each mode runs in a FRESH process (the production
`Controller` with its trainer rank and stores, as `asyncwebrl train` builds them), so neither mode
inherits the other's warm caches: with the local scheduler the trainer rank lives in the bench
process, and running async after sync in one process let async skip the CUDA/allocator warm-up that
sync had paid (the sync train phase fell 14.6 -> 3.5 s over four GPU steps while async's sat at 3.0 s).

Figures (SPEC section 11: every throughput ratio twice):
- `whole_run_speedup` (= `speedup`): trajectories/s over the whole training loop, checkpoints and the
  first step included;
- `steady_state_speedup`: median step time of sync over async, the first step excluded; a step is
  rollout wait + train + weight sync, checkpoints and evaluation are their own phases;
- `ideal_overlap_bound`: from the sync run's steady phase medians, rollout R, train T, sync S:
  perfect overlap gives (R + T + S) / (max(R, T) + S); `share_of_ideal` = steady / bound; it assumes
  rollout and training run on separate devices;
- `pool_bound`: the everlasting pool also removes the wait for a round's slowest episode and the
  per-round warm-up, which the phase bound takes as fixed. From the sync run's steady train T and
  weight sync S and the async run's pool rate with every session busy (trajectories per busy
  slot-second x slots, measured while training ran beside it): sync step / max(T + S, trajectories
  per step / that rate); `share_of_pool_bound` = steady / it;
- `shared_core_bound` (CPU only): 1 / the share of the cores the sync run kept busy. When rollout and
  training share the cores, overlap can fill only the idle share, so this is the tighter bound there;
- per mode: per-phase medians, trainer and rollout idle fractions, CPU busy share, failed episodes.

Knobs (key=value): steps, batch, n_samples, eta, max_steps, tasks, env (miniwob|synthetic),
scheduler (ray|local), model, gpus (0 = CPU), extra (a ';'-separated list of config overrides),
workload (default | web-shaped), modes, mode_dir.

A long GPU headline need not fit one call: `modes=sync mode_dir=DIR` runs only the sync half and keeps
its record in DIR/sync.json (with the knobs it ran under); a later `modes=async mode_dir=DIR` (same
knobs, DIR carried along) runs the other half and writes the combined result. A kept half whose
knobs differ from this call's is refused, never silently mixed. `from_run=RUNDIR` (with one mode in
`modes`) runs nothing: it builds that half from a finished run's own records (RUNDIR/metrics.jsonl and
timeline.jsonl), for a half whose 12 steps ran but whose bench process ended before writing (a device
call's time limit during shutdown). What only the bench process measures (decode rates by phase, CPU
busy share, load average) comes from that run's kept half in mode_dir when there is one, else is
absent; the record says where each half came from.

`workload=web-shaped` is the synthetic env shaped like web agents' work (issue 18): recorded pages
(env.synthetic_replay_dir, from `asyncwebrl record-screens`), step/reset/warm-up latencies replayed
from bench/data/web_latency.json (measured on real Chromium by `asyncwebrl record-latency`),
heavy-tailed episode lengths (log-normal, median 4, sigma 1: p95 ~ 21, capped at 30 steps), and at
least 64 concurrent sessions (batch x n_samples); the sync pool relaunches its sessions every round
and pays the recorded warm-up each time, the everlasting pool once per session.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncwebrl.bench.common import parse_overrides, print_table
from asyncwebrl.results import RESULTS_DIR, machine_info, write_result

DEFAULTS = {
    "steps": 12,
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
    "workload": "default",
    "modes": "sync,async",
    "mode_dir": "",
    "from_run": "",
    "machine_note": "",
}
MODES = ("sync", "async")
# knobs that only say where things go or which half runs; every other knob must match to combine halves
_PLACEMENT_KNOBS = {"modes", "mode_dir", "out", "fileroot", "from_run", "machine_note"}

WEB_LATENCY_FILE = Path(__file__).resolve().parents[2] / "bench" / "data" / "web_latency.json"
MIN_WEB_SESSIONS = 64


def workload_overrides(knobs: dict[str, Any]) -> list[str]:
    """Config overrides of the named workload (applied after the knobs, so they win)."""
    name = knobs.get("workload", "default")
    if name == "default":
        return []
    if name != "web-shaped":
        raise SystemExit(f"unknown workload '{name}' (default, web-shaped)")
    sessions = int(knobs["batch"]) * int(knobs["n_samples"])
    if sessions < MIN_WEB_SESSIONS:
        raise SystemExit(f"workload=web-shaped needs batch x n_samples >= {MIN_WEB_SESSIONS} concurrent sessions "
                         f"(got {sessions})")
    return ["env.type=synthetic", "env.max_steps=30", "env.synthetic_length_median=4",
            "env.synthetic_length_sigma=1.0", f"env.synthetic_latency_file={WEB_LATENCY_FILE}",
            f"rollout.max_concurrent_rollouts={knobs['batch']}", "rollout.sync_warmup=true",
            "test_rollout.heldout_tasks=''"]  # MiniWoB held-out tasks need the miniwob package: GPU boxes lack it

PHASES = ("rollout_wait", "train", "weight_sync")


@dataclass(kw_only=True)
class ModeResult:
    """One mode's run, measured in its own process."""

    mode: str
    run_dir: str
    setup_s: float
    wall_s: float
    """the training loop, first step to last, checkpoints included"""
    steps: int
    trajectories: int
    generated_tokens: int
    step_times_s: list[float]
    """rollout wait + train + weight sync of each step"""
    phase_times_s: dict[str, list[float]]
    """per phase, per step"""
    checkpoint_s_total: float
    checkpoint_stall_s: float
    trainer_idle_frac: float
    rollout_idle_frac: float
    cpu_busy_frac: float | None
    failed_episodes: int
    dropped_stale: int
    staleness_hist: dict[str, int]
    success_vs_time: list[list[float]]
    timeline: list[dict[str, Any]] = field(default_factory=list)
    pool_full_rate_traj_s: float | None = None
    """async: trajectories/s the pool delivers with every slot busy (delivered trajectories x slots /
    busy slot-seconds); None for the sync pool"""
    budget: dict[str, Any] = field(default_factory=dict)
    """the cores' budget the run used (scheduling/budget.py): threads per role, rollout niceness"""
    load_avg: list[float] = field(default_factory=list)
    """the machine's 1/5/15-minute load average when the run ended (other work on shared cores)"""
    load_avg_start: list[float] = field(default_factory=list)
    """the same when the run started"""
    decode_tok_s_training: float | None = None
    """tokens/s the train-rollout servers generated while the trainer ran a train phase (sharing the
    device or the cores with it); None when no train phase saw generation"""
    decode_tok_s_trainer_idle: float | None = None
    """tokens/s they generated while the trainer waited for rollout (the servers alone)"""
    end_s: float | None = None
    """after the last step until the run returned: the final checkpoint's write (None when not measured)"""
    machine: dict[str, Any] = field(default_factory=dict)
    """where the half ran (`machine_info()`; empty in halves kept before it was recorded)"""
    source: str = "bench"
    """bench = measured by the bench process around the run; run-records = built afterwards from the
    run's own metrics.jsonl and timeline.jsonl (`from_run`: the sampler's figures are absent);
    run-records+bench = the same, with the bench-only figures of that run's kept half"""

    @property
    def trajectories_per_s(self) -> float:
        return self.trajectories / max(1e-9, self.wall_s)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / max(1e-9, self.wall_s)

    @property
    def steady_step_s(self) -> float:
        """median step time, the first step excluded (it pays start-up: empty pool, cold caches)"""
        steady = self.step_times_s[1:] or self.step_times_s
        return statistics.median(steady)

    def steady_phase_s(self, phase: str) -> float:
        xs = self.phase_times_s[phase]
        return statistics.median(xs[1:] or xs)

    @property
    def success_mean(self) -> float:
        return statistics.fmean([s for _, s in self.success_vs_time]) if self.success_vs_time else 0.0

    def figures(self) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "timeline"}
        d.update(trajectories_per_s=self.trajectories_per_s, tokens_per_s=self.tokens_per_s,
                 steady_step_s=self.steady_step_s, wall_per_step_s=self.wall_s / max(1, self.steps),
                 phase_medians_s={p: self.steady_phase_s(p) for p in PHASES}, success_mean=self.success_mean)
        return d


def _overrides(mode: str, knobs: dict[str, Any]) -> list[str]:
    out = [
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
    return out + workload_overrides(knobs) + [o for o in str(knobs["extra"]).split(";") if o.strip()]


def run_mode(mode: str, knobs: dict[str, Any]) -> ModeResult:
    """Train `knobs['steps']` steps in `mode` in this process, through the production controller."""
    from asyncwebrl.config import load_run_config
    from asyncwebrl.controller.main import Controller
    from asyncwebrl.controller.rundir import RunDir, read_jsonl
    from asyncwebrl.controller.system import build_system
    from asyncwebrl.scheduling.budget import core_budget

    cfg = load_run_config(None, _overrides(mode, knobs))
    budget = core_budget(cfg)
    load0 = _load_avg()
    run = RunDir(cfg.run_dir, keep_episodes=cfg.stats.keep_episodes, tensorboard=False)
    t0 = time.monotonic()
    system = build_system(cfg, run)
    setup_s = time.monotonic() - t0
    sampler = DecodeSampler(system.server_addresses, system.api_key, run.now)
    try:
        cpu0 = _cpu_times()
        ctl = Controller(cfg, system, run)
        sampler.start()
        summary = ctl.train()
        cpu_busy = _busy_fraction(cpu0, _cpu_times())
        rstats = system.rollout.stats()
    finally:
        sampler.stop()
        system.shutdown()
        run.close()
    recs = ctl.history
    timeline = read_jsonl(run.root / "timeline.jsonl")
    training, idle = sampler.rates(timeline)
    return ModeResult(
        mode=mode, run_dir=str(run.root), setup_s=setup_s, steps=summary.steps,
        # the loop is first step to last; what follows it (the last checkpoint's write) is end_s
        wall_s=recs[-1].wall_time_s if recs else summary.wall_time_s,
        end_s=summary.wall_time_s - recs[-1].wall_time_s if recs else 0.0,
        trajectories=summary.trajectories, generated_tokens=sum(r.generated_tokens for r in recs),
        step_times_s=[r.step_time_s for r in recs],
        phase_times_s={"rollout_wait": [r.wait_s for r in recs], "train": [r.train_s for r in recs],
                       "weight_sync": [r.weight_sync_s for r in recs]},
        checkpoint_s_total=sum(r.checkpoint_s for r in recs), checkpoint_stall_s=summary.checkpoint_stall_s,
        # over the loop, as wall_s: the last step's record, not the run's return
        trainer_idle_frac=recs[-1].trainer_idle_frac if recs else summary.trainer_idle_frac,
        rollout_idle_frac=rstats.rollout_idle_fraction,
        cpu_busy_frac=cpu_busy, failed_episodes=summary.failed_episodes, dropped_stale=summary.dropped_stale,
        staleness_hist={str(k): v for k, v in rstats.staleness_hist.items()},
        success_vs_time=[[round(r.wall_time_s, 2), r.success_rate] for r in recs],
        timeline=timeline, decode_tok_s_training=training, decode_tok_s_trainer_idle=idle,
        pool_full_rate_traj_s=_pool_full_rate(rstats), budget=dataclasses.asdict(budget),
        load_avg=_load_avg(), load_avg_start=load0, machine=machine_info(),
    )


def half_from_run(mode: str, run_dir: Path, kept: ModeResult | None = None) -> ModeResult:
    """A mode's half from a finished run's own records (its per-step train rows and timeline): the
    step and phase times, trajectories, tokens, staleness, idle fractions and wall time the controller
    logged. The bench process's own figures (decode rates by phase, CPU busy share, load average,
    set-up time, machine) are not in them: they come from `kept`, the half the bench kept of this same
    run, else stay empty; `source` says which."""
    from asyncwebrl.controller.rundir import read_jsonl

    metrics, timeline = run_dir / "metrics.jsonl", run_dir / "timeline.jsonl"
    if not metrics.is_file() or not timeline.is_file():
        raise SystemExit(f"bench e2e: from_run={run_dir} needs the run's metrics.jsonl and timeline.jsonl")
    rows = [r for r in read_jsonl(metrics) if r.get("kind") == "train"]
    spans = read_jsonl(timeline)
    if not rows or not spans:
        raise SystemExit(f"bench e2e: {run_dir} holds no train steps")
    last = rows[-1]
    hist: dict[str, int] = {}
    for r in rows:
        for k, v in (r.get("staleness_hist") or {}).items():
            hist[str(k)] = hist.get(str(k), 0) + int(v)
    half = ModeResult(
        mode=mode, run_dir=str(run_dir), setup_s=float(spans[0]["start"]), wall_s=float(last["wall_time_s"]),
        steps=len(rows), trajectories=sum(int(r["n_trajectories"]) for r in rows),
        generated_tokens=sum(int(r["generated_tokens"]) for r in rows),
        step_times_s=[float(r["step_time_s"]) for r in rows],
        phase_times_s={"rollout_wait": [float(r["wait_s"]) for r in rows], "train": [float(r["train_s"]) for r in rows],
                       "weight_sync": [float(r["weight_sync_s"]) for r in rows]},
        checkpoint_s_total=sum(float(r["checkpoint_s"]) for r in rows),
        checkpoint_stall_s=sum(float(r["checkpoint_s"]) for r in rows),
        trainer_idle_frac=float(last["trainer_idle_frac"]), rollout_idle_frac=float(last["rollout_idle_frac"]),
        cpu_busy_frac=None, failed_episodes=sum(int(r["failed_episodes"]) for r in rows),
        dropped_stale=sum(int(r["dropped_stale"]) for r in rows), staleness_hist=hist,
        success_vs_time=[[round(float(r["wall_time_s"]), 2), float(r["success_rate"])] for r in rows],
        timeline=spans, source="run-records",
    )
    if kept is None:
        return half
    if kept.mode != mode or kept.steps != half.steps or kept.trajectories != half.trajectories:
        raise SystemExit(f"bench e2e: the kept {kept.mode} half ({kept.steps} steps, {kept.trajectories} "
                         f"trajectories) is not of the run in {run_dir}")
    bench_only = ("setup_s", "cpu_busy_frac", "pool_full_rate_traj_s", "budget", "load_avg", "load_avg_start",
                  "decode_tok_s_training", "decode_tok_s_trainer_idle", "machine")
    return dataclasses.replace(half, source="run-records+bench", **{k: getattr(kept, k) for k in bench_only})


class DecodeSampler:
    """Polls the servers' generated-token counters (/server_info stats) on the run's clock, so decode
    speed can be split by what the trainer was doing (the cost of sharing a device or the cores)."""

    def __init__(self, addresses: list[str], api_key: str | None, now, period_s: float = 0.5):
        import threading

        self.addresses, self.api_key, self.now, self.period_s = addresses, api_key, now, period_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decode-sampler", daemon=True)

    def _tokens(self) -> int | None:
        import urllib.request

        total = 0
        for a in self.addresses:
            req = urllib.request.Request(a + "/server_info")
            if self.api_key:
                req.add_header("Authorization", f"Bearer {self.api_key}")
            try:
                with urllib.request.urlopen(req, timeout=5) as r:
                    total += int(json.loads(r.read()).get("stats", {}).get("generated_tokens", 0))
            except (OSError, ValueError):
                return None
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            n = self._tokens()
            if n is not None:
                self.samples.append((self.now(), n))
            self._stop.wait(self.period_s)

    def start(self) -> None:
        if self.addresses:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def rates(self, timeline: list[dict[str, Any]]) -> tuple[float | None, float | None]:
        """(tokens/s inside train phases, tokens/s inside rollout_wait phases), each interval between
        two samples counted where its midpoint falls."""
        def phase_at(t: float) -> str | None:
            for rec in timeline:
                if rec["start"] <= t < rec["end"]:
                    return rec["phase"]
            return None

        sums = {"train": [0, 0.0], "rollout_wait": [0, 0.0]}
        for (t0, n0), (t1, n1) in itertools.pairwise(self.samples):
            ph = phase_at((t0 + t1) / 2)
            if ph in sums and t1 > t0:
                sums[ph][0] += n1 - n0
                sums[ph][1] += t1 - t0
        out = [sums[p][0] / sums[p][1] if sums[p][1] > 0 and sums[p][0] > 0 else None
               for p in ("train", "rollout_wait")]
        return out[0], out[1]


def _load_avg() -> list[float]:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else []


def _pool_full_rate(rstats) -> float | None:
    """Trajectories per second of the everlasting pool with every slot busy (see ModeResult)."""
    workers = [w for w in rstats.workers if w.busy_s > 0]
    if rstats.mode != "async" or not workers:
        return None
    busy = sum(w.busy_s for w in workers)
    return sum(w.trajectories for w in workers) * sum(w.slots for w in workers) / busy


def run_mode_isolated(mode: str, knobs: dict[str, Any]) -> ModeResult:
    """`run_mode` in a fresh Python process; its record comes back as JSON."""
    with tempfile.TemporaryDirectory(prefix="awrl-e2e-") as tmp:
        out = Path(tmp) / f"{mode}.json"
        cmd = [sys.executable, "-m", "asyncwebrl.bench.e2e", "--one-mode", mode, str(out), json.dumps(knobs)]
        proc = subprocess.run(cmd)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"the {mode} run of bench e2e failed (exit {proc.returncode}); its output is above")
        return ModeResult(**json.loads(out.read_text()))


def _half_knobs(knobs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in knobs.items() if k not in _PLACEMENT_KNOBS}


def save_half(mode_dir: Path, res: ModeResult, knobs: dict[str, Any]) -> Path:
    mode_dir.mkdir(parents=True, exist_ok=True)
    path = mode_dir / f"{res.mode}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"knobs": _half_knobs(knobs), "result": dataclasses.asdict(res)}, default=float))
    tmp.replace(path)
    return path


def load_half(mode_dir: Path, mode: str, knobs: dict[str, Any]) -> ModeResult | None:
    """The kept record of `mode` in mode_dir, or None; a record run under other knobs is an error."""
    path = mode_dir / f"{mode}.json"
    if not path.exists():
        return None
    try:
        rec = json.loads(path.read_text())
        kept_knobs, res = rec["knobs"], ModeResult(**rec["result"])
    except (ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"bench e2e: {path} is not a kept half of bench e2e ({e})") from e
    want = json.loads(json.dumps(_half_knobs(knobs), default=str))
    if kept_knobs != want:
        diff = sorted(k for k in set(kept_knobs) | set(want) if kept_knobs.get(k) != want.get(k))
        raise SystemExit(f"bench e2e: {path} ran with other knobs ({', '.join(diff)}); the halves would not "
                         "be comparable. Use the same knobs or another mode_dir")
    return res


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


def ideal_overlap(sync: ModeResult) -> float:
    """Speedup bound of perfect overlap from the sync run's own steady phases (see module docstring)."""
    r, t, s = (sync.steady_phase_s(p) for p in PHASES)
    return (r + t + s) / max(1e-9, max(r, t) + s)


def pool_bound(sync: ModeResult, asy: ModeResult) -> float | None:
    """Speedup bound of the everlasting pool (see module docstring); None without the async pool's rate."""
    if not asy.pool_full_rate_traj_s:
        return None
    _, t, s = (sync.steady_phase_s(p) for p in PHASES)
    per_step = asy.trajectories / max(1, asy.steps)
    return sync.steady_step_s / max(1e-9, max(t + s, per_step / asy.pool_full_rate_traj_s))


@dataclass(kw_only=True)
class E2EFigures:
    whole_run_speedup: float
    steady_state_speedup: float
    ideal_overlap_bound: float
    share_of_ideal: float
    tokens_per_s_ratio: float
    checkpoint_stall_s: float
    shared_core_bound: float | None
    """where rollout and training share the cores (gpus=0): 1 / the share of CPU the sync run kept busy,
    the most overlap can gain when it adds no compute (None with GPUs)"""
    pool_bound: float | None = None
    """sync step / max(T + S, trajectories per step / the pool's rate with every session busy)"""
    share_of_pool_bound: float | None = None
    share_of_shared_core_bound: float | None = None

    @classmethod
    def of(cls, sync: ModeResult, asy: ModeResult, shared_cores: bool = False) -> E2EFigures:
        steady = sync.steady_step_s / max(1e-9, asy.steady_step_s)
        bound = ideal_overlap(sync)
        pool = pool_bound(sync, asy)
        cores = 1.0 / sync.cpu_busy_frac if shared_cores and sync.cpu_busy_frac else None
        return cls(whole_run_speedup=asy.trajectories_per_s / max(1e-9, sync.trajectories_per_s),
                   steady_state_speedup=steady, ideal_overlap_bound=bound, share_of_ideal=steady / bound,
                   tokens_per_s_ratio=asy.tokens_per_s / max(1e-9, sync.tokens_per_s),
                   checkpoint_stall_s=max(sync.checkpoint_stall_s, asy.checkpoint_stall_s),
                   shared_core_bound=cores, pool_bound=pool, share_of_pool_bound=steady / pool if pool else None,
                   share_of_shared_core_bound=steady / cores if cores else None)


def plot_timeline(results: list[ModeResult], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"rollout_wait": "#4c9be8", "train": "#e8804c", "weight_sync": "#5cb85c", "checkpoint": "#999999",
              "eval": "#b05cc8"}
    fig, axes = plt.subplots(len(results), 1, figsize=(10, 1.6 * len(results) + 0.8), sharex=True)
    axes = axes if len(results) > 1 else [axes]
    for ax, res in zip(axes, results, strict=False):
        for rec in res.timeline:
            ax.barh(0, rec["end"] - rec["start"], left=rec["start"], color=colors.get(rec["phase"], "#ccc"),
                    edgecolor="white", height=0.6)
        ax.set_yticks([0], [res.mode])
    axes[-1].set_xlabel("seconds since run start")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="upper center", ncol=len(colors), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(overrides: list[str] | None = None) -> int:
    knobs = parse_overrides(overrides, DEFAULTS)
    if int(knobs["steps"]) < 2:
        raise SystemExit("bench e2e needs steps >= 2 (the steady state excludes the first step); SPEC asks >= 12")
    wanted = [m.strip() for m in str(knobs["modes"]).split(",") if m.strip()]
    if not wanted or any(m not in MODES for m in wanted):
        raise SystemExit(f"bench e2e: modes must name sync and/or async (comma list), got {knobs['modes']!r}")
    mode_dir = Path(knobs["mode_dir"]) if knobs["mode_dir"] else None
    # kept halves first, so a half from other knobs is refused before any long run; a wanted mode is re-run
    done: dict[str, ModeResult] = {}
    if mode_dir is not None:
        for mode in MODES:
            kept = None if mode in wanted else load_half(mode_dir, mode, knobs)
            if kept is not None:
                done[mode] = kept
    if knobs["from_run"] and len(wanted) != 1:
        raise SystemExit("bench e2e: from_run builds one half: name its mode alone in modes= (sync or async)")
    for mode in (m for m in MODES if m in wanted):
        if knobs["from_run"]:  # the bench's own figures from this run's kept half, when there is one
            kept = load_half(mode_dir, mode, knobs) if mode_dir is not None else None
            done[mode] = half_from_run(mode, Path(knobs["from_run"]), kept)
        else:
            done[mode] = run_mode_isolated(mode, knobs)
        if mode_dir is not None:
            save_half(mode_dir, done[mode], knobs)
        if len(done) == 1:  # a partial record first: a long run cut short leaves a half
            write_result(knobs["out"], knobs, {"partial": f"{mode} mode only; the other half did not run (yet)",
                                               "modes": {mode: done[mode].figures()}})
    if len(done) < len(MODES):
        missing = [m for m in MODES if m not in done]
        print(f"bench e2e: {', '.join(done)} done; run modes={','.join(missing)} with mode_dir={mode_dir} "
              "(same knobs) to complete the comparison")
        return 0
    sync, asy = done["sync"], done["async"]
    results = [sync, asy]
    e2e = E2EFigures.of(sync, asy, shared_cores=int(knobs["gpus"]) == 0)
    # the servers alone: the sync run's generation while its trainer waited, else (a half built from run
    # records has no sampler) the async run's generation while its trainer waited
    alone, alone_from = sync.decode_tok_s_trainer_idle, "sync"
    if alone is None and asy.decode_tok_s_trainer_idle is not None:
        alone, alone_from = asy.decode_tok_s_trainer_idle, "async, trainer idle"
    figures: dict[str, Any] = {
        **dataclasses.asdict(e2e),
        "speedup": e2e.whole_run_speedup,
        "anchors": {"asyncwebrl_paper_over_webgym": 2.9, "areal_async_over_sync": 2.77},
        "shared_core_note": (
            "on one machine rollout and training share the same cores: overlap removes idle waiting "
            "(browser latency, the long tail, per-round warm-up) but cannot add compute"
            if int(knobs["gpus"]) == 0 else
            "rollout server and trainer resident on the same GPU(s), both running (shared-device layout)"
            if "|" in str(knobs["extra"]) else "rollout and trainer on separate GPUs"),
        "decode_tok_s_while_training": asy.decode_tok_s_training,
        "decode_tok_s_alone": alone,
        "decode_tok_s_alone_from": alone_from,
        "decode_share_while_training": (asy.decode_tok_s_training / alone
                                        if asy.decode_tok_s_training and alone else None),
        "half_sources": {r.mode: r.source for r in results},
        "refresh_s": asy.steady_phase_s("weight_sync"),
        "trainer_idle_frac": {r.mode: r.trainer_idle_frac for r in results},
        "rollout_idle_frac": {r.mode: r.rollout_idle_frac for r in results},
        "modes": {r.mode: r.figures() for r in results},
        "load_avg_1min_max": max([x[0] for r in results for x in (r.load_avg_start, r.load_avg) if x], default=None),
    }
    name = knobs["out"]
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    plot = RESULTS_DIR / f"{name}_timeline.png"
    try:
        plot_timeline(results, plot)
        figures["timeline_plot"] = plot.name
    except Exception as e:  # the numbers matter more than the picture
        figures["timeline_plot_error"] = repr(e)
    (RESULTS_DIR / f"{name}_timeline.json").write_text(json.dumps({r.mode: r.timeline for r in results}))
    write_result(name, knobs, figures, machine=_halves_machine(results, str(knobs["machine_note"])))
    rows = [{"mode": r.mode, "steady s/step": r.steady_step_s, "traj/s": r.trajectories_per_s,
             "tok/s": r.tokens_per_s, "rollout": r.steady_phase_s("rollout_wait"), "train": r.steady_phase_s("train"),
             "sync": r.steady_phase_s("weight_sync"), "trainer_idle": r.trainer_idle_frac,
             "rollout_idle": r.rollout_idle_frac, "cpu_busy": r.cpu_busy_frac, "failed": r.failed_episodes,
             "decode_train": r.decode_tok_s_training, "decode_idle": r.decode_tok_s_trainer_idle}
            for r in results]
    print_table(rows, f"e2e async/sync: steady state {e2e.steady_state_speedup:.2f}x, whole run "
                      f"{e2e.whole_run_speedup:.2f}x (ideal overlap bound {e2e.ideal_overlap_bound:.2f}x, "
                      f"share of ideal {e2e.share_of_ideal:.2f}; pool bound {_fmt(e2e.pool_bound)}x"
                      + (f"; shared-core bound {e2e.shared_core_bound:.2f}x" if e2e.shared_core_bound else "")
                      + ")")
    return 0


def _halves_machine(results: list[ModeResult], note: str) -> dict[str, Any] | None:
    """The record's machine: the halves' own (None = this machine, when they ran here); halves that
    ran elsewhere and carry no record of it are named by `machine_note` (the knob), with this machine
    as where they were combined."""
    here = machine_info()
    kept = [r.machine for r in results if r.machine]
    if kept and all(m == kept[0] for m in kept) and len(kept) == len(results):
        return None if kept[0] == here else kept[0]
    if not note and not kept:
        return None
    return {"halves_ran_on": note or None, "halves": {r.mode: r.machine or None for r in results},
            "combined_on": here}


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _one_mode_main(argv: list[str]) -> int:
    mode, out, knobs = argv[0], Path(argv[1]), json.loads(argv[2])
    res = run_mode(mode, knobs)
    out.write_text(json.dumps(dataclasses.asdict(res), default=float))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one-mode":
        sys.exit(_one_mode_main(sys.argv[2:]))
    sys.exit(main(sys.argv[1:]))
