"""The /v2 routes of a pull-through cache, in front of oci.py's.

A request for a repository that mirrors an upstream is looked at here first: a manifest or blob
the cache lacks is fetched upstream (manifests.py, blob_fetch.py), then, like every hit, served
by oci.py's own handlers. A blob fetched now is streamed from the fetch instead. Writes to a
mirrored repository are refused with DENIED; local repositories go straight to oci.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from registry.digests import Digest
from registry.names import parse_repository
from registry.service import oci, oci_blobs
from registry.service.auth.gate import authorize
from registry.service.errors import RegistryError
from registry.service.oci_blobs import parse_digest
from registry.service.proxy.blob_fetch import BlobFetch, BlobFetches, Subscription
from registry.service.proxy.config import ProxyConfig
from registry.service.proxy.eviction import Eviction
from registry.service.proxy.manifests import (
    UPSTREAM_ERRORS,
    ManifestCache,
    Resolved,
    upstream_failed,
)
from registry.service.proxy.upstream import UpstreamClient
from registry.service.registry import Registry
from registry.service.tags import is_tag
from registry.transfer.errors import RegistryNotFound
from registry.transfer.session import Piece

CATCH_ALL = oci.CATCH_ALL
STALE_WARNING = '110 ferry "Response is Stale"'
_READS = ("GET", "HEAD")
_KINDS = {oci.BLOB: "blobs", oci.MANIFEST: "manifests"}  # other routes: oci.py's handler


class Proxy:
    """The cache of one registry app: upstream clients, manifests, running fetches, the cap."""

    def __init__(self, registry: Registry, config: ProxyConfig) -> None:
        self.registry = registry
        self.config = config
        self.clients = {u.prefix: UpstreamClient(u, config) for u in config.upstreams}
        self.manifests = ManifestCache(registry, config)
        self.eviction = Eviction(registry, config)
        self.fetches = BlobFetches(registry, config.retry, self.eviction.soon)

    def client_for(self, repo: str) -> UpstreamClient | None:
        upstream = self.config.upstream_for(repo)
        return None if upstream is None else self.clients[upstream.prefix]

    async def aclose(self) -> None:
        await self.fetches.aclose()
        await self.eviction.aclose()
        for client in self.clients.values():
            await client.aclose()


def proxy_routes(routes: Sequence[BaseRoute]) -> list[BaseRoute]:
    """`routes` (oci.routes) with the catch-all /v2 route answered here first."""
    fallback = next(r for r in routes if isinstance(r, Route) and r.path == CATCH_ALL).endpoint

    async def dispatch(request: Request) -> Response:
        proxy: Proxy = request.app.state.proxy
        repo, kind, argument = _target(oci.route_path(request))
        client = proxy.client_for(repo) if repo else None
        if client is None:
            return await fallback(request)  # type: ignore[no-any-return]
        if request.method not in _READS:
            raise RegistryError("DENIED", f"{repo} is read-only here: this namespace mirrors "
                                f"{client.upstream.shown}")
        authorize(request, repo, "pull")  # before anything is fetched upstream or served
        if kind == "manifests":
            return await _manifest(request, proxy, client, repo, argument)
        if kind == "blobs":
            return await _blob(request, proxy, client, repo, argument)
        return await fallback(request)  # type: ignore[no-any-return]

    kept = [r for r in routes if not (isinstance(r, Route) and r.path == CATCH_ALL)]
    return [*kept, Route(CATCH_ALL, dispatch, methods=oci.METHODS)]


def _target(path: str) -> tuple[str, str, str]:
    """(repository, kind, reference) of a /v2 path, by oci.py's own patterns; the kind is ""
    for routes answered by oci.py's handlers, and all three are "" when the path names no
    repository."""
    found = oci.match_route(path)
    if found is None:
        return "", "", ""
    pattern, match = found
    return parse_repository(match.group(1)), _KINDS.get(pattern, ""), match.group(2)


# -- manifests ------------------------------------------------------------------------------------


async def _manifest(request: Request, proxy: Proxy, client: UpstreamClient, repo: str,
                    reference: str) -> Response:
    resolved: Resolved
    if ":" in reference:
        resolved = await proxy.manifests.by_digest(client, repo, parse_digest(reference))
    elif is_tag(reference):
        resolved = await proxy.manifests.by_tag(client, repo, reference)
    else:
        raise RegistryError("MANIFEST_INVALID", f"invalid tag {reference!r}")
    response = await oci.manifest_get(request, repo, str(resolved.digest))
    response.headers["X-Ferry-Cache"] = resolved.state
    if resolved.state == "stale":
        response.headers["Warning"] = STALE_WARNING
    if request.method == "GET":
        await proxy.manifests.mark_used(repo, resolved.digest)
    return response


# -- blobs ----------------------------------------------------------------------------------------


async def _blob(request: Request, proxy: Proxy, client: UpstreamClient, repo: str,
                reference: str) -> Response:
    digest = parse_digest(reference)
    blobs = proxy.registry.blobs
    state = "hit"
    stat = await blobs.stat(repo, digest)
    if stat is None:
        state = "fetched"
        stat = await blobs.stat_anywhere(digest)
        if stat is not None:
            # Stored for another repository, perhaps a local one: link it only once the
            # upstream confirms it serves this digest here, so no private blob leaks.
            await _upstream_size(client, repo, digest)
            await blobs.link(repo, digest)
        elif request.method == "HEAD":
            return await _head_upstream(client, repo, digest)
        else:
            streamed = await _stream_miss(request, proxy, client, repo, digest)
            if streamed is not None:
                return streamed
            stat = await blobs.stat(repo, digest)  # committed and linked meanwhile
            if stat is None:  # evicted at once: the next request fetches again
                raise RegistryError("BLOB_UNKNOWN", detail={"digest": str(digest)})
    response = await oci_blobs.blob_response(request, proxy.registry, digest, stat)
    response.headers["X-Ferry-Cache"] = state
    return response


async def _upstream_size(client: UpstreamClient, repo: str, digest: Digest) -> int | None:
    """The blob's size as the upstream reports it for `repo`; BLOB_UNKNOWN when it has none."""
    try:
        return await client.config.retry.run("checking the blob",
                                             lambda _n: client.blob_size(repo, digest))
    except RegistryNotFound as exc:
        raise RegistryError("BLOB_UNKNOWN", detail={"digest": str(digest)}) from exc
    except UPSTREAM_ERRORS as exc:
        raise upstream_failed(client, exc) from exc


async def _head_upstream(client: UpstreamClient, repo: str, digest: Digest) -> Response:
    """A HEAD for a blob the cache lacks: ask upstream, fetch nothing."""
    size = await _upstream_size(client, repo, digest)
    headers = {"Docker-Content-Digest": str(digest), "Content-Type": "application/octet-stream",
               "X-Ferry-Cache": "upstream"}
    if size is not None:
        headers["Content-Length"] = str(size)
    return Response(headers=headers)


async def _stream_miss(request: Request, proxy: Proxy, client: UpstreamClient, repo: str,
                       digest: Digest) -> Response | None:
    """Serve the blob from its (new or running) fetch; None: it is in the cache by now."""
    fetch = proxy.fetches.start(client, repo, digest)
    await fetch.ready.wait()
    if fetch.error is not None:
        raise fetch.error
    start, end, status = 0, None, 200
    wanted = request.headers.get("range")
    subscription = None
    if wanted and fetch.size is not None:
        start, end = oci_blobs._satisfiable_range(wanted, fetch.size)
        status = 206
    if not wanted or fetch.size is not None:
        subscription = fetch.subscribe(start, end)
    if subscription is None:  # its first bytes went by already: wait for the cache
        await fetch.done.wait()
        if fetch.error is not None:
            raise fetch.error
        await proxy.registry.blobs.link(repo, digest)
        return None
    try:
        first = await subscription.next()
    except BaseException:
        subscription.close()
        raise
    headers = _blob_headers(fetch, start, end, status)
    return StreamingResponse(_relay(first, subscription, proxy, repo, fetch),
                             status_code=status, headers=headers)


def _blob_headers(fetch: BlobFetch, start: int, end: int | None, status: int) -> dict[str, str]:
    headers = {"Docker-Content-Digest": str(fetch.digest), "ETag": f'"{fetch.digest}"',
               "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream",
               "X-Ferry-Cache": "fetched"}
    if fetch.size is not None:
        last = fetch.size - 1 if end is None else end
        headers["Content-Length"] = str(max(last - start + 1, 0))
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{last}/{fetch.size}"
    return headers


async def _relay(first: Piece | None, subscription: Subscription, proxy: Proxy, repo: str,
                 fetch: BlobFetch) -> AsyncIterator[Piece]:
    try:
        piece = first
        while piece is not None:
            yield piece
            piece = await subscription.next()
    finally:
        subscription.close()
    if fetch.done.is_set() and fetch.error is None:
        await proxy.registry.blobs.link(repo, fetch.digest)
