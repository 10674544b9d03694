"""The PixelStore without Ray: a small aiohttp server process on the loopback address and its client.

Used under `scheduler.type=local` (no Ray, one machine by definition, so loopback is the address). The client offers the same API as the Ray
client (put / put_batch / get / free / retain / count_missing / stats, plus async `a*` variants), so
rollout and trainer code do not change with the scheduler.

Wire format (no pickle anywhere): screenshots travel as length-prefixed binary frames
(8-byte big-endian length, then the bytes; length -1 marks a missing key on `get`), everything else
as JSON. Every request carries the per-server random token (handed to the server in its environment,
never argv); the server binds loopback only, refuses browser requests (Origin / Sec-Fetch-*), foreign
Host headers and bodies of the wrong type or size (asyncwebrl.httpguard), and exits when the process
that started it dies.

Invariant: a client call never hangs: each request has a timeout; if the server process died, the
client restarts it (when it owns it) and retries once; keys lost with the old process read as missing.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import secrets
import struct
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncwebrl.httpguard import body_type_refusal, keys_equal, refusal, served_names
from asyncwebrl.net import LOOPBACK
from asyncwebrl.pixelstore.base import ThreadedAsyncAPI
from asyncwebrl.pixelstore.store import PixelStore, PixelStoreFull, PixelStoreUnavailable

TOKEN_HEADER = "X-PixelStore-Token"
MAX_BODY_BYTES = 1 << 30
"""largest request body (a put_batch of screenshots)"""
_LEN = struct.Struct(">q")


def pack_frames(items: list[bytes | None]) -> bytes:
    parts: list[bytes] = []
    for it in items:
        if it is None:
            parts.append(_LEN.pack(-1))
        else:
            parts.append(_LEN.pack(len(it)))
            parts.append(it)
    return b"".join(parts)


def unpack_frames(body: bytes) -> list[bytes | None]:
    out: list[bytes | None] = []
    pos, n = 0, len(body)
    while pos < n:
        if pos + _LEN.size > n:
            raise ValueError("truncated frame header")
        (length,) = _LEN.unpack_from(body, pos)
        pos += _LEN.size
        if length < 0:
            out.append(None)
            continue
        if pos + length > n:
            raise ValueError("truncated frame body")
        out.append(body[pos : pos + length])
        pos += length
    return out


# ---------------------------------------------------------------------------------------------
# server
# ---------------------------------------------------------------------------------------------
def build_app(store: PixelStore, token: str):
    from aiohttp import web

    put_pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="pixelstore-put")

    names = served_names()

    @web.middleware
    async def auth(request, handler):
        # the gate of every listener (asyncwebrl.httpguard): no browser, no foreign Host, sized bodies
        refused = refusal(request, names=names, max_body=MAX_BODY_BYTES)
        if refused is None and not keys_equal(request.headers.get(TOKEN_HEADER), token):
            refused = 401, "missing or wrong token"
        if refused is None:
            refused = body_type_refusal(request, "application/octet-stream" if request.path == "/put_batch"
                                        else "application/json")
        if refused is not None:
            return web.json_response({"error": refused[1]}, status=refused[0])
        try:
            return await handler(request)
        except (ValueError, TypeError, KeyError) as e:
            return web.json_response({"error": f"bad request: {e}"}, status=400)

    async def keys_of(request) -> list[str]:
        data = await request.json()
        keys = data.get("keys") if isinstance(data, dict) else None
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ValueError("body must be {\"keys\": [str, ...]}")
        return keys

    async def put_batch(request):
        refs = int(request.query.get("refs", "1"))
        timeout = float(request.query.get("timeout", store.put_timeout_s))
        items = unpack_frames(await request.read())
        if any(it is None for it in items):
            raise ValueError("put frames must not be empty markers")
        loop = asyncio.get_running_loop()
        try:
            keys = await loop.run_in_executor(put_pool, lambda: store.put_batch(items, refs, timeout))
        except PixelStoreFull as e:
            return web.json_response({"error": str(e), "full": True}, status=503)
        return web.json_response({"keys": keys})

    async def get(request):
        return web.Response(body=pack_frames(store.get(await keys_of(request))), content_type="application/octet-stream")

    async def free(request):
        return web.json_response({"n": store.free(await keys_of(request))})

    async def retain(request):
        return web.json_response({"n": store.retain(await keys_of(request))})

    async def count_missing(request):
        return web.json_response({"n": store.count_missing(await keys_of(request))})

    async def stats(request):
        return web.json_response(store.stats())

    async def health(request):
        return web.json_response({"ok": True, "prefix": store.prefix})

    app = web.Application(middlewares=[auth], client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/put_batch", put_batch)
    app.router.add_post("/get", get)
    app.router.add_post("/free", free)
    app.router.add_post("/retain", retain)
    app.router.add_post("/count_missing", count_missing)
    app.router.add_get("/stats", stats)
    app.router.add_get("/health", health)
    app.on_cleanup.append(lambda _app: asyncio.to_thread(put_pool.shutdown, False, cancel_futures=True))
    return app


async def _serve(args: argparse.Namespace, token: str) -> None:
    from aiohttp import web

    store = PixelStore(args.capacity_bytes, args.put_timeout_s, args.prefix)
    runner = web.AppRunner(build_app(store, token), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, LOOPBACK, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # the port actually bound (args.port may be 0)
    print(f"PIXELSTORE_LISTENING {port}", flush=True)
    try:
        while True:
            await asyncio.sleep(1.0)
            if args.parent_pid and not _pid_alive(args.parent_pid):
                break
            if args.max_age_s > 0:
                store.evict_older_than(args.max_age_s)
    finally:
        await runner.cleanup()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def server_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="PixelStore server on the loopback address (token from $ASYNCWEBRL_PIXELSTORE_TOKEN)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--capacity-bytes", type=int, required=True)
    p.add_argument("--put-timeout-s", type=float, default=60.0)
    p.add_argument("--prefix", default="local")
    p.add_argument("--parent-pid", type=int, default=0)
    p.add_argument("--max-age-s", type=float, default=0.0)
    args = p.parse_args(argv)
    token = os.environ.get("ASYNCWEBRL_PIXELSTORE_TOKEN")
    if not token:
        print("ASYNCWEBRL_PIXELSTORE_TOKEN is not set", file=sys.stderr)
        return 2
    asyncio.run(_serve(args, token))
    return 0


class LocalStoreProcess:
    """Starts (and restarts) the store server as a child process of this one."""

    def __init__(self, capacity_bytes: int, put_timeout_s: float, prefix: str = "local", max_age_s: float = 0.0,
                 start_timeout_s: float = 30.0):
        self.capacity_bytes = capacity_bytes
        self.put_timeout_s = put_timeout_s
        self.prefix = prefix
        self.max_age_s = max_age_s
        self.start_timeout_s = start_timeout_s
        self.token = secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.restarts = 0
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def start(self) -> LocalStoreProcess:
        with self._lock:
            self._start_locked()
        return self

    def _start_locked(self) -> None:
        env = dict(os.environ, ASYNCWEBRL_PIXELSTORE_TOKEN=self.token)
        cmd = [sys.executable, "-m", "asyncwebrl.pixelstore.local_store", "--capacity-bytes",
               str(self.capacity_bytes), "--put-timeout-s", str(self.put_timeout_s), "--prefix", self.prefix,
               "--parent-pid", str(os.getpid()), "--max-age-s", str(self.max_age_s)]
        # stderr goes to a file, not a pipe: nobody drains a pipe after start-up, and a full one blocks the server
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        line = _readline_with_timeout(self.proc, self.start_timeout_s)
        if not line.startswith("PIXELSTORE_LISTENING "):
            self._kill_locked()
            self._stderr.seek(0)
            err = self._stderr.read()[-2000:].decode(errors="replace")
            raise PixelStoreUnavailable(f"local PixelStore server did not start: {line!r} {err}")
        self.port = int(line.split()[1])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ensure_alive(self) -> bool:
        """Restart the server if it died; True when a restart happened."""
        with self._lock:
            if self.alive():
                return False
            self._kill_locked()
            self._start_locked()
            self.restarts += 1
            return True

    def _kill_locked(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(5)
            if self.proc.stdout:
                self.proc.stdout.close()
            self.proc = None

    def stop(self) -> None:
        with self._lock:
            self._kill_locked()


def _readline_with_timeout(proc: subprocess.Popen, timeout_s: float) -> str:
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline() if proc.stdout else ""), daemon=True)
    t.start()
    t.join(timeout_s)
    return box[0].strip() if box else ""


class LocalStoreEndpoint:
    """Address + token of a store server started by another process (what a pickled client carries)."""

    def __init__(self, port: int, token: str, put_timeout_s: float, prefix: str):
        self.port, self.token, self.put_timeout_s, self.prefix = port, token, put_timeout_s, prefix
        self.restarts = 0

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def ensure_alive(self) -> bool:
        return False  # only the owning process restarts the server

    def stop(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# client
# ---------------------------------------------------------------------------------------------
class LocalPixelStoreClient(ThreadedAsyncAPI):
    """Client of one local store server; thread-safe (one keep-alive connection per thread)."""

    def __init__(self, server: LocalStoreProcess | LocalStoreEndpoint, request_timeout_s: float = 30.0):
        self.server = server
        self.request_timeout_s = request_timeout_s
        self._tls = threading.local()
        self.missing_seen = 0
        """keys this client asked for and did not get (lost in a restart, or freed)"""

    def __getstate__(self) -> dict:
        srv = self.server
        return {"endpoint": (srv.port, srv.token, srv.put_timeout_s, srv.prefix), "timeout": self.request_timeout_s}

    def __setstate__(self, state: dict) -> None:
        self.__init__(LocalStoreEndpoint(*state["endpoint"]), state["timeout"])

    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._tls, "conn", None)
        if c is None or getattr(self._tls, "port", None) != self.server.port:
            c = http.client.HTTPConnection(LOOPBACK, self.server.port, timeout=self.request_timeout_s)
            self._tls.conn, self._tls.port = c, self.server.port
        return c

    def _request(self, method: str, path: str, body: bytes | None, content_type: str,
                 timeout_s: float | None = None) -> tuple[int, bytes]:
        last: Exception | None = None
        for attempt in range(3):
            conn = self._conn()
            conn.timeout = timeout_s or self.request_timeout_s
            if conn.sock is not None:
                conn.sock.settimeout(conn.timeout)
            try:
                conn.request(method, path, body=body,
                             headers={TOKEN_HEADER: self.server.token, "Content-Type": content_type})
                resp = conn.getresponse()
                return resp.status, resp.read()
            except (OSError, http.client.HTTPException) as e:
                last = e
                conn.close()
                self._tls.conn = None
                if isinstance(e, TimeoutError):
                    break
                if attempt == 0:
                    continue  # a stale keep-alive connection: retry once on a fresh one
                self.server.ensure_alive()
        raise PixelStoreUnavailable(f"local PixelStore at {self.server.address} unreachable: {last!r}")

    def _json(self, path: str, payload: dict) -> Any:
        status, body = self._request("POST", path, json.dumps(payload).encode(), "application/json")
        if status != 200:
            raise PixelStoreUnavailable(f"PixelStore {path} answered {status}: {body[:300]!r}")
        return json.loads(body)

    # -- the PixelStoreAPI --------------------------------------------------------------------
    def put(self, data: bytes, refs: int = 1) -> str:
        return self.put_batch([data], refs=refs)[0]

    def put_batch(self, items: list[bytes], refs: int = 1, timeout_s: float | None = None) -> list[str]:
        wait = self.server.put_timeout_s if timeout_s is None else timeout_s
        status, body = self._request("POST", f"/put_batch?refs={int(refs)}&timeout={wait}",
                                     pack_frames([bytes(i) for i in items]), "application/octet-stream",
                                     timeout_s=wait + self.request_timeout_s)
        if status == 503:
            raise PixelStoreFull(json.loads(body).get("error", "PixelStore full"))
        if status != 200:
            raise PixelStoreUnavailable(f"PixelStore put answered {status}: {body[:300]!r}")
        return json.loads(body)["keys"]

    def get(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        status, body = self._request("POST", "/get", json.dumps({"keys": list(keys)}).encode(), "application/json")
        if status != 200:
            raise PixelStoreUnavailable(f"PixelStore get answered {status}: {body[:300]!r}")
        out = unpack_frames(body)
        self.missing_seen += sum(v is None for v in out)
        return out

    def free(self, keys: list[str]) -> int:
        return int(self._json("/free", {"keys": list(keys)})["n"]) if keys else 0

    def retain(self, keys: list[str]) -> int:
        return int(self._json("/retain", {"keys": list(keys)})["n"]) if keys else 0

    def count_missing(self, keys: list[str]) -> int:
        return int(self._json("/count_missing", {"keys": list(keys)})["n"]) if keys else 0

    def stats(self) -> dict:
        status, body = self._request("GET", "/stats", None, "application/json")
        if status != 200:
            raise PixelStoreUnavailable(f"PixelStore stats answered {status}")
        d = json.loads(body)
        d["restarts"] = self.server.restarts
        d["client_missing"] = self.missing_seen
        return d

    def close(self) -> None:
        """Stop the server process this client owns."""
        self.server.stop()


def start_local_store(capacity_bytes: int, put_timeout_s: float = 60.0, prefix: str = "local",
                      max_age_s: float = 0.0) -> LocalPixelStoreClient:
    return LocalPixelStoreClient(LocalStoreProcess(capacity_bytes, put_timeout_s, prefix, max_age_s).start())


if __name__ == "__main__":
    sys.exit(server_main())
