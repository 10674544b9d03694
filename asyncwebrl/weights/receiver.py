"""The receiving side of the weight refresh: broadcasts from the trainer's rank 0 into a mapping of
parameters (an inference server's live weights, or any dict of tensors).

Two wire forms, as SGLang's `/update_weights_from_distributed` has them:
- per tensor (`load_format` null): one broadcast per tensor, received straight into the parameter
  when dtype, shape and device match, else into scratch and copied;
- flattened buckets (`load_format: "flattened_bucket"`, see `buckets.py`): one broadcast per bucket
  into a flat scratch buffer, tensors read back as views and copied into the parameters. With the
  extension `bucket_sizes` (tensors per bucket) one announcement covers every bucket of a refresh;
  the next bucket's broadcast is posted before the previous one is unpacked (two scratch buffers),
  so the copy overlaps the transfer and nothing waits on the host per tensor or per bucket.

Invariants: an announcement that does not match the parameters (unknown name, wrong shape) is still
drained from the group, so the trainer's broadcasts complete, and then rejected with the parameters
untouched; every collective has the group's deadline.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from asyncwebrl.weights.buckets import Bucket, bucket_from_request, dtype_of
from asyncwebrl.weights.group import WeightGroup, WeightSyncError, join_group

FLATTENED = "flattened_bucket"


class AnnouncementRejected(WeightSyncError):
    """The announced tensors do not fit the parameters (the data was drained, nothing changed)."""


class WeightReceiver:
    """Groups joined by this process and the receive loops into `params`."""

    def __init__(self, params: Mapping[str, torch.Tensor], device: str | torch.device = "cpu",
                 timeout_s: float = 120.0):
        self.params = params
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.groups: dict[str, WeightGroup] = {}
        self._scratch: list[torch.Tensor | None] = [None, None]

    # ---- group lifecycle ---------------------------------------------------------------------------
    def join(self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
             backend: str) -> WeightGroup:
        if group_name in self.groups:
            raise WeightSyncError(f"group '{group_name}' exists; destroy it first")
        g = join_group(master_address, master_port, rank, world_size, group_name, backend, self.device,
                       self.timeout_s)
        self.groups[group_name] = g
        return g

    def destroy(self, group_name: str) -> None:
        g = self.groups.pop(group_name, None)
        if g is None:
            raise WeightSyncError(f"no weight update group '{group_name}'")
        g.destroy()

    def group(self, group_name: str) -> WeightGroup:
        g = self.groups.get(group_name)
        if g is None:
            raise WeightSyncError(f"no weight update group '{group_name}'; call /init_weights_update_group first")
        return g

    # ---- receiving ---------------------------------------------------------------------------------
    def problems(self, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[str]:
        out = []
        for name, shape in zip(names, shapes, strict=True):
            p = self.params.get(name)
            if p is None:
                out.append(f"unknown parameter '{name}'")
            elif list(p.shape) != [int(x) for x in shape]:
                out.append(f"shape of '{name}' is {list(p.shape)}, announced {list(shape)}")
        return out

    def receive(self, group_name: str, names: Sequence[str], dtypes: Sequence[str],
                shapes: Sequence[Sequence[int]], load_format: str | None = None,
                bucket_sizes: Sequence[int] | None = None) -> int:
        """Receive one announcement; returns the bytes received. Raises AnnouncementRejected (after
        draining) when it does not fit the parameters."""
        g = self.group(group_name)
        if not (len(names) == len(dtypes) == len(shapes)):
            raise WeightSyncError("names, dtypes and shapes must have the same length")
        deadline = time.monotonic() + self.timeout_s
        problems = self.problems(names, shapes)
        if load_format is None:
            if bucket_sizes is not None:
                raise WeightSyncError("bucket_sizes needs load_format 'flattened_bucket'")
            n = self._per_tensor(g, names, dtypes, shapes, not problems, deadline)
        elif load_format == FLATTENED:
            sizes = list(bucket_sizes) if bucket_sizes is not None else [len(names)]
            if sum(sizes) != len(names) or any(s <= 0 for s in sizes):
                raise WeightSyncError(f"bucket_sizes {sizes[:8]}... do not partition {len(names)} tensors")
            buckets, i = [], 0
            for s in sizes:
                buckets.append(bucket_from_request(names[i:i + s], dtypes[i:i + s], shapes[i:i + s]))
                i += s
            n = self._flat(g, buckets, not problems, deadline)
        else:
            raise WeightSyncError(f"load_format {load_format!r} is not supported (null | '{FLATTENED}')")
        if problems:
            raise AnnouncementRejected("announcement rejected (drained, weights unchanged): " + "; ".join(problems[:5]))
        return n

    def _per_tensor(self, g: WeightGroup, names, dtypes, shapes, apply: bool, deadline: float) -> int:
        works, copies, nbytes = [], [], 0
        for name, d, shape in zip(names, dtypes, shapes, strict=True):
            dt = dtype_of(d)
            p = self.params.get(name)
            direct = apply and p is not None and p.dtype == dt and p.is_contiguous() and p.device == self.device
            buf = p.data if direct else torch.empty([int(x) for x in shape], dtype=dt, device=self.device)
            works.append(g.broadcast(buf, deadline))
            if apply and not direct:
                copies.append((p, buf))
            nbytes += buf.numel() * buf.element_size()
        for w in works:
            g.wait(w, deadline)
        for p, buf in copies:
            p.data.copy_(buf)
        self._sync()
        return nbytes

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        b = self._scratch[slot]
        if b is None or b.numel() < nbytes:
            self._scratch[slot] = b = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return b[:nbytes]

    def _flat(self, g: WeightGroup, buckets: list[Bucket], apply: bool, deadline: float) -> int:
        pending: tuple[Bucket, torch.Tensor, object] | None = None
        nbytes = 0
        for i, b in enumerate(buckets):
            buf = self._buffer(i % 2, b.nbytes)
            work = g.broadcast(buf, deadline)  # posted before the previous bucket is unpacked
            if pending is not None:
                self._unpack(g, *pending, apply=apply, deadline=deadline)
            pending = (b, buf, work)
            nbytes += b.nbytes
        if pending is not None:
            self._unpack(g, *pending, apply=apply, deadline=deadline)
        self._sync()
        return nbytes

    def _unpack(self, g: WeightGroup, b: Bucket, buf: torch.Tensor, work, *, apply: bool, deadline: float) -> None:
        g.wait(work, deadline)  # NCCL: the current stream waits for the broadcast, the host does not
        if not apply:
            return
        for name, view in b.views(buf):
            self.params[name].data.copy_(view, non_blocking=True)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        for name in list(self.groups):
            self.destroy(name)
        self._scratch = [None, None]
