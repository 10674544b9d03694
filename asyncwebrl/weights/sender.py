"""The trainer's rank 0 side of the weight refresh: group setup and the bucketed flat transfer.

Protocol (SGLang's HTTP API; group layout in `group.py`, bucket layout in `buckets.py`):
  init:     POST /init_weights_update_group {master_address, master_port, rank_offset=1+i,
            world_size=n+1, group_name, backend} to every server i, concurrently with this rank's
            side of the rendezvous (it hosts the store).
  transfer: the parameters are planned into flat buckets of `bucket_mb`; each bucket is ONE
            broadcast. Servers that advertise the `bucket_sizes` extension (`/server_info`
            `weight_update_extensions`, the embedded server) get ONE announcement per refresh
            (every name, dtype and shape, `load_format: "flattened_bucket"`, `bucket_sizes`);
            other servers (SGLang) get one `/update_weights_from_distributed` per bucket, the next
            bucket packed while the current one is in flight. The weight version is not sent here:
            the refresh bracket sets it once, after the last bucket (`bracket.py`).
  close:    POST /destroy_weights_update_group {group_name}.

Invariants: bucket k+1 is packed into the other of two send buffers while bucket k is on the wire,
and on NCCL no host synchronisation happens per tensor or per bucket (one at the end); the
tensors come from an iterator consumed bucket by bucket, so an FSDP trainer gathers one bucket at a
time, never the whole model. Every call and collective is bounded by `timeout_s`; a refused or dead
peer raises `WeightSyncError` and marks the group broken (re-init, never broadcast into a half-dead
group); the error's `touched` lists the servers that may have loaded some of the new weights (all
but those that refused their first announcement before loading), for the refresh bracket. `close()`
destroys the group on every server, broken or not.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncwebrl.net import LOOPBACK, WILDCARDS
from asyncwebrl.protocol import (
    InitWeightsUpdateGroupRequest,
    ProtocolError,
    UpdateWeightsFromDistributedRequest,
)
from asyncwebrl.weights.buckets import Bucket, plan_buckets, tensors_and_meta
from asyncwebrl.weights.control import ControlChannel, wait_confirmed
from asyncwebrl.weights.group import WeightGroup, WeightSyncError, join_with_store
from asyncwebrl.weights.receiver import FLATTENED

EXTENSION_BUCKET_SIZES = "bucket_sizes"
DEFAULT_BUCKET_MB = 2048


@dataclass
class TransferReport:
    """What one transfer moved and how long it took (trainer side, until every server confirmed)."""

    n_tensors: int
    n_buckets: int
    bytes: int
    seconds: float
    announcements: int
    """HTTP announcements per server (1 with the bucket_sizes extension, else one per bucket)"""


class WeightSender:
    """Rank 0's side of the weight-update group with every train-rollout server."""

    def __init__(self, servers: list[str], api_key: str | None = None, *, master_address: str = LOOPBACK,
                 master_port: int = 0, backend: str | None = None, device: str = "cpu",
                 bucket_mb: float = DEFAULT_BUCKET_MB, timeout_s: float = 120.0, group_name: str | None = None,
                 announce_once: bool | None = None):
        if not servers:
            raise ValueError("WeightSender needs at least one server address")
        self.device = torch.device(device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if self.backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend nccl needs device=cuda")
        self.control = ControlChannel(servers, api_key, timeout_s)
        self.servers = self.control.servers
        self.master_address = master_address
        self.master_port = master_port
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.timeout_s = timeout_s
        self.group_name = group_name or f"awrl_weights_{uuid.uuid4().hex[:8]}"
        self.announce_once = announce_once
        self.group: WeightGroup | None = None
        self.broken = False
        self._bufs: list[torch.Tensor | None] = [None, None]
        self._confirmed: dict[str, int] = {}
        """announcements each server confirmed in the transfer in progress"""
        self._refused: set[str] = set()
        """servers that refused their first announcement of it without loading anything"""

    @property
    def world_size(self) -> int:
        return len(self.servers) + 1

    # ---- group ---------------------------------------------------------------------------------------
    def init_group(self) -> None:
        """Form the group: HTTP init to every server concurrently with rank 0's rendezvous."""
        import torch.distributed as dist

        from asyncwebrl.net import free_port

        if self.group is not None:
            raise WeightSyncError("weight update group already initialized; close() first")
        if self.announce_once is None:
            self.announce_once = self._servers_take_bucket_sizes()
        host = LOOPBACK if self.master_address in WILDCARDS else self.master_address
        self.master_port = self.master_port or free_port(host)
        import datetime

        store = dist.TCPStore(self.master_address, self.master_port, self.world_size, is_master=True,
                              timeout=datetime.timedelta(seconds=self.timeout_s), wait_for_workers=False)
        deadline = time.monotonic() + self.timeout_s
        inits = [self.control.start(self.control.acall(s, "/init_weights_update_group", InitWeightsUpdateGroupRequest(
            master_address=self.master_address, master_port=self.master_port, rank_offset=1 + i,
            world_size=self.world_size, group_name=self.group_name, backend=self.backend,
        ).model_dump())) for i, s in enumerate(self.servers)]
        box: dict[str, Any] = {}

        def make() -> None:
            try:
                box["group"] = join_with_store(store, 0, self.world_size, self.group_name, self.backend,
                                               self.device, self.timeout_s)
            except BaseException as e:  # noqa: BLE001 - reported below
                box["error"] = e

        # not a daemon: if init fails early the rendezvous still runs (bounded by the timeout) and the
        # interpreter must wait for it at exit, or the C++ thread it holds aborts the process
        maker = threading.Thread(target=make, name="weights-rendezvous")
        maker.start()
        while maker.is_alive() and time.monotonic() < deadline:
            for s, f in zip(self.servers, inits, strict=True):
                if f.done() and f.exception() is not None:
                    self.broken = True
                    raise WeightSyncError(f"server {s} failed to join the weight group: {f.exception()}")
            maker.join(0.05)
        if maker.is_alive() or "error" in box:
            self.broken = True
            raise WeightSyncError(f"weight group rendezvous failed: {box.get('error', 'timed out')}")
        for f in inits:
            try:
                f.result(timeout=max(0.1, deadline - time.monotonic()))
            except WeightSyncError:
                self.broken = True
                raise
            except Exception as e:  # noqa: BLE001
                self.broken = True
                raise WeightSyncError(f"a server did not confirm joining the weight group: {e}") from e
        self.group = box["group"]
        self.broken = False

    def _servers_take_bucket_sizes(self) -> bool:
        ctl, t = self.control, min(30.0, self.timeout_s)

        async def ask() -> list[Any]:  # GET: SGLang's /server_info answers POST with 405
            return await asyncio.gather(*(ctl.acall(s, "/server_info", None, optional=True, method="GET", timeout_s=t)
                                          for s in self.servers))
        try:
            infos = dict(zip(self.servers, ctl.run(ask(), t), strict=True))
        except WeightSyncError:
            return False
        return all(info is not None and EXTENSION_BUCKET_SIZES in (info.get("weight_update_extensions") or [])
                   for info in infos.values())

    # ---- transfer ------------------------------------------------------------------------------------
    def plan(self, meta: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> list[Bucket]:
        return plan_buckets(meta, self.bucket_bytes)

    def transfer(self, named: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor],
                 meta: Sequence[tuple[str, torch.dtype, Sequence[int]]] | None = None) -> TransferReport:
        """Send every tensor to every server; returns when all servers confirmed.

        `named` may be a lazy iterator (an FSDP gather): give `meta` (name, dtype, shape in the same
        order) and it is consumed one bucket at a time."""
        if self.group is None or self.broken:
            raise WeightSyncError("no usable weight update group: call init_group() first")
        named, meta = tensors_and_meta(named, meta)
        buckets = self.plan(meta)
        t0 = time.perf_counter()
        self._confirmed = dict.fromkeys(self.servers, 0)
        self._refused = set()
        try:
            if self.announce_once:
                n_ann = 1
                self._send_announced_once(buckets, iter(named))
            else:
                n_ann = len(buckets)
                self._send_per_bucket(buckets, iter(named))
        except BaseException as e:
            self.broken = True
            err = e if isinstance(e, WeightSyncError) else WeightSyncError(
                f"weight transfer failed: {type(e).__name__}: {e}")
            err.touched = [s for s in self.servers if self._confirmed.get(s) or s not in self._refused]
            if err is e:
                raise
            raise err from e
        return TransferReport(len(meta), len(buckets), sum(b.nbytes for b in buckets), time.perf_counter() - t0,
                              n_ann)

    def _announcement(self, buckets: Sequence[Bucket], with_sizes: bool) -> dict[str, Any]:
        """The /update_weights_from_distributed body (the shared protocol model; fields left at None
        are not sent, so a server without the bucket_sizes extension sees SGLang's own fields only)."""
        return UpdateWeightsFromDistributedRequest(
            names=[n for b in buckets for n in b.names], dtypes=[d for b in buckets for d in b.dtypes],
            shapes=[s for b in buckets for s in b.shapes], group_name=self.group_name, flush_cache=False,
            abort_all_requests=False, load_format=FLATTENED,
            bucket_sizes=[len(b.slots) for b in buckets] if with_sizes else None,
        ).model_dump(exclude_none=True)

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        b = self._bufs[slot]
        if b is None or b.numel() < nbytes:
            self._bufs[slot] = None
            self._bufs[slot] = b = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return b

    def _broadcast_all(self, buckets: Sequence[Bucket], tensors: Iterator[tuple[str, torch.Tensor]],
                       per_bucket: list | None, deadline: float) -> None:
        """Pack and broadcast every bucket; bucket k+1 is packed while k is on the wire. With
        `per_bucket` (futures of the announcements, one per bucket) each bucket's broadcast waits
        for nothing but the previous bucket's confirmation (SGLang receives one bucket per request)."""
        g = self.group
        works: list[Any] = [None, None]
        for k, b in enumerate(buckets):
            slot = k % 2
            if works[slot] is not None:  # the buffer's previous broadcast must be done before reuse
                g.wait(works[slot], deadline)
                works[slot] = None
            got = []
            for slot_meta in b.slots:
                name, t = next(tensors)
                if name != slot_meta.name:
                    raise WeightSyncError(f"tensor order differs from the plan: got {name}, planned {slot_meta.name}")
                got.append(t.detach())
            flat = b.pack(got, self._buffer(slot, b.nbytes))
            del got
            if per_bucket is not None and k > 0:
                self._confirm(per_bucket[k - 1], deadline)
                per_bucket[k] = self.control.start(self._announce_each(self._announcement([b], False)))
                per_bucket[k].add_done_callback(lambda _f: self._wake.set())
            works[slot] = g.broadcast(flat, deadline)
        for w in works:
            if w is not None:
                g.wait(w, deadline)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    async def _announce_each(self, body: dict[str, Any]) -> None:
        await asyncio.gather(*(self._announce(s, body) for s in self.servers))

    async def _announce(self, server: str, body: dict[str, Any]) -> None:
        try:
            await self.control.acall(server, "/update_weights_from_distributed", body, timeout_s=self.timeout_s)
        except WeightSyncError as e:
            # a refusal (HTTP 4xx) of the first announcement loaded nothing, unless the server says it
            # loaded part (SGLang: "partially updated")
            if (not self._confirmed.get(server) and isinstance(e.__cause__, ProtocolError)
                    and "partially updated" not in str(e)):
                self._refused.add(server)
            raise
        self._confirmed[server] = self._confirmed.get(server, 0) + 1

    def _confirm(self, fut, deadline: float) -> None:
        wait_confirmed(fut, deadline, "a server did not confirm its weights")

    def _send_announced_once(self, buckets: list[Bucket], tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        deadline = time.monotonic() + self.timeout_s
        fut = self.control.start(self._announce_each(self._announcement(buckets, True)))
        self._broadcast_checked(buckets, tensors, None, fut, deadline)
        self._confirm(fut, deadline)

    def _send_per_bucket(self, buckets: list[Bucket], tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        deadline = time.monotonic() + self.timeout_s
        futs: list[Any] = [None] * len(buckets)
        futs[0] = self.control.start(self._announce_each(self._announcement(buckets[:1], False)))
        self._broadcast_checked(buckets, tensors, futs, futs[0], deadline)
        self._confirm(futs[-1], deadline)

    def _broadcast_checked(self, buckets, tensors, per_bucket, first, deadline: float) -> None:
        """The broadcasts on a worker thread; a server that refuses an announcement fails the
        transfer at once instead of leaving this rank blocked in a broadcast nobody receives."""
        box: dict[str, BaseException] = {}
        wake = threading.Event()
        self._wake = wake
        first.add_done_callback(lambda _f: wake.set())

        def run() -> None:
            try:
                self._broadcast_all(buckets, tensors, per_bucket, deadline)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                box["error"] = e
            finally:
                wake.set()

        th = threading.Thread(target=run, name="weights-broadcast", daemon=True)
        th.start()
        while th.is_alive():
            wake.wait(max(0.0, deadline - time.monotonic()))
            wake.clear()
            for f in [f for f in (per_bucket or [first]) if f is not None]:
                if f.done() and f.exception() is not None:
                    raise WeightSyncError(f"a server refused the weights: {f.exception()}")
            if th.is_alive() and time.monotonic() > deadline:
                raise WeightSyncError("weight broadcast did not finish before the deadline")
        if "error" in box:
            raise box["error"]

    def close(self) -> None:
        """Tear the group down on the servers (best effort, bounded; a broken group too: a server that
        refused a transfer still holds its side of the group) and locally."""
        if self.group is not None:
            try:
                self.control.call_all("/destroy_weights_update_group", {"group_name": self.group_name},
                                      timeout_s=min(self.timeout_s, 30.0))
            except WeightSyncError:
                pass  # a dead server has no group to destroy
        if self.group is not None:
            self.group.destroy()
        self.group = None
        self._bufs = [None, None]
        self.control.close()
