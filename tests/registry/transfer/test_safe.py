"""The redirect policy: scheme, address, hop count, DNS pinning, one pool per host name.

Refusals are proved to happen before any connection: either the target is an address nothing
listens on and the server-side hit counters stay at zero, or the check runs without a session.
"""

from __future__ import annotations

import ipaddress

import httpx
import pytest

from registry.transfer.errors import RedirectRefused
from registry.transfer.safe import (
    HopChain,
    RedirectPolicy,
    address_problem,
    check_hop,
)
from registry.transfer.session import SafeSession

from .fakes import hops_app
from .helpers import StaticResolver
from .tls import tls_server


@pytest.mark.parametrize(("address", "rule"), [
    ("10.0.0.5", "private address"),
    ("172.16.3.4", "private address"),
    ("192.168.1.1", "private address"),
    ("127.0.0.2", "loopback address"),
    ("169.254.169.254", "link-local address"),
    ("100.64.0.1", "CGNAT address"),
    ("198.18.0.1", "benchmarking address"),
    ("224.0.0.1", "multicast address"),
    ("0.0.0.0", "unspecified address"),
    ("240.0.0.1", "reserved address"),
    ("::1", "loopback address"),
    ("::", "unspecified address"),
    ("fd12:3456::1", "private address"),
    ("fe80::1", "link-local address"),
    ("ff02::1", "multicast address"),
    ("::ffff:10.0.0.5", "private address"),
    ("::ffff:127.0.0.1", "loopback address"),
    ("::ffff:169.254.169.254", "link-local address"),
    ("2002:a00:5::1", "private address"),
    ("fec0::1", "private address"),
    ("8.8.8.8", None),
    ("2606:4700:4700::1111", None),
])
def test_address_policy_names_the_rule(address: str, rule: str | None) -> None:
    assert address_problem(ipaddress.ip_address(address)) == rule


def _policy(registry: str, insecure: bool = False, **answers: str) -> RedirectPolicy:
    return RedirectPolicy(httpx.URL(registry), insecure, StaticResolver(answers))


async def test_redirect_to_a_private_literal_is_refused_with_a_clear_error() -> None:
    policy = _policy("https://registry.example")
    with pytest.raises(RedirectRefused) as err:
        await check_hop(httpx.URL("https://10.0.0.5/v2/blob?sig=x"), policy, HopChain(1))
    assert str(err.value) == ("refusing redirect to https://10.0.0.5/v2/blob: private address; "
                              "pass --insecure for a private registry")


async def test_a_name_resolving_to_any_private_address_is_refused() -> None:
    resolver = StaticResolver({"cdn.example": ["93.184.216.34"]})
    resolver.answers["mixed.example"] = "10.1.2.3"
    policy = RedirectPolicy(httpx.URL("https://registry.example"), False, resolver)
    with pytest.raises(RedirectRefused, match=r"mixed\.example resolves to 10\.1\.2\.3, a private"):
        await check_hop(httpx.URL("https://mixed.example/x"), policy, HopChain(1))
    hop = await check_hop(httpx.URL("https://cdn.example/x"), policy, HopChain(1))
    assert str(hop.address) == "93.184.216.34"
    assert hop.connect_url.host == "93.184.216.34" and hop.host_header == "cdn.example"
    assert hop.extensions == {"sni_hostname": "cdn.example"}


async def test_dns_failure_or_empty_answer_is_a_refusal() -> None:
    policy = _policy("https://registry.example")
    with pytest.raises(RedirectRefused, match=r"nowhere\.example has no address"):
        await check_hop(httpx.URL("https://nowhere.example/x"), policy, HopChain(1))


@pytest.mark.parametrize("url", ["ftp://cdn.example/x", "file:///etc/passwd"])
async def test_only_http_and_https_hops_are_allowed(url: str) -> None:
    with pytest.raises(RedirectRefused, match="unsupported scheme"):
        await check_hop(httpx.URL(url), _policy("https://r.example"), HopChain(1))


async def test_https_to_http_is_refused_even_with_insecure() -> None:
    policy = _policy("https://registry.example", insecure=True, **{"cdn.example": "127.0.0.1"})
    with pytest.raises(RedirectRefused, match="not even with --insecure"):
        await check_hop(httpx.URL("http://cdn.example/x"), policy, HopChain(1))


async def test_plain_http_registry_needs_insecure() -> None:
    with pytest.raises(RedirectRefused, match="insecure protocol http"):
        await check_hop(httpx.URL("http://127.0.0.1:5000/v2/"), _policy("http://127.0.0.1:5000"),
                        HopChain())


async def test_the_named_registry_host_is_exempt_from_the_address_check() -> None:
    policy = _policy("https://127.0.0.1:5000")
    hop = await check_hop(httpx.URL("https://127.0.0.1:5000/v2/"), policy, HopChain())
    assert str(hop.address) == "127.0.0.1"


async def test_hop_to_127_0_0_2_is_refused_without_insecure_and_followed_with_it(
        tmp_path) -> None:
    app, hits = hops_app()
    with tls_server(app, "127.0.0.1", tmp_path) as (registry, ca_file), \
            tls_server(app, "127.0.0.2", tmp_path) as (cdn, _):
        target = f"{registry}/to?u={cdn}/ok"
        for insecure in (False, True):
            session = _session(registry, ca_file, insecure)
            try:
                if not insecure:
                    with pytest.raises(RedirectRefused, match=r"127\.0\.0\.2.*loopback address"):
                        await session.send("GET", target)
                    assert hits["/ok"] == 0  # refused before any connection
                else:
                    reply = await session.send("GET", target)
                    assert reply.status == 200 and hits["/ok"] == 1
                    await reply.aclose()
            finally:
                await session.aclose()


async def test_https_registry_redirecting_to_http_is_refused_with_insecure(tmp_path) -> None:
    from conftest import serve_app

    app, hits = hops_app()
    with tls_server(app, "127.0.0.1", tmp_path) as (registry, ca_file), serve_app(app) as plain:
        session = _session(registry, ca_file, insecure=True)
        try:
            with pytest.raises(RedirectRefused, match="may not continue over plain http"):
                await session.send("GET", f"{registry}/to?u={plain}/ok")
        finally:
            await session.aclose()
    assert hits["/ok"] == 0


async def test_a_redirect_loop_stops_after_ten_redirects() -> None:
    from conftest import serve_app

    app, hits = hops_app()
    with serve_app(app) as url:
        policy = RedirectPolicy(httpx.URL(url), True, StaticResolver({}))
        session = SafeSession(policy)
        try:
            with pytest.raises(RedirectRefused, match="more than 10 redirects"):
                await session.send("GET", f"{url}/loop")
        finally:
            await session.aclose()
    assert hits["/loop"] == 11  # the first request and ten redirects


async def test_each_hop_resolves_once_and_connects_to_the_checked_address() -> None:
    """A resolver that would answer differently the second time is asked once per hop."""
    from conftest import serve_app

    app, hits = hops_app()
    with serve_app(app) as url:
        port = httpx.URL(url).port
        # A second lookup would yield 127.0.0.3, where nothing listens: pinning must not ask.
        resolver = StaticResolver({"rebind.test": ["127.0.0.1", "127.0.0.3"]})
        session = SafeSession(RedirectPolicy(httpx.URL(url), True, resolver))
        try:
            reply = await session.send("GET", f"{url}/to?u=http://rebind.test:{port}/ok")
            assert reply.status == 200
            await reply.aclose()
        finally:
            await session.aclose()
    assert resolver.lookups == ["rebind.test"]
    assert hits[f"host:rebind.test:{port}"] == 1  # the original Host header was kept


async def test_one_connection_pool_per_host_name() -> None:
    from conftest import serve_app

    app, _hits = hops_app()
    with serve_app(app) as url:
        port = httpx.URL(url).port
        resolver = StaticResolver({"a.test": "127.0.0.1", "b.test": "127.0.0.1"})
        session = SafeSession(RedirectPolicy(httpx.URL(url), True, resolver))
        try:
            for host in ("a.test", "b.test", "a.test"):
                reply = await session.send("GET", f"http://{host}:{port}/ok")
                await reply.aclose()
            assert sorted(key[1] for key in session._pools) == ["a.test", "b.test"]
        finally:
            await session.aclose()


def _session(registry: str, ca_file: str, insecure: bool) -> SafeSession:
    from registry.transfer.session import build_ssl_context

    policy = RedirectPolicy(httpx.URL(registry), insecure, StaticResolver({}))
    return SafeSession(policy, build_ssl_context(ca_file))


async def test_a_resolver_error_is_a_refusal_and_localhost_never_reaches_dns() -> None:
    from registry.transfer.safe import DnsResolver, ResolveError

    class Broken:
        async def resolve(self, host: str):
            raise ResolveError("SERVFAIL")

    policy = RedirectPolicy(httpx.URL("https://registry.example"), True, Broken())
    with pytest.raises(RedirectRefused, match=r"could not resolve cdn\.example: SERVFAIL"):
        await check_hop(httpx.URL("https://cdn.example/x"), policy, HopChain(1))
    # RFC 6761: localhost is answered locally (no query leaves the machine), and is loopback.
    addresses = await DnsResolver().resolve("localhost")
    assert {str(a) for a in addresses} == {"127.0.0.1", "::1"}
    strict = RedirectPolicy(httpx.URL("https://registry.example"), False, DnsResolver())
    with pytest.raises(RedirectRefused, match="loopback address"):
        await check_hop(httpx.URL("https://localhost:8443/x"), strict, HopChain(1))
