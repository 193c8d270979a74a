"""The /v2 routes of the OCI distribution spec v1.1.

Repository names may contain `/`, so one catch-all route takes every `/v2/<name>/<kind>/<arg>`
path and `_dispatch` picks the handler from the path's tail and the method. Handlers raise
RegistryError or the shared domain errors; errors.py renders them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from urllib.parse import quote

from starlette.convertors import PathConvertor, register_url_convertor
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from registry import media_types as mt
from registry.decimal_text import saturating_decimal
from registry.digests import Digest
from registry.names import parse_repository
from registry.service import oci_blobs
from registry.service.auth.gate import authorize, require_token, visible_repositories
from registry.service.blobs import list_repositories
from registry.service.errors import RegistryError
from registry.service.oci_blobs import parse_digest
from registry.service.registry import Registry
from registry.service.tags import is_tag

Handler = Callable[[Request, str, str], Awaitable[Response]]
API_VERSION = {"Docker-Distribution-API-Version": "registry/2.0"}


def _registry(request: Request) -> Registry:
    return request.app.state.registry  # type: ignore[no-any-return]


async def base(request: Request) -> Response:
    require_token(request)
    return JSONResponse({}, headers=API_VERSION)


# -- manifests ------------------------------------------------------------------------------------


def _readable_reference(reference: str) -> None:
    """A GET, HEAD or DELETE of a reference that is neither a tag nor a wire digest names
    nothing that can exist: 404 (the distribution spec's pull tests expect it, not 400)."""
    if not (is_tag(reference) or Digest.is_wire(reference)):
        raise RegistryError("MANIFEST_UNKNOWN", detail={"reference": reference[:200]})


async def _resolve(reg: Registry, repo: str, reference: str) -> Digest:
    _readable_reference(reference)
    if ":" in reference:
        return parse_digest(reference)
    digest = await reg.tags.current(repo, reference)
    if digest is None:
        raise RegistryError("MANIFEST_UNKNOWN", detail={"tag": reference})
    return digest


async def manifest_get(request: Request, repo: str, reference: str) -> Response:
    reg = _registry(request)
    stored = await reg.revisions.get(repo, await _resolve(reg, repo, reference))
    headers = {"Docker-Content-Digest": str(stored.digest), "ETag": f'"{stored.digest}"',
               "Content-Type": stored.media_type, "Content-Length": str(len(stored.raw))}
    if request.method == "HEAD":
        return Response(headers=headers)
    return Response(stored.raw, headers=headers)


async def _read_limited(request: Request, limit: int) -> bytes:
    declared = saturating_decimal(request.headers.get("content-length"))
    if declared is not None and declared > limit:
        raise RegistryError("MANIFEST_TOO_LARGE", detail={"limit": limit, "size": declared})
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RegistryError("MANIFEST_TOO_LARGE", detail={"limit": limit})
        parts.append(chunk)
    return b"".join(parts)


async def manifest_put(request: Request, repo: str, reference: str) -> Response:
    reg = _registry(request)
    tag = None
    if ":" in reference:
        wanted = parse_digest(reference)
    elif is_tag(reference):
        tag = reference
    else:
        raise RegistryError("MANIFEST_INVALID", f"invalid tag {reference[:200]!r}")
    raw = await _read_limited(request, reg.max_manifest_bytes)
    if tag is None and Digest.of(raw) != wanted:
        raise RegistryError("DIGEST_INVALID", f"the manifest's digest is {Digest.of(raw)}, "
                            f"not {wanted}")
    manifest = await reg.revisions.put(repo, raw, request.headers.get("content-type"))
    if tag is not None:
        await reg.tags.move(repo, tag, manifest.digest)
    headers = {"Location": f"/v2/{repo}/manifests/{manifest.digest}",
               "Docker-Content-Digest": str(manifest.digest), "Content-Length": "0"}
    if manifest.subject is not None:
        headers["OCI-Subject"] = str(manifest.subject.digest)
    return Response(status_code=201, headers=headers)


async def manifest_delete(request: Request, repo: str, reference: str) -> Response:
    reg = _registry(request)
    _readable_reference(reference)
    if ":" not in reference:
        if not await reg.tags.remove(repo, reference):
            raise RegistryError("MANIFEST_UNKNOWN", detail={"tag": reference})
        return Response(status_code=202, headers={"Content-Length": "0"})
    digest = parse_digest(reference)
    await reg.revisions.delete(repo, digest)
    for tag in await reg.tags.tags_of(repo, digest):
        await reg.tags.remove(repo, tag)
    return Response(status_code=202, headers={"Content-Length": "0"})


# -- listings -------------------------------------------------------------------------------------


def _page(request: Request, names: list[str], url: str) -> tuple[list[str], dict[str, str]]:
    """Apply `last` and `n`; a `Link` header points at the next page when one exists."""
    last = request.query_params.get("last")
    if last:
        names = [n for n in names if n > last]
    raw_n = request.query_params.get("n")
    if raw_n is None or raw_n == "":
        return names, {}
    limit = saturating_decimal(raw_n)
    if limit is None:
        raise RegistryError("PAGINATION_NUMBER_INVALID", detail={"n": raw_n[:100]})
    if len(names) <= limit:
        return names, {}
    page = names[:limit]
    if not page:
        return page, {}
    link = f'<{url}?n={limit}&last={quote(page[-1], safe="")}>; rel="next"'
    return page, {"Link": link}


async def tags_list(request: Request, repo: str, _: str) -> Response:
    reg = _registry(request)
    if not await reg.store.list(f"repositories/{repo}"):
        raise RegistryError("NAME_UNKNOWN", detail={"name": repo})
    tags, headers = _page(request, await reg.tags.names(repo), f"/v2/{repo}/tags/list")
    return JSONResponse({"name": repo, "tags": tags}, headers=headers)


async def catalog(request: Request) -> Response:
    repos = visible_repositories(request, await list_repositories(_registry(request).store))
    page, headers = _page(request, repos, "/v2/_catalog")
    return JSONResponse({"repositories": page}, headers={**API_VERSION, **headers})


async def referrers(request: Request, repo: str, reference: str) -> Response:
    subject = parse_digest(reference)
    found = await _registry(request).revisions.referrers(repo, subject)
    headers = {}
    wanted = request.query_params.get("artifactType")
    if wanted:
        found = [d for d in found if d.get("artifactType") == wanted]
        headers["OCI-Filters-Applied"] = "artifactType"
    found.sort(key=lambda d: d["digest"])
    body = {"schemaVersion": 2, "mediaType": mt.OCI_INDEX, "manifests": found}
    return Response(json.dumps(body).encode(), media_type=mt.OCI_INDEX, headers=headers)


# -- dispatch -------------------------------------------------------------------------------------

# What each handler needs on its repository (auth/gate.py checks it before the handler runs);
# a handler missing here needs push, so a new route is never readable by accident.
_NEEDS: dict[Handler, str] = {
    oci_blobs.blob_get: "pull", manifest_get: "pull", tags_list: "pull", referrers: "pull",
    oci_blobs.blob_delete: "delete", manifest_delete: "delete",
}

# The /v2/<path> shapes, full-matched in this order: group 1 is the repository, group 2 the
# reference (empty where there is none). The pull-through cache routes by the same patterns.
UPLOAD_START = re.compile(r"(.+)/blobs/uploads/?()", re.DOTALL)
UPLOAD = re.compile(r"(.+)/blobs/uploads/([^/]+)", re.DOTALL)
BLOB = re.compile(r"(.+)/blobs/([^/]+)", re.DOTALL)
MANIFEST = re.compile(r"(.+)/manifests/([^/]+)", re.DOTALL)
TAGS = re.compile(r"(.+)/tags/list()", re.DOTALL)
REFERRERS = re.compile(r"(.+)/referrers/([^/]+)", re.DOTALL)

_ROUTES: dict[re.Pattern[str], dict[str, Handler]] = {  # tried in this order
    UPLOAD_START: {"POST": oci_blobs.upload_start},
    UPLOAD: {"GET": oci_blobs.upload_status, "PATCH": oci_blobs.upload_patch,
             "PUT": oci_blobs.upload_finish, "DELETE": oci_blobs.upload_cancel},
    BLOB: {"GET": oci_blobs.blob_get, "HEAD": oci_blobs.blob_get,
           "DELETE": oci_blobs.blob_delete},
    MANIFEST: {"GET": manifest_get, "HEAD": manifest_get, "PUT": manifest_put,
               "DELETE": manifest_delete},
    TAGS: {"GET": tags_list},
    REFERRERS: {"GET": referrers},
}


def route_path(request: Request) -> str:
    """The path after /v2/, raw: not the route's parameter, since Starlette's `$` drops a
    trailing newline, so `manifests/v1%0a` would reach a handler as `v1`."""
    return str(request.scope["path"]).removeprefix("/v2/")


def match_route(path: str) -> tuple[re.Pattern[str], re.Match[str]] | None:
    """The first pattern `path` fully matches, with its match; None when none does."""
    for pattern in _ROUTES:
        match = pattern.fullmatch(path)
        if match is not None:
            return pattern, match
    return None


async def _dispatch(request: Request) -> Response:
    path = route_path(request)
    found = match_route(path)
    if found is None:
        raise RegistryError("NAME_UNKNOWN", f"no route for /v2/{path}")
    pattern, match = found
    handler = _ROUTES[pattern].get(request.method)
    if handler is None:
        raise RegistryError("UNSUPPORTED", f"{request.method} is not supported here")
    repo = parse_repository(match.group(1))  # a newline in it fails here
    authorize(request, repo, _NEEDS.get(handler, "push"))
    return await handler(request, repo, match.group(2))


METHODS = ["GET", "HEAD", "PUT", "POST", "PATCH", "DELETE"]


class AnyPathConvertor(PathConvertor):
    """`path`, but across newlines too, so `/v2/a%0a/...` reaches `_dispatch` (and gets its
    NAME_INVALID) instead of falling out of the router as a plain-text 404."""

    regex = r"[\s\S]*"


register_url_convertor("v2path", AnyPathConvertor())
# Every repository route: the handler is picked from the path's tail (a pull-through cache
# answers this route first, registry/service/proxy/routes.py).
CATCH_ALL = "/v2/{path:v2path}"

routes = [
    Route("/v2/", base, methods=["GET"]),
    Route("/v2", base, methods=["GET"]),
    Route("/v2/_catalog", catalog, methods=["GET"]),
    Route(CATCH_ALL, _dispatch, methods=METHODS),
]
