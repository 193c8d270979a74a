"""Builds the Starlette apps from the packages' route lists; the only module importing them all."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware

from ferry import __version__
from ferry.config import Settings
from registry.errors import FerryError
from registry.service.auth.limits import LimitSettings
from registry.service.proxy.config import ProxyConfig
from registry.service.storage.base import BlobStore
from registry.store import Store
from registry.transfer.client import TransferOptions
from registry.upload_sessions import Uploads
from server import (
    chat_api,
    create_api,
    embed_api,
    models_api,
    openai_api,
    openai_completions,
    transfer_api,
    uploads_api,
)
from server.api_errors import handle_ferry_error
from server.browser_guard import BrowserGuard
from server.scheduler import Scheduler

log = logging.getLogger("ferry.server")
# An authenticated (exposed) registry's defaults; an open one on loopback has no limits.
DEFAULT_RATE_LIMIT = 100.0  # requests per second per client, bursts of ten seconds' worth
DEFAULT_MAX_UPLOADS = 32  # open upload sessions per client
DEFAULT_AUTH_MAX_BLOB_BYTES = 64 * 1024**3


def build_model_server(settings: Settings, scheduler: Scheduler | None = None,
                       transfer: TransferOptions | None = None) -> Starlette:
    """The model server: Ollama's /api over the local store (`ferry serve`).

    `scheduler` (its store is the server's) and `transfer` (what every pull and push starts
    from) default to what `settings` says; tests pass their own instead of patching modules.
    """
    runners = scheduler or Scheduler(settings, Store(settings.models_dir))
    store = runners.store
    routes = [
        *models_api.routes,
        *transfer_api.routes,
        *create_api.routes,
        *uploads_api.routes,
        *chat_api.routes,
        *openai_api.routes,
        *embed_api.routes,
        *openai_completions.routes,
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        store.root.mkdir(parents=True, exist_ok=True)
        if not settings.noprune:
            removed = await asyncio.to_thread(store.prune)
            if removed:
                log.info("pruned %d unused files from %s", len(removed), store.root)
        try:
            yield
        finally:
            await runners.close()  # every runner killed and reaped before the server exits

    app = Starlette(
        routes=routes,
        exception_handlers={FerryError: handle_ferry_error},
        lifespan=lifespan,
        middleware=[Middleware(BrowserGuard, bind_host=settings.host, origins=settings.origins,
                               allowed_hosts=settings.allowed_hosts)],
    )
    app.state.settings = settings
    app.state.version = __version__
    app.state.store = store
    app.state.uploads = Uploads(store.blobs_dir, settings.upload_stall_timeout)
    app.state.scheduler = runners
    app.state.transfer_options = transfer or transfer_api.transfer_options(settings)
    return app


def build_registry_app(settings: Settings) -> Starlette:
    """The registry service: the OCI distribution API over `settings.registry_root`."""
    from registry.service.app import build_registry_app as build
    from registry.service.auth.audit import AuditLog
    from registry.service.auth.config import load_auth_config

    auth = load_auth_config(Path(settings.registry_auth)) if settings.registry_auth else None
    on = auth is not None
    audit_target = settings.registry_audit_log or ("-" if on else "")
    max_blob = settings.registry_max_blob_bytes or (DEFAULT_AUTH_MAX_BLOB_BYTES if on else 0)
    return build(settings.registry_root, store=registry_store(settings),
                 max_manifest_bytes=settings.max_manifest_bytes,
                 upload_session_ttl=settings.upload_session_ttl,
                 max_blob_bytes=max_blob, auth=auth, limits=_registry_limits(settings, on),
                 audit=AuditLog(audit_target) if audit_target else None,
                 proxy=proxy_config(settings))


def _registry_limits(settings: Settings, authenticated: bool) -> LimitSettings:
    """The configured limits; unset ones default on for an authenticated registry only."""
    rate, uploads = settings.registry_rate_limit, settings.registry_max_uploads
    return LimitSettings(
        rate=rate if rate >= 0 else (DEFAULT_RATE_LIMIT if authenticated else 0.0),
        burst=settings.registry_rate_burst,
        max_uploads=uploads if uploads >= 0 else (DEFAULT_MAX_UPLOADS if authenticated else 0),
        upload_ttl=settings.upload_session_ttl)


def proxy_config(settings: Settings) -> ProxyConfig | None:
    """The pull-through cache's configuration, or None when the registry mirrors nothing."""
    from registry.service.proxy.config import ProxyConfig, parse_upstreams

    if not settings.registry_proxy:
        return None
    return ProxyConfig(parse_upstreams(settings.registry_proxy),
                       local=settings.registry_proxy_local, ttl=settings.registry_proxy_ttl,
                       max_bytes=settings.registry_proxy_max_bytes, home=settings.home,
                       ca_file=settings.ssl_cert_file)


def registry_store(settings: Settings) -> BlobStore:
    """The registry's storage: an S3 bucket when one is configured, else `registry_root`.
    boto3 finds credentials, region and AWS_ENDPOINT_URL the way the AWS CLI does."""
    from registry.service.storage.filesystem import FilesystemStore

    if not settings.registry_s3_bucket:
        return FilesystemStore(settings.registry_root)
    import boto3
    from botocore.config import Config

    from registry.service.storage.s3 import S3Store

    client = boto3.client("s3", config=Config(max_pool_connections=32))
    return S3Store(client, settings.registry_s3_bucket, settings.registry_s3_prefix,
                   redirect_ttl=settings.registry_s3_redirect_ttl)
