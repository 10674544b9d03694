"""The run directory: everything a run leaves for people and tools to read.

Layout (relative to `cfg.run_dir`)::

    config.yaml          resolved config
    metrics.jsonl        one JSON object per line: {"kind", "step", "time", ...figures}
                         kind = "train" (one per training step), "eval" (one per evaluated checkpoint,
                         with "version"), "rollout" (pool statistics), "summary" (end of run),
                         "warm_start" (one per behaviour-cloning epoch, step = epoch)
    timeline.jsonl       {"step", "phase", "start", "end"} with phase in rollout_wait, train,
                         weight_sync, eval, checkpoint, warm_start (seconds since run start)
    episodes/index.jsonl one line per kept episode: {traj_id, task_id, version, reward, success,
                         n_steps, n_invalid, truncated, dir}
    episodes/<traj_id>/episode.json   steps with action_text, action, invalid, reward, versions,
                         behave logprob summary, screenshot file names
    episodes/<traj_id>/step_<k>.png   the screenshot the model saw at step k
    tb/                  TensorBoard event files
    checkpoints/         atomic checkpoints (training.checkpoint)
    summary.json         headline figures of the finished run

Invariant: the episode sample is bounded (`stats.keep_episodes`, reservoir sampling with the most
recent episodes favoured), so a run directory does not grow without bound; every file is appended
or replaced atomically, so a reader never sees a half-written JSON line.
"""

from __future__ import annotations

import json
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any


def set_aside_previous(root: Path) -> Path | None:
    """A fresh run (recover=off) into a directory that holds an earlier run: move that run to
    `<root>.prev` (replacing an older `.prev`) and return where it went; None when there was nothing.

    Without this the new run appended to the old metrics.jsonl and found the old checkpoints: its
    test-rollout thread evaluated the previous run's last checkpoint as this run's first evaluation,
    and the summary mixed both runs' evaluations (measured: a second `make train`)."""
    root = Path(root)
    if not root.is_dir() or not any(root.iterdir()):
        return None
    prev = root.with_name(root.name + ".prev")
    if prev.exists():
        shutil.rmtree(prev)
    root.rename(prev)
    return prev


class RunDir:
    def __init__(self, root: Path, keep_episodes: int = 64, tensorboard: bool = True, seed: int = 0,
                 wandb_project: str | None = None, config: dict[str, Any] | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "episodes").mkdir(exist_ok=True)
        self.keep_episodes = keep_episodes
        self.t0 = time.time()
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._seen = 0
        self._kept: list[str] = self._load_kept()
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.root / "tb"))
            except Exception:  # tensorboard is optional at run time
                self._tb = None
        self._wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("stats.wandb_project is set but wandb is not installed: pip install "
                                   "'asyncwebrl[wandb]'") from e
            self._wandb = wandb.init(project=wandb_project, name=self.root.name, dir=str(self.root), config=config)

    def _load_kept(self) -> list[str]:
        idx = self.root / "episodes" / "index.jsonl"
        if not idx.exists():
            return []
        return [json.loads(line)["traj_id"] for line in idx.read_text().splitlines() if line.strip()]

    def now(self) -> float:
        return time.time() - self.t0

    def _append(self, name: str, record: dict[str, Any]) -> None:
        line = json.dumps(record, default=float) + "\n"
        with self._lock, open(self.root / name, "a") as f:
            f.write(line)

    def log_metrics(self, kind: str, step: int, figures: dict[str, Any]) -> None:
        rec = {"kind": kind, "step": step, "time": round(self.now(), 3), **figures}
        self._append("metrics.jsonl", rec)
        if self._tb is not None:
            for k, v in figures.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"{kind}/{k}", v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({f"{kind}/{k}": v for k, v in figures.items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool)}, step=step)

    def log_phase(self, step: int, phase: str, start: float, end: float) -> None:
        """start/end as returned by `now()`."""
        self._append("timeline.jsonl", {"step": step, "phase": phase, "start": round(start, 4), "end": round(end, 4)})

    def keep_episode(self, traj, version: int, screenshots) -> bool:
        """Reservoir-sample one finished episode (with the screenshots of its steps) for the viewer.
        `screenshots` is a list (one PNG or None per step) or a callable returning it, called only
        for episodes that are kept (so pixels are fetched only for the sample)."""
        with self._lock:
            self._seen += 1
            if len(self._kept) < self.keep_episodes:
                evict = None
            else:
                j = self._rng.randrange(self._seen)
                if j >= self.keep_episodes:
                    return False
                evict = self._kept[j]
            if callable(screenshots):
                screenshots = screenshots()
            d = self.root / "episodes" / traj.traj_id
            d.mkdir(parents=True, exist_ok=True)
            steps = []
            for k, s in enumerate(traj.steps):
                png = screenshots[k] if k < len(screenshots) else None
                name = None
                if png:
                    name = f"step_{k}.png"
                    (d / name).write_bytes(png)
                lps = s.behave_logprobs
                steps.append({
                    "k": k, "action_text": s.action_text, "action": s.action, "invalid": s.invalid,
                    "reward": s.step_reward, "versions": s.versions, "screenshot": name,
                    "n_prompt_tokens": len(s.prompt_ids), "n_output_tokens": len(s.output_ids),
                    "behave_logprob_mean": (sum(lps) / len(lps)) if lps else None,
                    "behave_logprob_min": min(lps) if lps else None,
                })
            doc = {
                "traj_id": traj.traj_id, "task_id": traj.task_id, "version": version,
                "reward": traj.reward, "raw_reward": traj.raw_reward, "success": traj.success,
                "truncated": traj.truncated, "failed": traj.failed, "n_invalid": traj.n_invalid,
                "n_no_effect": traj.n_no_effect, "instruction": traj.info.get("instruction", ""), "steps": steps,
            }
            (d / "episode.json").write_text(json.dumps(doc, default=float))
            if evict is not None:
                shutil.rmtree(self.root / "episodes" / evict, ignore_errors=True)
                self._kept[self._kept.index(evict)] = traj.traj_id
            else:
                self._kept.append(traj.traj_id)
            self._rewrite_index()
            return True

    def _rewrite_index(self) -> None:
        lines = []
        for tid in self._kept:
            p = self.root / "episodes" / tid / "episode.json"
            if p.exists():
                e = json.loads(p.read_text())
                lines.append(json.dumps({
                    "traj_id": tid, "task_id": e["task_id"], "version": e["version"], "reward": e["reward"],
                    "success": e["success"], "n_steps": len(e["steps"]), "n_invalid": e["n_invalid"],
                    "truncated": e["truncated"], "dir": f"episodes/{tid}",
                }))
        tmp = self.root / "episodes" / "index.jsonl.tmp"
        tmp.write_text("\n".join(lines) + ("\n" if lines else ""))
        tmp.replace(self.root / "episodes" / "index.jsonl")

    def write_summary(self, summary: dict[str, Any]) -> Path:
        out = self.root / "summary.json"
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=2, default=float))
        tmp.replace(out)
        return out

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not Path(path).exists():
        return []
    out = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line of a killed run
    return out
