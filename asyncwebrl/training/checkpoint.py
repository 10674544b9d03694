"""Atomic HF-format checkpoints on disk (SPEC section 5, disk mode; issue 7 resume).

A checkpoint is a folder `<root>/version_<v>` holding:
    model.safetensors + config.json + tokenizer/processor files   (loadable by `load_model` and by an
                                                                    inference server's
                                                                    /update_weights_from_disk)
    optimizer.pt       full (unsharded) optimizer state, reloadable at any world size
    trainer_state.json {step, version}
    extra_state.json   caller's state (task-sampler position, staleness seed, ...)
    COMPLETE           written last

Invariant: a folder named `version_*` without `COMPLETE` is never returned by
`latest_complete_checkpoint`. Everything is written into a hidden temp folder, each file fsynced,
the marker written and fsynced, then the folder is renamed into place (atomic on one filesystem) and
the parent directory fsynced; a crash at any point leaves the previous complete checkpoint usable.

Writes that do not stall the trainer (`CheckpointWriter`): the caller blocks only while the state is
snapshotted (a clone on its own device, a device-to-device copy; host memory if the device is full);
the device-to-host copy, serialisation, fsyncs and the atomic publish run on one writer thread. At
most one write is in flight: a new one first waits for the previous (the caller times that wait as
part of its stall).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

COMPLETE = "COMPLETE"
MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optimizer.pt"
TRAINER_STATE = "trainer_state.json"
EXTRA_STATE = "extra_state.json"
_NAME = re.compile(r"^version_(\d+)$")
# files copied from the source model folder so the checkpoint is a complete HF model folder
_MODEL_SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "processor_config.json",
    "preprocessor_config.json", "vocab.json", "merges.txt", "added_tokens.json",
)


def checkpoint_name(version: int) -> str:
    return f"version_{version:08d}"


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some filesystems refuse directory fsync; the rename is still atomic
        pass


def write_checkpoint(
    root: str | Path,
    version: int,
    step: int,
    model_state: dict[str, torch.Tensor],
    source_model_dir: str | Path | None,
    optim_state: dict[str, Any] | None = None,
    extra_state: dict[str, Any] | None = None,
    keep_last: int | None = None,
    _crash_after_model: bool = False,
    _before_publish: Any = None,
) -> Path:
    """Write one checkpoint atomically and prune older complete ones down to `keep_last`.

    `model_state` must hold HF parameter names (tied weights once). `_crash_after_model` is a test
    hook that aborts the write half way (as a kill would).
    """
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(version)
    tmp = root / f".tmp-{checkpoint_name(version)}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
    save_file(tensors, str(tmp / MODEL_FILE), metadata={"format": "pt"})
    if source_model_dir is not None:
        for name in _MODEL_SIDE_FILES:
            src = Path(source_model_dir) / name
            if src.is_file():
                shutil.copyfile(src, tmp / name)
    if _crash_after_model:
        raise RuntimeError("simulated crash during checkpoint write")
    if optim_state is not None:
        torch.save(optim_state, tmp / OPTIM_FILE)
    (tmp / TRAINER_STATE).write_text(json.dumps({"version": version, "step": step}))
    (tmp / EXTRA_STATE).write_text(json.dumps(extra_state or {}))
    for f in tmp.iterdir():
        _fsync_file(f)
    if _before_publish is not None:  # test hook: runs with everything but the marker written
        _before_publish()
    (tmp / COMPLETE).write_text("ok\n")
    _fsync_file(tmp / COMPLETE)
    _fsync_dir(tmp)
    if final.exists():  # re-writing the same version: move the old one aside, then replace
        old = root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_dir(root)
    if keep_last is not None:
        prune(root, keep_last)
    return final


def _snapshot(x: Any) -> Any:
    """A private copy of a (nested) state that training may go on mutating: tensors cloned on their
    own device (to host memory if the device has no room), everything else as is."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if t.is_cuda:
            try:
                return t.clone()
            except torch.OutOfMemoryError:
                return t.to("cpu")
        return t.clone()
    if isinstance(x, dict):
        return {k: _snapshot(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_snapshot(v) for v in x)
    return x


def _to_host(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to("cpu")
    if isinstance(x, dict):
        return {k: _to_host(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_host(v) for v in x)
    return x


class CheckpointWriter:
    """Background checkpoint writes, at most one in flight (see the module docstring)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_path: Path | None = None
        self.last_write_s = 0.0
        """seconds the newest finished write took on the writer thread"""

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, root: str | Path, version: int, step: int, model_state: dict[str, torch.Tensor],
               source_model_dir: str | Path | None, optim_state: dict[str, Any] | None = None,
               extra_state: dict[str, Any] | None = None, keep_last: int | None = None,
               _before_publish: Any = None) -> Path:
        """Snapshot the state (blocking, short) and write it in the background; returns the path the
        checkpoint will have once complete. Raises the previous write's error, if it failed."""
        self.wait()
        model = _snapshot(model_state)
        optim = _snapshot(optim_state) if optim_state is not None else None
        extra = json.loads(json.dumps(extra_state or {}))

        def run() -> None:
            t0 = time.perf_counter()
            try:
                self.last_path = write_checkpoint(root, version, step, model, source_model_dir,
                                                  _to_host(optim) if optim is not None else None, extra, keep_last,
                                                  _before_publish=_before_publish)
            except BaseException as e:  # noqa: BLE001 - raised to the trainer at the next submit/wait
                self._error = e
            finally:
                self.last_write_s = time.perf_counter() - t0

        # not a daemon: a clean exit finishes the write; a kill leaves only a temp folder behind
        self._thread = threading.Thread(target=run, name="checkpoint-writer")
        self._thread.start()
        return Path(root) / checkpoint_name(version)

    def wait(self, timeout_s: float | None = None) -> Path | None:
        """Block until the write in flight (if any) is published; raises its error."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"checkpoint write still running after {timeout_s}s")
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError(f"background checkpoint write failed: {e}") from e
        return self.last_path


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir() and (p / COMPLETE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_complete_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint that has its completion marker, or None."""
    done = complete_checkpoints(root)
    return done[-1] if done else None


def prune(root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints, and leftover temp folders."""
    if keep_last < 1:
        raise ValueError("keep_last must be >= 1")
    done = complete_checkpoints(root)
    removed = done[:-keep_last]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    for p in Path(root).iterdir():
        if p.name.startswith((".tmp-", ".old-")) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def read_checkpoint(path: str | Path, with_optimizer: bool = True) -> dict[str, Any]:
    """{model, optimizer, version, step, extra_state} of a complete checkpoint (ValueError otherwise)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / COMPLETE).is_file():
        raise ValueError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
    meta = json.loads((path / TRAINER_STATE).read_text())
    out: dict[str, Any] = {
        "model": load_file(str(path / MODEL_FILE)),
        "version": int(meta["version"]),
        "step": int(meta["step"]),
        "extra_state": json.loads((path / EXTRA_STATE).read_text()),
        "optimizer": None,
    }
    if with_optimizer and (path / OPTIM_FILE).is_file():
        out["optimizer"] = torch.load(path / OPTIM_FILE, map_location="cpu", weights_only=True)
    return out
