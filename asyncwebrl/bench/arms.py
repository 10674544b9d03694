"""One training run ("arm") of a learning benchmark, through the production `asyncwebrl train` path
(`run_training`: the real system, rollout, trainer, test rollout), read back as typed records.

Invariant: every figure of an `ArmResult` comes from the run's own metrics.jsonl / summary, read
into dataclasses field by field; a missing field is a KeyError, never a silent zero.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class StepRow:
    """One training step as the controller logged it (kind=train)."""

    step: int
    version: int
    time: float
    """seconds since the run started"""
    success_rate: float
    n_trajectories: int
    n_successes: float
    clip_rate: float
    """decoupled objective: share of loss tokens where the clipped branch of pi_theta/pi_prox was active"""
    clip_rate_coupled: float
    """same batch, had the ratio been pi_theta/pi_behave (the coupled objective)"""
    n_tokens: float
    n_groups: int
    zero_adv_groups: int
    staleness_hist: dict[str, int]

    @classmethod
    def from_record(cls, r: dict[str, Any]) -> StepRow:
        return cls(step=int(r["step"]), version=int(r["version"]), time=float(r["time"]),
                   success_rate=float(r["success_rate"]), n_trajectories=int(r["n_trajectories"]),
                   n_successes=float(r["success_rate"]) * (int(r["n_trajectories"]) - int(r["failed_trajectories"])),
                   clip_rate=float(r["clip_rate"]), clip_rate_coupled=float(r["clip_rate_coupled"]),
                   n_tokens=float(r["n_tokens"]), n_groups=int(r["n_groups"]), zero_adv_groups=int(r["zero_adv_groups"]),
                   staleness_hist={str(k): int(v) for k, v in r["staleness_hist"].items()})


@dataclass
class EvalRow:
    """One greedy evaluation of a checkpoint by the test-rollout group (kind=eval)."""

    version: int
    success_rate: float
    per_task: dict[str, float]
    heldout_success_rate: float | None = None

    @classmethod
    def from_record(cls, r: dict[str, Any]) -> EvalRow:
        return cls(version=int(r["version"]), success_rate=float(r["success_rate"]),
                   per_task={str(k): float(v) for k, v in r["per_task"].items()},
                   heldout_success_rate=r.get("heldout_success_rate"))


@dataclass
class ArmResult:
    name: str
    seed: int
    overrides: list[str]
    run_dir: str
    wall_s: float
    """training loop wall time (setup excluded)"""
    setup_s: float
    steps: list[StepRow] = field(default_factory=list)
    evals: list[EvalRow] = field(default_factory=list)
    shortcut_baseline: float | None = None
    """the best constant answer's success on the arm's evaluation episodes (the run summary's)"""
    shortcut_policy: str | None = None
    groups_by_task: dict[str, int] = field(default_factory=dict)
    """groups the trainer consumed per task (the run's last task sampling record)"""
    groups_to_first_success_by_task: dict[str, int | None] = field(default_factory=dict)
    """per task, its consumed groups at the end of the first step whose groups of it held a success (None:
    none in the run): the all-fail groups before that success plus the groups of that step. {} for runs
    recorded before the task sampling record counted wins"""

    def token_weighted(self, attr: str) -> float:
        n = sum(s.n_tokens for s in self.steps)
        return sum(getattr(s, attr) * s.n_tokens for s in self.steps) / n if n else 0.0

    @property
    def clip_rate(self) -> float:
        return self.token_weighted("clip_rate")

    @property
    def clip_rate_coupled(self) -> float:
        return self.token_weighted("clip_rate_coupled")

    @property
    def successes_per_s(self) -> float:
        """successful training episodes consumed per second of training wall time"""
        return sum(s.n_successes for s in self.steps) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def eval_first(self) -> float | None:
        return self.evals[0].success_rate if self.evals else None

    @property
    def eval_last(self) -> float | None:
        return self.evals[-1].success_rate if self.evals else None

    @property
    def heldout_first(self) -> float | None:
        """held-out success at the first evaluation (None when the run evaluated no held-out tasks)"""
        return self.evals[0].heldout_success_rate if self.evals else None

    @property
    def heldout_last(self) -> float | None:
        return self.evals[-1].heldout_success_rate if self.evals else None

    @property
    def gain_over_shortcut(self) -> float | None:
        """final greedy success minus the shortcut's: an arm that only rises to it has not learned to read"""
        if self.eval_last is None or self.shortcut_baseline is None:
            return None
        return self.eval_last - self.shortcut_baseline

    @property
    def zero_adv_frac(self) -> float:
        groups = sum(s.n_groups for s in self.steps)
        return sum(s.zero_adv_groups for s in self.steps) / groups if groups else 0.0

    @classmethod
    def from_brief(cls, d: dict[str, Any]) -> ArmResult:
        """The arm back from its `brief()` in a results file (the derived figures are recomputed)."""
        return cls(name=str(d["name"]), seed=int(d["seed"]), overrides=list(d["overrides"]), run_dir=str(d["run_dir"]),
                   wall_s=float(d["wall_s"]), setup_s=float(d["setup_s"]),
                   steps=[StepRow(**s) for s in d["steps"]], evals=[EvalRow(**e) for e in d["evals"]],
                   shortcut_baseline=d["shortcut_baseline"], shortcut_policy=d["shortcut_policy"],
                   groups_by_task=dict(d["groups_by_task"]) if "groups_by_task" in d
                   else _groups_in_run_dir(Path(str(d["run_dir"]))),
                   groups_to_first_success_by_task=dict(d.get("groups_to_first_success_by_task", {})))

    def brief(self) -> dict[str, Any]:
        """The arm as recorded in bench/results (per-step rows included)."""
        d = asdict(self)
        d.update(clip_rate=self.clip_rate, clip_rate_coupled=self.clip_rate_coupled,
                 successes_per_s=self.successes_per_s, zero_adv_frac=self.zero_adv_frac, eval_first=self.eval_first, eval_last=self.eval_last,
                 gain_over_shortcut=self.gain_over_shortcut)
        return d


def groups_by_task(recs: list[dict[str, Any]]) -> dict[str, int]:
    """Consumed groups per task from the last kind=curriculum record of a run's metrics ({} if none)."""
    last = next((r for r in reversed(recs) if r.get("kind") == "curriculum"), {})
    return {k.removeprefix("groups."): int(v) for k, v in last.items() if k.startswith("groups.")}


def groups_to_first_success(recs: list[dict[str, Any]]) -> dict[str, int | None]:
    """Per task, its consumed-group count in the first kind=curriculum record whose `wins.<task>` is
    above 0 (None if no record has that; {} if the run's records carry no wins)."""
    cur = [r for r in recs if r.get("kind") == "curriculum"]
    tasks = [k.removeprefix("wins.") for k in (cur[-1] if cur else {}) if k.startswith("wins.")]
    return {t: next((int(r[f"groups.{t}"]) for r in cur if r.get(f"wins.{t}", 0) > 0), None) for t in tasks}


def _groups_in_run_dir(root: Path) -> dict[str, int]:
    """For runs recorded before `groups_by_task` was: read back from the run directory, if it is still there."""
    from asyncwebrl.controller.rundir import read_jsonl

    path = root / "metrics.jsonl"
    return groups_by_task(read_jsonl(path)) if path.is_file() else {}


def run_arm(name: str, overrides: list[str], fileroot: str, seed: int = 1, keep_checkpoints: bool = False) -> ArmResult:
    """Train one arm with the default config plus `overrides` (no bench/results write of its own).
    Once its figures are read the arm's checkpoints are deleted unless `keep_checkpoints` (each holds
    weights and optimizer state, ~1.6 GB for the default model: a 4-arm benchmark would leave ~20 GB in
    the file root); metrics.jsonl, the timeline and the config stay."""
    from asyncwebrl.config import load_run_config
    from asyncwebrl.controller.main import run_training
    from asyncwebrl.controller.rundir import read_jsonl

    trial = f"{name}-s{seed}-{int(time.time())}"
    ovs = [f"cluster.fileroot={fileroot}", f"trial_name={trial}", f"seed={seed}", "stats.progress_bar=false",
           "stats.keep_episodes=0", *overrides]
    cfg = load_run_config(None, ovs)
    summary = run_training(cfg)  # no record: only the benchmark writes bench/results
    root = Path(cfg.run_dir)
    recs = read_jsonl(root / "metrics.jsonl")
    evals = sorted((EvalRow.from_record(r) for r in recs if r.get("kind") == "eval"), key=lambda e: e.version)
    if not keep_checkpoints:
        shutil.rmtree(root / "checkpoints", ignore_errors=True)
    return ArmResult(name=name, seed=seed, overrides=ovs, run_dir=str(root), wall_s=summary.wall_time_s,
                     setup_s=summary.setup_s,
                     steps=[StepRow.from_record(r) for r in recs if r.get("kind") == "train"], evals=evals,
                     shortcut_baseline=summary.shortcut_baseline, shortcut_policy=summary.shortcut_policy,
                     groups_by_task=groups_by_task(recs), groups_to_first_success_by_task=groups_to_first_success(recs))
