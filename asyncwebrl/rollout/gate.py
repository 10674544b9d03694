"""The pause/resume gate of the rollout pool, and the client wrapper that honours it.

`pause()` and `resume()` are called from any thread (the controller, a Ray actor method); coroutines
in the executor's event loop `await gate.wait()` before they start an episode or send a generation
request.

Invariant: once `pause()` has returned, no coroutine passes `wait()` until `resume()` is called
(the paused flag is set synchronously and checked before every await returns); requests already in
flight are the inference server's business (SGLang's /pause_generation), not the gate's.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class ResumeGate:
    """An asyncio-awaitable open/closed flag that other threads may flip."""

    def __init__(self) -> None:
        self._paused = False
        self._lock = threading.Lock()
        self._events: dict[asyncio.AbstractEventLoop, asyncio.Event] = {}

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            events = list(self._events.items())
        for loop, ev in events:
            if loop.is_closed():
                continue
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # loop closed between the check and the call
                pass

    async def wait(self) -> None:
        """Return at once while open; while paused, block until `resume()`."""
        if not self._paused:
            return
        loop = asyncio.get_running_loop()
        with self._lock:
            ev = self._events.get(loop)
            if ev is None:
                ev = self._events[loop] = asyncio.Event()
        while self._paused:
            ev.clear()
            if not self._paused:  # resumed between the loop test and the clear
                break
            await ev.wait()


class GatedClient:
    """Wraps an inference client so that every `agenerate` first waits for the gate to open.

    The episode loop stays unaware of pausing: it gets this object as its `client`.
    """

    def __init__(self, client: Any, gate: ResumeGate):
        self._client = client
        self.gate = gate

    async def agenerate(self, *args: Any, **kwargs: Any) -> Any:
        await self.gate.wait()
        return await self._client.agenerate(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)
