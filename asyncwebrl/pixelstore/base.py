"""The `PixelStore` protocol: what every store a run can use honours, with the same semantics.

Implementations: `store.InProcessPixelStore` (one process: scheduler=local, evaluation, tests) and
`ray_store.PixelStoreClient` (named per-node Ray actors, each wrapping an `InProcessPixelStore`).
tests/pixelstore/test_contract.py runs one contract against both.

The contract (SPEC section 8):
- Keys are opaque strings `"<prefix>:<id>"` made by the store. A string without a prefix is not a key:
  ValueError. A well-formed key the store does not hold (freed, evicted, lost in a restart) is
  *missing*: `get` yields None for it and never blocks; `retain` and `free` skip it.
- Refcounts: `put(..., refs=n)` stores an item with n references; `retain(keys)` adds one reference
  per occurrence of each held key; `free(keys)` drops one per occurrence and removes an item when its
  last reference goes. So a screenshot shared by the per-step samples of a history window lives until
  its last user is consumed. `retain` returns the occurrences it found; `free` the items it removed.
- Bounded memory: a put that does not fit blocks (back-pressure) for at most the store's put timeout
  (or `timeout_s`), then raises `PixelStoreFull`; a batch larger than the whole capacity raises at
  once. Puts hold bytes only (TypeError otherwise) and are all or nothing.
- `stats()` holds at least the `store.PixelStoreStats` fields (summed over stores).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


class PixelStoreFull(TimeoutError):
    """A put waited its timeout for room and the store stayed full (or can never fit the items)."""


class PixelStoreUnavailable(ConnectionError):
    """The store could not be reached (and did not come back) within the client's deadline."""


@runtime_checkable
class PixelStore(Protocol):
    """Screenshots by opaque key, refcounted and bounded (see the module docstring for the contract)."""

    def put(self, data: bytes, refs: int = 1) -> str:
        """Store one screenshot with `refs` references; its key."""
        ...

    def put_batch(self, items: Sequence[bytes], refs: int = 1, timeout_s: float | None = None) -> list[str]:
        """Store all items (all or nothing), each with `refs` references; their keys in order."""
        ...

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """The bytes of each key in order, None for a missing one."""
        ...

    def retain(self, keys: Sequence[str]) -> int:
        """One more reference per occurrence of each held key; how many occurrences were held."""
        ...

    def free(self, keys: Sequence[str]) -> int:
        """Drop one reference per occurrence; how many items went (their last reference dropped)."""
        ...

    def count_missing(self, keys: Sequence[str]) -> int:
        """How many of `keys` the store does not hold."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters: items, bytes, capacity_bytes, puts, gets, frees, evictions, missing, ..."""
        ...

    def close(self) -> None:
        """Release what the store holds (end of run); idempotent."""
        ...


def key_prefix(key: str) -> str:
    """The store prefix (node) a key belongs to; ValueError for a string that is not a key."""
    head, sep, _ = key.partition(":") if isinstance(key, str) else ("", "", "")
    if not sep or not head:
        raise ValueError(f"not a PixelStore key: {key!r}")
    return head


def check_blobs(items: Sequence[bytes], refs: int) -> list[bytes]:
    """The items of a put as bytes; TypeError for anything else, ValueError for refs < 1."""
    if refs < 1:
        raise ValueError(f"refs must be >= 1, got {refs}")
    for it in items:
        if not isinstance(it, (bytes, bytearray, memoryview)):
            raise TypeError(f"a PixelStore holds bytes, got {type(it).__name__}")
    return [bytes(it) for it in items]
