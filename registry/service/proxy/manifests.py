"""Manifests through the cache.

By digest: the bytes never change, so a cached one is served as is; a missing one is fetched
upstream and stored only when its sha256 is the digest asked for.

By tag: a tag confirmed upstream less than `ttl` seconds ago is served from the cache. Older, it
is revalidated: a HEAD names the upstream's digest, and only a different (or unnamed) one is
fetched. When the upstream cannot answer (unreachable, 5xx, refusing), the cached manifest is
served anyway (stale-if-error) and the response says so; a 404 upstream is a 404 here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import httpx

from registry.digests import Digest
from registry.errors import FerryError, NotFound
from registry.service.errors import RegistryError
from registry.service.proxy import keys
from registry.service.proxy.config import ProxyConfig
from registry.service.proxy.upstream import FetchedManifest, UpstreamClient
from registry.service.registry import Registry
from registry.transfer import errors as transfer_errors
from registry.transfer.retry import RetryPolicy

log = logging.getLogger("ferry.registry.proxy")
UPSTREAM_ERRORS = (FerryError, httpx.HTTPError)


@dataclass(frozen=True)
class Resolved:
    digest: Digest
    state: str  # hit, revalidated, fetched or stale (the X-Ferry-Cache header)


def upstream_failed(client: UpstreamClient, exc: BaseException) -> RegistryError:
    """The wire error for a failed upstream request; the message names the upstream, never a
    credential (the URL carries none) or a path of this server."""
    detail = str(exc) or type(exc).__name__
    return RegistryError("UPSTREAM_FAILED",
                         f"upstream {client.upstream.shown} failed: {detail}"[:1000])


class ManifestCache:
    def __init__(self, registry: Registry, config: ProxyConfig) -> None:
        self.registry = registry
        self.config = config
        # A cached copy can be served if the upstream is down, so do not make its client wait
        # through the full retry schedule first.
        self.quick_retry = replace(config.retry, attempts=min(2, config.retry.attempts))

    async def by_digest(self, client: UpstreamClient, repo: str, digest: Digest) -> Resolved:
        if await self.registry.revisions.media_type(repo, digest) is not None:
            return Resolved(digest, "hit")
        fetched = await self._fetch(client, repo, str(digest), self.config.retry)
        if fetched.digest != digest:
            raise RegistryError("UPSTREAM_FAILED", f"upstream {client.upstream.shown} sent a "
                                f"manifest whose digest is {fetched.digest}, not {digest}")
        try:
            await self._store(repo, fetched)
        except FerryError as exc:  # bytes that are no manifest: the upstream's fault
            raise upstream_failed(client, exc) from exc
        return Resolved(digest, "fetched")

    async def by_tag(self, client: UpstreamClient, repo: str, tag: str) -> Resolved:
        cached = await self.registry.tags.current(repo, tag)
        if cached is not None and await self._fresh(repo, tag, cached):
            return Resolved(cached, "hit")
        try:
            return await self._revalidate(client, repo, tag, cached)
        except RegistryError:
            raise
        except NotFound as exc:
            raise RegistryError("MANIFEST_UNKNOWN", detail={"tag": tag}) from exc
        except UPSTREAM_ERRORS as exc:
            if cached is None:
                raise upstream_failed(client, exc) from exc
            log.warning("serving %s:%s stale: upstream %s failed: %s", repo, tag,
                        client.upstream.shown, exc)
            return Resolved(cached, "stale")

    async def _fresh(self, repo: str, tag: str, cached: Digest) -> bool:
        key = keys.checked(repo, tag)
        stat = await self.registry.store.stat(key)
        if stat is None or time.time() - stat.mtime >= self.config.ttl:
            return False
        return (await self.registry.store.get(key)).decode() == str(cached)

    async def _revalidate(self, client: UpstreamClient, repo: str, tag: str,
                          cached: Digest | None) -> Resolved:
        if cached is not None:
            named = await self._upstream_digest(client, repo, tag)
            if named == cached:
                await self.registry.store.put(keys.checked(repo, tag), str(cached).encode())
                return Resolved(cached, "revalidated")
        policy = self.quick_retry if cached is not None else self.config.retry
        fetched = await self._fetch_raw(client, repo, tag, policy)
        await self._store(repo, fetched)
        if fetched.digest != cached:
            await self.registry.tags.move(repo, tag, fetched.digest)
        await self.registry.store.put(keys.checked(repo, tag), str(fetched.digest).encode())
        return Resolved(fetched.digest, "fetched")

    async def _upstream_digest(self, client: UpstreamClient, repo: str,
                               tag: str) -> Digest | None:
        """What the upstream's tag points at, by HEAD; None when the HEAD says nothing useful
        (a registry without HEAD support): then the manifest itself is fetched."""
        try:
            return await self.quick_retry.run(
                "checking the manifest", lambda _n: client.manifest_digest(repo, tag))
        except transfer_errors.UpstreamError as exc:
            if isinstance(exc, transfer_errors.TransientStatus):
                raise
            return None

    async def _fetch(self, client: UpstreamClient, repo: str, reference: str,
                     policy: RetryPolicy) -> FetchedManifest:
        try:
            return await self._fetch_raw(client, repo, reference, policy)
        except NotFound as exc:
            raise RegistryError("MANIFEST_UNKNOWN", detail={"reference": reference}) from exc
        except UPSTREAM_ERRORS as exc:
            raise upstream_failed(client, exc) from exc

    async def _fetch_raw(self, client: UpstreamClient, repo: str, reference: str,
                         policy: RetryPolicy) -> FetchedManifest:
        limit = self.registry.max_manifest_bytes
        return await policy.run(
            "fetching the manifest", lambda _n: client.manifest(repo, reference, limit))

    async def _store(self, repo: str, fetched: FetchedManifest) -> None:
        """Store the verified bytes as a revision of `repo` (its blobs come on demand)."""
        await self.registry.revisions.put(repo, fetched.raw, fetched.content_type,
                                          check_references=False)

    async def mark_used(self, repo: str, digest: Digest) -> None:
        """Note the pull for the size cap's LRU; at most one write a minute per manifest."""
        key = keys.used(repo, digest)
        stat = await self.registry.store.stat(key)
        if stat is None or time.time() - stat.mtime > 60:
            await self.registry.store.put(key, b"")
