"""Weights to a server on the same device, without a network: SGLang's `/update_weights_from_tensor`.

When a trainer rank and an inference server share a GPU (the shared-device layout,
`sglang[rollout]:d1|fsdp[actor]:d1`), the refresh needs no broadcast: the trainer packs its
parameters into flat buckets (the `flattened_bucket` layout of `buckets.py`, cast to the server's
dtype) and hands the server a handle to each bucket's memory; the server copies from it into its own
parameters. On a GPU the handle is a CUDA IPC handle (torch.multiprocessing's tensor reduction, the
device named by its UUID as SGLang's patched reduction does, so the two processes may number their
devices differently); on a CPU it is a shared-memory segment (torch's `file_system` sharing). Either
way it is one device-to-device copy on the server's side.

Wire form (SGLang 0.5.x `UpdateWeightsFromTensorReqInput`): POST /update_weights_from_tensor
{`serialized_named_tensors`: [base64 of one pickle per tensor-parallel rank], `load_format`:
"flattened_bucket", `flush_cache`, `abort_all_requests`, `weight_version`}; the pickle is a dict
{"flattened_tensor": uint8 tensor, "metadata": [FlattenedTensorMetadata(name, shape, dtype, start_idx,
end_idx, numel)]}, the metadata class named as SGLang's (`sglang.srt.weight_sync.tensor_bucket`), so a
real SGLang server on the same GPU reads the same bytes. `load_format` null carries a list of
(name, tensor) instead.

Invariants: a bucket's memory is neither freed nor overwritten until the server answered for it
(the sender reuses two buffers, bucket k+1 packed while the server copies bucket k); the receiving
side unpickles with an allow-list (torch's rebuild functions, dtypes, sizes and the metadata class:
no other global), and a CPU handle must name a torch shared-memory segment; a refused bucket fails
the transfer (`WeightSyncError`) with the server's message, and the bracket then keeps the version.
"""

from __future__ import annotations

import base64
import collections
import copyreg
import functools
import io
import json
import pickle
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncwebrl.protocol import TensorUpdateReply, TensorUpdateTimes, UpdateWeightsFromTensorRequest
from asyncwebrl.weights.buckets import Bucket, plan_buckets, tensors_and_meta
from asyncwebrl.weights.group import WeightSyncError

FLATTENED = "flattened_bucket"
SGLANG_META = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
"""where SGLang keeps the metadata class its unpickler allows (its name travels, not our class)"""
_DEVICE_ARG = 6
"""position of the device index in the arguments of torch's `rebuild_cuda_tensor`"""


@dataclass
class FlatTensorMeta:
    """One tensor of a flattened bucket: SGLang's `FlattenedTensorMetadata` fields, in its order."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int

    def __reduce__(self):
        return _GlobalRef(*SGLANG_META), (self.name, torch.Size(self.shape), self.dtype, self.start_idx,
                                          self.end_idx, self.numel)


class _GlobalRef:
    """A class named by module and qualified name, pickled as that name without importing it."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args):  # pickle wants a callable; it is only ever called on the other side
        raise TypeError(f"{self.module}.{self.name} is a reference, not the class")


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _device_index(uuid_or_index: int | str) -> int:
    if isinstance(uuid_or_index, int):
        return uuid_or_index
    for i in range(torch.cuda.device_count()):
        if _device_uuid(i) == uuid_or_index:
            return i
    raise WeightSyncError(f"the weights live on GPU {uuid_or_index}, which this process cannot see "
                          "(same-device refresh needs the server on the trainer's GPU)")


def _reduce_tensor(t: torch.Tensor):
    from torch.multiprocessing.reductions import reduce_tensor

    fn, args = reduce_tensor(t)
    if t.is_cuda:  # name the device by UUID: the server may number its visible devices differently
        args = (*args[:_DEVICE_ARG], _device_uuid(int(args[_DEVICE_ARG])), *args[_DEVICE_ARG + 1:])
    return fn, args


class _HandlePickler(pickle._Pickler):  # the Python pickler: it lets `_GlobalRef` write a bare name
    dispatch = dict(pickle._Pickler.dispatch)

    def _save_ref(self, obj: _GlobalRef) -> None:
        self.save(obj.module)
        self.save(obj.name)
        self.write(pickle.STACK_GLOBAL)

    dispatch[_GlobalRef] = _save_ref


def serialize(obj: Any) -> str:
    """base64 of a pickle of `obj` whose tensors travel as handles to their memory (see module doc)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp  # noqa: F401 - registers torch's storage reductions

    table = dict(copyreg.dispatch_table)
    table.update(ForkingPickler._extra_reducers)
    table[torch.Tensor] = _reduce_tensor
    table[torch.nn.Parameter] = _reduce_tensor
    buf = io.BytesIO()
    p = _HandlePickler(buf, protocol=4)
    p.dispatch_table = table
    p.dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def share_cpu_memory() -> None:
    """CPU handles are named shared-memory segments (a server process can open them by name)."""
    import torch.multiprocessing as tmp

    if tmp.get_sharing_strategy() != "file_system":
        tmp.set_sharing_strategy("file_system")


# ---- the receiving side --------------------------------------------------------------------------
def _rebuild_cuda_tensor(*args):
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = (*args[:_DEVICE_ARG], _device_index(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])
    return rebuild_cuda_tensor(*args)


def _rebuild_storage_filename(cls, manager, handle, size, dtype=None):
    from torch.multiprocessing.reductions import rebuild_storage_filename

    name = handle.decode() if isinstance(handle, bytes) else str(handle)
    if not name.startswith("/torch_") or "/" in name[1:]:
        raise WeightSyncError(f"shared-memory handle {name!r} is not a torch segment")
    return rebuild_storage_filename(cls, manager, handle, size, dtype)


def _allowed() -> dict[tuple[str, str], Any]:
    import torch.multiprocessing.reductions as red

    allowed: dict[tuple[str, str], Any] = {
        SGLANG_META: FlatTensorMeta,
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"): _rebuild_storage_filename,
        ("torch.multiprocessing.reductions", "rebuild_tensor"): red.rebuild_tensor,
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"): red.rebuild_typed_storage,
        ("torch.storage", "UntypedStorage"): torch.storage.UntypedStorage,
        ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
        ("torch", "Tensor"): torch.Tensor,
        ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
        ("torch", "Size"): torch.Size,
        ("collections", "OrderedDict"): __import__("collections").OrderedDict,
    }
    for name in dir(torch):
        obj = getattr(torch, name, None)
        if isinstance(obj, torch.dtype):
            allowed[("torch", name)] = obj
    for name in dir(torch.cuda):  # legacy typed-storage classes torch may name for CUDA storages
        if name.endswith("Storage") and isinstance(getattr(torch.cuda, name, None), type):
            allowed[("torch.cuda", name)] = getattr(torch.cuda, name)
    return allowed


class _HandleUnpickler(pickle.Unpickler):
    _table: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if _HandleUnpickler._table is None:
            _HandleUnpickler._table = _allowed()
        obj = _HandleUnpickler._table.get((module, name))
        if obj is None:
            raise WeightSyncError(f"refused global {module}.{name} in serialized_named_tensors")
        return obj


def deserialize(data: str | bytes) -> Any:
    """The object `serialize` made, its tensors mapped onto the sender's memory (allow-listed)."""
    raw = base64.b64decode(data, validate=True) if isinstance(data, str) else data
    try:
        return _HandleUnpickler(io.BytesIO(raw)).load()
    except WeightSyncError:
        raise
    except Exception as e:  # a malformed payload is the caller's error, not the server's
        raise WeightSyncError(f"serialized_named_tensors could not be read: {type(e).__name__}: {e}") from e


def named_tensors(payload: Any, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of one rank's payload: a flattened bucket's views, or a plain list."""
    if load_format == FLATTENED:
        if not isinstance(payload, dict) or "flattened_tensor" not in payload or "metadata" not in payload:
            raise WeightSyncError("a flattened_bucket payload is {'flattened_tensor': ..., 'metadata': [...]}")
        flat, metas = payload["flattened_tensor"], payload["metadata"]
        if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
            raise WeightSyncError("flattened_tensor must be a 1-D uint8 tensor")
        out = []
        for m in metas:
            if not isinstance(m, FlatTensorMeta) or not 0 <= m.start_idx <= m.end_idx <= flat.numel():
                raise WeightSyncError(f"bad flattened_bucket metadata {m!r}")
            out.append((m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)))
        return out
    if load_format is not None:
        raise WeightSyncError(f"load_format {load_format!r} is not supported (null | '{FLATTENED}')")
    if isinstance(payload, dict):
        payload = list(payload.items())
    if not all(isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[1], torch.Tensor) for p in payload):
        raise WeightSyncError("serialized_named_tensors must hold a list of (name, tensor)")
    return [(str(n), t) for n, t in payload]


class KeptHandles:
    """The receiver's mappings of a sender's memory, kept by payload: a sender whose tensors stay where
    they are (a trainer's own parameters, its reused bucket buffers) sends the same payload string again,
    and the server finds the mapped (name, tensor) pairs here instead of unpickling and mapping them
    anew (opening CUDA IPC handles, building one view per tensor: milliseconds per refresh).

    A server that keeps handles says so in its reply (`handles_kept`); only then does a sender resend
    a payload it already sent, so each handle is opened once on this side (torch counts every opening
    against the sender's memory). Bounded: the least recently used payload is dropped beyond `size`."""

    def __init__(self, size: int = 64):
        self.size = size
        self._kept: collections.OrderedDict[str, tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]] = \
            collections.OrderedDict()

    def named(self, data: str, load_format: str | None) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any], bool]:
        """(the payload's (name, tensor) pairs, its landing memo for `copy_into`, whether it was mapped
        already)."""
        hit = self._kept.get(data)
        if hit is not None:
            self._kept.move_to_end(data)
            return hit[0], hit[1], True
        named = named_tensors(deserialize(data), load_format)
        self._kept[data] = (named, {})
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)
        return named, self._kept[data][1], False

    def has(self, data: str) -> bool:
        return data in self._kept

    def drop(self, data: str) -> None:
        self._kept.pop(data, None)


def copy_into(params: Mapping[str, torch.Tensor], named: Sequence[tuple[str, torch.Tensor]],
              memo: dict[str, Any] | None = None) -> int:
    """Copy every (name, tensor) into `params` after checking them all (a mismatch changes nothing);
    returns the bytes copied. The copy runs on the receiver's current stream and is waited for, so
    the sender may reuse the memory once this returns. `memo` (a kept payload's) remembers the checked
    destinations: the next copy of the same payload only checks that they are still the parameters,
    at the same addresses, and on one GPU replays the copies as one captured CUDA graph."""
    dst = memo.get("dst") if memo is not None else None
    if dst is None or not all(params.get(n) is p and p.data_ptr() == a
                              for (n, _), p, a in zip(named, dst, memo["ptrs"], strict=True)):
        problems = []
        for name, t in named:
            p = params.get(name)
            if p is None:
                problems.append(f"unknown parameter '{name}'")
            elif tuple(p.shape) != tuple(t.shape):
                problems.append(f"shape of '{name}' is {list(p.shape)}, sent {list(t.shape)}")
        if problems:
            raise WeightSyncError("update rejected (weights unchanged): " + "; ".join(problems[:5]))
        dst = [params[name] for name, _ in named]
        if memo is not None:
            memo.clear()
            memo.update(dst=dst, ptrs=[p.data_ptr() for p in dst],
                        nbytes=sum(t.numel() * t.element_size() for _, t in named),
                        devices={p.device for p in dst if p.is_cuda})
    nbytes = memo["nbytes"] if memo is not None else sum(t.numel() * t.element_size() for _, t in named)
    devs = memo["devices"] if memo is not None else {p.device for p in dst if p.is_cuda}
    src = [t for _, t in named]
    with torch.no_grad():
        if devs:
            graph = memo.get("graph") if memo is not None else None
            if graph is not None:
                graph.replay()
            else:
                # one copy per tensor: a device-to-device memcpy (or cast) each, at the memory's
                # bandwidth; the multi-tensor copy kernel ran at ~2/3 of it
                for p, t in zip(dst, src, strict=True):
                    p.copy_(t, non_blocking=True)
                if memo is not None and len(devs) == 1 and "graph" not in memo:  # for the next landing
                    memo["graph"] = _captured(dst, src, next(iter(devs)))
        else:  # one multi-tensor copy for the payload, not one copy per parameter
            torch._foreach_copy_(dst, src, non_blocking=True)
    for d in devs:
        torch.cuda.current_stream(d).synchronize()
    return nbytes


LANDING_STREAMS = 4
"""parallel branches of the captured landing. Copies in one chain run back to back, each with a ramp
at its start and end: 327 copies of a 3B model (6.8 GB) took 4.05 ms captured in one chain against
3.26 ms for one flat copy on an H200; in 2 / 4 / 8 branches 3.71 / 3.67 / 3.65 ms"""


def _captured(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], device: torch.device) -> Any:
    """The copies `src` -> `dst` captured as one CUDA graph on `device` (replayed on its current
    stream), spread over `LANDING_STREAMS` branches balanced by bytes; None where capture fails (the
    copies then run one by one). A replay is one launch whatever the number of tensors, and the
    branches overlap the copies' ramps. The addresses are fixed: the caller replays only while sources
    and destinations stay."""
    try:
        with torch.cuda.device(device):
            g = torch.cuda.CUDAGraph()
            branches = [torch.cuda.Stream(device) for _ in range(LANDING_STREAMS)]
            load = [0] * len(branches)
            size = [t.numel() * t.element_size() for t in dst]
            order = sorted(range(len(dst)), key=lambda i: -size[i])
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                main = torch.cuda.current_stream()
                for b in branches:
                    b.wait_stream(main)
                for i in order:
                    k = load.index(min(load))
                    load[k] += size[i]
                    with torch.cuda.stream(branches[k]):
                        dst[i].copy_(src[i], non_blocking=True)
                for b in branches:
                    main.wait_stream(b)
        return g
    except Exception:  # noqa: BLE001 - a capture the driver refuses leaves the plain copies
        return None


# ---- the sending side ----------------------------------------------------------------------------
@dataclass
class IpcTransferReport:
    """What one same-device transfer moved (the fields `TransferReport` has, for the bracket)."""

    n_tensors: int
    n_buckets: int
    """update calls: one per flat bucket, or one for the whole model (`resident`)"""
    bytes: int
    seconds: float
    announcements: int
    pack_s: float
    """the trainer's side: packing (and casting) into the buckets, or serializing the handles, synchronized"""
    server: TensorUpdateTimes
    """the server's side, summed over the calls: mapping the handles, waiting for the model, copying"""
    resent: int = 0
    """calls whose payload the server had mapped already (it keeps handles): nothing serialized or mapped"""


def _bucket_payload(b: Bucket, flat: torch.Tensor) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """A flattened bucket's payload (SGLang's layout) and the tensor its handle refers to."""
    return {"flattened_tensor": flat, "metadata": [
        FlatTensorMeta(s.name, torch.Size(s.shape), s.dtype, s.start, s.end, s.end - s.start) for s in b.slots]}, [flat]


class SameDeviceSender:
    """A trainer rank's side of the same-device refresh to one server (see the module docstring).

    Two forms. Flat buckets (any tensors, e.g. gathered ones): packed into two reused buffers, one
    handle per bucket. `resident=True` (the trainer's own parameters, whole, where they live between
    refreshes: a single rank): one call carrying a handle to each tensor, no packing; the server copies
    (and casts) from them directly, so the refresh is one pass over the weights. Either way, once the
    server says it keeps handles, a payload whose tensors have not moved is sent again as the same
    string, and the server copies without mapping anything.

    The interface of `sender.WeightSender` (init_group, transfer, close, broken) so the trainer host
    and the bench use either; there is no process group to form, only the server's device to check."""

    _SENT_KEEP = 64
    """payload strings remembered for resending (the receiver keeps at least as many mappings)"""

    def __init__(self, server: str, api_key: str | None = None, *, device: str = "cpu",
                 bucket_mb: float = 2048, timeout_s: float = 120.0, wire_dtype: torch.dtype | None = None):
        from asyncwebrl.weights.control import ControlChannel

        self.device = torch.device(device)
        self.control = ControlChannel([server], api_key, timeout_s)
        self.servers = self.control.servers
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.timeout_s = timeout_s
        self.wire_dtype = wire_dtype
        self.broken = False
        self.group = None
        self.server_keeps_handles = False
        """learned from the server's replies: only then are payload strings resent"""
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._sent: collections.OrderedDict[tuple, tuple[str, list[torch.Tensor]]] = collections.OrderedDict()
        self._resident_body: tuple[str, bytes] | None = None
        """the resident call's payload string and its encoded body (the same bytes go out again)"""
        if self.device.type == "cpu":
            share_cpu_memory()

    def init_group(self) -> None:
        """Nothing to rendezvous; the server must answer (and take the same-device update)."""
        try:
            self.control.call(self.servers[0], "/health", None, method="GET", timeout_s=min(30.0, self.timeout_s))
        except WeightSyncError:
            self.broken = True
            raise
        self.broken = False

    def _wire(self, dt: torch.dtype) -> torch.dtype:
        return self.wire_dtype if self.wire_dtype is not None and dt.is_floating_point else dt

    def plan(self, meta: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> list[Bucket]:
        return plan_buckets([(n, self._wire(d), s) for n, d, s in meta], self.bucket_bytes)

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        b = self._bufs[slot]
        if b is None or b.numel() < nbytes:
            if b is not None:  # payloads of the outgrown buffer are never resent: let it go
                old = b.data_ptr()
                for key in [k for k in self._sent if k[0] == "bucket" and k[1] == old]:
                    del self._sent[key]
            self._bufs[slot] = b = None
            b = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            if b.device.type == "cpu":
                b.share_memory_()  # a named segment the server opens (once: the handle is cached there)
            self._bufs[slot] = b
        return b

    def transfer(self, named: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor],
                 meta: Sequence[tuple[str, torch.dtype, Sequence[int]]] | None = None,
                 resident: bool = False) -> IpcTransferReport:
        """Have the server copy every tensor; returns when the last one is in. `resident`: the tensors
        are the trainer's own, whole, and stay where they are between refreshes (see the class doc)."""
        if self.broken:
            raise WeightSyncError("the same-device sender is broken: call init_group() again")
        t0 = time.perf_counter()
        try:
            if resident:
                named = list(named.items()) if isinstance(named, dict) else list(named)
                n_tensors, n_calls, nbytes = len(named), 1, sum(t.numel() * t.element_size() for _, t in named)
                pack_s, server, resent = self._send_resident(named)
            else:
                named, meta = tensors_and_meta(named, meta)
                buckets = self.plan(meta)
                n_tensors, n_calls, nbytes = len(meta), len(buckets), sum(b.nbytes for b in buckets)
                pack_s, server, resent = self._send(buckets, iter(named))
        except BaseException as e:
            self.broken = not isinstance(e, WeightSyncError)
            if isinstance(e, WeightSyncError):
                raise
            raise WeightSyncError(f"same-device weight transfer failed: {type(e).__name__}: {e}") from e
        return IpcTransferReport(n_tensors, n_calls, nbytes, time.perf_counter() - t0, n_calls, pack_s, server, resent)

    def _payload(self, key: tuple, make: Any) -> tuple[str, bool]:
        """The serialized payload for `key`: the string sent before when the server keeps handles,
        else a fresh one (`make()` -> (object to serialize, tensors it refers to))."""
        if self.server_keeps_handles:
            hit = self._sent.get(key)
            if hit is not None:
                self._sent.move_to_end(key)
                return hit[0], True
        obj, tensors = make()
        data = serialize(obj)
        # the tensors stay referenced while their string may be resent: their memory cannot be reused
        self._sent[key] = (data, tensors)
        while len(self._sent) > self._SENT_KEEP:
            self._sent.popitem(last=False)
        return data, False

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the bytes exist before the handle travels

    def _send_resident(self, named: list[tuple[str, torch.Tensor]]) -> tuple[float, TensorUpdateTimes, int]:
        t = time.perf_counter()
        for name, x in named:
            if x.device != self.device or not x.is_contiguous():
                raise WeightSyncError(f"resident tensor '{name}' must be contiguous on {self.device}, "
                                      f"is on {x.device}{'' if x.is_contiguous() else ', strided'}")
            if x.device.type == "cpu" and not x.is_shared():
                x.share_memory_()  # moved into a named segment once; it stays there
        key = ("resident", tuple((n, x.data_ptr(), x.dtype, tuple(x.shape)) for n, x in named))
        data, resent = self._payload(key, lambda: ([(n, x.detach()) for n, x in named], [x for _, x in named]))
        self._sync()
        pack_s = time.perf_counter() - t
        if self._resident_body is None or self._resident_body[0] is not data:
            self._resident_body = (data, json.dumps(self._body(data, None)).encode())
        # one call, nothing to overlap it with: made on this thread (no event loop in between)
        answer = self.control.call(self.servers[0], "/update_weights_from_tensor", self._resident_body[1],
                                   timeout_s=self.timeout_s)
        return pack_s, self._times(answer), int(resent)

    def _send(self, buckets: list[Bucket], tensors: Iterator[tuple[str, torch.Tensor]]
              ) -> tuple[float, TensorUpdateTimes, int]:
        """Returns the packing time, the server's times summed over the buckets, and the resent count."""
        pending = None
        pack_s, server, resent = 0.0, TensorUpdateTimes(), 0
        deadline = time.monotonic() + self.timeout_s
        for k, b in enumerate(buckets):
            got = []
            for s in b.slots:
                name, t = next(tensors)
                if name != s.name:
                    raise WeightSyncError(f"tensor order differs from the plan: got {name}, planned {s.name}")
                got.append(t.detach())
            # bucket k-2 used this buffer; it was confirmed before bucket k-1 went out
            t = time.perf_counter()
            flat = b.pack(got, self._buffer(k % 2, b.nbytes))
            del got
            self._sync()
            key = ("bucket", flat.data_ptr(), tuple((s.name, s.dtype, tuple(s.shape), s.start, s.end) for s in b.slots))
            data, again = self._payload(key, functools.partial(_bucket_payload, b, flat))
            resent += again
            pack_s += time.perf_counter() - t
            if pending is not None:
                server += self._confirm(pending, deadline)
            pending = self.control.start(self._update(data, FLATTENED))
        if pending is not None:
            server += self._confirm(pending, deadline)
        return pack_s, server, resent

    @staticmethod
    def _body(data: str, load_format: str | None) -> dict[str, Any]:
        return UpdateWeightsFromTensorRequest(serialized_named_tensors=[data], load_format=load_format,
                                              flush_cache=False, abort_all_requests=False).model_dump(exclude_none=True)

    def _times(self, answer: dict[str, Any] | None) -> TensorUpdateTimes:
        reply = TensorUpdateReply.model_validate(answer or {})  # a server that reports none: zeros
        self.server_keeps_handles = reply.handles_kept
        return TensorUpdateTimes(map_s=reply.map_s, hold_s=reply.hold_s, copy_s=reply.copy_s,
                                 read_s=reply.read_s, handler_s=reply.handler_s)

    async def _update(self, data: str, load_format: str | None) -> TensorUpdateTimes:
        answer = await self.control.acall(self.servers[0], "/update_weights_from_tensor", self._body(data, load_format),
                                          timeout_s=self.timeout_s)
        return self._times(answer)

    def _confirm(self, fut, deadline: float) -> TensorUpdateTimes:
        from asyncwebrl.weights.control import wait_confirmed

        return wait_confirmed(fut, deadline, "the server did not confirm a same-device update")

    def close(self) -> None:
        self._bufs = [None, None]
        self._sent.clear()
        self._resident_body = None
        self.control.close()
