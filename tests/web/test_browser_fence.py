"""The browser's network fence under attack (issue 20, items 2-4): an "attacker site" the task allows
and "forbidden targets" that log every connection, all on 127.0.0.1. For every vector — the redirect
race (a POST that 307s to loopback), a subresource 302, a fetch POST 307 with its body replayed, a
WebSocket, a worker's fetch, WebRTC (STUN over UDP, TURN over TCP), and under the '*' policy names
that resolve to 127.0.0.1 — no connection reaches a forbidden target and each refusal is reported in
`StepResult.blocked`. A control run with the same page and the targets allowed shows each vector
does reach its target when permitted, so these tests fail when the fence is removed.
Only loopback addresses are ever contacted."""

from __future__ import annotations

import asyncio
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from asyncwebrl.web.browser import BrowserPool
from asyncwebrl.web.config import EnvConfig
from asyncwebrl.web.fence import NavigationPolicy, address_refusal
from asyncwebrl.web.webgym import WebGymEnv, load_task_file


class Forbidden:
    """A TCP listener on 127.0.0.1 that logs every connection (and its first line) and answers a tiny
    HTTP 200 with permissive CORS, whatever it was sent."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.hits: list[str] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(2)
            try:
                first = conn.recv(4096).split(b"\r\n", 1)[0].decode("latin-1")
            except OSError:
                first = ""
            self.hits.append(first or "(connection)")
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\nAccess-Control-Allow-Origin: *\r\nContent-Type: text/plain\r\n"
                             b"Content-Length: 2\r\nConnection: close\r\n\r\nok")
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


class UdpLog:
    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.hits = 0
        self._stop = False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop:
            try:
                self.sock.recvfrom(2048)
                self.hits += 1
            except OSError:
                continue

    def close(self) -> None:
        self._stop = True


def _attack_page(http_t: int, ws_t: int, turn_t: int, udp_t: int) -> str:
    t = f"http://127.0.0.1:{http_t}"
    return f"""<!DOCTYPE html><html><head><title>attack</title></head><body>
<img src="/img302">
<form id="race" method="POST" action="/hop" enctype="text/plain" target="sink">
  <input name='{{"model_path": "/evil", "x' value='": 1}}'></form>
<iframe name="sink" src="about:blank"></iframe>
<a id="go" href="{t}/navigate">Go</a>
<script>
document.getElementById('race').submit();
fetch('/f307', {{method: 'POST', mode: 'no-cors', headers: {{'Content-Type': 'text/plain'}},
                 body: '{{"model_path": "/evil"}}'}}).catch(() => {{}});
try {{ new WebSocket('ws://127.0.0.1:{ws_t}/ws'); }} catch (e) {{}}
const src = "fetch('{t}/worker').catch(() => {{}});";
try {{ new Worker(URL.createObjectURL(new Blob([src], {{type: 'text/javascript'}}))); }} catch (e) {{}}
try {{
  const pc = new RTCPeerConnection({{iceServers: [{{urls: 'stun:127.0.0.1:{udp_t}'}},
    {{urls: 'turn:127.0.0.1:{turn_t}?transport=tcp', username: 'u', credential: 'c'}},
    {{urls: 'turn:127.0.0.1:{udp_t}?transport=udp', username: 'u', credential: 'c'}}]}});
  pc.createDataChannel('x');
  pc.createOffer().then((o) => pc.setLocalDescription(o));
  window.__pc = pc;
}} catch (e) {{}}
</script></body></html>"""


def _attacker_site(page: str, target: str) -> ThreadingHTTPServer:
    class Attacker(BaseHTTPRequestHandler):
        def _send(self, code: int, body: bytes = b"", location: str | None = None) -> None:
            self.send_response(code)
            if location:
                self.send_header("Location", location)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path == "/img302":
                self._send(302, location=f"{target}/img")
            elif self.path == "/hop":
                self._send(200, b"harmless")  # what a GET-only checker of the hop would see
            else:
                self._send(200, page.encode())

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path in ("/hop", "/f307"):
                self._send(307, location=f"{target}/update_weights_from_disk{self.path}")
            else:
                self._send(404)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Attacker)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


async def _loopback_resolver(host: str) -> list[str]:
    """The test's DNS: one attacker name that resolves to loopback; everything else does not resolve."""
    if host == "attacker-rebind.test":
        return ["127.0.0.1"]
    raise socket.gaierror(socket.EAI_NONAME, "no such name")


def _play(tmp_path, origins: list[str], start: str, steps: list[dict], allow_private: bool = False):
    """Reset a WebGym task at `start` (allowed: `origins`) in a private pool, play `steps`; return the
    step results. The pool's fence resolves names with `_loopback_resolver`."""
    import json

    line = {"id": "attack", "instruction": "x", "start_url": start, "max_steps": 20,
            "allowed_origins": origins, "allow_private": allow_private,
            "evaluator": {"type": "url_match", "pattern": "never-matches"}}
    f = tmp_path / "tasks.jsonl"
    f.write_text(json.dumps(line) + "\n")
    task = load_task_file(f)[0]
    cfg = EnvConfig(type="webgym", task_file=str(f), viewport_width=320, viewport_height=240, step_timeout_s=30)

    async def go():
        pool = BrowserPool(cfg, resolver=_loopback_resolver)
        env = WebGymEnv(cfg, pool=pool)
        try:
            await env.reset(task)
            out = []
            for a in steps:
                out.append((await env.step(a))[1])
                await asyncio.sleep(0.5)
            return out
        finally:
            await env.close()
            await pool.close()

    return asyncio.run(asyncio.wait_for(go(), 120))


@pytest.fixture()
def targets():
    ts = {"http": Forbidden(), "ws": Forbidden(), "turn": Forbidden()}
    udp = UdpLog()
    yield ts, udp
    for t in ts.values():
        t.close()
    udp.close()


def _run_attack(tmp_path, targets, allow_targets: bool):
    ts, udp = targets
    http_origin = f"http://127.0.0.1:{ts['http'].port}"
    page = _attack_page(ts["http"].port, ts["ws"].port, ts["turn"].port, udp.port)
    site = _attacker_site(page, http_origin)
    origin = f"http://127.0.0.1:{site.server_address[1]}"
    allowed = [origin] + ([http_origin, f"http://127.0.0.1:{ts['ws'].port}",
                           f"http://127.0.0.1:{ts['turn'].port}"] if allow_targets else [])
    try:
        wait = {"type": "wait"}
        results = _play(tmp_path, allowed, origin + "/attack.html", [wait, wait, wait, wait])
    finally:
        site.shutdown()
        site.server_close()
    blocked = [b for r in results for b in r.blocked]
    return ts, udp, blocked


@pytest.mark.browser
def test_every_vector_is_refused_and_reported(tmp_path, targets):
    ts, udp, blocked = _run_attack(tmp_path, targets, allow_targets=False)
    assert ts["http"].hits == [] and ts["ws"].hits == [] and ts["turn"].hits == [], \
        {k: t.hits for k, t in ts.items()}
    assert udp.hits == 0, "WebRTC sent UDP to loopback"
    http = f"http://127.0.0.1:{ts['http'].port}"
    refused = {b.target for b in blocked if b.kind == "refused"}
    for vector, target in [("subresource 302", f"{http}/img"),
                           ("redirect race (form POST 307)", f"{http}/update_weights_from_disk/hop"),
                           ("fetch POST 307 with body", f"{http}/update_weights_from_disk/f307"),
                           ("worker fetch", f"{http}/worker")]:
        assert target in refused, (vector, refused)
    assert any(f"127.0.0.1:{ts['ws'].port}" in t for t in refused), ("WebSocket", refused)
    assert any(f"127.0.0.1:{ts['turn'].port}" in t for t in refused), ("WebRTC TURN over TCP", refused)
    assert all(b.reason for b in blocked)


@pytest.mark.browser
def test_control_the_vectors_are_live_when_the_targets_are_allowed(tmp_path, targets):
    """The same page with the targets allowed: each vector does reach its target, so the refusals
    above are the fence's doing (without it the test above fails)."""
    ts, _udp, _blocked = _run_attack(tmp_path, targets, allow_targets=True)
    paths = " ".join(ts["http"].hits)
    for path in ["/img", "/update_weights_from_disk/hop", "/update_weights_from_disk/f307", "/worker"]:
        assert f" {path} " in paths, (path, ts["http"].hits)
    assert any("POST /update_weights_from_disk/f307" in h for h in ts["http"].hits)  # the body was replayed
    assert ts["ws"].hits, "the WebSocket never reached its allowed target"
    assert ts["turn"].hits, "WebRTC's TURN-over-TCP never reached its allowed target (through the fence)"


@pytest.mark.browser
def test_names_that_resolve_to_loopback_are_refused_under_star(tmp_path, targets):
    ts, _udp = targets
    port = ts["http"].port
    page = f"""<html><head><title>rebind</title></head><body>
<a href="http://attacker-rebind.test:{port}/nav">Rebind</a>
<script>
fetch('http://rebind.localhost:{port}/localhost-name', {{mode: 'no-cors'}}).catch(() => {{}});
fetch('http://attacker-rebind.test:{port}/dns-name', {{mode: 'no-cors'}}).catch(() => {{}});
</script></body></html>"""
    site = _attacker_site(page, "http://unused.invalid")
    origin = f"http://127.0.0.1:{site.server_address[1]}"
    try:
        results = _play(tmp_path, ["*", origin], origin + "/rebind.html",
                        [{"type": "wait"}, {"type": "click", "element": 1}, {"type": "wait"}])
    finally:
        site.shutdown()
        site.server_close()
    assert ts["http"].hits == [], ts["http"].hits
    refused = {b.target: b.reason for r in results for b in r.blocked if b.kind == "refused"}
    assert "loopback" in refused.get(f"http://rebind.localhost:{port}/localhost-name", ""), refused
    assert "127.0.0.1" in refused.get(f"http://attacker-rebind.test:{port}/dns-name", ""), refused
    nav = results[1]
    assert nav.invalid and any("/nav" in b.target for b in nav.blocked) and "refused" in nav.info["error"]


def test_policy_decides_on_the_resolved_address():
    """Without a browser: every non-public range is refused, IPv4 hidden in IPv6 included, names are
    judged by what they resolve to, and a task's exact IP-literal origin is allowed as written."""
    async def resolve_to(ip):
        async def r(host):
            return [ip]
        return r

    async def go():
        star = NavigationPolicy(["*"])
        out = {}
        for ip in ["127.0.0.1", "10.1.2.3", "169.254.169.254", "100.100.100.200", "100.64.0.1", "192.0.0.170",
                   "::1", "::ffff:127.0.0.1", "64:ff9b::7f00:1", "2002:7f00:1::", "fd00:ec2::254", "fe80::1",
                   "0.0.0.0", "224.0.0.1", "93.184.216.34", "2606:4700::1111"]:
            addr, blocked = await star.decide("some.name", 80, ("http",), await resolve_to(ip))
            out[ip] = blocked is None
        exact = NavigationPolicy(["http://127.0.0.1:8123"])
        out["exact"] = (await exact.decide("127.0.0.1", 8123, ("http",), await resolve_to("x")))[1] is None
        out["other-port"] = (await exact.decide("127.0.0.1", 8124, ("http",), await resolve_to("x")))[1] is None
        priv = NavigationPolicy(["*"], allow_private=True)
        out["private-ok"] = (await priv.decide("n", 80, ("http",), await resolve_to("10.0.0.5")))[1] is None
        out["metadata-even-private"] = (await priv.decide("n", 80, ("http",), await resolve_to("169.254.169.254")))[1] is None
        return out

    out = asyncio.run(go())
    public = {"93.184.216.34", "2606:4700::1111", "exact", "private-ok"}
    for k, allowed in out.items():
        assert allowed == (k in public), (k, allowed)
    assert address_refusal("100.100.100.200") and "CGNAT" in address_refusal("100.100.100.200")


def test_a_proxied_connection_carries_one_request_only():
    """An allowed upstream that ignores `Connection: close` and keeps the socket open cannot get the
    browser to send a second request (for any host) down the connection checked for the first: the
    fence rewrites the answer to `Connection: close` and forwards nothing after the first request."""
    from asyncwebrl.web.fence import NetworkFence

    forbidden = Forbidden()
    seen: list[bytes] = []
    keepalive = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = keepalive.accept()
        conn.settimeout(3)
        try:
            while True:
                data = conn.recv(4096)
                if not data:
                    return
                seen.append(data)
                conn.sendall(b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=60\r\n"
                             b"Content-Length: 2\r\n\r\nok")
        except OSError:
            return
        finally:
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    up = f"http://127.0.0.1:{keepalive.getsockname()[1]}"

    class Session:
        policy = NavigationPolicy([up])
        blocked: list = []

        def record_blocked(self, item):
            self.blocked.append(item)

    fence = NetworkFence()
    try:
        port = asyncio.run(fence.open_gate(Session()))
        c = socket.create_connection(("127.0.0.1", port), timeout=5)
        c.sendall(f"GET {up}/first HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        head = c.recv(4096)
        c.sendall(f"GET http://127.0.0.1:{forbidden.port}/second HTTP/1.1\r\nHost: y\r\n\r\n".encode())
        try:
            rest = c.recv(4096)
        except OSError:
            rest = b""
        c.close()
    finally:
        fence.close()
        forbidden.close()
        keepalive.close()
    assert head.startswith(b"HTTP/1.1 200") and b"Connection: close" in head and b"keep-alive" not in head.lower()
    assert b"/second" not in b"".join(seen) and forbidden.hits == [], (seen, forbidden.hits)
    assert not rest.startswith(b"HTTP/1.1 200")


@pytest.mark.browser
def test_control_webrtc_udp_is_live_without_the_switches():
    """The UDP half of the WebRTC vector is real: the same Chromium without the WebRTC switches of
    `CHROMIUM_ARGS` sends STUN datagrams to a loopback listener (with them — the pool's launch in
    test_every_vector_is_refused_and_reported — none arrive)."""
    from playwright.async_api import async_playwright

    from asyncwebrl.web.browser import CHROMIUM_ARGS

    udp = UdpLog()
    html = (f"<script>const pc = new RTCPeerConnection({{iceServers: [{{urls: 'stun:127.0.0.1:{udp.port}'}}]}});"
            "pc.createDataChannel('x'); pc.createOffer().then((o) => pc.setLocalDescription(o));</script>")

    async def go():
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=EnvConfig().headless_shell,
                                               args=[a for a in CHROMIUM_ARGS if "webrtc" not in a])
            try:
                page = await browser.new_page()
                await page.set_content(html)
                for _ in range(50):
                    if udp.hits:
                        break
                    await asyncio.sleep(0.1)
            finally:
                await browser.close()

    try:
        asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        udp.close()
    assert udp.hits > 0
