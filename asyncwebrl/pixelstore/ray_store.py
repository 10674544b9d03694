"""The PixelStore as named, restartable Ray actors (one per node) and the client that routes to them.

Each node gets one `PixelStoreActor` named `awrl-pixelstore-<run>-<node prefix>`, pinned to that node
(NodeAffinity, hard) and created with `max_restarts=-1`. Keys start with the node prefix, so a client
sends a put to its own node's store and a get to the store that holds the key: a screenshot crosses
nodes only when the trainer that consumes it sits elsewhere.

Invariant: a client call never hangs on a dead actor. Calls carry timeouts; when the actor died the
client waits for Ray to restart it and retries until `retry_deadline_s`, then raises
`PixelStoreUnavailable`. A restarted actor starts empty: keys lost with it read as None on `get`
(counted as missing by the store and by the client) and the trainer drops those samples.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import ray

from asyncwebrl.pixelstore.base import PixelStoreFull, PixelStoreUnavailable, check_blobs, key_prefix
from asyncwebrl.pixelstore.store import InProcessPixelStore

log = logging.getLogger(__name__)

ACTOR_PREFIX = "awrl-pixelstore"


class PixelStoreActor:
    """Ray actor body: an `InProcessPixelStore` served to many concurrent callers (threaded actor)."""

    def __init__(self, capacity_bytes: int, put_timeout_s: float, prefix: str, max_age_s: float = 0.0):
        self.store = InProcessPixelStore(prefix, capacity_bytes, put_timeout_s, max_age_s)

    def put_batch(self, items: list[bytes], refs: int = 1, timeout_s: float | None = None) -> list[str] | str:
        try:
            return self.store.put_batch(items, refs, timeout_s)
        except PixelStoreFull as e:
            return f"FULL: {e}"  # an error string, not an exception: no retry on back-pressure timeouts

    def get(self, keys: list[str]) -> list[bytes | None]:
        return self.store.get(keys)

    def free(self, keys: list[str]) -> int:
        return self.store.free(keys)

    def retain(self, keys: list[str]) -> int:
        return self.store.retain(keys)

    def count_missing(self, keys: list[str]) -> int:
        return self.store.count_missing(keys)

    def stats(self) -> dict:
        return self.store.stats()

    def ping(self) -> str:
        return self.store.prefix


def node_prefix(node_id: str) -> str:
    return "n" + node_id[:12]


def actor_name(run_name: str, prefix: str) -> str:
    return f"{ACTOR_PREFIX}-{run_name}-{prefix}"


def launch_ray_stores(run_name: str, capacity_bytes: int, put_timeout_s: float, max_age_s: float = 0.0,
                      node_ids: list[str] | None = None, max_concurrency: int = 64) -> dict[str, Any]:
    """One store actor per alive node (or per given node); returns {prefix: actor handle}."""
    if not ray.is_initialized():
        raise RuntimeError("launch_ray_stores needs a running Ray (ray.init first), or use scheduler.type=local")
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if node_ids is None:
        node_ids = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    cls = ray.remote(PixelStoreActor)
    handles: dict[str, Any] = {}
    for nid in node_ids:
        prefix = node_prefix(nid)
        handles[prefix] = cls.options(
            name=actor_name(run_name, prefix),
            get_if_exists=True,
            max_restarts=-1,
            max_task_retries=0,
            max_concurrency=max_concurrency,
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False),
        ).remote(capacity_bytes, put_timeout_s, prefix, max_age_s)
    ray.get([h.ping.remote() for h in handles.values()], timeout=60)
    return handles


class _Restarting(Exception):
    """The store actor's name did not resolve: Ray is restarting it."""


class PixelStoreClient:
    """Routes PixelStore calls to the per-node actors by key prefix; picklable (Ray workers get a copy).
    Honours the `base.PixelStore` contract; `close` ends the stores for good."""

    def __init__(self, run_name: str, prefixes: list[str] | dict[str, Any], put_timeout_s: float = 60.0,
                 call_timeout_s: float = 30.0, retry_deadline_s: float = 60.0):
        """`prefixes`: the store prefixes, or the {prefix: handle} dict of launch_ray_stores. Pass the
        dict in the process that launched the stores: Ray ends a (non-detached) actor when its last
        handle is gone, so the owning client keeps them alive for the run."""
        self._owned = dict(prefixes) if isinstance(prefixes, dict) else {}
        if not prefixes:
            raise ValueError("PixelStoreClient needs at least one store prefix")
        self.run_name = run_name
        self.prefixes = list(prefixes)
        self.put_timeout_s = put_timeout_s
        self.call_timeout_s = call_timeout_s
        self.retry_deadline_s = retry_deadline_s
        self.missing_seen = 0
        self.retries = 0
        self._handles: dict[str, Any] = {}

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["_handles"] = {}
        d["_owned"] = {}  # copies look stores up by name; only the launcher owns them
        return d

    def _handle(self, prefix: str) -> Any:
        h = self._handles.get(prefix)
        if h is None:
            if prefix not in self.prefixes:
                raise KeyError(f"no PixelStore for key prefix {prefix!r} (stores: {self.prefixes})")
            h = self._handles[prefix] = ray.get_actor(actor_name(self.run_name, prefix))
        return h

    def local_prefix(self) -> str:
        try:
            p = node_prefix(ray.get_runtime_context().get_node_id())
        except Exception:  # noqa: BLE001 - outside a Ray worker/driver context
            p = ""
        return p if p in self.prefixes else self.prefixes[0]

    def _call(self, prefix: str, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        deadline = time.monotonic() + self.retry_deadline_s + (timeout_s or 0)
        delay = 0.05
        while True:
            try:
                try:
                    handle = self._handle(prefix)
                except ValueError as e:  # the name is not registered (yet): the actor is restarting
                    raise _Restarting(str(e)) from e
                return ray.get(getattr(handle, method).remote(*args), timeout=timeout_s or self.call_timeout_s)
            except (_Restarting, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                self._handles.pop(prefix, None)
                self.retries += 1
                if time.monotonic() + delay > deadline:
                    raise PixelStoreUnavailable(
                        f"PixelStore {prefix} of run {self.run_name} unavailable for "
                        f"{self.retry_deadline_s} s: {type(e).__name__}: {e}"
                    ) from e
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    # -- the PixelStore protocol ---------------------------------------------------------------
    def put(self, data: bytes, refs: int = 1) -> str:
        return self.put_batch([data], refs)[0]

    def put_batch(self, items: Sequence[bytes], refs: int = 1, timeout_s: float | None = None) -> list[str]:
        blobs = check_blobs(items, refs)
        wait = self.put_timeout_s if timeout_s is None else timeout_s
        out = self._call(self.local_prefix(), "put_batch", blobs, refs, wait, timeout_s=wait + self.call_timeout_s)
        if isinstance(out, str):
            raise PixelStoreFull(out.removeprefix("FULL: "))
        return out

    def _by_prefix(self, keys: Sequence[str]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            groups.setdefault(key_prefix(k), []).append(i)
        return groups

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(keys)
        for prefix, idx in self._by_prefix(keys).items():
            if prefix not in self.prefixes:
                continue  # unknown store: the keys are missing
            vals = self._call(prefix, "get", [keys[i] for i in idx])
            for i, v in zip(idx, vals, strict=True):
                out[i] = v
        self.missing_seen += sum(v is None for v in out)
        return out

    def _sum(self, method: str, keys: Sequence[str]) -> int:
        total = 0
        for prefix, idx in self._by_prefix(keys).items():
            if prefix in self.prefixes:
                total += int(self._call(prefix, method, [keys[i] for i in idx]))
            elif method == "count_missing":
                total += len(idx)
        return total

    def free(self, keys: Sequence[str]) -> int:
        return self._sum("free", keys)

    def retain(self, keys: Sequence[str]) -> int:
        return self._sum("retain", keys)

    def count_missing(self, keys: Sequence[str]) -> int:
        return self._sum("count_missing", keys)

    def stats(self) -> dict:
        per = {p: self._call(p, "stats") for p in self.prefixes}
        total: dict[str, Any] = {}
        for s in per.values():
            for k, v in s.items():
                total[k] = total.get(k, 0) + v
        total["stores"] = per
        total["client_missing"] = self.missing_seen
        total["client_retries"] = self.retries
        return total

    def kill_all(self) -> None:
        """Remove the stores for good (end of run): no restart."""
        for p in self.prefixes:
            try:
                ray.kill(self._handle(p), no_restart=True)
            except Exception as e:  # noqa: BLE001 - already gone
                log.debug("killing PixelStore %s: %r", p, e)
        self._handles.clear()
        self._owned.clear()

    def close(self) -> None:
        self.kill_all()
