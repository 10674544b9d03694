"""Model families by name: detection from a model folder's config.json, and the family object.

Every module of this package other than `base` is a family file; importing the package imports them
all, so a family registers itself (`@register`) by existing. Adding a family is one new file here
(and its test under tests/models/): see docs/architecture.md, "Adding a model family".

Invariant: detection names exactly one family for a config or raises ValueError naming the registered
families; it never falls back to a guess.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from pathlib import Path
from typing import Any

from asyncwebrl.models.families.base import _REGISTRY, Encoded, ModelFamily, register

__all__ = ["Encoded", "ModelFamily", "family_class", "family_for_config", "load_family", "read_config",
           "register", "registered"]

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name != "base":
        importlib.import_module(f"{__name__}.{_mod.name}")


def registered() -> list[str]:
    """Names of the registered families, sorted."""
    return sorted(_REGISTRY)


def family_class(name: str) -> type[ModelFamily]:
    """The family registered under `name`."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"no model family {name!r}; registered: {', '.join(registered())}") from None


def family_for_config(config: dict[str, Any]) -> type[ModelFamily]:
    """The one family that claims this config.json content; ValueError for none or several."""
    found = [cls for _, cls in sorted(_REGISTRY.items()) if cls.claims(config)]
    if len(found) == 1:
        return found[0]
    model_type = config.get("model_type")
    if not found:
        raise ValueError(
            f"no model family serves model_type {model_type!r}; registered families: {', '.join(registered())}. "
            f"Add one as a file in asyncwebrl/models/families/ (docs/architecture.md, 'Adding a model family')")
    raise ValueError(f"model_type {model_type!r} is claimed by several families: {', '.join(c.name for c in found)}")


def read_config(path: str) -> dict[str, Any]:
    """config.json of a local model folder, or of a hub id through transformers."""
    cfg_file = Path(path) / "config.json"
    if cfg_file.is_file():
        return json.loads(cfg_file.read_text())
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).to_dict()


def load_family(path: str) -> ModelFamily:
    """The family object of a model folder: its tokenizer and image processor loaded."""
    return family_for_config(read_config(path))(path)
