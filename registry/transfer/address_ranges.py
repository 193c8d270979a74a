"""The address ranges a transfer refuses without `--insecure`: ferry's own table.

Python's `ipaddress` flags (`is_private`, `is_global`, ...) follow the IANA registries as of each
Python release, so they differ between versions (3.11 calls 192.0.0.8 and 3fff::1 public). The
table below is the IANA IPv4 and IPv6 Special-Purpose Address Registries (plus multicast, the
deprecated site-local block and the reserved 240/4), fixed here so every Python refuses the same
addresses. Blocks the registry marks globally reachable but which no registry lives in (AS112,
anycast relays inside 192.0.0.0/24 and 2001::/23) are refused too: stricter is harmless here.
IPv6 forms that carry an IPv4 address (mapped, NAT64, 6to4) are judged by that address; Teredo
is refused with the rest of 2001::/23.
"""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_V4: list[tuple[str, str]] = [
    ("0.0.0.0/8", "unspecified address"),  # "this network"
    ("10.0.0.0/8", "private address"),
    ("100.64.0.0/10", "CGNAT address"),
    ("127.0.0.0/8", "loopback address"),
    ("169.254.0.0/16", "link-local address"),
    ("172.16.0.0/12", "private address"),
    ("192.0.0.0/24", "reserved address"),  # IETF protocol assignments (192.0.0.8, ...)
    ("192.0.2.0/24", "documentation address"),
    ("192.31.196.0/24", "reserved address"),  # AS112-v4
    ("192.52.193.0/24", "reserved address"),  # AMT
    ("192.88.99.0/24", "reserved address"),  # deprecated 6to4 relay anycast
    ("192.168.0.0/16", "private address"),
    ("192.175.48.0/24", "reserved address"),  # AS112 direct delegation
    ("198.18.0.0/15", "benchmarking address"),
    ("198.51.100.0/24", "documentation address"),
    ("203.0.113.0/24", "documentation address"),
    ("224.0.0.0/4", "multicast address"),
    ("240.0.0.0/4", "reserved address"),  # includes 255.255.255.255, limited broadcast
]
_V6: list[tuple[str, str]] = [
    ("::/128", "unspecified address"),
    ("::1/128", "loopback address"),
    ("::/96", "reserved address"),  # deprecated IPv4-compatible
    ("64:ff9b:1::/48", "private address"),  # local-use NAT64
    ("100::/64", "reserved address"),  # discard-only
    ("100:0:0:1::/64", "reserved address"),  # dummy prefix
    ("2001::/23", "reserved address"),  # IETF protocol assignments (Teredo judged apart)
    ("2001:db8::/32", "documentation address"),
    ("3fff::/20", "documentation address"),
    ("5f00::/16", "reserved address"),  # SRv6 SIDs
    ("fc00::/7", "private address"),  # unique local
    ("fe80::/10", "link-local address"),
    ("fec0::/10", "private address"),  # deprecated site-local
    ("ff00::/8", "multicast address"),
]
V4_RANGES = [(ipaddress.IPv4Network(net), why) for net, why in _V4]
V6_RANGES = [(ipaddress.IPv6Network(net), why) for net, why in _V6]
_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_SIXTOFOUR = ipaddress.IPv6Network("2002::/16")


def embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries to a gateway (mapped, NAT64, 6to4)."""
    if address in _MAPPED or address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address in _SIXTOFOUR:
        return ipaddress.IPv4Address((int(address) >> 80) & 0xFFFFFFFF)
    return None


def refused_range(address: IPAddress) -> str | None:
    """Why `address` is not a public unicast address (e.g. "loopback address"), or None."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = embedded_ipv4(address)
        if inner is not None:
            return refused_range(inner)
        ranges: list = V6_RANGES
    else:
        ranges = V4_RANGES
    for network, why in ranges:
        if address in network:
            return why
    return None
