"""The browser's network fence: a filtering HTTP proxy that every browser context must use, which
decides on the RESOLVED address of each connection the browser opens.

Why a proxy, and why at connect time: request interception in the page (Playwright routing) sees
only some requests — not the later hops of a redirect the browser follows itself, not WebSockets,
not every worker request, not WebRTC — and a check on the URL's host name says nothing about the
address the name resolves to. A proxy sees every TCP connection a context's network stack makes
(navigations, subresources, fetch/XHR, each redirect hop and each 307 body replay as a request of
its own, WebSockets and TLS as CONNECT tunnels, dedicated/shared workers, WebRTC's TCP relay). It
resolves the host itself, checks every address the name resolves to, and connects to the address it
checked, so a name cannot be re-resolved to somewhere else between the check and the connection.

Invariants:
- Each context gets its own gate (listening port on 127.0.0.1) bound to its session; the gate reads
  the session's current `NavigationPolicy` on every request, and records every refusal (and every
  unreachable allowed target) on the session, where the environment reports it in the step result.
- Chromium is told to send loopback through the proxy too (`<-loopback>` removes its implicit
  bypass of localhost / 127.0.0.1 / [::1]); the browser-wide proxy (contexts without their own, if
  any), and a context's gate before it is bound, is a gate of no session: it denies by construction
  (no policy consulted, no name resolved, nothing dialed).
- An address is judged by `asyncwebrl.web.addresses` (the IANA special-purpose registries of both
  families, every IPv4-embedding IPv6 form): refused unless public, or the task names that exact
  origin by IP literal or `localhost`; loopback and private pass only with `allow_private`.
- Names are looked up on threads of the gate's own `LookupPool` (one per gate and origin class, at
  most LOOKUPS_PER_CLASS in flight): a lookup that never answers holds only its page's own slot, so
  no page can starve another episode's lookups.

What it does not cover is listed in docs/fence.md.
"""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
import socket
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

from asyncwebrl.loop_thread import LoopThread
from asyncwebrl.web.addresses import address_refusal

__all__ = ["BlockedRequest", "LookupPool", "NavigationPolicy", "NetworkFence", "address_refusal", "system_lookup"]

Resolver = Callable[[str], Awaitable[list[str]]] | Callable[[str], list[str]]
"""host name -> IP address strings (raises OSError when the name does not resolve). A plain function
is a blocking resolver, run on the gate's own lookup threads; a coroutine function is awaited on the
fence's loop (tests)."""

FENCE_HEADER = "X-AsyncWebRL-Fence"
"""header on the fence's own answers: 'refused' (policy) or 'unreachable' (allowed, but no answer)"""

RESOLVE_TIMEOUT_S = 5.0
LOOKUPS_PER_CLASS = 4
"""lookups in flight per gate and origin class (the task's named origins; any other name under '*')"""
CONNECT_TIMEOUT_S = 10.0
HEAD_TIMEOUT_S = 30.0
MAX_HEAD_BYTES = 64 * 1024

_ALWAYS_OK_SCHEMES = {"data", "blob", "about"}
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}

@dataclass(frozen=True)
class BlockedRequest:
    """One connection the fence did not let through."""

    target: str
    """the URL (plain http) or host:port (a CONNECT tunnel: https, ws/wss, WebRTC relay)"""
    kind: Literal["refused", "unreachable"]
    """refused by the policy, or allowed but the target did not answer / did not resolve"""
    reason: str
    """why, in words"""


def _is_localhost_name(host: str) -> bool:
    return host in ("localhost", "localhost.localdomain") or host.endswith(".localhost")


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def _origin_parts(origin: str) -> tuple[str, str, int] | None:
    p = urlsplit(origin)
    if not p.scheme or not p.hostname:
        return None
    try:
        port = p.port or _DEFAULT_PORTS.get(p.scheme.lower(), 0)
    except ValueError:
        return None
    return p.scheme.lower(), p.hostname.lower(), port


def system_lookup(host: str) -> list[str]:
    """The machine's resolver, blocking (the fence runs it on a `LookupPool` thread)."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(i[4][0]) for i in infos))


class LookupPool:
    """Blocking name lookups on threads of their own, at most `size` at once.

    getaddrinfo cannot be cancelled: a lookup that times out still holds its thread until the resolver
    gives up. Here that thread is this pool's own and keeps its slot until it really ends, so lookups
    that never answer exhaust only the pool of the page that made them (further lookups of that pool
    fail at once as unreachable); no thread shared with another gate or another episode is ever held.
    Used from the fence's loop only."""

    def __init__(self, lookup: Callable[[str], list[str]], size: int):
        self.lookup = lookup
        self.size = size
        self.in_flight = 0

    async def resolve(self, host: str) -> list[str]:
        if self.in_flight >= self.size:
            raise OSError(f"{self.size} earlier lookups of this page are still unanswered")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[str]] = loop.create_future()
        self.in_flight += 1

        def settle(result: list[str] | None, error: BaseException | None) -> None:
            self.in_flight -= 1
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(result or [])

        def work() -> None:
            try:
                result, error = self.lookup(host), None
            except BaseException as e:  # handed to the waiting coroutine
                result, error = None, e
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the fence is closed
                pass

        threading.Thread(target=work, name="fence-lookup", daemon=True).start()
        return await asyncio.shield(fut)  # a timeout cancels the wait, never the slot's accounting


@dataclass
class NavigationPolicy:
    """Which origins and addresses one task may reach. `allowed_origins` empty = any public http(s)."""

    allowed_origins: list[str] = field(default_factory=list)
    """exact origins, e.g. 'http://127.0.0.1:8123'; '*' = any origin whose addresses are public"""
    allow_private: bool = False
    """let loopback/private address ranges through (link-local, CGNAT and metadata stay refused)"""
    allow_file: bool = False
    """let file:// URLs load (they never touch the network)"""

    def __post_init__(self) -> None:
        self.allowed_origins = [o.rstrip("/").lower() for o in self.allowed_origins]
        self._exact = [p for p in (_origin_parts(o) for o in self.allowed_origins if o != "*") if p]

    @property
    def any_public(self) -> bool:
        return not self.allowed_origins or "*" in self.allowed_origins

    def _named(self, host: str, port: int, schemes: tuple[str, ...]) -> bool:
        return any(h == host and p == port and s in schemes for s, h, p in self._exact)

    def permits(self, url: str) -> tuple[bool, str]:
        """(allowed, reason) for one URL, WITHOUT resolving names: the envs use it to decide where the
        main frame may stay. The connection-time check that holds is `decide`."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme in _ALWAYS_OK_SCHEMES:
            return True, ""
        if scheme == "file":
            return (True, "") if self.allow_file else (False, "file:// is blocked")
        if scheme not in ("http", "https", "ws", "wss"):
            return False, f"scheme '{scheme}:' is blocked"
        parts = _origin_parts(url)
        if parts is None:
            return False, f"malformed URL {url[:100]}"
        s, host, port = parts
        if self._named(host, port, (s,)):
            return True, ""
        if not self.any_public:
            return False, f"origin {s}://{host}:{port} is not among the task's allowed origins"
        if _is_localhost_name(host):
            return (True, "") if self.allow_private else (False, f"{host} is loopback")
        if _is_ip_literal(host):
            why = address_refusal(host, self.allow_private)
            return (False, why) if why else (True, "")
        return True, ""

    def may_land(self, url: str) -> tuple[bool, str]:
        """(allowed, reason) for the main frame to STAY on `url` after a step: `permits`, and not an
        about: or data: page (GoBack past the start page lands on about:blank, which is no page of the
        task: the agent would be stranded there with nothing to act on)."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme in ("about", "data"):
            return False, f"{url[:60]} is not a page of the task ({scheme}: pages are no landing place)"
        return self.permits(url)

    async def decide(self, host: str, port: int, schemes: tuple[str, ...],
                     resolve: Resolver) -> tuple[str | None, BlockedRequest | None]:
        """(address to connect to, None) or (None, why not) for a connection to host:port that one of
        `schemes` would use (a CONNECT tunnel may be https or wss, or ws on a plain port)."""
        host = host.strip("[]").lower()
        target = f"{host}:{port}"
        named = self._named(host, port, schemes)
        if not named and not self.any_public:
            return None, BlockedRequest(target, "refused", "origin is not among the task's allowed origins")
        if _is_ip_literal(host):
            addresses = [host]
        elif _is_localhost_name(host):
            addresses = ["127.0.0.1"]  # RFC 6761: *.localhost is loopback, whatever a resolver says
        else:
            try:
                addresses = await asyncio.wait_for(resolve(host), RESOLVE_TIMEOUT_S)
            except (TimeoutError, OSError, UnicodeError) as e:
                detail = f" ({str(e)[:120]})" if str(e) else ""
                return None, BlockedRequest(target, "unreachable", f"cannot resolve {host}: {type(e).__name__}{detail}")
            if not addresses:
                return None, BlockedRequest(target, "unreachable", f"{host} resolves to no address")
        if named and (_is_ip_literal(host) or _is_localhost_name(host)):
            return addresses[0], None  # the task named this address itself
        for a in addresses:
            why = address_refusal(a, self.allow_private)
            if why:
                return None, BlockedRequest(target, "refused", f"{host} resolves to {a}: {why}")
        return addresses[0], None


class FencedSession(Protocol):
    """What a gate needs from the session it serves."""

    policy: NavigationPolicy

    def record_blocked(self, item: BlockedRequest) -> None: ...


def _split_hostport(target: str) -> tuple[str, int] | None:
    if target.startswith("["):
        host, _, rest = target[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port = target.rpartition(":")
    if not host or not port.isdigit() or not (0 < int(port) < 65536):
        return None
    return host, int(port)


_HOP_HEADERS = {"proxy-connection", "proxy-authorization", "connection", "keep-alive", "te", "trailer", "upgrade"}


class NetworkFence:
    """The proxy: its own event loop on a daemon thread (a busy or blocked caller loop can never
    stall the browser's network), one gate per browser context."""

    def __init__(self, resolver: Resolver | None = None):
        self.resolver = resolver or system_lookup
        self._awaited = inspect.iscoroutinefunction(self.resolver)
        self._loop = LoopThread("asyncwebrl-fence")
        self._gates: dict[int, tuple[asyncio.AbstractServer, set[asyncio.StreamWriter]]] = {}
        self._owners: dict[int, FencedSession] = {}
        """gate port -> the session it serves (read on every connection); a gate without one denies"""
        self._lookups: dict[tuple[int, str], LookupPool] = {}
        """(gate port, origin class) -> that gate's own lookup threads"""
        self.deny_port = self._call(self._open(None))
        self.closed = False

    def _call(self, coro: Awaitable[Any], timeout: float = 10.0) -> Any:
        return self._loop.run(coro, timeout)

    async def open_gate(self, session: FencedSession | None = None) -> int:
        """A new gate for `session` (await from any loop; None = refuse everything until `bind_gate`);
        its port goes into the context's proxy setting."""
        return await asyncio.wrap_future(self._loop.submit(self._open(session)))

    def bind_gate(self, port: int, session: FencedSession) -> None:
        """Point an open gate at its session (the context needs the port before the session exists)."""
        self._owners[port] = session

    async def close_gate(self, port: int) -> None:
        if self.closed:
            return
        await asyncio.wait_for(
            asyncio.wrap_future(self._loop.submit(self._close(port))), 10)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            for port in list(self._gates):
                self._call(self._close(port))
        finally:
            self._loop.stop(10)

    async def _open(self, session: FencedSession | None) -> int:
        conns: set[asyncio.StreamWriter] = set()
        port = 0

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conns.add(writer)
            try:
                owner = self._owners.get(port)
                if owner is None:
                    await self._deny(reader, writer)
                else:
                    await self._serve(owner, reader, writer, port)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
                pass
            finally:
                conns.discard(writer)
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=MAX_HEAD_BYTES)
        port = server.sockets[0].getsockname()[1]
        self._gates[port] = (server, conns)
        if session is not None:
            self._owners[port] = session
        return port

    async def _deny(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The gate of no session (the browser-wide proxy; a context's gate before it is bound): it reads
        the request head and refuses it. No policy is consulted, no name resolved, nothing dialed: it
        denies by construction, whatever the target says."""
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
        await self._answer(writer, "403 Forbidden", "refused", "this gate serves no browser context")

    async def _resolve(self, gate: int, policy: NavigationPolicy, host: str) -> list[str]:
        if self._awaited:
            return await self.resolver(host)
        named = any(h == host for _, h, _ in policy._exact)
        key = (gate, "named" if named else "any")
        pool = self._lookups.get(key)
        if pool is None:
            pool = self._lookups[key] = LookupPool(self.resolver, LOOKUPS_PER_CLASS)
        return await pool.resolve(host)

    async def _close(self, port: int) -> None:
        server, conns = self._gates.pop(port, (None, set()))
        self._owners.pop(port, None)
        for key in [k for k in self._lookups if k[0] == port]:
            del self._lookups[key]  # threads still in a lookup end on their own; nothing waits for them
        if server is None:
            return
        server.close()
        for w in list(conns):
            w.close()

    @staticmethod
    async def _answer(writer: asyncio.StreamWriter, status: str, verdict: str, text: str) -> None:
        body = f"<html><body><h1>{status}</h1><p>asyncwebrl fence: {text}</p></body></html>".encode()
        writer.write((f"HTTP/1.1 {status}\r\n{FENCE_HEADER}: {verdict}\r\nContent-Type: text/html\r\n"
                      f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body)
        await writer.drain()

    async def _connect(self, session: FencedSession, writer: asyncio.StreamWriter, shown: str, host: str,
                       port: int, schemes: tuple[str, ...], gate: int):
        """The upstream streams of an allowed connection, or None after answering the refusal."""
        policy = session.policy
        address, blocked = await policy.decide(host, port, schemes,
                                               lambda h: self._resolve(gate, policy, h))
        if blocked is None:
            try:
                return await asyncio.wait_for(asyncio.open_connection(address, port), CONNECT_TIMEOUT_S)
            except (TimeoutError, OSError) as e:
                blocked = BlockedRequest(shown, "unreachable", f"{host}:{port} ({address}) did not answer: "
                                                               f"{type(e).__name__}")
        blocked = BlockedRequest(shown, blocked.kind, blocked.reason)
        session.record_blocked(blocked)
        if blocked.kind == "unreachable":
            await self._answer(writer, "502 Bad Gateway", blocked.kind, blocked.reason)
        elif "http" in schemes and "https" not in schemes:
            # a refused plain-http request gets an empty 204: a navigation answered 204 does not commit,
            # so the page stays where it was (a refused tunnel can only fail: the browser shows its error page)
            writer.write(f"HTTP/1.1 204 No Content\r\n{FENCE_HEADER}: refused\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
        else:
            await self._answer(writer, "403 Forbidden", blocked.kind, blocked.reason)
        return None

    async def _serve(self, session: FencedSession, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter, gate: int) -> None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            await self._answer(writer, "400 Bad Request", "refused", "malformed request line")
            return
        method, target, version = parts
        if method.upper() == "CONNECT":
            hp = _split_hostport(target)
            if hp is None:
                await self._answer(writer, "400 Bad Request", "refused", "malformed CONNECT target")
                return
            up = await self._connect(session, writer, target, hp[0], hp[1], ("https", "wss", "ws", "http"), gate)
            if up is None:
                return
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            await _pipe_both(reader, writer, *up)
            return
        u = urlsplit(target)
        try:
            port = u.port or 80
        except ValueError:
            port = 0
        if u.scheme.lower() != "http" or not u.hostname or not port:
            session.record_blocked(BlockedRequest(target[:300], "refused", "not an absolute http:// URL"))
            await self._answer(writer, "403 Forbidden", "refused", "only http:// and CONNECT go through")
            return
        up = await self._connect(session, writer, target[:300], u.hostname, port, ("http", "ws"), gate)
        if up is None:
            return
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        kept = [h for h in lines[1:] if h and h.split(":", 1)[0].strip().lower() not in _HOP_HEADERS]
        up[1].write(f"{method} {path} {version}\r\n".encode("latin-1")
                    + "".join(h + "\r\n" for h in kept).encode("latin-1") + b"Connection: close\r\n\r\n")
        tasks = [asyncio.ensure_future(_forward_body(reader, up[1], kept)),
                 asyncio.ensure_future(_response_closing(up[0], writer))]
        try:  # done when the response ends or the browser hangs up, whichever is first
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            up[1].close()


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while True:
            data = await src.read(65536)
            if not data:
                return
            dst.write(data)
            await dst.drain()
    except (OSError, asyncio.IncompleteReadError):
        return


async def _forward_body(src: asyncio.StreamReader, dst: asyncio.StreamWriter, headers: list[str]) -> None:
    """Forward exactly the request's body (Content-Length or chunked) and nothing after it: bytes the
    browser might send next never reach the upstream that was checked for this request (they are
    read and dropped until the browser hangs up, which ends this call)."""
    fields = {h.split(":", 1)[0].strip().lower(): h.split(":", 1)[1].strip() for h in headers if ":" in h}
    try:
        if "chunked" in fields.get("transfer-encoding", "").lower():
            while True:
                size_line = await src.readuntil(b"\r\n")
                dst.write(size_line)
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while True:  # trailer lines up to the empty one
                        line = await src.readuntil(b"\r\n")
                        dst.write(line)
                        if line == b"\r\n":
                            break
                    break
                dst.write(await src.readexactly(size + 2))
                await dst.drain()
        else:
            left = int(fields.get("content-length", "0") or 0)
            while left > 0:
                data = await src.read(min(left, 65536))
                if not data:
                    break
                dst.write(data)
                left -= len(data)
                await dst.drain()
        await dst.drain()
        while await src.read(65536):
            pass
    except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        return


async def _response_closing(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Relay an HTTP response whose head(s) say `Connection: close`: the browser never sends a second
    request on this connection, whose upstream socket is bound to the address checked for the first."""
    try:
        while True:
            head = (await src.readuntil(b"\r\n\r\n")).decode("latin-1")
            status, *headers = head[:-4].split("\r\n")
            kept = [h for h in headers if h.split(":", 1)[0].strip().lower()
                    not in ("connection", "keep-alive", "proxy-connection")]
            dst.write((status + "\r\n" + "".join(h + "\r\n" for h in kept) + "Connection: close\r\n\r\n")
                      .encode("latin-1"))
            code = status.split(" ", 2)[1] if status.count(" ") else ""
            if not (len(code) == 3 and code.startswith("1") and code != "101"):
                break  # the final head; 1xx interim heads are followed by another
        await _pipe(src, dst)
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, IndexError):
        return


async def _pipe_both(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter,
                     u_reader: asyncio.StreamReader, u_writer: asyncio.StreamWriter) -> None:
    """Relay a tunnel both ways until either side ends, then close both."""
    tasks = [asyncio.ensure_future(_pipe(c_reader, u_writer)), asyncio.ensure_future(_pipe(u_reader, c_writer))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        u_writer.close()
