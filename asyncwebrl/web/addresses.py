"""Which IP addresses the browser may connect to: the IANA special-purpose address registries of both
families, written out here, and every IPv6 form that carries an IPv4 address.

Why not `ipaddress.is_global`: it calls several special-purpose blocks public (AS112 192.31.196.0/24
and 192.175.48.0/24, AMT 192.52.193.0/24, the 6to4 relay 192.88.99.0/24, 64:ff9b:1::/48, 3fff::/20,
5f00::/16, 100:0:0:1::/64, site-local fec0::/10, IPv4-compatible ::a.b.c.d, anything outside 2000::/3),
and its answer differs between Python releases. The fence must not.

Invariants:
- An address is allowed only when it is ordinary unicast of its family: IPv4 outside every block
  below; IPv6 inside global unicast 2000::/3 and outside every block below.
- Loopback and private blocks (127.0.0.0/8, 10/8, 172.16/12, 192.168/16, ::1, fc00::/7) pass only
  with `allow_private`; every other special-purpose block is refused whatever the task says
  (link-local holds the cloud metadata services, CGNAT holds 100.100.100.200).
- An IPv6 address that carries an IPv4 address is refused unless every IPv4 address it carries is
  allowed: IPv4-mapped ::ffff:0:0/96, IPv4-compatible ::/96, IPv4-translated ::ffff:0:0:0/96, NAT64
  64:ff9b::/96, 6to4 2002::/16, ISATAP-style interface ids (::0:5efe:a.b.c.d, ::200:5efe:a.b.c.d), and
  Teredo 2001::/32 (server and client; Teredo is refused in any case, as part of 2001::/23).
"""

from __future__ import annotations

import ipaddress
from ipaddress import IPv4Address, IPv6Address, ip_network

IP = IPv4Address | IPv6Address

V4_PRIVATE = tuple(ip_network(n) for n in ("127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"))
V4_SPECIAL = tuple((ip_network(n), why) for n, why in (
    ("0.0.0.0/8", "'this network'"),
    ("100.64.0.0/10", "CGNAT shared space (metadata 100.100.100.200)"),
    ("169.254.0.0/16", "link-local (metadata 169.254.169.254)"),
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("192.0.2.0/24", "documentation (TEST-NET-1)"),
    ("192.31.196.0/24", "AS112-v4"),
    ("192.52.193.0/24", "AMT"),
    ("192.88.99.0/24", "deprecated 6to4 relay anycast"),
    ("192.175.48.0/24", "AS112 direct delegation"),
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation (TEST-NET-2)"),
    ("203.0.113.0/24", "documentation (TEST-NET-3)"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved"),
    ("255.255.255.255/32", "limited broadcast"),
))
"""IANA IPv4 special-purpose registry (plus multicast), loopback and private apart"""

V6_PRIVATE = tuple(ip_network(n) for n in ("::1/128", "fc00::/7"))
V6_SPECIAL = tuple((ip_network(n), why) for n, why in (
    ("::/128", "unspecified"),
    ("100::/64", "discard-only"),
    ("100:0:0:1::/64", "dummy prefix"),
    ("64:ff9b:1::/48", "local-use NAT64"),
    ("2001::/23", "IETF protocol assignments (Teredo, benchmarking, ORCHID, AMT, AS112)"),
    ("2001:db8::/32", "documentation"),
    ("2620:4f:8000::/48", "AS112 direct delegation"),
    ("3fff::/20", "documentation"),
    ("5f00::/16", "SRv6 SIDs"),
    ("fd00:ec2::/32", "cloud metadata (fd00:ec2::254)"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "deprecated site-local"),
    ("ff00::/8", "multicast"),
))
"""IANA IPv6 special-purpose registry (plus multicast and site-local), loopback and ULA apart; checked
before the private blocks (fd00:ec2::/32 lies inside fc00::/7)"""

_GLOBAL_UNICAST = ip_network("2000::/3")
_MAPPED = ip_network("::ffff:0:0/96")
_TRANSLATED = ip_network("::ffff:0:0:0/96")
_COMPATIBLE = ip_network("::/96")
_NAT64 = ip_network("64:ff9b::/96")
_6TO4 = ip_network("2002::/16")
_TEREDO = ip_network("2001::/32")
_ISATAP_IDS = (0x0000_5EFE, 0x0100_5EFE, 0x0200_5EFE, 0x0300_5EFE)


def carried_v4(ip: IPv6Address) -> tuple[str, list[IPv4Address]]:
    """(form, the IPv4 addresses `ip` carries) for every IPv4-embedding IPv6 form; ('', []) if none."""
    n = int(ip)
    low32 = IPv4Address(n & 0xFFFF_FFFF)
    if ip in _MAPPED:
        return "IPv4-mapped", [low32]
    if ip in _TRANSLATED:
        return "IPv4-translated", [low32]
    if ip in _COMPATIBLE and n > 1:
        return "IPv4-compatible", [low32]
    if ip in _NAT64:
        return "NAT64", [low32]
    if ip in _6TO4:
        return "6to4", [IPv4Address((n >> 80) & 0xFFFF_FFFF)]
    if ip in _TEREDO:
        return "Teredo", [IPv4Address((n >> 64) & 0xFFFF_FFFF), IPv4Address(~n & 0xFFFF_FFFF)]
    if (n >> 32) & 0xFFFF_FFFF in _ISATAP_IDS:
        return "ISATAP", [low32]
    return "", []


def _v4_refusal(ip: IPv4Address, allow_private: bool) -> str | None:
    for net, why in V4_SPECIAL:
        if ip in net:
            return f"address {ip} is in {net}: {why}"
    for net in V4_PRIVATE:
        if ip in net:
            return None if allow_private else f"address {ip} is loopback/private ({net})"
    return None


def _v6_refusal(ip: IPv6Address, allow_private: bool) -> str | None:
    form, v4s = carried_v4(ip)
    for v4 in v4s:
        why = _v4_refusal(v4, allow_private)
        if why:
            return f"address {ip} ({form}) carries {v4}: {why}"
    for net, why in V6_SPECIAL:
        if ip in net:
            return f"address {ip} is in {net}: {why}"
    if form in ("IPv4-mapped", "IPv4-translated", "IPv4-compatible", "NAT64"):
        return None  # judged by the IPv4 address it carries, above
    for net in V6_PRIVATE:
        if ip in net:
            return None if allow_private else f"address {ip} is loopback/private ({net})"
    if ip not in _GLOBAL_UNICAST:
        return f"address {ip} is not global unicast (outside 2000::/3)"
    return None


def address_refusal(address: str, allow_private: bool = False) -> str | None:
    """Why the browser may not connect to `address` (an IP string), or None when it may."""
    try:
        ip = ipaddress.ip_address(address.strip("[]").split("%", 1)[0])
    except ValueError:
        return f"'{address}' is not an IP address"
    if isinstance(ip, IPv4Address):
        return _v4_refusal(ip, allow_private)
    return _v6_refusal(ip, allow_private)
