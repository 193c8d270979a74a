"""The OCI release store is the transfer client's: it answers a standard Bearer challenge
(`scope="repository:x:pull,push"`, which the old hand-rolled parser split on `,` and crashed
on) and never sends its token off the registry's origin, upload `Location`s included."""

from __future__ import annotations

import hashlib

import httpx
import pytest
from conftest import serve_app
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from registry.service.app import build_registry_app
from workflows.release.job import PublishOptions, publish
from workflows.release.oci import OCIReleaseStore

from .s3_helpers import make_dist, payloads

TOKEN = "Bearer t0ken"
REPO = "ferry/releases"


def token_gate(upstream: str, seen: list[tuple[str, str | None]],
               upload_host: str | None = None) -> Starlette:
    """A registry front that wants a Bearer token (from its own /token) on every /v2 call."""

    async def token(request: Request) -> Response:
        assert request.query_params["scope"] == f"repository:{REPO}:pull,push"
        return JSONResponse({"token": TOKEN.split()[1]})

    async def v2(request: Request) -> Response:
        seen.append((f"{request.method} {request.url.path}", request.headers.get("authorization")))
        if request.headers.get("authorization") != TOKEN:
            realm = f"http://{request.url.netloc}/token"
            return Response(status_code=401, headers={"WWW-Authenticate": (
                f'Bearer realm="{realm}",service="registry",'
                f'scope="repository:{REPO}:pull,push"')})
        async with httpx.AsyncClient(base_url=upstream) as client:
            answer = await client.request(request.method, request.url.path,
                                          params=request.query_params, content=await request.body(),
                                          headers={"content-type":
                                                   request.headers.get("content-type", "")})
        headers = {k: v for k, v in answer.headers.items()
                   if k.lower() in ("location", "docker-content-digest", "content-type")}
        if upload_host and request.method == "POST" and "location" in headers:
            headers["location"] = f"http://{upload_host}{headers['location']}"
        return Response(answer.content, answer.status_code, headers=headers)

    methods = ["GET", "HEAD", "PUT", "POST", "PATCH", "DELETE"]
    return Starlette(routes=[Route("/token", token),
                             Route("/v2/{path:path}", v2, methods=methods)])


@pytest.fixture
def registry(tmp_path):
    with serve_app(build_registry_app(tmp_path / "registry")) as url:
        yield url


def test_publish_answers_a_bearer_challenge_with_a_comma_in_its_scope(registry, tmp_path,
                                                                       sleeps):
    seen: list[tuple[str, str | None]] = []
    files = payloads("auth", 2)
    with serve_app(token_gate(registry, seen)) as gate:
        store = OCIReleaseStore(gate.removeprefix("http://"), REPO, insecure=True, settle=0.01,
                                home=tmp_path / "home")
        report = publish(store, "v1.0.0", make_dist(tmp_path / "d", files),
                         PublishOptions(retry_delays=(0.01,), parallel=2), sleep=sleeps)
        store.close()
    assert report.ok, report.problems
    assert any(auth == TOKEN for _, auth in seen)
    manifest = httpx.get(f"{registry}/v2/{REPO}/manifests/v1.0.0",
                         headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}).json()
    assert len(manifest["layers"]) == 3  # two assets and the checksum file


def test_the_token_never_follows_an_upload_location_to_another_host(registry, tmp_path):
    seen: list[tuple[str, str | None]] = []
    elsewhere: list[str | None] = []

    async def catch(request: Request) -> Response:
        elsewhere.append(request.headers.get("authorization"))
        return Response(status_code=201)

    other = Starlette(routes=[Route("/{path:path}", catch, methods=["PUT", "POST"])])
    with serve_app(other) as stranger, serve_app(
            token_gate(registry, seen, upload_host=stranger.removeprefix("http://"))) as gate:
        store = OCIReleaseStore(gate.removeprefix("http://"), REPO, insecure=True,
                                home=tmp_path / "home")
        data = b"asset bytes"
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        store._push_blob(digest, len(data), [data], lambda sent: None)
        store.close()
    assert elsewhere == [None]  # the upload went there, the token did not
    assert ("POST /v2/ferry/releases/blobs/uploads/", TOKEN) in seen
