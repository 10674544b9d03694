"""Export the kept episodes for the report's episode browser: annotated screenshot copies plus the
per-step record the page's script reads.

Invariant: every step of every loaded episode appears in the payload, in order; a step whose
screenshot is missing or unreadable has `image: null` and an `image_note` saying why, so the
browser can still step through it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from asyncwebrl.view.annotate import draw_action
from asyncwebrl.view.rundata import EpisodeRecord

MAX_TEXT = 4000
"""characters of raw model output kept per step (a runaway generation must not bloat the page)"""


def safe_name(traj_id: str) -> str:
    """A folder name for a trajectory id that cannot escape the report folder."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", traj_id).strip(".") or "episode"
    return name[:120]


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


def export_episode(ep: EpisodeRecord, out_root: Path, coord_mode: str = "pixel") -> dict[str, Any]:
    """Write annotated screenshots under out_root/episodes/<id>/ and return the page's record."""
    folder_name = safe_name(ep.traj_id)
    out_dir = out_root / "episodes" / folder_name
    steps = []
    for i, s in enumerate(ep.steps):
        action = s.get("action") if isinstance(s.get("action"), dict) else None
        invalid = bool(s.get("invalid"))
        image, note = None, ""
        shot = s.get("screenshot")
        if isinstance(shot, str) and shot:
            src = (ep.folder / shot).resolve()
            if ep.folder.resolve() not in src.parents:
                note = f"screenshot name '{shot}' points outside the episode folder"
            elif not src.is_file():
                note = f"screenshot {shot} is missing from the run directory"
            else:
                drawn = draw_action(src.read_bytes(), action, invalid, coord_mode)
                if drawn is None:
                    note = f"screenshot {shot} is not a readable image"
                else:
                    out_dir.mkdir(parents=True, exist_ok=True)
                    (out_dir / f"step_{i}.png").write_bytes(drawn)
                    image = f"episodes/{folder_name}/step_{i}.png"
        text = s.get("action_text")
        text = "" if text is None else str(text)
        if len(text) > MAX_TEXT:
            text = text[:MAX_TEXT] + f" ... [{len(text) - MAX_TEXT} more characters]"
        steps.append({
            "k": i, "image": image, "image_note": note, "action_text": text, "action": action,
            "invalid": invalid, "reward": _finite(s.get("reward")),
            "versions_summary": versions_summary(s.get("versions")),
            "behave_logprob_mean": _finite(s.get("behave_logprob_mean")),
            "behave_logprob_min": _finite(s.get("behave_logprob_min")),
            "n_prompt_tokens": _int(s.get("n_prompt_tokens")), "n_output_tokens": _int(s.get("n_output_tokens")),
        })
    return {
        "traj_id": ep.traj_id, "task_id": ep.task_id, "version": ep.version, "reward": ep.reward,
        "success": ep.success, "outcome": ep.outcome, "truncated": ep.truncated,
        "n_invalid": max(ep.n_invalid, sum(1 for s in steps if s["invalid"])),
        "instruction": ep.instruction, "steps": steps,
    }


def export_episodes(episodes: list[EpisodeRecord], out_root: Path, coord_mode: str = "pixel") -> list[dict[str, Any]]:
    """The page records of all episodes, newest version first."""
    ordered = sorted(episodes, key=lambda e: (-e.version, e.task_id, e.traj_id))
    return [export_episode(ep, out_root, coord_mode) for ep in ordered]
