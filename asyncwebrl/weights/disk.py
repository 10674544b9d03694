"""The disk path of the weight refresh: a safetensors HF folder copied into a mapping of parameters
(`/update_weights_from_disk`).

Invariant: every shape is checked before the first parameter is written, so a folder that does not
fit leaves the parameters untouched; names the live module spells differently (older HF layouts)
are mapped by `fallback` (a function path -> {name: tensor}, e.g. transformers' own loading).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Mapping

import torch

from asyncwebrl.weights.group import WeightSyncError


def load_folder(params: Mapping[str, torch.Tensor], path: str,
                fallback: Callable[[str], Mapping[str, torch.Tensor]] | None = None) -> int:
    """Copy a safetensors folder into `params`; returns how many tensors were loaded."""
    from safetensors import safe_open

    if not os.path.isdir(path):
        raise WeightSyncError(f"model_path '{path}' is not a directory")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise WeightSyncError(f"no *.safetensors files in '{path}'")
    where: dict[str, str] = {}
    shapes: dict[str, list[int]] = {}
    try:
        for f in files:
            with safe_open(f, "pt") as sf:
                for k in sf.keys():
                    where[k] = f
                    shapes[k] = list(sf.get_slice(k).get_shape())
    except Exception as e:  # noqa: BLE001 - a broken file is the caller's input error
        raise WeightSyncError(f"unreadable safetensors in '{path}': {e}") from None
    if set(params) <= set(where):
        for name, p in params.items():
            if shapes[name] != list(p.shape):
                raise WeightSyncError(f"shape of '{name}' is {list(p.shape)} in the model, {shapes[name]} on disk")
        by_file: dict[str, list[str]] = {}
        for name in params:
            by_file.setdefault(where[name], []).append(name)
        for f, names in by_file.items():
            with safe_open(f, "pt", device="cpu") as sf:
                for name in names:
                    params[name].data.copy_(sf.get_tensor(name))
        return len(params)
    if fallback is None:
        missing = sorted(set(params) - set(where))
        raise WeightSyncError(f"'{path}' lacks parameters of the served model, e.g. {missing[:3]}")
    try:
        src = fallback(path)
    except Exception as e:  # noqa: BLE001
        raise WeightSyncError(f"cannot load '{path}' as this model: {type(e).__name__}: {e}") from None
    missing = sorted(set(params) - set(src))
    if missing:
        raise WeightSyncError(f"'{path}' lacks parameters of the served model, e.g. {missing[:3]}")
    for name, p in params.items():
        if list(p.shape) != list(src[name].shape):
            raise WeightSyncError(f"shape of '{name}' is {list(p.shape)} in the model, {list(src[name].shape)} on disk")
    for name, p in params.items():
        p.data.copy_(src[name])
    return len(params)
