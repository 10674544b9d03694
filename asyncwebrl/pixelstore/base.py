"""The PixelStore interface every implementation serves (Ray actor, local process, in-process).

Invariant: keys are opaque strings; `get` never blocks on a missing key, it returns None for it
(callers drop and count such samples, SPEC section 8).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Protocol


class PixelStoreAPI(Protocol):
    def put(self, data: bytes) -> str: ...
    def put_batch(self, items: list[bytes]) -> list[str]: ...
    def get(self, keys: list[str]) -> list[bytes | None]: ...
    def free(self, keys: list[str]) -> int: ...
    def count_missing(self, keys: list[str]) -> int: ...
    def stats(self) -> dict: ...


class ThreadedAsyncAPI:
    """Async forms of a blocking store client, run on a worker thread so an episode loop's event loop
    never blocks on a store round trip (shared by the Ray and the local-process clients)."""

    async def aput(self, data: bytes, refs: int = 1) -> str:
        return await asyncio.to_thread(self.put, data, refs)

    async def aput_batch(self, items: list[bytes], refs: int = 1) -> list[str]:
        return await asyncio.to_thread(self.put_batch, items, refs)

    async def aget(self, keys: list[str]) -> list[bytes | None]:
        return await asyncio.to_thread(self.get, keys)


class InProcessPixelStore:
    """Dictionary-backed store in the caller's process, for single-process runs and tests."""

    def __init__(self, prefix: str = "local"):
        self._items: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._prefix = prefix
        self._counters = dict(puts=0, gets=0, frees=0, evictions=0, missing=0)

    def put(self, data: bytes) -> str:
        return self.put_batch([data])[0]

    def put_batch(self, items: list[bytes]) -> list[str]:
        keys = [f"{self._prefix}:{uuid.uuid4().hex}" for _ in items]
        with self._lock:
            for k, v in zip(keys, items, strict=True):
                self._items[k] = bytes(v)
            self._counters["puts"] += len(items)
        return keys

    def get(self, keys: list[str]) -> list[bytes | None]:
        with self._lock:
            out = [self._items.get(k) for k in keys]
            self._counters["gets"] += len(keys)
            self._counters["missing"] += sum(v is None for v in out)
        return out

    def free(self, keys: list[str]) -> int:
        with self._lock:
            n = sum(self._items.pop(k, None) is not None for k in keys)
            self._counters["frees"] += n
        return n

    def count_missing(self, keys: list[str]) -> int:
        with self._lock:
            return sum(k not in self._items for k in keys)

    def stats(self) -> dict:
        with self._lock:
            return dict(items=len(self._items), bytes=sum(map(len, self._items.values())), **self._counters)
