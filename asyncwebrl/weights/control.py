"""Control calls to every rollout server, from synchronous code (the trainer loop, a trainer rank).

Synchronous calls (`call`, `call_all`, `each`) go out on the calling thread over kept connections
(`ServerHttp.call_sync`), to several servers at once from a small thread pool: a weight refresh makes a
handful of control calls in a row and must not pay for thread hand-offs and a new connection each
time. Coroutines (`acall`, `run`, `start`: a sender pipelining its buckets, a disk load to every server)
run on one event loop on a private daemon thread with one aiohttp session, kept for the life of the
channel. Bearer key: passed through to every call when the caller has one.

Invariant: every call has a deadline and raises `WeightSyncError` naming the server and endpoint on
any failure (transport, HTTP status, `success: false`); an endpoint the caller marks optional may
be missing on a server (HTTP 404: an older SGLang without update sessions) and then answers None.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

from asyncwebrl.loop_thread import LoopThread
from asyncwebrl.server_http import ServerHttp
from asyncwebrl.weights.group import WeightSyncError

T = TypeVar("T")


class ControlChannel:
    def __init__(self, servers: list[str], api_key: str | None = None, timeout_s: float = 120.0):
        if not servers:
            raise ValueError("a control channel needs at least one server address")
        self.timeout_s = timeout_s
        self.client = ServerHttp(list(servers), api_key=api_key, timeout_s=timeout_s)
        self.servers = self.client.addresses
        self._loop = LoopThread("weights-control")
        self.missing: set[tuple[str, str]] = set()
        """(server, endpoint) pairs that answered 404 once: not asked again"""
        self._pool: ThreadPoolExecutor | None = None

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> Any:
        try:
            return self._loop.run(coro, (timeout_s or self.timeout_s) + 5.0)
        except TimeoutError as e:
            raise WeightSyncError(f"control call still running after {timeout_s or self.timeout_s:.0f}s") from e

    def start(self, coro: Coroutine[Any, Any, Any]):
        """Schedule `coro` on the channel's loop; returns a concurrent future."""
        return self._loop.submit(coro)

    async def acall(self, server: str, endpoint: str, body: dict[str, Any] | None = None, *,
                    optional: bool = False, method: str = "POST", timeout_s: float | None = None) -> dict[str, Any] | None:
        if optional and (server, endpoint) in self.missing:
            return None
        try:
            answer = await self.client.call(server, endpoint, body if body is not None else {}, method=method,
                                            timeout_s=timeout_s or self.timeout_s)
        except Exception as e:  # noqa: BLE001 - every failure becomes one clear error
            return self._failed(server, endpoint, optional, e)
        return self._checked(server, endpoint, answer)

    def call(self, server: str, endpoint: str, body: dict[str, Any] | bytes | None = None, *,
             optional: bool = False, method: str = "POST", timeout_s: float | None = None) -> dict[str, Any] | None:
        """`acall` on the calling thread: the same answers and errors, no event loop in between."""
        if optional and (server, endpoint) in self.missing:
            return None
        try:
            answer = self.client.call_sync(server, endpoint, body if body is not None else {}, method=method,
                                           timeout_s=timeout_s or self.timeout_s)
        except Exception as e:  # noqa: BLE001 - every failure becomes one clear error
            return self._failed(server, endpoint, optional, e)
        return self._checked(server, endpoint, answer)

    def _failed(self, server: str, endpoint: str, optional: bool, e: Exception) -> None:
        if optional and "HTTP 404" in str(e):
            self.missing.add((server, endpoint))
            return None
        raise WeightSyncError(f"{server}{endpoint} failed: {e}") from e

    @staticmethod
    def _checked(server: str, endpoint: str, answer: Any) -> Any:
        if isinstance(answer, dict) and answer.get("success") is False:
            raise WeightSyncError(f"{server}{endpoint} refused: {answer.get('message')}")
        return answer

    def each(self, fn: Callable[[str], T], servers: list[str] | None = None) -> list[T]:
        """`fn(server)` for every server (all of them by default), at once when there are several;
        the results in order. Every call runs to its end; the first exception is then raised."""
        servers = self.servers if servers is None else servers
        if len(servers) <= 1:
            return [fn(s) for s in servers]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(min(32, len(self.servers)), thread_name_prefix="weights-control")
        futs = [self._pool.submit(fn, s) for s in servers]
        wait(futs)
        return [f.result() for f in futs]

    def call_all(self, endpoint: str, body: dict[str, Any] | None = None, *, optional: bool = False,
                 timeout_s: float | None = None) -> dict[str, dict[str, Any] | None]:
        answers = self.each(lambda s: self.call(s, endpoint, body, optional=optional, timeout_s=timeout_s))
        return dict(zip(self.servers, answers, strict=True))

    def close(self) -> None:
        self.client.close_sync()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        if self._loop.stopped:
            return
        try:
            self.run(self.client.aclose(), 10.0)
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
        self._loop.stop(10)


def wait_confirmed(fut: Future, deadline: float, what: str) -> Any:
    """Wait for a control call started with `ControlChannel.start` until the monotonic `deadline` and
    return its result; a call still running then is a WeightSyncError saying `what` was not confirmed."""
    try:
        return fut.result(timeout=max(0.1, deadline - time.monotonic()))
    except WeightSyncError:
        raise
    except TimeoutError as e:
        raise WeightSyncError(f"{what} before the deadline") from e
