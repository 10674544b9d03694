"""Server side of the weight refresh (SPEC section 5): receive broadcast tensors from the trainer's
rank 0 into the live model, or load a safetensors folder from disk.

The broadcast group is built from public torch.distributed objects only: a `TCPStore` client of the
trainer's rank-0 store, a `PrefixStore(group_name, ...)`, and a `ProcessGroupGloo` (CPU) or
`ProcessGroupNCCL` (GPU) at rank `rank_offset` -- never `init_process_group`, so the group can live
beside any default group.

Invariants:
- tensors are received in the announced order, each straight into the parameter's storage when
  dtype and shape match (no extra full copy); otherwise into a bucket-sized scratch and copied;
- a bucket whose announcement does not match the model (unknown name, wrong shape) is still drained
  from the group (so the trainer's broadcasts complete) and then rejected without touching weights;
- every collective has a timeout: a dead trainer surfaces as an error, never a hang (gloo: an HTTP
  error; NCCL: its watchdog tears the server process down, as it does in SGLang).
"""

from __future__ import annotations

import datetime
import glob
import json
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from asyncwebrl.inference.engine import HFEngine
from asyncwebrl.protocol import (
    InitWeightsUpdateGroupRequest,
    ProtocolError,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
)

log = logging.getLogger(__name__)


class WeightUpdateGroup:
    """One broadcast group joined at rank `rank_offset` (the trainer's rank 0 is the source)."""

    def __init__(self, req: InitWeightsUpdateGroupRequest, device: torch.device, timeout_s: float):
        self.name = req.group_name
        self.rank = req.rank_offset
        self.world_size = req.world_size
        self.backend = req.backend
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(req.master_address, req.master_port, req.world_size, is_master=False,
                              timeout=self.timeout)
        prefix = dist.PrefixStore(req.group_name, store)
        if req.backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefix, req.rank_offset, req.world_size, self.timeout)
        else:
            if device.type != "cuda":
                raise ProtocolError("backend 'nccl' needs a server on a CUDA device; use 'gloo' on CPU")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(prefix, req.rank_offset, req.world_size, opts)
        self._store = store  # keep the store client alive as long as the group

    def broadcast_into(self, buf: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        if buf.is_cuda:
            with torch.cuda.device(buf.device):  # NCCL launches on the current device's stream
                work = self.pg.broadcast([buf], opts)
        else:
            work = self.pg.broadcast([buf], opts)
        if not work.wait(self.timeout):
            raise TimeoutError(f"broadcast in group '{self.name}' timed out after {self.timeout}")

    def destroy(self) -> None:
        try:
            if self.backend == "nccl" and hasattr(self.pg, "abort"):
                self.pg.abort()  # local; NCCL's shutdown() waits for every rank to finalize its side
            elif hasattr(self.pg, "shutdown"):
                self.pg.shutdown()
        except Exception:  # a group whose peer already died may fail to shut down cleanly
            log.warning("shutdown of group %s failed", self.name, exc_info=True)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def receive_bucket(engine: HFEngine, group: WeightUpdateGroup, req: UpdateWeightsFromDistributedRequest) -> int:
    """Receive every announced tensor of one bucket (engine held exclusive by the caller); returns
    the bytes received. Raises ProtocolError (after draining) when the announcement does not fit."""
    params = engine.named_parameters()
    problems = []
    for name, shape in zip(req.names, req.shapes, strict=True):
        p = params.get(name)
        if p is None:
            problems.append(f"unknown parameter '{name}'")
        elif list(p.shape) != list(shape):
            problems.append(f"shape of '{name}' is {list(p.shape)}, announced {list(shape)}")
    nbytes = 0
    for name, dt, shape in zip(req.names, req.dtypes, req.shapes, strict=False):
        dtype = _dtype(dt)
        p = params.get(name)
        direct = (not problems and p is not None and p.dtype == dtype and p.is_contiguous()
                  and p.device.type == group.device.type)
        buf = p.data if direct else torch.empty(shape, dtype=dtype, device=group.device)
        group.broadcast_into(buf)
        if not problems and not direct:
            p.data.copy_(buf)
        nbytes += buf.numel() * buf.element_size()
    if group.device.type == "cuda":
        torch.cuda.synchronize(group.device)
    if problems:
        raise ProtocolError("bucket rejected (drained, weights unchanged): " + "; ".join(problems[:5]))
    return nbytes


def load_from_disk(engine: HFEngine, req: UpdateWeightsFromDiskRequest) -> int:
    """Copy a safetensors HF folder into the live parameters (engine held exclusive by the caller);
    returns how many tensors were loaded."""
    from safetensors import safe_open

    path = req.model_path
    if not os.path.isdir(path):
        raise ProtocolError(f"model_path '{path}' is not a directory")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ProtocolError(f"no *.safetensors files in '{path}'")
    params = engine.named_parameters()
    keys: dict[str, str] = {}
    try:
        for f in files:
            with safe_open(f, "pt") as sf:
                for k in sf.keys():
                    keys[k] = f
    except Exception as e:
        raise ProtocolError(f"unreadable safetensors in '{path}': {e}") from None
    if set(params) <= set(keys):
        _check_shapes_direct(params, keys)
        by_file: dict[str, list[str]] = {}
        for name in params:
            by_file.setdefault(keys[name], []).append(name)
        for f, names in by_file.items():
            with safe_open(f, "pt", device="cpu") as sf:
                for name in names:
                    params[name].data.copy_(sf.get_tensor(name))
        return len(params)
    # checkpoint names differ from the live module's (older HF layouts): let transformers map them
    from asyncwebrl.models.vlm import load_model

    try:
        src = dict(load_model(path, engine.model.dtype, "cpu").named_parameters())
    except Exception as e:
        raise ProtocolError(f"cannot load '{path}' as this model: {type(e).__name__}: {e}") from None
    missing = sorted(set(params) - set(src))
    if missing:
        raise ProtocolError(f"'{path}' lacks parameters of the served model, e.g. {missing[:3]}")
    for name, p in params.items():
        if p.shape != src[name].shape:
            raise ProtocolError(f"shape of '{name}' is {list(p.shape)} in the model, {list(src[name].shape)} on disk")
    for name, p in params.items():
        p.data.copy_(src[name].data)
    return len(params)


def _check_shapes_direct(params: dict[str, torch.nn.Parameter], keys: dict[str, str]) -> None:
    from safetensors import safe_open

    for f in set(keys.values()):
        with safe_open(f, "pt") as sf:
            for name in sf.keys():
                if name in params:
                    shape = list(sf.get_slice(name).get_shape())
                    if shape != list(params[name].shape):
                        raise ProtocolError(
                            f"shape of '{name}' is {list(params[name].shape)} in the model, {shape} on disk"
                        )


def model_summary(engine: HFEngine) -> dict[str, Any]:
    cfg = engine.model.config
    return {
        "architectures": getattr(cfg, "architectures", None),
        "model_type": cfg.model_type,
        "n_parameters": sum(p.numel() for p in engine.model.parameters()),
        "config": json.loads(cfg.to_json_string()) if hasattr(cfg, "to_json_string") else {},
    }
