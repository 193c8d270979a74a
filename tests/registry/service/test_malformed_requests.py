"""Malformed requests to the registry get a clear 4xx, never a 500 (issue 19, items 3 and 4)."""

from __future__ import annotations

import hashlib

import httpx

from registry import media_types as mt

from .conftest import push_blob, push_image

REPO = "library/app"
HUGE = "9" * 5000


def code(r: httpx.Response) -> str:
    return r.json()["errors"][0]["code"]


async def test_huge_and_non_ascii_numbers_are_4xx(client: httpx.AsyncClient) -> None:
    digest = await push_blob(client, REPO, b"0123456789")
    r = await client.get(f"/v2/{REPO}/blobs/{digest}", headers={"Range": f"bytes={HUGE}-"})
    assert r.status_code == 416
    r = await client.get(f"/v2/{REPO}/blobs/{digest}", headers={"Range": f"bytes=2-{HUGE}"})
    assert r.status_code == 206 and r.content == b"23456789"
    r = await client.get(f"/v2/{REPO}/blobs/{digest}", headers={"Range": "bytes=²-3".encode()})
    assert r.status_code == 416
    start = await client.post(f"/v2/{REPO}/blobs/uploads/")
    location = start.headers["Location"]
    for value in (f"0-{HUGE}", f"{HUGE}-{HUGE}", "0-²"):
        r = await client.patch(location, content=b"x", headers={"Content-Range": value.encode()})
        assert r.status_code == 400 and code(r) == "BLOB_UPLOAD_INVALID", value
    for n in (HUGE, "²", "-1", "1e3"):
        r = await client.get("/v2/_catalog", params={"n": n})
        if n == HUGE:
            assert r.status_code == 200, n  # more than there are: all of them
        else:
            assert r.status_code == 400 and code(r) == "PAGINATION_NUMBER_INVALID", n
    r = await client.get(f"/v2/{REPO}/tags/list", params={"n": HUGE})
    assert r.status_code in (200, 404)


async def test_a_deeply_nested_manifest_is_manifest_invalid(client: httpx.AsyncClient) -> None:
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
                 ('{"schemaVersion": 2, "n": ' + HUGE + "}").encode()):
        r = await client.put(f"/v2/{REPO}/manifests/deep", content=body,
                             headers={"Content-Type": mt.OCI_MANIFEST})
        assert r.status_code == 400 and code(r) == "MANIFEST_INVALID"


async def test_references_are_validated_before_anything_is_touched(
    client: httpx.AsyncClient,
) -> None:
    raw, digest = await push_image(client, REPO, "v1")
    for ref in ("%2E%2E", "%2e", "v1%0a", "v1%0A", "v1%20", "-x", "a" * 129, "sha256:..", "%00"):
        r = await client.delete(f"/v2/{REPO}/manifests/{ref}")
        assert r.status_code == 404 and code(r) == "MANIFEST_UNKNOWN", ref
        assert (await client.get(f"/v2/{REPO}/manifests/{ref}")).status_code == 404, ref
        assert (await client.head(f"/v2/{REPO}/manifests/{ref}")).status_code == 404, ref
        r = await client.put(f"/v2/{REPO}/manifests/{ref}", content=raw,
                             headers={"Content-Type": mt.OCI_MANIFEST})
        assert r.status_code == 400, ref
    assert (await client.get(f"/v2/{REPO}/manifests/v1")).content == raw  # v1\n deleted nothing
    assert (await client.get(f"/v2/{REPO}/manifests/{digest}%0a")).status_code == 404


async def test_only_the_canonical_wire_digest_is_accepted(client: httpx.AsyncClient) -> None:
    data = b"some bytes"
    digest = await push_blob(client, REPO, data)
    hex_ = hashlib.sha256(data).hexdigest()
    assert (await client.head(f"/v2/{REPO}/blobs/{digest}")).status_code == 200
    for wrong in (f"sha256-{hex_}", f"sha256:{hex_.upper()}", f"{digest}%0a", f"{digest}%0A",
                  f"SHA256:{hex_}"):
        r = await client.head(f"/v2/{REPO}/blobs/{wrong}")
        assert r.status_code == 400, wrong
        r = await client.get(f"/v2/{REPO}/blobs/{wrong}")
        assert r.status_code == 400 and code(r) == "DIGEST_INVALID", wrong
    r = await client.post(f"/v2/{REPO}/blobs/uploads/", params={"digest": f"sha256-{hex_}"},
                          content=data)
    assert r.status_code == 400 and code(r) == "DIGEST_INVALID"
    r = await client.get(f"/v2/{REPO}/blobs/{digest}/%0a")
    assert 400 <= r.status_code < 500
    r = await client.get(f"/v2/{REPO}%0a/blobs/{digest}")
    assert r.status_code == 400 and code(r) == "NAME_INVALID"
    r = await client.get("/v2/lib%0arary/app/manifests/v1")
    assert r.status_code == 400 and code(r) == "NAME_INVALID"
