"""Addresses and ports: where a role binds and what it advertises to the others.

Invariant: an address that another process dials comes from here. On one box (a private Ray
instance, or the `local` scheduler) every role binds and advertises the loopback address; when the
Ray cluster spans nodes every role binds and advertises its own node's address (Ray's node IP), so a
server on node B is dialled at B's address, never at a loopback that means another machine there.
`LOOPBACK` is the one spelling of the loopback address in the package.
"""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"
"""the address of a run that stays on one machine"""
WILDCARDS = ("0.0.0.0", "::", "")
NODE = "node"
"""the bind address meaning: this node's address (loopback on one box, Ray's node IP across nodes)"""


def answers_health(address: str, api_key: str | None = None, timeout_s: float = 5.0) -> bool:
    """One GET `address`/health: True when the server answers 200 within `timeout_s` (the health
    probe of every caller: a launcher waiting for a server, the controller's supervisor)."""
    import http.client
    import urllib.request

    req = urllib.request.Request(address.rstrip("/") + "/health")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status == 200
    except (OSError, ValueError, http.client.HTTPException):  # refused, timed out, HTTP error, garbage
        return False


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that was free on `host` a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_address(multi_node: bool) -> str:
    """This process's node address: Ray's node IP when the run spans nodes, else loopback."""
    if not multi_node:
        return LOOPBACK
    import ray

    if not ray.is_initialized():
        raise RuntimeError("node_address(multi_node=True) needs Ray: only a Ray cluster spans nodes")
    return ray.util.get_node_ip_address()


def bind_address(host: str, multi_node: bool) -> str:
    """The address to bind for a configured `host` ('node' = this node's address)."""
    return node_address(multi_node) if host == NODE else host


def advertised_address(bind: str, multi_node: bool) -> str:
    """The address others dial for a socket bound to `bind` (a wildcard bind: this node's address)."""
    return node_address(multi_node) if bind in WILDCARDS else bind


def ray_spans_nodes() -> bool:
    """True when the connected Ray cluster has more than one alive node."""
    import ray

    return ray.is_initialized() and sum(1 for n in ray.nodes() if n.get("Alive")) > 1


def interface_of(ip: str) -> str | None:
    """The network interface that holds `ip` on this machine (None if none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return name
    return None


def collective_interface_env(ip: str) -> dict[str, str]:
    """Environment that makes gloo (and NCCL's bootstrap) use the interface of `ip`: left alone,
    gloo advertises the address the hostname resolves to, often loopback, which a peer on another
    node cannot dial. Settings the user made already win."""
    import os

    iface = interface_of(ip)
    if iface is None:
        return {}
    return {k: os.environ.get(k, iface) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
