"""Fixtures for the transfer tests: two local stores and ferry's registry service on loopback."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import serve_app

from registry.service.app import build_registry_app
from registry.store import Store

from .fakes import BlobCDN, RedirectBlobs, RequestLog, TokenAuth


@pytest.fixture
def source(tmp_path: Path) -> Store:
    """The publisher's store: models are made here and pushed from here."""
    return Store(tmp_path / "source")


@pytest.fixture
def target(tmp_path: Path) -> Store:
    """The client's store: models are pulled into it."""
    return Store(tmp_path / "target")


@contextlib.contextmanager
def registry_with_cdn(tmp_path: Path, source: Store, cdn_host: str = "127.0.0.1",
                      token_auth: bool = False) -> Iterator[tuple[str, BlobCDN, RequestLog]]:
    """ferry's registry (logged) that redirects blob GETs to a CDN serving `source`'s blobs.

    Yields (registry host:port, cdn, request log). The CDN is reached as `cdn_host`. With
    `token_auth` the registry demands a Bearer token from its own `/token` realm.
    """
    cdn = BlobCDN(source)
    with serve_app(cdn.app) as cdn_url:
        cdn_base = cdn_url.replace("127.0.0.1", cdn_host)
        app = RedirectBlobs(build_registry_app(tmp_path / "registry"), cdn_base)
        auth = TokenAuth(app, realm="") if token_auth else None
        log = RequestLog(auth or app)
        with serve_app(log) as url:
            if auth is not None:
                auth.realm = f"{url}/token"
            yield url.removeprefix("http://"), cdn, log


@pytest.fixture
def registry_host(tmp_path: Path) -> Iterator[str]:
    """ferry's registry service, plain: yields `127.0.0.1:<port>`."""
    with serve_app(build_registry_app(tmp_path / "plain-registry")) as url:
        yield url.removeprefix("http://")
