"""One HTTP transport to servers that speak SGLang's native API, shared by the rollout client
(`inference.client.InferenceClient`) and the weight refresh (`weights.control.ControlChannel`).

It sits on the protocol floor so that neither of those packages imports the other. It does one call,
with no retry: the policy (retries, fail-over, stickiness) belongs to the caller. Two forms of the same
call: `call` (aiohttp, from a coroutine) and `call_sync` (the standard library's HTTP/1.1 client on the
calling thread, one kept-alive connection per server and thread). A refresh bracket makes six control
calls from the trainer's thread; through an event loop on another thread each paid two thread
hand-offs and aiohttp's per-request work, about 0.6 ms more than the server's handler took on an H200
host (`docs/results-log.md`), which is most of a same-device refresh.

Invariant: a call either returns the server's JSON object (HTTP 200) or raises one of three errors:
`ProtocolError` (400 and the other caller faults: never retried), `ServerAuthError` (401), or
`ServerError` (transport failure, timeout, 404/408/429, 5xx: the caller may retry). The message
always names the URL and the server's own message, whatever its error shape.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from typing import Any
from urllib.parse import urlsplit

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
        self._local = threading.local()  # call_sync's connections, per thread
        self._all: list[_KeptConnection] = []
        self._all_lock = threading.Lock()

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
                return _answer(url, r.status, body)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise ServerError(f"{url}: {type(e).__name__}: {e}") from e

    def call_sync(self, addr: str, endpoint: str, payload: dict[str, Any] | bytes | None = None, *,
                  method: str = "POST", timeout_s: float | None = None) -> dict[str, Any]:
        """`call` on the calling thread (see the module docstring); the same answers and errors."""
        url = f"{addr}{endpoint}"
        if method != "POST":
            data = None
        elif isinstance(payload, bytes):  # a body the caller encoded once (and sends again)
            data = payload
        else:
            data = json.dumps(payload if payload is not None else {}).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        conn = self._conn(addr)
        try:
            status, raw = conn.request(method, endpoint, data, headers, timeout_s or self.timeout_s)
        except (TimeoutError, http.client.HTTPException, OSError) as e:
            raise ServerError(f"{url}: {type(e).__name__}: {e}") from e
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {"message": raw[:500].decode(errors="replace")}
        return _answer(url, status, body)

    def _conn(self, addr: str) -> _KeptConnection:
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        c = conns.get(addr)
        if c is None:
            c = conns[addr] = _KeptConnection(addr)
            with self._all_lock:
                self._all.append(c)
        return c

    def close_sync(self) -> None:
        """Close every thread's kept connection (a later `call_sync` opens a new one)."""
        with self._all_lock:
            conns, self._all = self._all, []
        for c in conns:
            c.close()
        self._local = threading.local()


def _answer(url: str, status: int, body: Any) -> dict[str, Any]:
    if status == 200:
        return body if isinstance(body, dict) else {"value": body}
    msg = f"HTTP {status}: {error_message(body)}"
    if status == 401:
        raise ServerAuthError(f"{url}: {msg}")
    if 400 <= status < 500 and status not in (404, 408, 429):
        raise ProtocolError(f"{url}: {msg}")
    raise ServerError(f"{url}: {msg}")


class _KeptConnection:
    """One HTTP/1.1 connection kept open between calls (one thread uses it). A connection idle for
    longer than `FRESH_S` is replaced before use: servers close idle ones (uvicorn after 5 s), and a
    request written into a connection the server is closing may or may not have been read."""

    FRESH_S = 3.0

    def __init__(self, addr: str):
        u = urlsplit(addr)
        if not u.hostname:
            raise ValueError(f"server address without a host: {addr!r}")
        self.host, self.port = u.hostname, u.port or (443 if u.scheme == "https" else 80)
        self.https = u.scheme == "https"
        self.conn: http.client.HTTPConnection | None = None
        self.used = 0.0

    def request(self, method: str, path: str, data: bytes | None, headers: dict[str, str],
                timeout_s: float) -> tuple[int, bytes]:
        if self.conn is not None and time.monotonic() - self.used > self.FRESH_S:
            self.close()
        if self.conn is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            self.conn = cls(self.host, self.port, timeout=timeout_s)
        try:
            self.conn.timeout = timeout_s
            if self.conn.sock is not None:
                self.conn.sock.settimeout(timeout_s)
            self.conn.request(method, path, body=data, headers=headers)
            r = self.conn.getresponse()
            raw = r.read()
            if r.will_close:
                self.close()
            return r.status, raw
        except BaseException:
            self.close()  # whatever state it is in, it is not reused
            raise
        finally:
            self.used = time.monotonic()

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
