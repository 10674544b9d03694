"""Read a run directory (layout: `asyncwebrl.controller.rundir`) into one in-memory record for the report.

Invariant: loading never raises on a partial, empty or damaged run directory (a run killed early,
a torn JSON line, an episode folder evicted between reading the index and the folder). Whatever
could not be read is left out and described in `RunData.problems`, so the report can say so.
The only error is a run directory that does not exist or is not a folder (`RunDirError`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from asyncwebrl.controller.rundir import read_jsonl


class RunDirError(ValueError):
    """The path given as a run directory cannot be one."""


@dataclass
class EpisodeRecord:
    """One kept episode as the viewer shows it (episode.json plus where its screenshots are)."""

    traj_id: str
    task_id: str
    version: int
    reward: float
    success: bool
    truncated: bool
    failed: bool
    n_invalid: int
    instruction: str
    steps: list[dict[str, Any]]
    folder: Path
    """episodes/<traj_id> inside the run directory"""

    @property
    def outcome(self) -> str:
        """success | failure | crashed (a crashed episode carries no training signal)"""
        if self.failed:
            return "crashed"
        return "success" if self.success else "failure"


@dataclass
class RunData:
    root: Path
    config_text: str = ""
    coord_mode: str = "pixel"
    """env.coord_mode of the run: how to read action coordinates ("pixel" or "norm1000")"""
    train: list[dict[str, Any]] = field(default_factory=list)
    """metrics.jsonl records with kind=train, in file order"""
    eval: list[dict[str, Any]] = field(default_factory=list)
    rollout: list[dict[str, Any]] = field(default_factory=list)
    curriculum: list[dict[str, Any]] = field(default_factory=list)
    """metrics.jsonl records with kind=curriculum (per-task success EMA and sampling share per step)"""
    summary_metrics: list[dict[str, Any]] = field(default_factory=list)
    """metrics.jsonl records with kind=summary"""
    timeline: list[dict[str, Any]] = field(default_factory=list)
    """timeline.jsonl records with a phase name and numeric start <= end"""
    episodes: list[EpisodeRecord] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    """summary.json (empty while the run is still going)"""
    problems: list[str] = field(default_factory=list)
    """what could not be read, for the report's notes"""

    @property
    def is_empty(self) -> bool:
        return not (self.train or self.eval or self.timeline or self.episodes or self.summary)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _load_metrics(data: RunData) -> None:
    for rec in read_jsonl(data.root / "metrics.jsonl"):
        if not isinstance(rec, dict):
            continue
        kind = rec.get("kind")
        bucket = {"train": data.train, "eval": data.eval, "rollout": data.rollout,
                  "curriculum": data.curriculum, "summary": data.summary_metrics}.get(kind)
        if bucket is not None:
            bucket.append(rec)


def _load_timeline(data: RunData) -> None:
    dropped = 0
    for rec in read_jsonl(data.root / "timeline.jsonl"):
        ok = (isinstance(rec, dict) and isinstance(rec.get("phase"), str)
              and _is_number(rec.get("start")) and _is_number(rec.get("end")) and rec["end"] >= rec["start"])
        if ok:
            data.timeline.append(rec)
        else:
            dropped += 1
    if dropped:
        data.problems.append(f"timeline.jsonl: {dropped} malformed record(s) skipped")


def _as_int(v: Any, default: int = -1) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _as_float(v: Any, default: float = 0.0) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return default


def _load_episode(root: Path, entry: dict[str, Any]) -> EpisodeRecord | str:
    """The episode, or a one-line reason why it cannot be shown."""
    traj_id = str(entry.get("traj_id", ""))
    rel = entry.get("dir") or f"episodes/{traj_id}"
    folder = (root / str(rel)).resolve()
    if root.resolve() not in folder.parents:
        return f"episode '{traj_id}': folder '{rel}' lies outside the run directory"
    path = folder / "episode.json"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return f"episode '{traj_id}': {rel}/episode.json is missing (evicted or not yet written)"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"episode '{traj_id}': {rel}/episode.json unreadable ({type(e).__name__})"
    if not isinstance(doc, dict):
        return f"episode '{traj_id}': episode.json is not an object"
    steps = [s for s in doc.get("steps") or [] if isinstance(s, dict)]
    return EpisodeRecord(
        traj_id=str(doc.get("traj_id", traj_id)), task_id=str(doc.get("task_id", entry.get("task_id", "?"))),
        version=_as_int(doc.get("version", entry.get("version"))), reward=_as_float(doc.get("reward")),
        success=bool(doc.get("success")), truncated=bool(doc.get("truncated")), failed=bool(doc.get("failed")),
        n_invalid=_as_int(doc.get("n_invalid"), 0), instruction=str(doc.get("instruction") or ""),
        steps=steps, folder=folder,
    )


def _load_episodes(data: RunData) -> None:
    index = data.root / "episodes" / "index.jsonl"
    entries = [e for e in read_jsonl(index) if isinstance(e, dict) and e.get("traj_id")]
    if not entries and (data.root / "episodes").is_dir():
        # No index yet (or a torn one): fall back to the folders themselves.
        entries = [{"traj_id": p.name, "dir": f"episodes/{p.name}"}
                   for p in sorted((data.root / "episodes").iterdir()) if (p / "episode.json").is_file()]
    seen: set[str] = set()
    for entry in entries:
        got = _load_episode(data.root, entry)
        if isinstance(got, str):
            data.problems.append(got)
        elif got.traj_id not in seen:
            seen.add(got.traj_id)
            data.episodes.append(got)


def _coord_mode(config_text: str, problems: list[str]) -> str:
    try:
        tree = yaml.safe_load(config_text) if config_text else None
    except yaml.YAMLError:
        problems.append("config.yaml is not valid YAML; action coordinates drawn as pixels")
        return "pixel"
    env = tree.get("env") if isinstance(tree, dict) else None
    mode = env.get("coord_mode") if isinstance(env, dict) else None
    return mode if mode in ("pixel", "norm1000") else "pixel"


def load_run(root: Path | str) -> RunData:
    """Everything the report shows, from a run directory that may still be growing."""
    root = Path(root)
    if not root.exists():
        raise RunDirError(f"run directory '{root}' does not exist")
    if not root.is_dir():
        raise RunDirError(f"'{root}' is not a directory; pass the run directory (the folder with metrics.jsonl)")
    data = RunData(root=root)
    cfg = root / "config.yaml"
    if cfg.is_file():
        try:
            data.config_text = cfg.read_text(errors="replace")
        except OSError as e:
            data.problems.append(f"config.yaml unreadable ({e})")
        data.coord_mode = _coord_mode(data.config_text, data.problems)
    _load_metrics(data)
    _load_timeline(data)
    _load_episodes(data)
    summary = root / "summary.json"
    if summary.is_file():
        try:
            got = json.loads(summary.read_text())
            data.summary = got if isinstance(got, dict) else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            data.problems.append("summary.json unreadable")
    return data
