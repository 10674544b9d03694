"""Building typed config trees from YAML plus dotted command-line overrides.

Each component owns a keyword-only dataclass next to its code (`asyncwebrl/<role>/config.py`);
the run is a tree of them (`asyncwebrl.config.RunConfig`). This module turns plain data into such a
tree and keeps one invariant: a config object that exists is fully typed and validated. Unknown
keys, wrong types and impossible values fail here, before any process starts, with the dotted key
and (for typos) the closest valid keys in the message.

OmegaConf does the layering: the YAML file and the dotted overrides are merged by OmegaConf (so
`${...}` interpolation works in files and overrides, e.g. `cluster.fileroot=${oc.env:SCRATCH}`), and
the resolved plain data is then built into the typed tree here, where each component's `validate()`
runs and errors name the dotted key with close-match hints.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and what to do."""


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, tuple):
        args = get_args(tp)
        return f"list[{_type_name(args[0])}]" if args else "list"
    if origin is dict:
        return "dict"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against annotation `tp`; allow only lossless conversions (int -> float)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ConfigError(f"config key '{key}' must be one of {_type_name(tp)}, got {value!r}")
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"config key '{key}' must be {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' is a section; give a mapping, got {value!r}")
        return build(tp, value, prefix=key + ".")
    if origin in (list, tuple):
        if isinstance(value, (list, tuple)):
            (inner,) = get_args(tp)[:1] or (Any,)
            return [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        raise ConfigError(f"config key '{key}' must be a list, got {value!r}")
    if origin is dict or tp is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads '3e-5' (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"config key '{key}' must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key '{key}' must be a string, got {value!r}")
    if isinstance(value, tp):
        return value
    raise ConfigError(f"config key '{key}' must be {_type_name(tp)}, got {value!r}")


def build(cls: type[T], data: dict[str, Any] | None, prefix: str = "") -> T:
    """Instantiate dataclass `cls` from nested plain data, validating every key and type."""
    data = dict(data or {})
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(prefix + c for c in close)}?" if close else ""
            valid = ", ".join(sorted(fields))
            raise ConfigError(
                f"unknown config key '{prefix}{key}'{hint} (valid keys under "
                f"'{prefix.rstrip('.') or '<root>'}': {valid})"
            )
        kwargs[key] = _coerce(value, hints[key], prefix + key)
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {e}") from e
    check = getattr(obj, "validate", None)
    if callable(check):
        try:
            check()
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {e}") from e
    return obj


def to_dict(obj: Any) -> Any:
    """Plain nested data of a config tree (what is saved as the resolved config)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


_KEY_PART = re.compile(r"[\w-]+")


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=VALUE` -> (['a','b','c'], parsed VALUE); VALUE is read as YAML (1, true, [1,2], x)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key.subkey=value")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("+")
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{text}' has an empty key part")
    bad = [part for part in key.split(".") if not _KEY_PART.fullmatch(part)]
    if bad:
        raise ConfigError(
            f"override '{text}': key part '{bad[0]}' may hold only letters, digits, '_' and '-'"
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{text}': value is not valid YAML ({e})") from e
    return key.split("."), value


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping at the top level")
    return data


def load(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """YAML file (optional) + dotted overrides, merged and interpolated by OmegaConf -> validated
    config tree of type `cls`."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base: dict[str, Any] = load_yaml(path) if path else {}
    items = []
    for ov in overrides or []:
        parse_override(ov)  # the same clear errors for a malformed override as before
        key, raw = ov.split("=", 1)
        # `key=` means the empty string, as it always has (OmegaConf alone would read it as null)
        items.append(f"{key.strip().lstrip('+')}={raw if raw.strip() else chr(39) * 2}")
    try:
        merged = OmegaConf.merge(OmegaConf.create(base), OmegaConf.from_dotlist(items))
        data = OmegaConf.to_container(merged, resolve=True)
    except (OmegaConfBaseException, IndexError, KeyError, TypeError, ValueError) as e:
        # OmegaConf raises plain IndexError/KeyError on some malformed dotlists
        msg = (str(e).splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"config could not be merged or interpolated: {msg} (overrides: {items})") from e
    return build(cls, data)


def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstrings written under each dataclass field (cleanrl style)."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    tree = ast.parse(src)
    docs: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node, nxt in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, doc) for every leaf of a config class tree."""
    rows = []
    hints = get_type_hints(cls)
    docs = field_docs(cls)
    default_obj = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        value = getattr(default_obj, f.name)
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, prefix + f.name + "."))
        else:
            rows.append((prefix + f.name, _type_name(tp), value, docs.get(f.name, "")))
    return rows
