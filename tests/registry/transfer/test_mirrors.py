"""Client-side mirrors: a pull tries the host's mirror first and stores the model under its name."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import free_port

from registry.names import Name
from registry.store import Store
from registry.transfer.errors import TransferError
from registry.transfer.pull import pull
from tests.registry.service.proxy_fixtures import (
    proxy_config,
    proxy_registry,
    publish,
    upstream_registry,
)

from .helpers import StaticResolver, fast_options

ORIGIN = "origin.invalid"  # resolves to nothing: only a mirror can serve it


async def test_a_model_pulled_through_a_mirror_keeps_its_host_in_its_name(
        tmp_path: Path) -> None:
    source = Store(tmp_path / "source")
    with upstream_registry(tmp_path / "upstream") as upstream:
        raw = await publish(source, f"{upstream.host}/library/tiny:latest", [70_000, 900],
                            tmp_path / "pub")
        config = proxy_config(f"http://{upstream.host}", tmp_path / "ph")
        with proxy_registry(tmp_path / "proxy", config) as (proxy, _app):
            target = Store(tmp_path / "target")
            # No --insecure: writing http:// in the mirror entry is the consent for that mirror.
            options = fast_options(tmp_path / "client", mirrors=((ORIGIN, f"http://{proxy}"),),
                                   resolver=StaticResolver({}))
            await pull(f"{ORIGIN}/library/tiny", target, options, lambda e: None)
    assert target.read_manifest(Name.parse_valid(f"{ORIGIN}/library/tiny:latest")) == raw
    manifests = target.root / "manifests"
    assert sorted(str(p.relative_to(manifests)) for p in manifests.rglob("*") if p.is_file()) \
        == [f"{ORIGIN}/library/tiny/latest"]


async def test_a_dead_mirror_falls_back_to_the_host_unless_mirrors_only(tmp_path: Path) -> None:
    source = Store(tmp_path / "source")
    dead = f"http://127.0.0.1:{free_port()}"
    with upstream_registry(tmp_path / "upstream") as upstream:
        name = f"{upstream.host}/library/tiny:latest"
        raw = await publish(source, name, [5000], tmp_path / "pub")
        target = Store(tmp_path / "target")
        mirrors = ((upstream.host, dead),)
        await pull(name, target, fast_options(tmp_path / "c", insecure=True, mirrors=mirrors),
                   lambda e: None)
        assert target.read_manifest(Name.parse_valid(name)) == raw
        assert upstream.log.count("GET", "/manifests/latest") == 1

        only = fast_options(tmp_path / "c", insecure=True, mirrors=mirrors, mirrors_only=True)
        with pytest.raises(TransferError):
            await pull(name, Store(tmp_path / "t2"), only, lambda e: None)
        assert upstream.log.count("GET", "/manifests/latest") == 1  # never asked directly


async def test_mirrors_only_refuses_a_host_without_a_mirror(tmp_path: Path) -> None:
    options = fast_options(tmp_path, mirrors=(("elsewhere.test", "http://127.0.0.1:9"),),
                           mirrors_only=True, resolver=StaticResolver({}))
    with pytest.raises(TransferError, match=r"no mirror is configured for origin\.invalid"):
        await pull(f"{ORIGIN}/library/tiny", Store(tmp_path / "t"), options, lambda e: None)


async def test_an_https_mirror_is_not_downgraded_to_http(tmp_path: Path) -> None:
    """A mirror without a scheme means https; a plain-http server behind it is not used."""
    from ferry.config import parse_mirrors

    with upstream_registry(tmp_path / "upstream") as upstream:
        (entry,) = parse_mirrors(f"{ORIGIN}={upstream.host}")
        assert entry == (ORIGIN, f"https://{upstream.host}")
        options = fast_options(tmp_path, mirrors=(entry,), mirrors_only=True,
                               resolver=StaticResolver({}))
        with pytest.raises(TransferError):
            await pull(f"{ORIGIN}/library/tiny", Store(tmp_path / "t"), options, lambda e: None)
        assert upstream.log.requests == []  # the TLS handshake failed: no request was read
