"""The weight-update process group: the trainer's rank 0 plus every rollout server (SPEC section 5).

The ONE constructor both sides use (`join_group`). Its rendezvous is laid out exactly as SGLang's
`init_custom_process_group` lays it out when a server answers `/init_weights_update_group`, so
our trainer forms a group with real SGLang servers and our embedded server with any SGLang-style
trainer. The layout (SGLang 0.5.x on torch 2.x; `tests/weights/test_sglang_receiver.py` runs SGLang
0.5.23's own `init_custom_process_group` on its pinned torch 2.14.1 against this one on ours, 2.13.0,
so neither the two codes nor the two torch versions can drift apart unnoticed):

  TCPStore at master_address:master_port (rank 0 hosts it, the others are clients)
    -> PrefixStore(group_name)            SGLang's own prefix
    -> PrefixStore(group_name + "/")      torch's process-group prefix
    -> PrefixStore(device + "/")          torch's per-backend prefix: "cpu" for gloo, "cuda" for nccl
    -> ProcessGroupGloo | ProcessGroupNCCL at `rank`, then the backend's group sequence number is
       agreed (gloo: rank 0 publishes it in the store and every other rank reads it).

Built from torch's public backend classes, never `init_process_group`, so the group lives beside
any default (FSDP) group. Invariant: every collective here has a deadline; a dead peer surfaces as
`WeightSyncError`, never a hang.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class WeightSyncError(RuntimeError):
    """A weight update could not complete (dead peer, refused request, timeout)."""


def backend_device(backend: str) -> str:
    """The device prefix torch gives a single-backend group (its first supported device)."""
    if backend == "gloo":
        return "cpu"
    if backend == "nccl":
        return "cuda"
    raise ValueError(f"unknown weight-group backend {backend!r} (gloo | nccl)")


@dataclass
class WeightGroup:
    """One member's handle on the group (rank 0 = trainer)."""

    name: str
    rank: int
    world_size: int
    backend: str
    device: torch.device
    pg: Any
    store: Any
    timeout_s: float

    def _left(self, deadline: float | None) -> datetime.timedelta:
        s = self.timeout_s if deadline is None else max(1.0, deadline - time.monotonic())
        return datetime.timedelta(seconds=s)

    def broadcast(self, t: torch.Tensor, deadline: float | None = None) -> Any:
        """Start one broadcast from rank 0 (async); returns the work to `wait` on."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = self._left(deadline)
        if t.is_cuda:
            with torch.cuda.device(t.device):  # NCCL launches on the current device's stream
                return self.pg.broadcast([t], opts)
        return self.pg.broadcast([t], opts)

    def wait(self, work: Any, deadline: float | None = None) -> None:
        """Wait for `work`. For NCCL this only orders the current stream after the collective and
        returns at once (torch turns a wait WITH a timeout into a host busy-wait, so none is passed:
        the group's own timeout, set at construction, bounds it through NCCL's watchdog); for gloo
        it blocks until the data is in place, bounded by the deadline."""
        try:
            ok = work.wait() if self.backend == "nccl" else work.wait(self._left(deadline))
        except Exception as e:  # noqa: BLE001 - a dead peer surfaces as a torch error
            raise WeightSyncError(f"collective in group '{self.name}' failed: {e}") from e
        if ok is False:
            raise WeightSyncError(f"collective in group '{self.name}' did not complete before the deadline")

    def barrier(self, deadline: float | None = None) -> None:
        """A one-element all-reduce (every backend has it, with a timeout), completed on the host."""
        t = torch.zeros(1, device=self.device)
        opts = dist.AllreduceOptions()
        opts.timeout = self._left(deadline)
        self.wait(self.pg.allreduce([t], opts), deadline)
        if t.is_cuda:
            torch.cuda.synchronize(self.device)

    def destroy(self) -> None:
        """Tear the local side down (no collective: a peer may already be gone)."""
        try:
            if self.backend == "nccl" and hasattr(self.pg, "abort"):
                self.pg.abort()
            elif hasattr(self.pg, "shutdown"):
                self.pg.shutdown()
        except Exception:  # noqa: BLE001 - a group whose peer died may fail to shut down cleanly
            pass
        self.pg = None
        self.store = None


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str, device: str | torch.device = "cpu", timeout_s: float = 120.0) -> WeightGroup:
    """Join (rank > 0) or host (rank 0) the weight-update group; returns when every rank joined.

    Rank 0 must already be listening (or start listening concurrently): the store master is
    created here for rank 0 without waiting for the clients, then the backend connects all ranks.
    """
    if not group_name:
        raise ValueError("group_name must not be empty")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    dev = torch.device(device)
    if backend == "nccl" and dev.type != "cuda":
        raise ValueError("backend 'nccl' needs a CUDA device; use 'gloo' on CPU")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0,
                          timeout=timeout, wait_for_workers=False)
    return join_with_store(store, rank, world_size, group_name, backend, dev, timeout_s)


def join_with_store(store: Any, rank: int, world_size: int, group_name: str, backend: str,
                    device: torch.device, timeout_s: float) -> WeightGroup:
    """The group on an existing store (rank 0 built the store master itself)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    layered = dist.PrefixStore(f"{backend_device(backend)}/",
                               dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(layered, rank, world_size, timeout)
    else:
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout
        opts.group_name = group_name
        pg = dist.ProcessGroupNCCL(layered, rank, world_size, opts)
    pg._set_sequence_number_for_group()
    return WeightGroup(group_name, rank, world_size, backend, device, pg, store, timeout_s)
