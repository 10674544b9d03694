"""Results files (SPEC section 11): `bench/results/NAME.json` = {name, date, machine, config, figures}.

The bottom floor, so that a run (`asyncwebrl train --record`) and a benchmark write the same shape.
A file is replaced atomically: a reader never sees half of one."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path
from typing import Any

import psutil

RESULTS_DIR = Path(os.environ.get("ASYNCWEBRL_BENCH_DIR", Path(__file__).resolve().parents[1] / "bench" / "results"))


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


def write_result(name: str, config: dict[str, Any], figures: dict[str, Any], path: Path | None = None,
                 machine: dict[str, Any] | None = None) -> Path:
    """Write bench/results/NAME.json; `machine`: where the figures were measured when that is not
    this process's machine (halves run elsewhere and combined here), else this machine."""
    out = path or RESULTS_DIR / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "name": name,
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": machine or machine_info(),
        "config": config,
        "figures": figures,
    }
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str))
    tmp.rename(out)
    return out
