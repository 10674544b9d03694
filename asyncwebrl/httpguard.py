"""The gate in front of every HTTP listener of the system (inference server, local PixelStore): only
the system's own programs get through, never a web page the agent's browser visits.

A page can make the browser send requests to loopback or LAN addresses (forms, fetch, images,
redirects, DNS rebinding). Browsers mark every such request; programs (aiohttp, urllib, requests)
do not. So a listener refuses, before reading the body:
- any request carrying a browser marker: `Origin` (sent on every cross-origin POST, and on fetch/XHR),
  or a `Sec-Fetch-*` header (sent by Chromium on every request, navigations and images included) -> 403;
- a `Host` that is neither an IP literal nor one of the names the listener serves (defeats DNS
  rebinding: the attacker's name still arrives as the Host) -> 403;
- a body that is not `application/json` where JSON is expected (a form POST is `text/plain` or
  `application/x-www-form-urlencoded`) -> 415;
- a body larger than the listener's limit, judged from Content-Length before any byte is read -> 413
  (a chunked body is cut off at the same limit while it is read).
Keys are compared in constant time. Keys travel to launched servers through the environment or a
0600 file, never argv (`/proc/PID/cmdline` is world-readable).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket
import stat
from pathlib import Path

BROWSER_HEADERS = ("Origin", "Sec-Fetch-Site", "Sec-Fetch-Mode", "Sec-Fetch-Dest", "Sec-Fetch-User")


def new_key() -> str:
    """A fresh random API key (256 bits)."""
    return secrets.token_urlsafe(32)


def keys_equal(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def bearer(header: str | None) -> str | None:
    if header and header.startswith("Bearer "):
        return header[len("Bearer "):]
    return None


def write_key_file(path: str | Path, key: str) -> Path:
    """Write `key` to `path` readable by its owner only (created 0600, never world-readable in between)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, key.encode())
    finally:
        os.close(fd)
    return path


def read_key_file(path: str | Path) -> str:
    """The key in `path`; ValueError when the file is readable by others (or empty)."""
    st = os.stat(path)
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"key file {path} is readable by group/others (chmod 600 it)")
    key = Path(path).read_text().strip()
    if not key:
        raise ValueError(f"key file {path} is empty")
    return key


def browser_marker(headers) -> str | None:
    """The first browser-only header present, or None."""
    for h in BROWSER_HEADERS:
        if h in headers:
            return h
    return None


def served_names(extra: list[str] | tuple[str, ...] = ()) -> set[str]:
    """Host names a listener on this machine answers to: localhost, the machine's names, `extra`."""
    names = {"localhost", socket.gethostname().lower()}
    try:
        names.add(socket.getfqdn().lower())
    except OSError:
        pass
    names.update(n.lower().rstrip(".") for n in extra if n)
    return names


def host_allowed(host_header: str | None, names: set[str]) -> bool:
    """Is the Host header an IP literal or one of `names` (any port)?"""
    if not host_header:
        return False
    h = host_header.strip()
    if h.startswith("["):  # [v6]:port
        h = h[1:].split("]", 1)[0]
    elif h.count(":") == 1:
        h = h.rsplit(":", 1)[0]
    try:
        ipaddress.ip_address(h)
        return True
    except ValueError:
        return h.lower().rstrip(".") in names


def refusal(request, *, names: set[str], max_body: int) -> tuple[int, str] | None:
    """(status, message) when an aiohttp request must be refused before anything else (browser marks,
    foreign Host, oversized body), else None. The key is checked next, the body type after it."""
    marker = browser_marker(request.headers)
    if marker is not None:
        return 403, f"requests from web browsers are refused (header {marker})"
    if not host_allowed(request.headers.get("Host"), names):
        return 403, f"Host '{request.headers.get('Host', '')}' is not a name this server serves"
    if request.content_length is not None and request.content_length > max_body:
        return 413, f"body of {request.content_length} bytes exceeds the limit of {max_body} bytes"
    return None


def body_type_refusal(request, want: str = "application/json") -> tuple[int, str] | None:
    """415 when the request has a body whose Content-Type is not `want` (a form POST is text/plain)."""
    has_body = (request.content_length or 0) > 0 or "chunked" in request.headers.get("Transfer-Encoding", "")
    if has_body and request.content_type != want:
        return 415, f"only {want} bodies are accepted here (got '{request.content_type}')"
    return None


def resolve_all(host: str) -> set[str]:
    """Every IP address `host` resolves to (an IP literal resolves to itself); empty if unresolvable."""
    try:
        return {ipaddress.ip_address(host).compressed}
    except ValueError:
        pass
    try:
        return {ipaddress.ip_address(ai[4][0].split("%")[0]).compressed for ai in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError, ValueError):
        return set()
