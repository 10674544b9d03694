"""Trainer -> train-rollout weight refresh over a dedicated process group (`xccl` mode, SPEC section 5).

Protocol (trainer side; the server side lives with the inference server):
  init:   POST /init_weights_update_group {master_address, master_port, rank_offset=1+i, world_size=n+1,
          group_name, backend} to every server i, while this process (rank 0) hosts the TCPStore,
          wraps it in PrefixStore(group_name) and builds ProcessGroupGloo / ProcessGroupNCCL at rank 0.
  update: parameters are packed into buckets of `weight_chunked_mem_mb`; per bucket one
          POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache,
          abort_all_requests, weight_version} runs concurrently with that bucket's broadcasts
          (rootRank 0, one broadcast per tensor, in the order of `names`).
  close:  POST /destroy_weights_update_group {group_name}.

Invariant: nothing here waits without a deadline. Every HTTP call and every collective is bounded by
`weight_update_timeout_s`; a dead or refusing peer raises `WeightSyncError` (and the group is marked
broken, so the caller re-inits instead of broadcasting into a half-dead group). Pausing and resuming
rollout around `broadcast` is the caller's job (the controller).
"""

from __future__ import annotations

import datetime
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from asyncwebrl.net import LOOPBACK, WILDCARDS, free_port
from asyncwebrl.training.config import ActorConfig


class WeightSyncError(RuntimeError):
    """A weight update could not complete (dead peer, refused request, timeout)."""


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def post_json(base_url: str, path: str, body: dict[str, Any], api_key: str | None, timeout_s: float) -> dict[str, Any]:
    """POST JSON and return the JSON answer; WeightSyncError on transport errors, HTTP errors or
    `success: false`."""
    url = base_url.rstrip("/") + path
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            answer = json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        raise WeightSyncError(f"{url} answered HTTP {e.code}: {e.read()[:500].decode(errors='replace')}") from e
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        raise WeightSyncError(f"{url} unreachable or timed out after {timeout_s:.0f}s: {e}") from e
    if isinstance(answer, dict) and answer.get("success") is False:
        raise WeightSyncError(f"{url} refused: {answer.get('message')}")
    return answer


class _Call(threading.Thread):
    """One blocking call on its own thread, so the caller can run collectives meanwhile."""

    def __init__(self, fn, *args, daemon: bool = True):
        super().__init__(daemon=daemon)
        self.fn, self.args = fn, args
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as e:  # re-raised by the caller in join_or_raise
            self.error = e

    def join_or_raise(self, deadline: float) -> Any:
        self.join(max(0.0, deadline - time.monotonic()))
        if self.is_alive():
            raise WeightSyncError(f"HTTP call {self.args[1]} to {self.args[0]} still running at the deadline")
        if self.error is not None:
            raise self.error if isinstance(self.error, WeightSyncError) else WeightSyncError(str(self.error))
        return self.result


def make_buckets(named: list[tuple[str, torch.Tensor]], bucket_mb: float) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of tensors of at most `bucket_mb` MiB (a larger tensor forms its own bucket)."""
    limit = bucket_mb * 2**20
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > limit:
            buckets.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += nbytes
    if cur:
        buckets.append(cur)
    return buckets


@dataclass
class BroadcastReport:
    """What one `broadcast` moved and how long it took."""

    version: int
    n_tensors: int
    n_buckets: int
    bytes: int
    seconds: float


class WeightBroadcaster:
    """Rank 0's side of the weight-update group with every train-rollout server."""

    def __init__(self, server_addresses: list[str], api_key: str | None, cfg: ActorConfig, *,
                 master_address: str = LOOPBACK, master_port: int = 0, backend: str | None = None,
                 device: str = "cpu", group_name: str | None = None):
        if not server_addresses:
            raise ValueError("WeightBroadcaster needs at least one server address")
        self.servers = list(server_addresses)
        self.api_key = api_key
        self.cfg = cfg
        self.device = torch.device(device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if self.backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend nccl needs device=cuda")
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name or f"awrl_weights_{uuid.uuid4().hex[:8]}"
        self.timeout_s = float(cfg.weight_update_timeout_s)
        self.pg: Any = None
        self.store: Any = None
        self.broken = False

    @property
    def world_size(self) -> int:
        return len(self.servers) + 1

    def _post(self, server: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return post_json(server, path, body, self.api_key, self.timeout_s)

    def init_group(self) -> None:
        """Form the group: HTTP init to every server concurrently with rank 0's rendezvous."""
        if self.pg is not None:
            raise WeightSyncError("weight update group already initialized; close() first")
        port = self.master_port or free_port(LOOPBACK if self.master_address in WILDCARDS else self.master_address)
        self.master_port = port
        deadline = time.monotonic() + self.timeout_s
        timeout = datetime.timedelta(seconds=self.timeout_s)
        calls = [
            _Call(self._post, s, "/init_weights_update_group", {
                "master_address": self.master_address, "master_port": port, "rank_offset": 1 + i,
                "world_size": self.world_size, "group_name": self.group_name, "backend": self.backend,
            })
            for i, s in enumerate(self.servers)
        ]
        # the store must be listening before the servers try to connect
        self.store = dist.TCPStore(self.master_address, port, self.world_size, is_master=True,
                                   timeout=timeout, wait_for_workers=False)
        for c in calls:
            c.start()
        # not a daemon: if init fails early the rendezvous still runs (bounded by the timeout) and the
        # interpreter must wait for it at exit, or the C++ thread it holds aborts the process
        maker = _Call(self._make_group, None, "rendezvous", daemon=False)
        maker.start()
        # fail fast if a server refuses; otherwise wait for the rendezvous
        while maker.is_alive() and time.monotonic() < deadline:
            for c in calls:
                if not c.is_alive() and c.error is not None:
                    self.broken = True
                    raise WeightSyncError(f"server {c.args[0]} failed to join the weight group: {c.error}")
            maker.join(0.05)
        self.pg = maker.join_or_raise(deadline)
        for c in calls:
            c.join_or_raise(deadline)
        self.broken = False

    def _make_group(self, *_):
        prefix = dist.PrefixStore(self.group_name, self.store)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if self.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(prefix, 0, self.world_size, opts)
        return dist.ProcessGroupGloo(prefix, 0, self.world_size, timeout)

    def _bcast_all(self, tensors: list[torch.Tensor], deadline: float) -> None:
        """Issue one broadcast per tensor (in order) and wait for all of them once: a host sync per
        tensor would serialize hundreds of small launches (NCCL) or round trips (gloo)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
        works = [self.pg.broadcast([t], opts) for t in tensors]
        for w in works:
            left = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
            if not w.wait(left):
                raise WeightSyncError("broadcast did not complete before the deadline")
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _prepare(self, t: torch.Tensor) -> torch.Tensor:
        if t.device != self.device:
            t = t.to(self.device, non_blocking=True)
        return t.contiguous()

    def broadcast(self, named_tensors: list[tuple[str, torch.Tensor]] | dict[str, torch.Tensor], version: int,
                  abort_all_requests: bool = False) -> BroadcastReport:
        """Send every tensor to every server, bucket by bucket; returns when all servers confirmed."""
        if self.pg is None or self.broken:
            raise WeightSyncError("no usable weight update group: call init_group() first")
        named = list(named_tensors.items()) if isinstance(named_tensors, dict) else list(named_tensors)
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        buckets = make_buckets(named, self.cfg.weight_chunked_mem_mb)
        nbytes = 0
        try:
            for b, bucket in enumerate(buckets):
                tensors = [self._prepare(t) for _, t in bucket]
                body = {
                    "names": [n for n, _ in bucket], "dtypes": [dtype_name(t.dtype) for t in tensors],
                    "shapes": [list(t.shape) for t in tensors], "group_name": self.group_name,
                    "flush_cache": b == len(buckets) - 1, "abort_all_requests": abort_all_requests,
                    "weight_version": str(version),
                }
                calls = [_Call(self._post, s, "/update_weights_from_distributed", body) for s in self.servers]
                for c in calls:
                    c.start()
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
                self._bcast_all(tensors, deadline)
                nbytes += sum(t.numel() * t.element_size() for t in tensors)
                for c in calls:
                    c.join_or_raise(deadline)
        except BaseException as e:
            self.broken = True
            if isinstance(e, WeightSyncError):
                raise
            raise WeightSyncError(f"weight broadcast failed: {e}") from e
        return BroadcastReport(version, len(named), len(buckets), nbytes, time.perf_counter() - t0)

    def raw_broadcast(self, tensors: list[torch.Tensor]) -> float:
        """Broadcast `tensors` with no HTTP at all (the physical floor); the peers must be receiving
        the same list. Timed between two barriers, so it includes the slowest receiver."""
        deadline = time.monotonic() + self.timeout_s
        tensors = [self._prepare(t) for t in tensors]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._barrier(deadline)
        t0 = time.perf_counter()
        self._bcast_all(tensors, deadline)
        self._barrier(deadline)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _barrier(self, deadline: float) -> None:
        # a one-element all-reduce: a barrier every backend has, with a timeout
        t = torch.zeros(1, device=self.device)
        opts = dist.AllreduceOptions()
        opts.timeout = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
        work = self.pg.allreduce([t], opts)
        if not work.wait(opts.timeout):
            raise WeightSyncError("barrier did not complete before the deadline")

    def close(self) -> None:
        """Tear the group down on the servers (best effort, bounded) and locally."""
        if self.pg is not None and not self.broken:
            deadline = time.monotonic() + min(self.timeout_s, 30.0)
            calls = [_Call(self._post, s, "/destroy_weights_update_group", {"group_name": self.group_name})
                     for s in self.servers]
            for c in calls:
                c.start()
            for c in calls:
                try:
                    c.join_or_raise(deadline)
                except WeightSyncError:
                    pass  # a dead server has no group to destroy
        if self.pg is not None and hasattr(self.pg, "shutdown"):
            try:
                self.pg.shutdown()
            except Exception:
                pass
        self.pg = None
        self.store = None
