"""The one benchmark convention (SPEC section 11): a short table whose last line is the headline,
and `bench/results/NAME.json` = {name, date, machine, config, figures}."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path
from typing import Any

import psutil

RESULTS_DIR = Path(os.environ.get("ASYNCWEBRL_BENCH_DIR", Path(__file__).resolve().parents[2] / "bench" / "results"))


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        pass
    return info


def parse_overrides(overrides: list[str] | None, defaults: dict[str, Any]) -> dict[str, Any]:
    """key=value overrides of a benchmark's own knobs; unknown keys are an error."""
    import yaml

    out = dict(defaults)
    for ov in overrides or []:
        if "=" not in ov:
            raise SystemExit(f"benchmark override '{ov}' must be key=value")
        k, v = ov.split("=", 1)
        if k not in out:
            raise SystemExit(f"unknown benchmark knob '{k}'; valid: {', '.join(sorted(out))}")
        out[k] = yaml.safe_load(v)
    return out


def print_table(rows: list[dict[str, Any]], headline: str) -> None:
    if rows:
        cols = list(rows[0])
        widths = [max(len(str(c)), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
        print("  ".join(str(c).ljust(w) for c, w in zip(cols, widths, strict=False)))
        for r in rows:
            print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(cols, widths, strict=False)))
    print(headline)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_result(name: str, config: dict[str, Any], figures: dict[str, Any], path: Path | None = None) -> Path:
    out = path or RESULTS_DIR / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "name": name,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "config": config,
        "figures": figures,
    }
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str))
    tmp.rename(out)
    return out
