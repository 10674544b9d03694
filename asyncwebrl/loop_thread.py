"""One asyncio event loop running on a daemon thread, for synchronous code that drives async work
(the executor's rollout slots, the sync pool's round, the weight-control channel, the browser fence,
the in-thread inference server, the Gymnasium wrapper).

Invariant: everything submitted runs on the one loop of the thread (Playwright pages, aiohttp sessions
and servers are bound to the loop that made them); `stop()` stops and closes the loop once its thread
has ended, and is safe to call twice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any


class LoopThread:
    """`LoopThread(name)` starts the loop at once; `run(coro)` waits for a result, `submit(coro)` does not."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        """Schedule `coro` on the loop from any thread; the concurrent future of its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> Any:
        """Run `coro` on the loop and wait for its result; TimeoutError (the coroutine cancelled) after
        `timeout_s`."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    @property
    def stopped(self) -> bool:
        return self.loop.is_closed()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop the loop and join its thread; True when the thread ended (the loop is then closed)."""
        if self.loop.is_closed():
            return True
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout_s)
        if self.thread.is_alive():
            return False
        self.loop.close()
        return True
