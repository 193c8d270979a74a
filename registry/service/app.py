"""Builds the registry service's Starlette app over a BlobStore (the filesystem by default)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT

from registry.errors import FerryError
from registry.manifests import MAX_MANIFEST_BYTES
from registry.service import oci
from registry.service.auth import token_endpoint
from registry.service.auth.audit import AuditLog
from registry.service.auth.config import AuthConfig
from registry.service.auth.gate import Gate
from registry.service.auth.limits import LimitSettings
from registry.service.auth.middleware import AccessMiddleware
from registry.service.errors import RegistryError, handle_error
from registry.service.header_limits import MESSAGE, HeaderLimitedProtocol
from registry.service.proxy.config import ProxyConfig
from registry.service.proxy.routes import Proxy, proxy_routes
from registry.service.registry import DEFAULT_UPLOAD_SESSION_TTL, Registry
from registry.service.storage.base import BlobStore
from registry.service.storage.filesystem import FilesystemStore
from registry.service.version_header import APIVersionHeader

log = logging.getLogger("ferry.registry")
PURGE_INTERVAL = 3600.0


def _cycle_has(*names: str) -> bool:
    """Whether uvicorn's request cycle still keeps its pending body the way `on_body` below
    relies on (a bytearray `body` and a `message_event`); else the stock path is used."""
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    init = RequestResponseCycle.__init__.__code__
    return all(name in init.co_names for name in names)


_KNOWN_CYCLE = _cycle_has("body", "message_event", "more_body")


class BulkHttpProtocol(HeaderLimitedProtocol):
    """uvicorn's httptools protocol with deeper write buffers (and capped request heads).

    By default a transport pauses the response at 64 KiB buffered and resumes at 16 KiB, so a
    blob GET on a connection whose kernel send buffer is still small (one that just carried a
    big upload) stalls on every refill while Python wakes up. Pausing at 2 MiB and resuming at
    512 KiB keeps bytes queued through those wake-ups; only large bodies ever fill it.
    """

    error_body = json.dumps({"errors": [{"code": "UNSUPPORTED", "message": MESSAGE}]})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        transport.set_write_buffer_limits(high=2 * 1024 * 1024, low=512 * 1024)

    def on_body(self, body: bytes) -> None:
        """Hand a request body piece to the app as the very bytes object httptools made.

        uvicorn appends every piece to a bytearray and `receive()` copies that into new bytes:
        two copies of every uploaded byte on the event loop, into fresh memory. When the app
        has taken everything before (the usual case for a blob upload, whose reader keeps up),
        the piece itself becomes the pending body, and `receive()`'s `bytes(...)` of a bytes
        object is that object: no copy. Pieces that pile up are still joined, as before.
        """
        cycle = self.cycle
        if self._refused or cycle is None or not _KNOWN_CYCLE or len(cycle.body) or \
                cycle.response_complete or (self.parser.should_upgrade()
                                            and self._should_upgrade()):
            super().on_body(body)
            return
        cycle.body = body  # type: ignore[assignment]  # receive() takes bytes(...) of it
        if len(body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.message_event.set()


def build_registry_app(
    root: Path | None = None,
    *,
    store: BlobStore | None = None,
    max_manifest_bytes: int = MAX_MANIFEST_BYTES,
    upload_session_ttl: float = DEFAULT_UPLOAD_SESSION_TTL,
    max_blob_bytes: int = 0,
    auth: AuthConfig | None = None,
    limits: LimitSettings | None = None,
    audit: AuditLog | None = None,
    proxy: ProxyConfig | None = None,
) -> Starlette:
    """The /v2 app over `store`, or over a FilesystemStore at `root`. Without `auth` it is open
    (anyone may push and delete); with it, every route checks the caller's token. With `proxy`,
    a pull-through cache of the upstreams it names (registry/service/proxy/)."""
    if store is None:
        if root is None:
            raise ValueError("build_registry_app needs a root directory or a store")
        store = FilesystemStore(root)
    registry = Registry.open(store, max_manifest_bytes, upload_session_ttl, max_blob_bytes)
    cache = Proxy(registry, proxy) if proxy is not None else None

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if isinstance(store, FilesystemStore):
            store.root.mkdir(parents=True, exist_ok=True)
        purger = asyncio.create_task(_purge_forever(registry))
        try:
            yield
        finally:
            purger.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await purger
            if cache is not None:
                await cache.aclose()
            close = getattr(store, "close", None)
            if close is not None:
                close()
            if audit is not None:
                audit.close()

    gate = Gate(auth) if auth is not None else None
    app = Starlette(
        routes=[*(proxy_routes(oci.routes) if cache is not None else oci.routes),
                *token_endpoint.routes],
        exception_handlers={RegistryError: handle_error, FerryError: handle_error,
                            ClientDisconnect: handle_error, Exception: handle_error},
        middleware=[],
        lifespan=lifespan,
    )
    app.state.registry = registry
    app.state.proxy = cache
    app.state.auth = gate
    limits = limits or LimitSettings()
    if gate is not None or limits.active or audit is not None:
        # it adds the version header too: one layer per request, as in an open registry
        app.add_middleware(AccessMiddleware, gate=gate, limits=limits,  # type: ignore[arg-type]
                           audit=audit)
    else:
        app.add_middleware(APIVersionHeader)  # type: ignore[arg-type]
    return app


async def _purge_forever(registry: Registry) -> None:
    """Drop stale upload sessions now and every PURGE_INTERVAL seconds."""
    while True:
        try:
            removed = await registry.uploads.purge_stale()
            if removed:
                log.info("purged %d stale upload sessions", len(removed))
        except Exception:
            log.exception("purging stale upload sessions failed")
        await asyncio.sleep(PURGE_INTERVAL)
