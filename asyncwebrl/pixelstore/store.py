"""The in-process PixelStore: bounded, refcounted screenshot bytes keyed by opaque ids (SPEC section 8).

`InProcessPixelStore` serves a run whose store users share one process (scheduler=local: the
rollout executors run on threads and the trainer rank in the controller; evaluation; tests), and is
the body of each per-node Ray actor (ray_store.py). It honours the `base.PixelStore` contract.

Invariants:
- Memory is bounded: the bytes held never exceed `capacity_bytes`. A put that does not fit blocks
  (back-pressure: rollout waits) until frees make room, for at most `put_timeout_s`, then raises
  `PixelStoreFull`; an item larger than the whole capacity is refused at once.
- Refcounts: an item put with `refs=n` (or retained n-1 extra times) is removed only when `free` has
  been called for it n times.
- With `max_age_s > 0`, items older than that go whatever their refcount (orphans of a consumer that
  died), swept at most once a second on put.
- `get` never blocks on a missing key: it yields None and counts it in `missing`.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from asyncwebrl.pixelstore.base import PixelStoreFull, check_blobs, key_prefix

DEFAULT_CAPACITY_BYTES = 1 << 30


@dataclass
class PixelStoreStats:
    """Counters of one store (a plain record: crosses process boundaries as a dict)."""

    items: int
    bytes: int
    capacity_bytes: int
    puts: int
    gets: int
    frees: int
    evictions: int
    missing: int
    blocked_puts: int
    """puts that had to wait for room (back-pressure engaged)"""
    blocked_s: float
    """total time puts spent waiting for room"""
    peak_bytes: int
    bytes_put: int = 0
    """bytes stored by all puts so far (the traffic the store has turned over)"""

    def as_dict(self) -> dict:
        return asdict(self)


class InProcessPixelStore:
    """Thread-safe bounded store. `prefix` starts every key (the node id in multi-node runs)."""

    def __init__(self, prefix: str = "mem", capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
                 put_timeout_s: float = 60.0, max_age_s: float = 0.0):
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        if not prefix or ":" in prefix:
            raise ValueError(f"store prefix must be non-empty without ':' (got {prefix!r})")
        self.capacity_bytes = capacity_bytes
        self.put_timeout_s = put_timeout_s
        self.max_age_s = max_age_s
        self.prefix = prefix
        self._items: dict[str, bytes] = {}
        self._refs: dict[str, int] = {}
        self._born: dict[str, float] = {}
        self._bytes = 0
        self._cond = threading.Condition()
        self._c = dict(puts=0, gets=0, frees=0, evictions=0, missing=0, blocked_puts=0)
        self._blocked_s = 0.0
        self._peak = 0
        self._bytes_put = 0
        self._last_sweep = time.monotonic()

    def new_key(self) -> str:
        return f"{self.prefix}:{uuid.uuid4().hex}"

    # -- writes -------------------------------------------------------------------------------
    def put(self, data: bytes, refs: int = 1) -> str:
        return self.put_batch([data], refs)[0]

    def put_batch(self, items: Sequence[bytes], refs: int = 1, timeout_s: float | None = None) -> list[str]:
        """Store all items (all or nothing); blocks while they do not fit (back-pressure)."""
        blobs = check_blobs(items, refs)
        need = sum(len(b) for b in blobs)
        if need > self.capacity_bytes:
            raise PixelStoreFull(
                f"{need} bytes can never fit a PixelStore of {self.capacity_bytes} bytes; "
                "raise pixelstore.capacity_mb"
            )
        self._sweep()
        timeout = self.put_timeout_s if timeout_s is None else timeout_s
        keys = [self.new_key() for _ in blobs]
        with self._cond:
            if self._bytes + need > self.capacity_bytes:
                self._c["blocked_puts"] += 1
                t0 = time.monotonic()
                fits = self._cond.wait_for(lambda: self._bytes + need <= self.capacity_bytes, timeout)
                self._blocked_s += time.monotonic() - t0
                if not fits:
                    raise PixelStoreFull(
                        f"PixelStore full ({self._bytes} of {self.capacity_bytes} bytes) for {timeout} s: "
                        "the trainer is not freeing consumed screenshots, or pixelstore.capacity_mb is too small"
                    )
            now = time.monotonic()
            for k, b in zip(keys, blobs, strict=True):
                self._items[k] = b
                self._refs[k] = refs
                self._born[k] = now
            self._bytes += need
            self._bytes_put += need
            self._peak = max(self._peak, self._bytes)
            self._c["puts"] += len(blobs)
        return keys

    def retain(self, keys: Sequence[str]) -> int:
        """One more reference per occurrence of each held key; returns how many were held."""
        _check_keys(keys)
        n = 0
        with self._cond:
            for k in keys:
                if k in self._refs:
                    self._refs[k] += 1
                    n += 1
        return n

    def free(self, keys: Sequence[str]) -> int:
        """Drop one reference per occurrence; returns how many items were actually removed."""
        _check_keys(keys)
        removed = 0
        with self._cond:
            for k in keys:
                r = self._refs.get(k)
                if r is None:
                    continue
                if r > 1:
                    self._refs[k] = r - 1
                    continue
                self._remove(k)
                removed += 1
            self._c["frees"] += removed
            if removed:
                self._cond.notify_all()
        return removed

    def evict_older_than(self, age_s: float) -> int:
        """Remove items older than `age_s` whatever their refcount (orphans of dead consumers)."""
        cutoff = time.monotonic() - age_s
        with self._cond:
            old = [k for k, t in self._born.items() if t < cutoff]
            for k in old:
                self._remove(k)
            self._c["evictions"] += len(old)
            if old:
                self._cond.notify_all()
        return len(old)

    def _sweep(self) -> None:
        now = time.monotonic()
        if self.max_age_s > 0 and now - self._last_sweep > 1.0:
            self._last_sweep = now
            self.evict_older_than(self.max_age_s)

    def _remove(self, key: str) -> None:
        self._bytes -= len(self._items.pop(key))
        del self._refs[key]
        del self._born[key]

    def close(self) -> None:
        """Drop every item (end of run)."""
        with self._cond:
            for k in list(self._items):
                self._remove(k)
            self._cond.notify_all()

    # -- reads --------------------------------------------------------------------------------
    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        _check_keys(keys)
        with self._cond:
            out = [self._items.get(k) for k in keys]
            self._c["gets"] += len(keys)
            self._c["missing"] += sum(v is None for v in out)
        return out

    def count_missing(self, keys: Sequence[str]) -> int:
        _check_keys(keys)
        with self._cond:
            return sum(k not in self._items for k in keys)

    def stats(self) -> dict:
        with self._cond:
            return PixelStoreStats(
                items=len(self._items),
                bytes=self._bytes,
                capacity_bytes=self.capacity_bytes,
                blocked_s=self._blocked_s,
                peak_bytes=self._peak,
                bytes_put=self._bytes_put,
                **self._c,
            ).as_dict()


def _check_keys(keys: Sequence[str]) -> None:
    for k in keys:
        key_prefix(k)
