"""Measured browser latencies for the synthetic env to replay (recorded by `asyncwebrl record-latency FILE`,
which lives in `asyncwebrl.bench.latency`: the table knows nothing of browsers).

GPU boxes have no Chromium, so the web-shaped workload replays latencies measured here on real
Chromium playing real MiniWoB++ tasks: each sample is one wall-clock duration of
- `step_ms`: one action (act + settle + observation: state read and screenshot);
- `reset_ms`: one page load of a new task on a warm session (goto, task start, first observation);
- `first_reset_ms`: the first reset of a fresh session (new browser context + page + page load);
- `warmup_ms`: first_reset_ms minus the median reset_ms, the per-session warm-up a synchronous
  pool pays again every round when it relaunches its sessions;
- `browser_launch_ms`: starting Chromium itself (once per recording).
Sessions run `concurrency` at a time, as in a rollout pool, so the samples include the contention
of concurrent sessions on this machine's cores.

Invariant: a `LatencyTable` is the recorded samples themselves (no fitted distribution): the
synthetic env draws uniformly from them, so every quantile it replays was observed.
"""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class LatencyTable:
    """Recorded latency samples in milliseconds (see module docstring)."""

    step_ms: list[float]
    reset_ms: list[float]
    first_reset_ms: list[float]
    warmup_ms: list[float]
    browser_launch_ms: float = 0.0
    source: dict[str, Any] = field(default_factory=dict)

    def validate(self, where: str = "latency table") -> None:
        for name in ("step_ms", "reset_ms", "warmup_ms"):
            vals = getattr(self, name)
            if not vals or any(not isinstance(v, int | float) or v < 0 for v in vals):
                raise ValueError(f"{where}: {name} must be a non-empty list of durations >= 0 ms")

    @classmethod
    def load(cls, path: str | Path) -> LatencyTable:
        p = Path(path)
        try:
            raw = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the latency file {p}: {e}") from None
        keys = {f for f in cls.__dataclass_fields__}
        unknown = set(raw) - keys - {"summary"}
        if unknown:
            raise ValueError(f"latency file {p}: unknown keys {sorted(unknown)}")
        try:
            table = cls(**{k: v for k, v in raw.items() if k in keys})
        except TypeError as e:
            raise ValueError(f"latency file {p}: {e}") from None
        table.validate(str(p))
        return table

    def draw(self, kind: str, rng: random.Random) -> float:
        """One recorded sample of `kind` (step, reset, warmup), in seconds."""
        return rng.choice(getattr(self, f"{kind}_ms")) / 1000.0

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for name in ("step_ms", "reset_ms", "first_reset_ms", "warmup_ms"):
            v = sorted(getattr(self, name))
            if v:
                out[name] = {"n": len(v), "median": round(statistics.median(v), 1),
                             "p90": round(v[int(0.9 * (len(v) - 1))], 1), "max": round(v[-1], 1),
                             "mean": round(statistics.fmean(v), 1)}
        return out

    def save(self, path: str | Path) -> None:
        d = asdict(self)
        d["summary"] = self.summary()
        Path(path).write_text(json.dumps(d, indent=1) + "\n")
