"""The redirect policy: which hops a transfer may take, and the address each one must use.

A registry, or anything answering in its name, must not steer the client into the user's private
network. So no request follows a redirect by itself; every hop (the first request, each
`Location`, token realms, upload locations) goes through `check_hop()`, which

1. allows only http and https, and never http once the chain has used https (not even with
   `--insecure`), and plain http to the registry itself only with `--insecure`;
2. resolves the host once (A and AAAA, dnspython, through an injectable resolver) and refuses it
   when any address is in ferry's table of special-purpose ranges (`address_ranges.py`: loopback,
   private, link-local, CGNAT, documentation, multicast, reserved, ...) unless `--insecure`; a
   DNS failure or an empty answer is a refusal. Numeric hosts in the legacy forms
   (`2130706433`, `0x7f.1`, `127.1`) are refused outright, whatever they would mean;
3. exempts the registry the user named from the address check, by origin (same scheme, host and
   port) only, and pins it: its addresses are resolved at the first hop and reused for the whole
   transfer, so a later lookup cannot move it into the private network;
4. returns the checked address, which the session then connects to (no second lookup, so the
   answer cannot be rebound between check and connect).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from registry.transfer.address_ranges import IPAddress, refused_range
from registry.transfer.errors import RedirectRefused

MAX_HOPS = 10
INSECURE_HINT = "pass --insecure for a private registry"
# What inet_aton (and so browsers and curl) reads as an IPv4 address: 1-4 parts, each decimal,
# 0x-hex or 0-octal, e.g. 2130706433, 0x7f.1, 127.1, 0177.0.0.1.
_NUMERIC_HOST = re.compile(r"(?:(?:0x[0-9a-f]*|[0-9]+)\.){0,3}(?:0x[0-9a-f]*|[0-9]+)\.?", re.I)


class ResolveError(Exception):
    """The resolver could not answer (timeout, SERVFAIL, no configuration)."""


class Resolver(Protocol):
    """Resolve a host name to all its addresses (A and AAAA); an empty list means none."""

    async def resolve(self, host: str) -> Sequence[IPAddress]: ...


class DnsResolver:
    """dnspython's async resolver, asked for A and AAAA together; fails closed."""

    def __init__(self, lifetime: float = 10.0) -> None:
        self.lifetime = lifetime
        self._resolver: object | None = None

    async def resolve(self, host: str) -> Sequence[IPAddress]:
        if host == "localhost" or host.endswith(".localhost"):  # RFC 6761: never sent to DNS
            return [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
        import dns.asyncresolver
        import dns.exception
        import dns.resolver

        if self._resolver is None:
            try:
                self._resolver = dns.asyncresolver.Resolver()
            except dns.exception.DNSException as exc:
                raise ResolveError(f"no DNS configuration: {exc}") from exc
        resolver: dns.asyncresolver.Resolver = self._resolver  # type: ignore[assignment]
        answers = await asyncio.gather(
            *(resolver.resolve(host, kind, lifetime=self.lifetime) for kind in ("A", "AAAA")),
            return_exceptions=True,
        )
        found: list[IPAddress] = []
        failures: list[BaseException] = []
        for answer in answers:
            if isinstance(answer, dns.resolver.NXDOMAIN | dns.resolver.NoAnswer):
                continue
            if isinstance(answer, BaseException):
                failures.append(answer)
                continue
            found.extend(ipaddress.ip_address(rr.to_text()) for rr in answer)
        if not found and failures:
            raise ResolveError(str(failures[0]) or type(failures[0]).__name__)
        return found


def address_problem(address: IPAddress) -> str | None:
    """Why a hop may not connect to `address` without --insecure, or None if it is public."""
    return refused_range(address)


def legacy_numeric_ipv4(host: str) -> ipaddress.IPv4Address | None:
    """The address a numeric host that is not a dotted quad means to inet_aton (and so to
    browsers and curl), or None when `host` is a name or a plain dotted quad."""
    if _NUMERIC_HOST.fullmatch(host) is None or _is_literal(host):
        return None
    parts = [_numeric_part(p) for p in host.rstrip(".").split(".")]
    value = 0
    for part in parts[:-1]:
        value = value << 8 | min(part, 0xFF)
    room = 8 * (5 - len(parts))  # the last part fills the bytes the others left
    return ipaddress.IPv4Address(value << room | min(parts[-1], (1 << room) - 1))


def _numeric_part(text: str) -> int:
    if text[:2].lower() == "0x":
        return int(text[2:] or "0", 16)
    if len(text) > 1 and text.startswith("0"):
        return int(text, 8) if set(text) <= set("01234567") else 0xFFFFFFFF
    return int(text[:12])  # longer is out of range anyway


def shown(url: httpx.URL) -> str:
    """The hop as shown in errors: no query (it may hold a signature), long paths cut."""
    path = url.path if len(url.path) <= 60 else url.path[:57] + "..."
    return f"{url.scheme}://{url.netloc.decode('ascii', 'replace')}{path}"


@dataclass(frozen=True)
class RedirectPolicy:
    """The rules for one transfer: the registry the user named, and whether it is private."""

    registry: httpx.URL
    insecure: bool
    resolver: Resolver
    max_hops: int = MAX_HOPS
    # The registry's addresses, resolved once at its first hop and reused for the whole
    # transfer (mutable though the policy is not: it fills on first use).
    pinned: list[IPAddress] = field(default_factory=list, compare=False)

    def is_registry_origin(self, url: httpx.URL) -> bool:
        """Same scheme, host and port: the only place `Authorization` may go."""
        return (url.scheme, url.host.lower(), url.port) == (
            self.registry.scheme, self.registry.host.lower(), self.registry.port)


@dataclass(frozen=True)
class PinnedHop:
    """A checked hop: connect to `address`, present `url`'s host as Host and TLS name."""

    url: httpx.URL
    address: IPAddress

    @property
    def connect_url(self) -> httpx.URL:
        return self.url.copy_with(host=str(self.address))

    @property
    def host_header(self) -> str:
        return self.url.netloc.decode("ascii")

    @property
    def extensions(self) -> dict[str, str]:
        return {"sni_hostname": self.url.host} if self.url.scheme == "https" else {}


@dataclass
class HopChain:
    """What a chain of hops has done so far: how many redirects, and whether https was used."""

    redirects: int = 0
    used_https: bool = False


async def check_hop(url: httpx.URL, policy: RedirectPolicy, chain: HopChain) -> PinnedHop:
    """Apply the scheme, hop-count and address rules to one hop; return where to connect."""
    redirected = chain.redirects > 0
    if chain.redirects > policy.max_hops:
        raise RedirectRefused(shown(url), f"more than {policy.max_hops} redirects",
                              redirected=True)
    _check_scheme(url, policy, chain, redirected)
    registry = policy.is_registry_origin(url)
    if registry and policy.pinned:
        addresses: Sequence[IPAddress] = policy.pinned
    else:
        addresses = await _resolve(url, policy, redirected)
    if registry and not policy.pinned:
        policy.pinned.extend(addresses)
    if not policy.insecure and not registry:
        for address in addresses:
            problem = address_problem(address)
            if problem is not None:
                rule = problem if _is_literal(url.host) else f"{url.host} resolves to {address}, "\
                    f"a {problem}"
                raise RedirectRefused(shown(url), rule, INSECURE_HINT, redirected)
    chain.used_https = chain.used_https or url.scheme == "https"
    return PinnedHop(url, addresses[0])


def _check_scheme(url: httpx.URL, policy: RedirectPolicy, chain: HopChain,
                  redirected: bool) -> None:
    if url.scheme not in ("http", "https"):
        raise RedirectRefused(shown(url), f"unsupported scheme {url.scheme!r}",
                              redirected=redirected)
    if url.scheme != "http":
        return
    if chain.used_https or policy.registry.scheme == "https":
        raise RedirectRefused(shown(url), "an https registry may not continue over plain http "
                              "(not even with --insecure)", redirected=redirected)
    if not policy.insecure:
        raise RedirectRefused(shown(url), "insecure protocol http", INSECURE_HINT, redirected)


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def _resolve(url: httpx.URL, policy: RedirectPolicy,
                   redirected: bool) -> Sequence[IPAddress]:
    """The hop's addresses: the literal itself, or one lookup; failure or none is a refusal."""
    host = url.host
    if _is_literal(host):
        return [ipaddress.ip_address(host)]
    numeric = legacy_numeric_ipv4(host)
    if numeric is not None:
        raise RedirectRefused(shown(url), f"numeric host {host!r} (it reads as {numeric}); "
                              "write addresses as a dotted quad", redirected=redirected)
    try:
        addresses = list(await policy.resolver.resolve(host.lower()))
    except (ResolveError, OSError, ValueError) as exc:
        raise RedirectRefused(shown(url), f"could not resolve {host}: {exc}",
                              redirected=redirected) from exc
    if not addresses:
        raise RedirectRefused(shown(url), f"{host} has no address", redirected=redirected)
    return addresses
