"""Control calls to every rollout server, from synchronous code (the trainer loop, a trainer rank).

One event loop on a private daemon thread and one `ServerHttp` session, kept for the life of
the channel: a weight refresh makes a handful of control calls and must not pay for a new loop and
connection each time. Bearer key: passed through to every call when the caller has one.

Invariant: every call has a deadline and raises `WeightSyncError` naming the server and endpoint on
any failure (transport, HTTP status, `success: false`); an endpoint the caller marks optional may
be missing on a server (HTTP 404: an older SGLang without update sessions) and then answers None.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

from asyncwebrl.loop_thread import LoopThread
from asyncwebrl.server_http import ServerHttp
from asyncwebrl.weights.group import WeightSyncError


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
            if optional and "HTTP 404" in str(e):
                self.missing.add((server, endpoint))
                return None
            raise WeightSyncError(f"{server}{endpoint} failed: {e}") from e
        if isinstance(answer, dict) and answer.get("success") is False:
            raise WeightSyncError(f"{server}{endpoint} refused: {answer.get('message')}")
        return answer

    async def acall_all(self, endpoint: str, body: dict[str, Any] | None = None, *, optional: bool = False,
                        timeout_s: float | None = None) -> dict[str, dict[str, Any] | None]:
        answers = await asyncio.gather(*(self.acall(s, endpoint, body, optional=optional, timeout_s=timeout_s)
                                         for s in self.servers), return_exceptions=True)
        for a in answers:
            if isinstance(a, BaseException):
                raise a
        return dict(zip(self.servers, answers, strict=True))

    def call_all(self, endpoint: str, body: dict[str, Any] | None = None, *, optional: bool = False,
                 timeout_s: float | None = None) -> dict[str, dict[str, Any] | None]:
        return self.run(self.acall_all(endpoint, body, optional=optional, timeout_s=timeout_s), timeout_s)

    def close(self) -> None:
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
