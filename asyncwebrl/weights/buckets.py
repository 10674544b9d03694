"""Flattened buckets: many tensors moved by ONE broadcast of a flat byte buffer.

The layout is SGLang's `load_format: "flattened_bucket"`: the tensors of a bucket are laid end to
end as raw bytes (`tensor.view(uint8)`), in the order of the request's `names`, with no padding;
the receiver allocates `sum(bytes)` uint8 and reads each tensor back as a view
`buf[start:end].view(dtype).reshape(shape)`. Invariants:
- a plan depends only on (names, dtypes, shapes) and the bucket size, so both ends derive the same
  plan from the same announcement;
- a tensor never straddles two buckets; one larger than the bucket size travels alone;
- every tensor starts at a byte offset that is a multiple of its element size (a tensor that would
  not is moved to the next bucket), so the receiver's views are valid for every dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from asyncwebrl.weights.group import WeightSyncError


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise WeightSyncError(f"unknown dtype {name!r}")
    return dt


@dataclass
class TensorSlot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass
class Bucket:
    """One broadcast: the slots it carries and its byte size."""

    slots: list[TensorSlot] = field(default_factory=list)
    nbytes: int = 0

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.slots]

    @property
    def dtypes(self) -> list[str]:
        return [dtype_name(s.dtype) for s in self.slots]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(s.shape) for s in self.slots]

    def views(self, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor view) of every slot of a received flat uint8 buffer (no copy)."""
        return [(s.name, buf[s.start:s.end].view(s.dtype).reshape(s.shape)) for s in self.slots]

    def pack(self, tensors: Sequence[torch.Tensor], buf: torch.Tensor) -> torch.Tensor:
        """Copy `tensors` (in slot order) into `buf[:nbytes]` (enqueued on the current stream)."""
        out = buf[: self.nbytes]
        dst = [out[s.start:s.end].view(s.dtype).view(s.shape) for s in self.slots]
        if len(dst) != len(tensors):
            raise ValueError(f"{len(tensors)} tensors for a bucket of {len(dst)} slots")
        # one multi-tensor copy (a few kernel launches for the whole bucket, casting where the slot's
        # dtype differs), not one copy per parameter
        torch._foreach_copy_(dst, list(tensors), non_blocking=True)
        return out


Named = Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]
Meta = Sequence[tuple[str, torch.dtype, Sequence[int]]]


def tensors_and_meta(named: Named, meta: Meta | None) -> tuple[Iterable[tuple[str, torch.Tensor]], Meta]:
    """The (name, tensor) pairs a sender walks and their (name, dtype, shape) plan. Without `meta` they
    are read whole here; with it, `named` may stay a lazy iterator (an FSDP gather), consumed one bucket
    at a time."""
    if isinstance(named, dict):
        named = list(named.items())
    if meta is None:
        named = list(named)
        meta = [(n, t.dtype, tuple(t.shape)) for n, t in named]
    return named, meta


def plan_buckets(meta: Sequence[tuple[str, torch.dtype, Sequence[int]]], bucket_bytes: int) -> list[Bucket]:
    """Consecutive runs of tensors of at most `bucket_bytes` bytes each, laid out flat."""
    if bucket_bytes <= 0:
        raise ValueError("bucket size must be positive")
    buckets: list[Bucket] = []
    cur = Bucket()
    for name, dt, shape in meta:
        shape = tuple(int(x) for x in shape)
        nbytes = dt.itemsize * _numel(shape)
        misaligned = cur.nbytes % dt.itemsize != 0
        if cur.slots and (cur.nbytes + nbytes > bucket_bytes or misaligned):
            buckets.append(cur)
            cur = Bucket()
        cur.slots.append(TensorSlot(name, dt, shape, cur.nbytes, cur.nbytes + nbytes))
        cur.nbytes += nbytes
    if cur.slots:
        buckets.append(cur)
    return buckets


def bucket_from_request(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> Bucket:
    """The one bucket a `flattened_bucket` announcement describes (the receiver's side)."""
    b = Bucket()
    for name, d, shape in zip(names, dtypes, shapes, strict=True):
        dt = dtype_of(d)
        shape = tuple(int(x) for x in shape)
        if any(x < 0 for x in shape):
            raise WeightSyncError(f"negative dimension in shape of {name!r}: {list(shape)}")
        if b.nbytes % dt.itemsize:
            raise WeightSyncError(f"tensor {name!r} would start at byte {b.nbytes}, not aligned to {dt}")
        nbytes = dt.itemsize * _numel(shape)
        b.slots.append(TensorSlot(name, dt, shape, b.nbytes, b.nbytes + nbytes))
        b.nbytes += nbytes
    return b



def _numel(shape: Sequence[int]) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n
