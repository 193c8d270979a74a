"""Builds the Starlette apps from the packages' route lists; the only module importing them all."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette

from ferry import __version__
from ferry.config import Settings
from registry.errors import FerryError
from registry.service.proxy.config import ProxyConfig
from registry.service.storage.base import BlobStore
from registry.store import Store
from server import chat_api, create_api, models_api, openai_api, transfer_api
from server.api_errors import handle_ferry_error
from server.scheduler import Scheduler

log = logging.getLogger("ferry.server")


def build_model_server(settings: Settings) -> Starlette:
    """The model server: Ollama's /api over the local store (`ferry serve`)."""
    store = Store(settings.models_dir)
    routes = [
        *models_api.routes,
        *transfer_api.routes,
        *create_api.routes,
        *chat_api.routes,
        *openai_api.routes,
    ]
    scheduler = Scheduler(settings, store)

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
            await scheduler.close()  # every runner killed and reaped before the server exits

    app = Starlette(
        routes=routes,
        exception_handlers={FerryError: handle_ferry_error},
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.version = __version__
    app.state.store = store
    app.state.scheduler = scheduler
    return app


def build_registry_app(settings: Settings) -> Starlette:
    """The registry service: the OCI distribution API over `settings.registry_root`."""
    from registry.service.app import build_registry_app as build

    return build(settings.registry_root, store=registry_store(settings),
                 max_manifest_bytes=settings.max_manifest_bytes,
                 upload_session_ttl=settings.upload_session_ttl,
                 max_blob_bytes=settings.registry_max_blob_bytes,
                 proxy=proxy_config(settings))


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
