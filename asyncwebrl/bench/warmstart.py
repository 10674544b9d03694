"""`asyncwebrl bench warmstart`: greedy success of the base model vs the behaviour-cloned one (issue 19).

On the default run's training tasks (env.tasks of the default config, or `tasks=`), the SAME fixed
evaluation episodes (`evaluation.evaluate.evaluate_model`, the `asyncwebrl eval` path: one embedded
server, `eval_task_sets`, greedy) are played by the base model and by the model after the warm start
(`training.warm_start.run_warm_start`: oracle demonstrations on real Chromium through the rollout
episode loop, then `FSDPActor.bc_step` epochs on an in-process trainer rank, as the controller runs it),
whose weights are written as a checkpoint and served. Held-out tasks are evaluated too (never
demonstrated). Headline: eval_warm vs eval_base.

Knobs (key=value): n_demos (per task), epochs, lr (null = warm_start.lr default), batch_size,
eval_episodes, tasks ('' = env.tasks), extra (';'-separated config overrides), workdir.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncwebrl.bench.common import parse_overrides, print_table
from asyncwebrl.results import write_result

DEFAULTS = {
    # the warm start of `make train` (the Makefile's TRAIN_ARGS: 24 demonstrations per task, 8 epochs),
    # so the bench says what the default run's version 0 owes to it; about 15 minutes of cloning on 2 cores
    "n_demos": 24,
    "epochs": 8,
    "lr": None,
    "batch_size": 16,
    "eval_episodes": 30,  # the default run's evaluation set: 6 per training task, one episode moves it by 0.033
    "tasks": "",
    "extra": "",
    "workdir": "/tmp/asyncwebrl-bench-warmstart",
}


@dataclass
class EvalResult:
    """One greedy evaluation (the figures `run_eval_episodes` returns, read field by field)."""

    success_rate: float
    n_episodes: int
    invalid_rate: float
    per_task: dict[str, float]
    heldout_success_rate: float | None = None
    heldout_per_task: dict[str, float] = field(default_factory=dict)
    time_s: float = 0.0
    shortcut_baseline: float | None = None
    """the best constant answer's success on the same episodes (None: test_rollout.shortcut_baseline off)"""
    shortcut_policy: str | None = None
    heldout_shortcut_baseline: float | None = None

    @classmethod
    def from_figures(cls, f: dict[str, Any], time_s: float) -> EvalResult:
        """From `evaluate_model`'s figures, with the shortcut entries of `shortcut_figures` when present."""
        held = f.get("heldout")
        return cls(success_rate=float(f["success_rate"]), n_episodes=int(f["n_episodes"]),
                   invalid_rate=float(f["invalid_rate"]), per_task={k: float(v) for k, v in f["per_task"].items()},
                   heldout_success_rate=float(held["success_rate"]) if held else None,
                   heldout_per_task={k: float(v) for k, v in held["per_task"].items()} if held else {},
                   time_s=time_s, shortcut_baseline=f.get("shortcut_baseline"),
                   shortcut_policy=f.get("shortcut_policy"),
                   heldout_shortcut_baseline=held.get("shortcut_baseline") if held else None)


@dataclass
class WarmStartBench:
    """The recorded figures (bench/results/warmstart.json)."""

    eval_base: float
    eval_warm: float
    eval_gain: float
    heldout_base: float | None
    heldout_warm: float | None
    eval_episodes: int
    tasks: list[str]
    demos: int
    """successful oracle demonstration episodes cloned"""
    demo_steps: int
    demo_attempts: int
    demos_per_task: dict[str, int]
    bc_epochs: list[dict[str, float]]
    """per epoch: token-mean NLL of the demonstrated tokens, updates, grad norm, time"""
    bc_nll_first: float
    bc_nll_last: float
    demo_collect_s: float
    bc_train_s: float
    bc_wall_s: float
    """demonstrations + behaviour cloning: what the warm start adds to a run"""
    base: EvalResult
    warm: EvalResult
    shortcut_baseline: float | None = None
    """the best constant answer (`click [k]`, first of a role) on the same evaluation episodes, played once
    beside the warm-started evaluation (its policy and the held-out one are in `warm`)"""
    gain_over_shortcut: float | None = None
    """eval_warm - shortcut_baseline: what the cloned policy adds over answering by position"""


def _config(knobs: dict[str, Any]):
    from asyncwebrl.config import load_run_config

    ovs = ["warm_start.enabled=true", f"warm_start.n_demos={knobs['n_demos']}",
           f"warm_start.epochs={knobs['epochs']}", f"warm_start.batch_size={knobs['batch_size']}",
           f"test_rollout.n_episodes={knobs['eval_episodes']}", f"cluster.fileroot={knobs['workdir']}",
           "scheduler.type=local", "stats.tensorboard=false"]
    if knobs["lr"] is not None:
        ovs.append(f"warm_start.lr={knobs['lr']}")
    if knobs["tasks"]:
        ovs.append(f"env.tasks={knobs['tasks']}")
    return load_run_config(None, ovs + [o for o in str(knobs["extra"]).split(";") if o.strip()])


def run(knobs: dict[str, Any]) -> WarmStartBench:
    from asyncwebrl.controller.warm_start import run_warm_start, warm_start_tasks
    from asyncwebrl.evaluation.evaluate import evaluate_model
    from asyncwebrl.models.prepare import resolve_model_path
    from asyncwebrl.rollout.workflow import cached_adapter
    from asyncwebrl.scheduling.trainer_host import start_trainer

    cfg = _config(knobs)
    work = Path(knobs["workdir"])
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    base_path = resolve_model_path(cfg.actor.path)
    t0 = time.monotonic()
    # the shortcut baseline depends only on the episodes, so it is played once, with the warm evaluation
    base_cfg = dataclasses.replace(cfg, test_rollout=dataclasses.replace(cfg.test_rollout, shortcut_baseline=False))
    base = EvalResult.from_figures(evaluate_model(base_cfg, base_path, version=0), time.monotonic() - t0)
    print(f"base model: greedy success {base.success_rate:.3f} on {base.n_episodes} episodes", flush=True)

    trainer = start_trainer(cfg, None)
    try:
        t0 = time.monotonic()
        rep = run_warm_start(cfg, trainer, cached_adapter(base_path))
        bc_wall = time.monotonic() - t0
        ckpt = trainer.save_checkpoint(str(work / "checkpoints"), {}, keep_last=1)
    finally:
        trainer.close()
    print(f"warm start: {rep.demos} demonstrations, NLL {rep.nll_first:.3f} -> {rep.nll_last:.3f}, "
          f"{bc_wall:.0f} s", flush=True)
    t0 = time.monotonic()
    warm = EvalResult.from_figures(evaluate_model(cfg, str(ckpt), version=0), time.monotonic() - t0)
    return WarmStartBench(
        eval_base=base.success_rate, eval_warm=warm.success_rate, eval_gain=warm.success_rate - base.success_rate,
        heldout_base=base.heldout_success_rate, heldout_warm=warm.heldout_success_rate,
        eval_episodes=base.n_episodes, tasks=warm_start_tasks(cfg), demos=rep.demos, demo_steps=rep.samples,
        demo_attempts=rep.attempts, demos_per_task=rep.per_task, bc_epochs=[e.as_log() for e in rep.epochs],
        bc_nll_first=rep.nll_first, bc_nll_last=rep.nll_last, demo_collect_s=rep.collect_s,
        bc_train_s=rep.train_s, bc_wall_s=bc_wall, base=base, warm=warm, shortcut_baseline=warm.shortcut_baseline,
        gain_over_shortcut=None if warm.shortcut_baseline is None else warm.success_rate - warm.shortcut_baseline)


def main(overrides: list[str] | None = None) -> int:
    knobs = parse_overrides(overrides, DEFAULTS)
    res = run(knobs)
    write_result("warmstart", knobs, dataclasses.asdict(res))
    rows = [{"task": t, "base": res.base.per_task.get(t), "warm": res.warm.per_task.get(t)}
            for t in sorted(set(res.base.per_task) | set(res.warm.per_task))]
    rows.append({"task": "held-out", "base": res.heldout_base, "warm": res.heldout_warm})
    if res.shortcut_baseline is not None:
        rows.append({"task": f"shortcut ({res.warm.shortcut_policy})", "base": res.shortcut_baseline,
                     "warm": res.shortcut_baseline})
    print_table(rows, f"greedy eval success on {res.eval_episodes} episodes: base {res.eval_base:.3f} -> "
                      f"warm start {res.eval_warm:.3f} ({res.demos} oracle demos, {res.bc_wall_s:.0f} s of warm start)")
    return 0
