"""Manifest, tag, referrer and catalog endpoints against a real server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from registry import media_types as mt
from registry.service.storage import FilesystemStore
from registry.service.tags import TagStore

from .conftest import descriptor, push_blob, push_image, sha

REPO = "library/llama3"


async def test_put_get_head_by_tag_and_digest_keep_exact_bytes(client: httpx.AsyncClient) -> None:
    raw, digest = await push_image(client, REPO, "v1")
    for ref in ("v1", digest):
        r = await client.get(f"/v2/{REPO}/manifests/{ref}")
        assert r.status_code == 200
        assert r.content == raw
        assert r.headers["Content-Type"] == mt.OCI_MANIFEST
        assert r.headers["Docker-Content-Digest"] == digest
        r = await client.head(f"/v2/{REPO}/manifests/{ref}")
        assert r.status_code == 200 and r.headers["Content-Length"] == str(len(raw))


async def test_put_answers_location_and_digest(client: httpx.AsyncClient) -> None:
    config = await push_blob(client, REPO, b"{}")
    body = json.dumps({"schemaVersion": 2, "mediaType": mt.DOCKER_MANIFEST,
                       "config": {"mediaType": mt.DOCKER_CONFIG, "digest": config, "size": 2},
                       "layers": []}).encode()
    r = await client.put(f"/v2/{REPO}/manifests/latest", content=body,
                         headers={"Content-Type": mt.DOCKER_MANIFEST})
    assert r.status_code == 201
    assert r.headers["Docker-Content-Digest"] == sha(body)
    assert r.headers["Location"] == f"/v2/{REPO}/manifests/{sha(body)}"


async def test_ollama_model_manifest_round_trips_byte_identical(
    client: httpx.AsyncClient,
) -> None:
    config = json.dumps({"model_format": "safetensors", "model_family": "llama"}).encode()
    tensors = [b"\x00\x01" * 1000, b"\x02\x03" * 2000]
    template = b"{{ .Prompt }}"
    for blob in (config, *tensors, template):
        await push_blob(client, "library/tiny", blob)
    manifest = {
        "schemaVersion": 2, "mediaType": mt.DOCKER_MANIFEST,
        "config": descriptor(mt.DOCKER_CONFIG, config),
        "layers": [descriptor(mt.TENSOR, t, name=f"model.layers.{i}.weight")
                   for i, t in enumerate(tensors)] + [descriptor(mt.TEMPLATE, template)],
    }
    raw = (json.dumps(manifest, separators=(",", ":")) + "\n").encode()
    r = await client.put("/v2/library/tiny/manifests/latest", content=raw,
                         headers={"Content-Type": mt.DOCKER_MANIFEST})
    assert r.status_code == 201, r.text
    r = await client.get("/v2/library/tiny/manifests/latest",
                         headers={"Accept": mt.DOCKER_MANIFEST})
    assert r.content == raw
    assert r.headers["Content-Type"] == mt.DOCKER_MANIFEST
    for layer in manifest["layers"]:
        got = await client.get(f"/v2/library/tiny/blobs/{layer['digest']}")
        assert sha(got.content) == layer["digest"]


async def test_missing_references_are_manifest_blob_unknown(client: httpx.AsyncClient) -> None:
    config = await push_blob(client, REPO, b"{}")
    body = json.dumps({
        "schemaVersion": 2, "mediaType": mt.OCI_MANIFEST,
        "config": {"mediaType": mt.OCI_CONFIG, "digest": config, "size": 2},
        "layers": [descriptor(mt.OCI_LAYER_TAR, b"never pushed")]}).encode()
    r = await client.put(f"/v2/{REPO}/manifests/x", content=body,
                         headers={"Content-Type": mt.OCI_MANIFEST})
    assert r.status_code == 400
    assert r.json()["errors"][0]["code"] == "MANIFEST_BLOB_UNKNOWN"
    assert (await client.get(f"/v2/{REPO}/manifests/x")).status_code == 404


async def test_invalid_manifests_and_references_are_400(client: httpx.AsyncClient) -> None:
    r = await client.put(f"/v2/{REPO}/manifests/x", content=b"{not json",
                         headers={"Content-Type": mt.OCI_MANIFEST})
    assert r.status_code == 400 and r.json()["errors"][0]["code"] == "MANIFEST_INVALID"
    r = await client.put(f"/v2/{REPO}/manifests/sha256:1234", content=b"{}",
                         headers={"Content-Type": mt.OCI_MANIFEST})
    assert r.status_code == 400 and r.json()["errors"][0]["code"] == "DIGEST_INVALID"
    r = await client.get(f"/v2/{REPO}/manifests/sha256:1234")  # nothing can exist there: 404
    assert r.status_code == 404 and r.json()["errors"][0]["code"] == "MANIFEST_UNKNOWN"
    r = await client.get("/v2/UPPER/case/manifests/latest")
    assert r.status_code == 400 and r.json()["errors"][0]["code"] == "NAME_INVALID"
    r = await client.get(f"/v2/{REPO}/manifests/nope")
    assert r.status_code == 404 and r.json()["errors"][0]["code"] == "MANIFEST_UNKNOWN"


async def test_put_by_digest_verifies_the_digest(client: httpx.AsyncClient) -> None:
    raw, digest = await push_image(client, REPO, "v1")
    r = await client.put(f"/v2/{REPO}/manifests/{digest}", content=raw,
                         headers={"Content-Type": mt.OCI_MANIFEST})
    assert r.status_code == 201
    r = await client.put(f"/v2/{REPO}/manifests/{sha(b'other')}", content=raw,
                         headers={"Content-Type": mt.OCI_MANIFEST})
    assert r.status_code == 400 and r.json()["errors"][0]["code"] == "DIGEST_INVALID"


async def test_manifest_over_the_size_limit_is_413(client: httpx.AsyncClient) -> None:
    body = json.dumps({"schemaVersion": 2, "pad": "x" * (4 * 1024 * 1024)}).encode()
    r = await client.put(f"/v2/{REPO}/manifests/big", content=body,
                         headers={"Content-Type": mt.OCI_MANIFEST})
    assert r.status_code == 413
    assert r.json()["errors"][0]["code"] == "MANIFEST_INVALID"


async def test_index_needs_its_children(client: httpx.AsyncClient) -> None:
    child_raw, child = await push_image(client, REPO, "amd64")
    child_desc = {"mediaType": mt.OCI_MANIFEST, "digest": child, "size": len(child_raw),
                  "platform": {"architecture": "amd64", "os": "linux"}}
    missing = {"mediaType": mt.OCI_MANIFEST, "digest": sha(b"nope"), "size": 4}
    bad = json.dumps({"schemaVersion": 2, "mediaType": mt.OCI_INDEX,
                      "manifests": [child_desc, missing]}).encode()
    r = await client.put(f"/v2/{REPO}/manifests/multi", content=bad,
                         headers={"Content-Type": mt.OCI_INDEX})
    assert r.status_code == 400 and r.json()["errors"][0]["code"] == "MANIFEST_BLOB_UNKNOWN"
    good = json.dumps({"schemaVersion": 2, "mediaType": mt.OCI_INDEX,
                       "manifests": [child_desc]}).encode()
    r = await client.put(f"/v2/{REPO}/manifests/multi", content=good,
                         headers={"Content-Type": mt.OCI_INDEX})
    assert r.status_code == 201
    r = await client.get(f"/v2/{REPO}/manifests/multi")
    assert r.content == good and r.headers["Content-Type"] == mt.OCI_INDEX


async def test_delete_tag_keeps_manifest_delete_digest_removes_both(
    client: httpx.AsyncClient,
) -> None:
    _, digest = await push_image(client, REPO, "one")
    r = await client.put(f"/v2/{REPO}/manifests/two",
                         content=(await client.get(f"/v2/{REPO}/manifests/one")).content,
                         headers={"Content-Type": mt.OCI_MANIFEST})
    assert r.status_code == 201
    assert (await client.delete(f"/v2/{REPO}/manifests/one")).status_code == 202
    assert (await client.get(f"/v2/{REPO}/manifests/one")).status_code == 404
    assert (await client.get(f"/v2/{REPO}/manifests/{digest}")).status_code == 200
    assert (await client.get(f"/v2/{REPO}/tags/list")).json()["tags"] == ["two"]
    assert (await client.delete(f"/v2/{REPO}/manifests/{digest}")).status_code == 202
    assert (await client.get(f"/v2/{REPO}/manifests/{digest}")).status_code == 404
    assert (await client.get(f"/v2/{REPO}/manifests/two")).status_code == 404
    assert (await client.delete(f"/v2/{REPO}/manifests/{digest}")).status_code == 404


async def test_tags_list_paginates_with_link_headers(client: httpx.AsyncClient) -> None:
    raw, _ = await push_image(client, REPO, "t00")
    names = [f"t{i:02d}" for i in range(7)]
    for tag in names[1:]:
        await client.put(f"/v2/{REPO}/manifests/{tag}", content=raw,
                         headers={"Content-Type": mt.OCI_MANIFEST})
    seen: list[str] = []
    url: str | None = f"/v2/{REPO}/tags/list?n=3"
    while url:
        r = await client.get(url)
        assert r.status_code == 200
        seen += r.json()["tags"]
        link = r.headers.get("Link")
        url = link.split(";")[0].strip("<>") if link else None
    assert seen == names
    r = await client.get(f"/v2/{REPO}/tags/list", params={"n": "x"})
    assert r.status_code == 400
    r = await client.get("/v2/library/unknown/tags/list")
    assert r.status_code == 404 and r.json()["errors"][0]["code"] == "NAME_UNKNOWN"


async def test_catalog_lists_repositories_of_any_depth_with_pagination(
    client: httpx.AsyncClient,
) -> None:
    repos = ["a", "library/llama3", "x/y/z"]
    for repo in repos:
        await push_image(client, repo, "latest")
    assert (await client.get("/v2/_catalog")).json()["repositories"] == repos
    r = await client.get("/v2/_catalog", params={"n": 2})
    assert r.json()["repositories"] == repos[:2]
    assert r.headers["Link"] == '</v2/_catalog?n=2&last=library%2Fllama3>; rel="next"'
    r = await client.get("/v2/_catalog", params={"n": 2, "last": "library/llama3"})
    assert r.json()["repositories"] == ["x/y/z"] and "Link" not in r.headers


async def test_referrers_list_and_filter_by_artifact_type(client: httpx.AsyncClient) -> None:
    subject_raw, subject = await push_image(client, REPO, "app")
    subject_desc = {"mediaType": mt.OCI_MANIFEST, "digest": subject, "size": len(subject_raw)}
    empty = await push_blob(client, REPO, b"{}")
    digests = {}
    for kind in ("application/vnd.example.sbom", "application/vnd.example.sig"):
        body = json.dumps({
            "schemaVersion": 2, "mediaType": mt.OCI_MANIFEST, "artifactType": kind,
            "config": {"mediaType": mt.OCI_EMPTY, "digest": empty, "size": 2},
            "layers": [], "subject": subject_desc,
            "annotations": {"kind": kind}}).encode()
        r = await client.put(f"/v2/{REPO}/manifests/{sha(body)}", content=body,
                             headers={"Content-Type": mt.OCI_MANIFEST})
        assert r.status_code == 201
        assert r.headers["OCI-Subject"] == subject
        digests[kind] = sha(body)
    r = await client.get(f"/v2/{REPO}/referrers/{subject}")
    assert r.status_code == 200 and r.headers["Content-Type"] == mt.OCI_INDEX
    found = {d["artifactType"]: d["digest"] for d in r.json()["manifests"]}
    assert found == digests
    r = await client.get(f"/v2/{REPO}/referrers/{subject}",
                         params={"artifactType": "application/vnd.example.sig"})
    assert r.headers["OCI-Filters-Applied"] == "artifactType"
    assert [d["digest"] for d in r.json()["manifests"]] == [digests["application/vnd.example.sig"]]
    assert (await client.delete(f"/v2/{REPO}/manifests/{digests['application/vnd.example.sig']}")
            ).status_code == 202
    r = await client.get(f"/v2/{REPO}/referrers/{subject}")
    assert [d["digest"] for d in r.json()["manifests"]] == [digests["application/vnd.example.sbom"]]
    r = await client.get(f"/v2/{REPO}/referrers/{sha(b'nothing')}")
    assert r.status_code == 200 and r.json()["manifests"] == []


async def test_64_concurrent_pushes_to_one_tag_serialize(
    client: httpx.AsyncClient, registry_url: str, registry_root: Path,
) -> None:
    config = await push_blob(client, REPO, b"{}")
    bodies = [json.dumps({
        "schemaVersion": 2, "mediaType": mt.OCI_MANIFEST,
        "config": {"mediaType": mt.OCI_CONFIG, "digest": config, "size": 2},
        "layers": [], "annotations": {"n": str(i)}}).encode() for i in range(64)]
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=registry_url, limits=limits, timeout=60) as many:
        results = await asyncio.gather(*(
            many.put(f"/v2/{REPO}/manifests/race", content=b,
                     headers={"Content-Type": mt.OCI_MANIFEST}) for b in bodies))
    assert all(r.status_code == 201 for r in results)
    final = await client.get(f"/v2/{REPO}/manifests/race")
    assert final.content in bodies
    assert final.headers["Docker-Content-Digest"] == sha(final.content)
    store = FilesystemStore(registry_root)
    history = await TagStore(store).history(REPO, "race")
    assert sorted(str(m.digest) for m in history) == sorted(sha(b) for b in bodies)
    assert str(history[-1].digest) == sha(final.content)  # the last move is the current one
    for body in bodies:  # every manifest intact and readable by digest
        r = await client.get(f"/v2/{REPO}/manifests/{sha(body)}")
        assert r.content == body


async def test_manifest_limit_comes_from_settings(settings) -> None:
    from conftest import serve_app

    from ferry.app import build_registry_app

    app = build_registry_app(settings.with_(max_manifest_bytes=2048))
    with serve_app(app) as url:
        async with httpx.AsyncClient(base_url=url) as c:
            body = json.dumps({"schemaVersion": 2, "pad": "x" * 3000}).encode()
            r = await c.put(f"/v2/{REPO}/manifests/big", content=body,
                            headers={"Content-Type": mt.OCI_MANIFEST})
            assert r.status_code == 413
            assert r.json()["errors"][0]["detail"]["limit"] == 2048
