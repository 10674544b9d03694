"""One HTTP transport to servers that speak SGLang's native API, shared by the rollout client
(`inference.client.InferenceClient`) and the weight refresh (`weights.control.ControlChannel`).

It sits on the protocol floor so that neither of those packages imports the other. It does one call,
with no retry: the policy (retries, fail-over, stickiness) belongs to the caller.

Invariant: a call either returns the server's JSON object (HTTP 200) or raises one of three errors:
`ProtocolError` (400 and the other caller faults: never retried), `ServerAuthError` (401), or
`ServerError` (transport failure, timeout, 404/408/429, 5xx: the caller may retry). The message
always names the URL and the server's own message, whatever its error shape.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from asyncwebrl.protocol import ProtocolError, error_message


class ServerAuthError(RuntimeError):
    """The server refused the API key (HTTP 401)."""


class ServerError(RuntimeError):
    """A failure the caller may retry: transport error, timeout, 404/408/429 or 5xx."""


def server_url(address: str) -> str:
    """`host:port` or a URL -> the base URL without a trailing slash (plain http when no scheme)."""
    address = address.rstrip("/")
    return address if "://" in address else f"http://{address}"


class ServerHttp:
    """Bearer-keyed HTTP calls to a fixed list of servers, one aiohttp session per event loop."""

    def __init__(self, addresses: list[str], api_key: str | None = None, timeout_s: float = 120.0):
        if not addresses:
            raise ValueError("needs at least one server address")
        self.addresses = [server_url(a) for a in addresses]
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        s = self._sessions.get(loop)
        if s is None or s.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            s = aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0))
            self._sessions[loop] = s
        return s

    async def aclose(self) -> None:
        """Close this event loop's session (each loop closes its own)."""
        s = self._sessions.pop(asyncio.get_running_loop(), None)
        if s is not None:
            await s.close()

    async def call(self, addr: str, endpoint: str, payload: dict[str, Any] | None = None, *,
                   method: str = "POST", timeout_s: float | None = None) -> dict[str, Any]:
        """One HTTP call, no retry (see the module's invariant for what it raises)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        url = f"{addr}{endpoint}"
        try:
            async with self._session().request(method, url, json=payload if method == "POST" else None,
                                               timeout=timeout) as r:
                try:
                    body = await r.json(content_type=None)
                except (ValueError, aiohttp.ContentTypeError):
                    body = {"message": (await r.text())[:500]}
                if r.status == 200:
                    return body if isinstance(body, dict) else {"value": body}
                msg = f"HTTP {r.status}: {error_message(body)}"
                if r.status == 401:
                    raise ServerAuthError(f"{url}: {msg}")
                if 400 <= r.status < 500 and r.status not in (404, 408, 429):
                    raise ProtocolError(f"{url}: {msg}")
                raise ServerError(f"{url}: {msg}")
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise ServerError(f"{url}: {type(e).__name__}: {e}") from e
