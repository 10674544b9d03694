"""Export the kept episodes for the report's episode browser: annotated screenshot copies plus the
per-step record the page's script reads.

Invariant: every step of every loaded episode appears in the payload, in order; a step whose
screenshot is missing or unreadable has `image: null` and an `image_note` saying why, so the
browser can still step through it. Annotated copies are named by a hash of their source file and
action, so a rebuilt report reuses them, and copies the page no longer shows are deleted.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncwebrl.view.annotate import draw_action
from asyncwebrl.view.rundata import EpisodeRecord

ANNOTATION_REV = 2
"""bump when the drawing changes, so cached annotated copies from older reports are redrawn"""

MAX_TEXT = 4000
"""characters of raw model output kept per step (a runaway generation must not bloat the page)"""


def safe_name(traj_id: str) -> str:
    """A folder name for a trajectory id that cannot escape the report folder (and stays unique)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", traj_id).strip(".")[:100] or "episode"
    if name != traj_id:
        name += "-" + hashlib.sha1(traj_id.encode()).hexdigest()[:8]
    return name


def versions_summary(versions: Any) -> str:
    """Run-length summary of per-token weight versions, e.g. 'v3 x5, v4 x2 (2 versions: interrupted by a weight update)'."""
    if not isinstance(versions, list) or not versions:
        return "no generated tokens"
    runs: list[list[Any]] = []
    for v in versions:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    text = ", ".join(f"v{v} x{n}" for v, n in runs[:12])
    if len(runs) > 12:
        text += f", ... ({len(runs) - 12} more runs)"
    distinct = len({v for v, _ in runs})
    if distinct > 1:
        text += f" ({distinct} versions: generation spanned a weight update)"
    return text


def _finite(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(float(v)) else None


def _int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


@dataclass
class _Drawing:
    """One annotated copy to make: `dst` is named by a hash of everything that changes its pixels."""

    src: Path
    dst: Path
    action: dict[str, Any] | None
    invalid: bool
    coord_mode: str
    step: dict[str, Any]
    """the page record of the step, updated if drawing fails"""


def _plan_image(ep: EpisodeRecord, i: int, s: dict[str, Any], out_root: Path, coord_mode: str,
                action: dict[str, Any] | None, invalid: bool) -> tuple[_Drawing | None, str]:
    """The drawing to make for step i, or None and the reason the step has no image."""
    shot = s.get("screenshot")
    if not isinstance(shot, str) or not shot:
        return None, "no screenshot kept for this step"
    src = (ep.folder / shot).resolve()
    if ep.folder.resolve() not in src.parents:
        return None, f"screenshot name '{shot}' points outside the episode folder"
    try:
        st = src.stat()
    except OSError:
        return None, f"screenshot {shot} is missing from the run directory"
    key = json.dumps([ANNOTATION_REV, st.st_size, st.st_mtime_ns, action, invalid, coord_mode],
                     sort_keys=True, default=str)
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    dst = out_root / "episodes" / safe_name(ep.traj_id) / f"step_{i}_{digest}.png"
    return _Drawing(src, dst, action, invalid, coord_mode, step={}), ""


def _draw(job: _Drawing) -> bool:
    """Make the annotated copy unless an identical one exists (reports are rebuilt often during a run)."""
    if job.dst.is_file():
        return True
    try:
        drawn = draw_action(job.src.read_bytes(), job.action, job.invalid, job.coord_mode)
    except OSError:
        drawn = None
    if drawn is None:
        return False
    job.dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = job.dst.with_suffix(".tmp")
    tmp.write_bytes(drawn)
    tmp.replace(job.dst)
    return True


def episode_record(ep: EpisodeRecord, out_root: Path, coord_mode: str, jobs: list[_Drawing]) -> dict[str, Any]:
    """The page's record of one episode; the screenshots it needs are appended to `jobs`."""
    steps = []
    for i, s in enumerate(ep.steps):
        action = s.get("action") if isinstance(s.get("action"), dict) else None
        invalid = bool(s.get("invalid"))
        job, note = _plan_image(ep, i, s, out_root, coord_mode, action, invalid)
        text = s.get("action_text")
        text = "" if text is None else str(text)
        if len(text) > MAX_TEXT:
            text = text[:MAX_TEXT] + f" ... [{len(text) - MAX_TEXT} more characters]"
        step = {
            "k": i, "image": job.dst.relative_to(out_root).as_posix() if job else None, "image_note": note,
            "action_text": text, "action": action, "invalid": invalid, "reward": _finite(s.get("reward")),
            "versions_summary": versions_summary(s.get("versions")),
            "behave_logprob_mean": _finite(s.get("behave_logprob_mean")),
            "behave_logprob_min": _finite(s.get("behave_logprob_min")),
            "n_prompt_tokens": _int(s.get("n_prompt_tokens")), "n_output_tokens": _int(s.get("n_output_tokens")),
        }
        if job:
            job.step = step
            jobs.append(job)
        steps.append(step)
    return {
        "traj_id": ep.traj_id, "task_id": ep.task_id, "version": ep.version, "reward": ep.reward,
        "success": ep.success, "outcome": ep.outcome, "truncated": ep.truncated,
        "n_invalid": max(ep.n_invalid, sum(1 for s in steps if s["invalid"])),
        "instruction": ep.instruction, "steps": steps,
    }


def _prune(folder: Path, keep: set[Path]) -> None:
    """Remove annotated copies (and episode folders) that the current page no longer shows."""
    if not folder.is_dir():
        return
    for d in folder.iterdir():
        if not d.is_dir():
            d.unlink(missing_ok=True)
            continue
        for f in d.iterdir():
            if f not in keep:
                f.unlink(missing_ok=True)
        if not any(d.iterdir()):
            d.rmdir()


def export_episodes(episodes: list[EpisodeRecord], out_root: Path, coord_mode: str = "pixel",
                    workers: int | None = None) -> list[dict[str, Any]]:
    """The page records of all episodes (newest version first), with their annotated screenshots
    under out_root/episodes/. Drawing runs on a few threads (PIL releases the GIL while coding PNGs)."""
    ordered = sorted(episodes, key=lambda e: (-e.version, e.task_id, e.traj_id))
    jobs: list[_Drawing] = []
    payload = [episode_record(ep, out_root, coord_mode, jobs) for ep in ordered]
    n = workers or min(4, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=max(1, n)) as pool:
        done = list(pool.map(_draw, jobs))
    for job, ok in zip(jobs, done, strict=True):
        if not ok:
            job.step["image"] = None
            job.step["image_note"] = f"screenshot {job.src.name} is not a readable image"
    _prune(out_root / "episodes", {job.dst for job, ok in zip(jobs, done, strict=True) if ok})
    return payload
