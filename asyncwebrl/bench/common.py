"""What every benchmark shares besides writing its result (that lives in `asyncwebrl.results`): its
own key=value knobs and the printed table whose last line is the headline."""

from __future__ import annotations

from typing import Any


def parse_overrides(overrides: list[str] | None, defaults: dict[str, Any]) -> dict[str, Any]:
    """key=value overrides of a benchmark's own knobs, read by the run config's override parser
    (`configtree.parse_override`: the value as YAML); unknown keys are an error."""
    from asyncwebrl.configtree import ConfigError, parse_override

    out = dict(defaults)
    for ov in overrides or []:
        try:
            path, value = parse_override(ov)
        except ConfigError as e:
            raise SystemExit(f"benchmark {e}") from None
        k = ".".join(path)
        if k not in out:
            raise SystemExit(f"unknown benchmark knob '{k}'; valid: {', '.join(sorted(out))}")
        out[k] = value
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
