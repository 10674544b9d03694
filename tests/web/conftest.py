"""One event loop on a background thread for all browser tests of this folder, so they share one
Chromium process (the browser pool is per loop), as the rollout workers do."""

from __future__ import annotations

import asyncio
import threading

import pytest


class LoopRunner:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 180.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        from asyncwebrl.web.browser import BrowserPool

        async def shutdown():
            pool = BrowserPool._shared.get(id(self.loop))
            if pool is not None:
                await pool.close()

        try:
            self.run(shutdown(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


@pytest.fixture(scope="session")
def runner():
    r = LoopRunner()
    yield r
    r.close()
