"""Push against ferry's registry service: chunk failures recovered from the session's offset,
cross-repository mounts, present blobs skipped, the manifest byte-exact."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import serve_app

from registry.errors import NotFound
from registry.manifests import parse_manifest
from registry.names import Name
from registry.service.app import build_registry_app
from registry.store import Store
from registry.transfer.errors import RetriesExhausted
from registry.transfer.pull import pull
from registry.transfer.push import push
from registry.transfer.retry import RetryPolicy

from .fakes import FailEverySecondPatch, RequestLog
from .helpers import fast_options, make_model

KiB = 1024


async def test_push_completes_when_every_second_chunk_fails(
        tmp_path: Path, source: Store, target: Store) -> None:
    flaky = FailEverySecondPatch(build_registry_app(tmp_path / "registry"))
    with serve_app(flaky) as url:
        name = f"{url.removeprefix('http://')}/ns/model:v1"
        raw = make_model(source, name, [640 * KiB + 3])
        events: list[dict] = []
        await push(name, source, fast_options(tmp_path / "p", insecure=True), events.append)
        await pull(name, target, fast_options(tmp_path / "c", insecure=True), lambda e: None)
    assert flaky.failed >= 4
    assert flaky.status_checks == flaky.failed  # each failure asked where the session was
    # After a failure the next chunk starts mid-chunk: where the registry really got to.
    starts = [int(r.split("-")[0]) for r in flaky.ranges]
    assert any(start % (64 * KiB) for start in starts)
    assert target.read_manifest(Name.parse(name)) == raw
    for desc in parse_manifest(raw).references():
        assert target.read_blob(desc.digest) == source.read_blob(desc.digest)
    statuses = [e["status"] for e in events]
    assert statuses[0] == "retrieving manifest"
    assert statuses[-2:] == ["pushing manifest", "success"]
    assert any(s.startswith("pushing ") and s != "pushing manifest" for s in statuses)


async def test_push_mounts_blobs_the_registry_has_in_another_repository(
        tmp_path: Path, source: Store) -> None:
    log = RequestLog(build_registry_app(tmp_path / "registry"))
    with serve_app(log) as url:
        host = url.removeprefix("http://")
        make_model(source, f"{host}/ns/first:v1", [100 * KiB, 2 * KiB])
        options = fast_options(tmp_path / "p", insecure=True)
        await push(f"{host}/ns/first:v1", source, options, lambda e: None)
        source.copy_model(Name.parse(f"{host}/ns/first:v1"), Name.parse(f"{host}/ns/second:v1"))
        uploads = log.uploads()
        assert log.count("PATCH") and uploads > log.count("PATCH")  # chunked and whole blobs
        await push(f"{host}/ns/second:v1", source, options, lambda e: None)
        mounts = [q for m, _p, q in log.requests if m == "POST" and "mount=" in q]
        assert log.uploads() == uploads  # no byte uploaded again
        assert len(mounts) == 3 and all("from=ns%2Ffirst" in q for q in mounts)
        # Pushing again finds every blob with HEAD and starts no upload at all.
        posts = log.count("POST")
        await push(f"{host}/ns/second:v1", source, options, lambda e: None)
        assert log.count("POST") == posts


async def test_push_sends_the_manifest_bytes_unchanged(tmp_path: Path, source: Store,
                                                       registry_host: str) -> None:
    name = f"{registry_host}/ns/model:v1"
    raw = make_model(source, name, [10 * KiB])
    # Reformat the stored manifest (same content, different bytes): the push must keep them.
    spaced = raw.replace(b",", b", ")
    source.write_manifest(Name.parse(name), spaced)
    await push(name, source, fast_options(tmp_path, insecure=True), lambda e: None)
    import httpx

    async with httpx.AsyncClient() as http:
        response = await http.get(f"http://{registry_host}/v2/ns/model/manifests/v1",
                                  headers={"Accept": parse_manifest(raw).media_type})
    assert response.content == spaced


async def test_push_of_a_missing_model_fails_before_any_request(tmp_path: Path,
                                                               source: Store) -> None:
    with pytest.raises(NotFound):
        await push("127.0.0.1:9/ns/none:v1", source, fast_options(tmp_path, insecure=True),
                   lambda e: None)


async def test_a_registry_that_keeps_failing_gives_up_naming_the_last_cause(
        tmp_path: Path, source: Store) -> None:
    from starlette.responses import PlainTextResponse

    hits = 0

    async def broken(request) -> PlainTextResponse:
        nonlocal hits
        hits += 1
        return PlainTextResponse("storage on fire", status_code=503)

    with serve_app(_catch_all(broken)) as url:
        name = f"{url.removeprefix('http://')}/ns/model:v1"
        make_model(source, name, [KiB])
        options = fast_options(tmp_path, insecure=True, max_streams=1,
                               retry=RetryPolicy(attempts=3, initial=0.001, cap=0.01))
        with pytest.raises(RetriesExhausted, match="after 3 attempts: 503: Service Unavailable"):
            await push(name, source, options, lambda e: None)
    assert hits >= 3


async def test_a_client_error_is_not_retried(tmp_path: Path, source: Store) -> None:
    from starlette.responses import JSONResponse

    hits = 0

    async def forbidden(request) -> JSONResponse:
        nonlocal hits
        hits += 1
        return JSONResponse({"errors": [{"code": "DENIED", "message": "no"}]}, status_code=403)

    with serve_app(_catch_all(forbidden)) as url:
        name = f"{url.removeprefix('http://')}/ns/model:v1"
        make_model(source, name, [KiB])
        from registry.transfer.errors import UpstreamError

        with pytest.raises(UpstreamError, match="403"):
            await push(name, source, fast_options(tmp_path, insecure=True, max_streams=1),
                       lambda e: None)
    await asyncio.sleep(0)
    assert hits <= 2  # at most the two blobs' HEADs that were in flight, once each


def _catch_all(handler):
    from starlette.applications import Starlette
    from starlette.routing import Route

    methods = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"]
    return Starlette(routes=[Route("/{path:path}", handler, methods=methods)])


async def test_push_mounts_layers_that_name_their_source_with_from(
        tmp_path: Path, source: Store, target: Store) -> None:
    """`from` on a layer is enough: this store has never seen the source repository."""
    import dataclasses

    from registry.manifests import build_manifest

    log = RequestLog(build_registry_app(tmp_path / "registry"))
    with serve_app(log) as url:
        host = url.removeprefix("http://")
        first = f"{host}/ns/first:v1"
        raw = make_model(source, first, [50 * KiB])
        await push(first, source, fast_options(tmp_path / "p", insecure=True), lambda e: None)
        manifest = parse_manifest(raw)
        for desc in manifest.references():
            target.blob_writer(desc.digest).write_all(source.read_blob(desc.digest))
        layers = [dataclasses.replace(d, from_=first) for d in manifest.layers]
        third = f"{host}/ns/third:v1"
        assert manifest.config is not None
        target.write_manifest(Name.parse(third), build_manifest(manifest.config, layers))
        uploads = log.uploads()
        await push(third, target, fast_options(tmp_path / "q", insecure=True), lambda e: None)
    mounts = [q for m, _p, q in log.requests if m == "POST" and "mount=" in q]
    assert len(mounts) == 1 and "from=ns%2Ffirst" in mounts[0]  # the layer; the config uploads
    assert log.uploads() == uploads + 1  # only the config (no `from`) was uploaded


async def test_small_blobs_go_up_whole_over_kept_connections(
        tmp_path: Path, source: Store, target: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each small blob is one HEAD and one POST with its bytes (no session, no PATCH), on
    connections that go back to the pool: a few connects for the whole push, not one per
    request; the blobs arrive byte-identical."""
    from registry.transfer.plain_socket import SocketBackend

    connects = 0
    real = SocketBackend.connect_tcp

    async def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal connects
        connects += 1
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(SocketBackend, "connect_tcp", counted)
    log = RequestLog(build_registry_app(tmp_path / "registry"))
    with serve_app(log) as url:
        name = f"{url.removeprefix('http://')}/ns/small:v1"
        raw = make_model(source, name, [KiB * (i + 1) for i in range(8)] + [0])
        options = fast_options(tmp_path / "p", insecure=True, max_streams=2)
        await push(name, source, options, lambda e: None)
        pushed = connects
        await pull(name, target, fast_options(tmp_path / "c", insecure=True), lambda e: None)
    blobs = parse_manifest(raw).references()
    assert log.count("PATCH") == 0 and log.uploads() == len(blobs)
    assert pushed <= 3  # two streams, and a spare for the manifest at most
    for desc in blobs:
        assert target.read_blob(desc.digest) == source.read_blob(desc.digest)


async def test_a_whole_blob_answered_with_202_takes_the_session_flow(
        tmp_path: Path, source: Store, target: Store) -> None:
    """A registry that does not take a whole blob in a POST opens a session (202): the client
    sends the bytes on it as to any registry, PATCH then `PUT ?digest=`."""
    from starlette.types import Receive, Scope, Send

    app = build_registry_app(tmp_path / "registry")

    async def no_monolithic_post(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            query = scope.get("query_string", b"").decode()
            scope = {**scope, "query_string": "&".join(
                p for p in query.split("&") if not p.startswith("digest=")).encode()}
        await app(scope, receive, send)

    log = RequestLog(no_monolithic_post)
    with serve_app(log) as url:
        name = f"{url.removeprefix('http://')}/ns/old:v1"
        raw = make_model(source, name, [3 * KiB])
        await push(name, source, fast_options(tmp_path / "p", insecure=True), lambda e: None)
        await pull(name, target, fast_options(tmp_path / "c", insecure=True), lambda e: None)
    blobs = len(parse_manifest(raw).references())
    assert log.count("PATCH") == blobs and log.count("PUT", "/blobs/uploads/") == blobs
    assert target.read_manifest(Name.parse(name)) == raw


@pytest.mark.parametrize("status", [400, 405, 415])
async def test_a_registry_refusing_a_post_with_a_body_gets_the_session_flow(
        tmp_path: Path, source: Store, target: Store, status: int) -> None:
    """A registry that refuses a POST carrying bytes (no single-POST pushes) is asked again
    without them, and the blob goes up through a session; the model arrives whole."""
    from starlette.responses import JSONResponse
    from starlette.types import Receive, Scope, Send

    app = build_registry_app(tmp_path / "registry")

    async def refuse_bodies(scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope.get("headers") or [])
        if scope["type"] == "http" and scope["method"] == "POST" and \
                headers.get(b"content-length", b"0") != b"0":
            body = {"errors": [{"code": "UNSUPPORTED", "message": "no single POST"}]}
            await JSONResponse(body, status_code=status)(scope, receive, send)
            return
        await app(scope, receive, send)

    log = RequestLog(refuse_bodies)
    with serve_app(log) as url:
        name = f"{url.removeprefix('http://')}/ns/strict:v1"
        raw = make_model(source, name, [3 * KiB, 5 * KiB])
        await push(name, source, fast_options(tmp_path / "p", insecure=True), lambda e: None)
        await pull(name, target, fast_options(tmp_path / "c", insecure=True), lambda e: None)
    blobs = parse_manifest(raw).references()
    assert log.count("PATCH") == len(blobs)
    for desc in blobs:
        assert target.read_blob(desc.digest) == source.read_blob(desc.digest)
