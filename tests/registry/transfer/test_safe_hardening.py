"""Transfer safety gaps closed by issue 19: ferry's own table of refused ranges, numeric host
forms, the registry pinned by origin for the whole transfer, userinfo stripped off redirects."""

from __future__ import annotations

import ipaddress

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from registry.transfer.address_ranges import V4_RANGES, V6_RANGES, refused_range
from registry.transfer.errors import RedirectRefused
from registry.transfer.safe import HopChain, RedirectPolicy, check_hop, legacy_numeric_ipv4
from registry.transfer.session import SafeSession

from .helpers import StaticResolver


@pytest.mark.parametrize("address", [
    "192.0.0.8", "192.0.0.170", "192.0.2.1", "198.51.100.7", "203.0.113.9", "240.0.0.1",
    "255.255.255.255", "0.1.2.3", "100.127.0.1", "192.88.99.1", "3fff::1", "2001:db8::1",
    "64:ff9b:1::1", "100::1", "5f00::1", "2001::1", "::ffff:192.0.0.8", "64:ff9b::7f00:1",
    "2002:c000:0208::1", "::127.0.0.1", "fc00::1",
])
def test_special_purpose_addresses_are_refused_on_every_python(address: str) -> None:
    assert refused_range(ipaddress.ip_address(address)) is not None


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111",
                                     "64:ff9b::808:808", "2a00:1450:4001::1"])
def test_public_addresses_pass(address: str) -> None:
    assert refused_range(ipaddress.ip_address(address)) is None


def test_the_table_is_ferrys_own_not_the_interpreters() -> None:
    """Every range is listed by network here, so no `ipaddress` flag decides anything."""
    assert len(V4_RANGES) >= 18 and len(V6_RANGES) >= 14
    assert all(isinstance(n, ipaddress.IPv4Network) for n, _ in V4_RANGES)


@pytest.mark.parametrize("host, meaning", [
    ("2130706433", "127.0.0.1"), ("0x7f.1", "127.0.0.1"), ("127.1", "127.0.0.1"),
    ("0177.0.0.1", "127.0.0.1"), ("0x7f000001", "127.0.0.1"), ("10.1", "10.0.0.1"),
    ("134744072", "8.8.8.8"),
])
async def test_numeric_host_forms_are_refused_explicitly(host: str, meaning: str) -> None:
    assert str(legacy_numeric_ipv4(host)) == meaning
    if host.count(".") == 3:  # httpx itself refuses a four-part form that is no dotted quad
        with pytest.raises(httpx.InvalidURL):
            httpx.URL(f"https://{host}/v2/")
        return
    for insecure in (False, True):
        policy = RedirectPolicy(httpx.URL("https://registry.test"), insecure, StaticResolver({}))
        with pytest.raises(RedirectRefused, match="numeric host"):
            await check_hop(httpx.URL(f"https://{host}/v2/"), policy, HopChain(redirects=1))
        assert policy.resolver.lookups == []  # type: ignore[attr-defined]
    assert legacy_numeric_ipv4("127.0.0.1") is None and legacy_numeric_ipv4("a1.test") is None


async def test_the_registry_is_pinned_at_its_first_hop() -> None:
    """A name that resolves to a private address on a later lookup is not followed there."""
    resolver = StaticResolver({"registry.test": ["8.8.8.8", "10.0.0.1"]})
    policy = RedirectPolicy(httpx.URL("https://registry.test"), False, resolver)
    first = await check_hop(httpx.URL("https://registry.test/v2/"), policy, HopChain())
    again = await check_hop(httpx.URL("https://registry.test/v2/x"), policy, HopChain())
    assert str(first.address) == str(again.address) == "8.8.8.8"
    assert resolver.lookups == ["registry.test"]


async def test_the_registry_exemption_is_by_origin_not_by_name() -> None:
    resolver = StaticResolver({"registry.test": "10.0.0.7"})
    policy = RedirectPolicy(httpx.URL("https://registry.test"), False, resolver)
    hop = await check_hop(httpx.URL("https://registry.test/v2/"), policy, HopChain())
    assert str(hop.address) == "10.0.0.7"  # the registry the user named may be private
    for other in ("https://registry.test:8443/x", "http://registry.test/x"):
        with pytest.raises(RedirectRefused):
            await check_hop(httpx.URL(other), policy, HopChain(redirects=1, used_https=True))


async def test_userinfo_in_a_redirect_location_is_never_sent() -> None:
    from conftest import serve_app

    seen: list[str | None] = []

    async def to(request: Request) -> Response:
        return RedirectResponse(request.query_params["u"], status_code=307)

    async def final(request: Request) -> Response:
        seen.append(request.headers.get("authorization"))
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/to", to), Route("/final", final)])
    with serve_app(app) as url:
        port = httpx.URL(url).port
        session = SafeSession(RedirectPolicy(httpx.URL(url), True, StaticResolver({})))
        try:
            target = f"http://user:secret@127.0.0.1:{port}/final"
            reply = await session.send("GET", f"{url}/to?u={target}")
            assert reply.status == 200 and "secret" not in str(reply.url)
            await reply.aclose()
        finally:
            await session.aclose()
    assert seen == [None]
