"""The fence with no soft spots (issue 33): the deny gate denies by construction, one page's name
lookups cannot fail another episode, and the address check follows the IANA special-purpose
registries for both families, every IPv4-embedding IPv6 form included. Real sockets on 127.0.0.1."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from hypothesis import given, settings
from hypothesis import strategies as st

from asyncwebrl.web.addresses import V4_SPECIAL, V6_SPECIAL
from asyncwebrl.web.fence import FENCE_HEADER, BlockedRequest, NavigationPolicy, NetworkFence, address_refusal


class Session:
    def __init__(self, policy: NavigationPolicy):
        self.policy = policy
        self.blocked: list[BlockedRequest] = []

    def record_blocked(self, item: BlockedRequest) -> None:
        self.blocked.append(item)


def ask(port: int, head: str, timeout: float = 10.0) -> tuple[str, str]:
    """(status line, fence verdict header) of one raw proxy request to the gate on `port`."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        c.sendall(head.encode("latin-1"))
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = c.recv(4096)
            if not chunk:
                break
            data += chunk
    lines = data.decode("latin-1").split("\r\n")
    verdict = next((ln.split(":", 1)[1].strip() for ln in lines if ln.lower().startswith(FENCE_HEADER.lower())), "")
    return lines[0], verdict


class Listener:
    """A local HTTP server that counts connections."""

    def __init__(self) -> None:
        hits = self.hits = []

        class H(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                hits.append(self.path)
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *a):
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.srv.server_address[1]
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


def test_the_deny_gate_denies_by_construction():
    """Port 0, port 80, 0.0.0.0, a loopback listener, a name: the gate of no session refuses each one
    with 403 without resolving a name or dialing anything."""
    looked_up: list[str] = []

    def lookup(host: str) -> list[str]:
        looked_up.append(host)
        return ["127.0.0.1"]

    target = Listener()
    fence = NetworkFence(lookup)
    try:
        unbound = fence._call(fence.open_gate())
        heads = ["GET http://0.0.0.0/ HTTP/1.1\r\nHost: 0.0.0.0\r\n\r\n",
                 "GET http://0.0.0.0:80/ HTTP/1.1\r\n\r\n",
                 "CONNECT 0.0.0.0:80 HTTP/1.1\r\n\r\n",
                 "CONNECT 0.0.0.0:0 HTTP/1.1\r\n\r\n",
                 f"GET http://127.0.0.1:{target.port}/x HTTP/1.1\r\n\r\n",
                 f"CONNECT 127.0.0.1:{target.port} HTTP/1.1\r\n\r\n",
                 f"GET http://some.name.test:{target.port}/ HTTP/1.1\r\n\r\n",
                 "GET / HTTP/1.1\r\n\r\n"]
        for port in (fence.deny_port, unbound):
            for head in heads:
                status, verdict = ask(port, head)
                assert status.startswith("HTTP/1.1 403") and verdict == "refused", (port, head, status)
    finally:
        fence.close()
        target.close()
    assert target.hits == [] and looked_up == []


def test_one_page_with_unanswered_lookups_does_not_fail_another_episode():
    """A '*' page that fires 40 lookups that never answer holds only its own gate's lookup threads:
    another episode's gate resolves and connects at once, and the hanging page's further lookups are
    refused as unreachable at once instead of queueing."""
    release = threading.Event()

    def lookup(host: str) -> list[str]:
        if host.startswith("hang-"):
            release.wait(60)
            raise socket.gaierror(socket.EAI_AGAIN, "gave up")
        return ["127.0.0.1"]

    target = Listener()
    fence = NetworkFence(lookup)
    hogs: list[socket.socket] = []
    try:
        hog = fence._call(fence.open_gate(Session(NavigationPolicy(["*"]))))
        other = fence._call(fence.open_gate(Session(NavigationPolicy(["*"], allow_private=True))))
        for i in range(40):
            c = socket.create_connection(("127.0.0.1", hog), timeout=10)
            c.sendall(f"CONNECT hang-{i}.test:443 HTTP/1.1\r\n\r\n".encode())
            hogs.append(c)
        time.sleep(0.3)
        t0 = time.monotonic()
        status, _ = ask(other, f"GET http://fine.test:{target.port}/page HTTP/1.1\r\n\r\n")
        other_s = time.monotonic() - t0
        t0 = time.monotonic()
        late, verdict = ask(hog, "CONNECT hang-late.test:443 HTTP/1.1\r\n\r\n")
        late_s = time.monotonic() - t0
    finally:
        release.set()
        for c in hogs:
            c.close()
        fence.close()
        target.close()
    assert " 200 " in status and other_s < 2.0, (status, other_s)
    assert target.hits == ["/page"]
    assert late.startswith("HTTP/1.1 502") and verdict == "unreachable" and late_s < 1.0, (late, late_s)


# ---- addresses ------------------------------------------------------------------------------------

PUBLIC_V4 = ["93.184.216.34", "8.8.8.8", "1.1.1.1", "151.101.1.69"]
PRIVATE_V4 = ["127.0.0.1", "10.1.2.3", "172.16.0.9", "192.168.1.1"]


def _v6(n: int) -> str:
    return str(ipaddress.IPv6Address(n))


def embeddings(v4: str) -> dict[str, str]:
    """Every IPv6 form that carries `v4` (Teredo as server and as client)."""
    a = int(ipaddress.IPv4Address(v4))
    return {
        "mapped": _v6((0xFFFF << 32) | a),
        "translated": _v6((0xFFFF << 48) | a),
        "compatible": _v6(a),
        "nat64": _v6((0x64FF9B << 96) | a),
        "local-nat64": _v6((0x64FF9B0001 << 80) | a),
        "6to4": _v6((0x2002 << 112) | (a << 80) | 1),
        "teredo-server": _v6((0x20010000 << 96) | (a << 64) | (0x8000 << 48) | 0xFFFF_FFFF),
        "teredo-client": _v6((0x20010000 << 96) | (int(ipaddress.IPv4Address("65.54.227.120")) << 64)
                             | (a ^ 0xFFFF_FFFF)),
        "isatap": _v6((0x2A00_1450_4001_081C << 64) | (0x5EFE << 32) | a),
        "isatap-u": _v6((0x2A00_1450_4001_081C << 64) | (0x0200_5EFE << 32) | a),
    }


def test_python_public_special_ranges_are_refused():
    """Special-purpose blocks `ipaddress.is_global` calls public, and IPv4-carrying forms it does not
    unwrap, are refused."""
    for a in ["192.31.196.1", "192.52.193.1", "192.88.99.1", "192.175.48.1", "192.0.0.9", "::7f00:1",
              "::ffff:0:7f00:1", "64:ff9b:1::7f00:1", "2620:4f:8000::1", "3fff::1", "5f00::1", "100:0:0:1::1",
              "fec0::1", "4000::1", "2a00:1450:4001:81c:0:5efe:7f00:1", "2a00:1450:4001:81c:200:5efe:a00:1",
              "2001:0:4136:e378:8000:63bf:80ff:fffe"]:
        assert address_refusal(a), a


def test_every_embedding_of_a_refused_v4_is_refused():
    for v4 in PRIVATE_V4 + ["169.254.169.254", "100.100.100.200", "0.0.0.0", "192.0.0.170", "224.0.0.1"]:
        for form, v6 in embeddings(v4).items():
            assert address_refusal(v6), (v4, form, v6)


def test_public_v4_through_nat64_mapped_and_6to4_still_works():
    """The forms real networks use for public sites (DNS64, dual stack, 6to4) stay usable."""
    for v4 in PUBLIC_V4:
        e = embeddings(v4)
        for form in ("mapped", "nat64", "6to4"):
            assert address_refusal(e[form]) is None, (v4, form, e[form], address_refusal(e[form]))
        for form in ("teredo-server", "teredo-client", "local-nat64"):
            assert address_refusal(e[form]), (form, e[form])
    for a in ["2606:4700::1111", "2a00:1450:4001:81c::200e", "8.8.4.4"]:
        assert address_refusal(a) is None, a


def test_metadata_and_cgnat_stay_refused_even_with_allow_private():
    for a in ["169.254.169.254", "100.100.100.200", "fd00:ec2::254", "::ffff:169.254.169.254",
              "64:ff9b::a9fe:a9fe", embeddings("169.254.169.254")["6to4"]]:
        assert address_refusal(a, allow_private=True), a
    assert "CGNAT" in address_refusal("100.100.100.200")
    for a in PRIVATE_V4 + ["::1", "fc00::1", "::ffff:10.0.0.1"]:
        assert address_refusal(a) and address_refusal(a, allow_private=True) is None, a


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(V4_SPECIAL), st.integers(min_value=0, max_value=2**32 - 1), st.booleans())
def test_property_every_v4_special_block_is_refused(entry, offset, allow_private):
    net, _ = entry
    ip = net[offset % net.num_addresses]
    assert address_refusal(str(ip), allow_private), ip
    for form, v6 in embeddings(str(ip)).items():
        assert address_refusal(v6, allow_private), (ip, form, v6)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(V6_SPECIAL), st.integers(min_value=0, max_value=2**128 - 1), st.booleans())
def test_property_every_v6_special_block_is_refused(entry, offset, allow_private):
    net, _ = entry
    ip = net[offset % net.num_addresses]
    assert address_refusal(str(ip), allow_private), ip


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=2**128 - 1))
def test_property_outside_global_unicast_only_embeddings_and_private_can_pass(n):
    ip = ipaddress.IPv6Address(n)
    if address_refusal(str(ip), allow_private=True) is None and ip not in ipaddress.ip_network("2000::/3"):
        assert (ip in ipaddress.ip_network("::ffff:0:0/96") or ip in ipaddress.ip_network("::ffff:0:0:0/96")
                or ip in ipaddress.ip_network("::/96") or ip in ipaddress.ip_network("64:ff9b::/96")
                or ip in ipaddress.ip_network("fc00::/7") or str(ip) == "::1"), ip


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_property_a_v4_and_its_carriers_agree(a):
    """Whatever IPv4 address: its mapped and NAT64 forms get the same verdict as the address itself."""
    v4 = str(ipaddress.IPv4Address(a))
    e = embeddings(v4)
    for allow in (False, True):
        own = address_refusal(v4, allow) is None
        assert (address_refusal(e["mapped"], allow) is None) == own, (v4, allow)
        assert (address_refusal(e["nat64"], allow) is None) == own, (v4, allow)
        if not own:  # (0.0.0.0 and 0.0.0.1 have no IPv4-compatible form: that is :: and ::1)
            assert all(address_refusal(v6, allow) for f, v6 in e.items() if a > 1 or f != "compatible"), v4
