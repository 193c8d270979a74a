"""Garbage collection: marks from every manifest, sweeps only old unreferenced blobs."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import pytest

from ferry.cli import main
from registry import media_types as mt
from registry.digests import Digest
from registry.service import blobs, paths
from registry.service.gc import MIN_GRACE, GraceTooShort, collect_garbage
from registry.service.storage import FilesystemStore

from .conftest import push_blob, push_image, sha

REPO = "library/app"


def age(root: Path, *keys: str, seconds: float = 7200) -> None:
    """Make objects look written `seconds` ago."""
    then = time.time() - seconds
    for key in keys:
        os.utime(root / key, (then, then))


def age_everything(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            age(root, str(path.relative_to(root)))


def blob_key(digest: str) -> str:
    return paths.blob(Digest.parse(digest))


async def test_gc_sweeps_only_unreferenced_blobs_past_the_grace_period(
    client: httpx.AsyncClient, registry_root: Path,
) -> None:
    kept_raw, kept = await push_image(client, REPO, "keep", seed="keep")
    gone_raw, gone = await push_image(client, REPO, "gone", seed="gone")
    gone_doc = json.loads(gone_raw)
    stray = await push_blob(client, REPO, b"stray, never referenced")
    young = await push_blob(client, REPO, b"young, upload still in flight")
    assert (await client.delete(f"/v2/{REPO}/manifests/{gone}")).status_code == 202
    garbage = [gone, stray, gone_doc["config"]["digest"],
               *(layer["digest"] for layer in gone_doc["layers"])]
    everything = [blob_key(d) for d in (*garbage, young)]
    kept_doc = json.loads(kept_raw)
    kept_blobs = [kept, kept_doc["config"]["digest"], *(x["digest"] for x in kept_doc["layers"])]
    age(registry_root, *everything, *(blob_key(d) for d in kept_blobs))
    age(registry_root, *(paths.layer_link(REPO, Digest.parse(d)) for d in (*garbage, *kept_blobs)
                         if (registry_root / paths.layer_link(REPO, Digest.parse(d))).exists()))
    store = FilesystemStore(registry_root)

    dry = await collect_garbage(store, grace=3600, dry_run=True)
    assert sorted(map(str, dry.swept)) == sorted(garbage)
    assert all((registry_root / blob_key(d)).exists() for d in garbage)

    report = await collect_garbage(store, grace=3600)
    assert sorted(map(str, report.swept)) == sorted(garbage)
    assert not any((registry_root / blob_key(d)).exists() for d in garbage)
    assert (registry_root / blob_key(young)).exists()  # its link is fresh: kept
    assert [str(d) for d in report.kept_young] == [young]
    r = await client.get(f"/v2/{REPO}/manifests/keep")
    assert r.content == kept_raw
    for digest in kept_blobs[1:]:
        assert (await client.head(f"/v2/{REPO}/blobs/{digest}")).status_code == 200
    assert (await client.head(f"/v2/{REPO}/blobs/{stray}")).status_code == 404


async def test_gc_keeps_index_children_and_subjects(
    client: httpx.AsyncClient, registry_root: Path,
) -> None:
    child_raw, child = await push_image(client, REPO, "child", seed="child")
    index = json.dumps({"schemaVersion": 2, "mediaType": mt.OCI_INDEX, "manifests": [
        {"mediaType": mt.OCI_MANIFEST, "digest": child, "size": len(child_raw)}]}).encode()
    r = await client.put(f"/v2/{REPO}/manifests/multi", content=index,
                         headers={"Content-Type": mt.OCI_INDEX})
    assert r.status_code == 201
    assert (await client.delete(f"/v2/{REPO}/manifests/child")).status_code == 202  # untag only
    for path in (registry_root / "blobs").rglob("*"):
        if path.is_file():
            age(registry_root, str(path.relative_to(registry_root)))
    for path in (registry_root / "repositories").rglob("_layers/sha256/*"):
        age(registry_root, str(path.relative_to(registry_root)))
    report = await collect_garbage(FilesystemStore(registry_root), grace=3600)
    assert report.swept == []
    assert {child, sha(index)} <= {str(d) for d in report.marked}
    assert (await client.get(f"/v2/{REPO}/manifests/{child}")).content == child_raw


def test_gc_command_reports_and_deletes(
    registry_root: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    data = b"orphan bytes"
    key = blob_key(sha(data))
    (registry_root / key).parent.mkdir(parents=True)
    (registry_root / key).write_bytes(data)
    age(registry_root, key)
    assert main(["registry", "gc", "--root", str(registry_root), "--dry-run"]) == 0
    assert f"would delete {sha(data)}" in capsys.readouterr().out
    assert (registry_root / key).exists()
    assert main(["registry", "gc", "--root", str(registry_root)]) == 0
    assert f"deleted {sha(data)}" in capsys.readouterr().out
    assert not (registry_root / key).exists()


async def test_a_manifest_push_refreshes_old_links_so_gc_spares_its_blobs(
    client: httpx.AsyncClient, registry_root: Path,
) -> None:
    """A push that reuses an old, unreferenced blob races gc; the manifest PUT rewrites the
    stale link, so the blob is young again until the manifest that marks it is stored."""
    config = await push_blob(client, REPO, b'{"old": true}')
    key = blob_key(config)
    link = paths.layer_link(REPO, Digest.parse(config))
    age(registry_root, key, link)
    body = json.dumps({"schemaVersion": 2, "mediaType": mt.OCI_MANIFEST,
                       "config": {"mediaType": mt.OCI_CONFIG, "digest": config, "size": 13},
                       "layers": []}).encode()
    r = await client.put(f"/v2/{REPO}/manifests/{sha(body)}", content=body,
                         headers={"Content-Type": mt.OCI_MANIFEST})
    assert r.status_code == 201
    assert time.time() - (registry_root / link).stat().st_mtime < 60
    # even if the manifest went away again before gc ran, the blob is within the grace period
    assert (await client.delete(f"/v2/{REPO}/manifests/{sha(body)}")).status_code == 202
    report = await collect_garbage(FilesystemStore(registry_root), grace=3600)
    assert Digest.parse(config) in report.kept_young
    assert (registry_root / key).exists()


def test_gc_command_removes_old_staging_leftovers_and_keeps_young_ones(
    registry_root: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    crashed = [blob_key(sha(b"half")) + "~tmp-dead", paths.tag_current(REPO, "v1") + "~tmp-0a"]
    young = blob_key(sha(b"busy")) + "~tmp-live"
    for key in (*crashed, young):
        (registry_root / key).parent.mkdir(parents=True, exist_ok=True)
        (registry_root / key).write_bytes(b"partial")
    age(registry_root, *crashed)
    assert main(["registry", "gc", "--root", str(registry_root), "--dry-run"]) == 0
    assert all((registry_root / key).exists() for key in crashed)
    assert main(["registry", "gc", "--root", str(registry_root)]) == 0
    out = capsys.readouterr().out
    assert all(f"deleted staging leftover {key}" in out for key in crashed)
    assert "2 staging leftovers" in out
    assert not any((registry_root / key).exists() for key in crashed)
    assert (registry_root / young).exists()  # may be a write in progress


@pytest.mark.parametrize("repo, tag", [("team/model.tmp-1", "v1"), (REPO, "v1.tmp-2"),
                                       ("a.tmp-b/c--d.tmp-e", "_.tmp-x"), ("x/tmp-0", "tmp-"),
                                       ("m.tmp-0", "A" * 120 + ".tmp-12")])
async def test_names_with_tmp_in_them_survive_gc(
    client: httpx.AsyncClient, registry_root: Path, repo: str, tag: str,
) -> None:
    raw, _ = await push_image(client, repo, tag, seed=repo + tag)
    age_everything(registry_root)
    report = await collect_garbage(FilesystemStore(registry_root), grace=3600)
    assert report.swept == []
    assert (await client.get("/v2/_catalog")).json()["repositories"].count(repo) == 1
    assert tag in (await client.get(f"/v2/{repo}/tags/list")).json()["tags"]
    r = await client.get(f"/v2/{repo}/manifests/{tag}")
    assert r.status_code == 200 and r.content == raw


def test_a_grace_below_the_fresh_link_floor_is_refused(
    registry_root: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(GraceTooShort):
        asyncio.run(collect_garbage(FilesystemStore(registry_root), grace=300))
    assert main(["registry", "gc", "--root", str(registry_root), "--grace", "300"]) == 1
    assert "below the safe minimum of 1200 seconds" in capsys.readouterr().err
    assert MIN_GRACE > blobs.FRESH_LINK


class PushDuringMark:
    """A store that lets a manifest push land right after gc's first mark pass."""

    def __init__(self, store: FilesystemStore, push) -> None:  # type: ignore[no-untyped-def]
        self.store, self.push = store, push

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.store, name)

    async def list(self, prefix: str) -> list[str]:
        if prefix == paths.BLOBS and self.push is not None:
            push, self.push = self.push, None
            await push()
        return await self.store.list(prefix)


async def test_a_manifest_stored_while_gc_marks_keeps_its_blobs(
    client: httpx.AsyncClient, registry_root: Path,
) -> None:
    config = await push_blob(client, REPO, b'{"late": true}')
    body = json.dumps({"schemaVersion": 2, "mediaType": mt.OCI_MANIFEST,
                       "config": {"mediaType": mt.OCI_CONFIG, "digest": config, "size": 14},
                       "layers": []}).encode()

    async def push() -> None:
        r = await client.put(f"/v2/{REPO}/manifests/late", content=body,
                             headers={"Content-Type": mt.OCI_MANIFEST})
        assert r.status_code == 201

    store = PushDuringMark(FilesystemStore(registry_root), push)
    # `now` far ahead: every blob looks old, so only the mark can save the late manifest's
    report = await collect_garbage(store, now=time.time() + 10 * 3600)  # type: ignore[arg-type]
    assert Digest.parse(config) in report.marked and report.swept == []
    r = await client.get(f"/v2/{REPO}/manifests/late")
    assert r.status_code == 200
    assert (await client.head(f"/v2/{REPO}/blobs/{config}")).status_code == 200
