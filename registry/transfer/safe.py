"""The redirect policy: which hops a transfer may take, and the address each one must use.

A registry, or anything answering in its name, must not steer the client into the user's private
network. So no request follows a redirect by itself; every hop (the first request, each
`Location`, token realms, upload locations) goes through `check_hop()`, which

1. allows only http and https, and never http once the chain has used https (not even with
   `--insecure`), and plain http to the registry itself only with `--insecure`;
2. resolves the host once (A and AAAA, dnspython, through an injectable resolver) and refuses it
   when any address is loopback, private, ULA, link-local, CGNAT, benchmarking, multicast,
   unspecified or reserved (IPv4-mapped IPv6 unwrapped first) unless `--insecure`; a DNS failure
   or an empty answer is a refusal. The registry host the user named is exempt from this check;
3. returns the checked address, which the session then connects to (no second lookup, so the
   answer cannot be rebound between check and connect).
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx

from registry.transfer.errors import RedirectRefused

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_HOPS = 10
INSECURE_HINT = "pass --insecure for a private registry"
_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_BENCHMARKING = ipaddress.ip_network("198.18.0.0/15")


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
    if isinstance(address, ipaddress.IPv6Address):
        if address.is_site_local:  # fec0::/10, deprecated but still private in practice
            return "private address"
        # IPv4-mapped (::ffff:a.b.c.d) and 6to4 (2002:aabb:ccdd::) carry an IPv4 address
        # that a local gateway may route to: judge that one.
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is not None:
            address = embedded
    checks: list[tuple[bool, str]] = [
        (address.is_unspecified, "unspecified address"),
        (address.is_loopback, "loopback address"),
        (address.is_link_local, "link-local address"),
        (address.is_multicast, "multicast address"),
        (isinstance(address, ipaddress.IPv4Address) and address in _CGNAT, "CGNAT address"),
        (isinstance(address, ipaddress.IPv4Address) and address in _BENCHMARKING,
         "benchmarking address"),
        (address.is_reserved, "reserved address"),
        (address.is_private, "private address"),
        (not address.is_global, "reserved address"),
    ]
    for failed, rule in checks:
        if failed:
            return rule
    return None


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

    def is_registry_host(self, url: httpx.URL) -> bool:
        return url.host.lower() == self.registry.host.lower()

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
    addresses = await _resolve(url, policy, redirected)
    if not policy.insecure and not policy.is_registry_host(url):
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
    try:
        addresses = list(await policy.resolver.resolve(host.lower()))
    except (ResolveError, OSError, ValueError) as exc:
        raise RedirectRefused(shown(url), f"could not resolve {host}: {exc}",
                              redirected=redirected) from exc
    if not addresses:
        raise RedirectRefused(shown(url), f"{host} has no address", redirected=redirected)
    return addresses
