"""`publish` to an OCI registry: ferry's own registry service, served by uvicorn on loopback."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import httpx
import pytest
from conftest import serve_app

from ferry.cli import main
from registry.service.app import build_registry_app
from workflows.release import checksums
from workflows.release.job import PublishOptions, publish
from workflows.release.oci import ARTIFACT_TYPE, TAG_ANNOTATION, TITLE, OCIReleaseStore
from workflows.release.store import LeaseHeld, LeaseLost, ReleaseRef

from .fault_proxy import FaultProxy, running
from .s3_helpers import make_dist, payloads, sha256sum_text


@pytest.fixture
def registry(tmp_path):
    with serve_app(build_registry_app(tmp_path / "registry")) as url:
        yield url


def _host(url: str) -> str:
    return url.removeprefix("http://")


def _release(url: str, repo: str, tag: str) -> tuple[dict, dict[str, bytes]]:
    """The release manifest and its assets, fetched back through the distribution API."""
    manifest = httpx.get(f"{url}/v2/{repo}/manifests/{tag}",
                         headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}).json()
    files = {}
    for layer in manifest["layers"]:
        data = httpx.get(f"{url}/v2/{repo}/blobs/{layer['digest']}").content
        assert "sha256:" + hashlib.sha256(data).hexdigest() == layer["digest"]
        files[layer["annotations"][TITLE]] = data
    return manifest, files


def test_publish_pushes_one_layer_per_asset_tagged_with_the_version(
        registry, tmp_path, capsys):
    files = payloads("ferry", 3)
    code = main(["release", "publish", "--tag", "v0.9.0-rc1", "--dist",
                 str(make_dist(tmp_path / "d", files)), "--store",
                 f"oci://{_host(registry)}/ferry/releases", "--insecure",
                 "--retry-delays", "0.01,0.02"])
    out, err = capsys.readouterr()
    assert code == 0, err
    for name in [*files, checksums.CHECKSUM_FILE]:  # the summary table, one row per asset
        assert any(name in line and "uploaded" in line for line in out.splitlines()), out
    manifest, stored = _release(registry, "ferry/releases", "v0.9.0")
    assert manifest["artifactType"] == ARTIFACT_TYPE
    assert manifest["annotations"][TAG_ANNOTATION] == "v0.9.0-rc1"
    assert stored.pop(checksums.CHECKSUM_FILE).decode() == sha256sum_text(files)
    assert stored == files


def test_a_new_tag_moves_the_release_and_replaces_every_asset(registry, tmp_path, sleeps):
    store = OCIReleaseStore(_host(registry), "ferry/releases", insecure=True, settle=0.05)
    options = PublishOptions(retry_delays=(0.01, 0.02), parallel=4)
    first = publish(store, "v0.9.0-rc1", make_dist(tmp_path / "a", payloads("old", 3)),
                    options, sleep=sleeps)
    files = payloads("new", 2)
    second = publish(store, "v0.9.0", make_dist(tmp_path / "b", files), options, sleep=sleeps)
    store.close()
    assert first.ok and second.ok, second.problems
    assert second.retag == "moved from v0.9.0-rc1" and second.deleted == 4
    manifest, stored = _release(registry, "ferry/releases", "v0.9.0")
    assert manifest["annotations"][TAG_ANNOTATION] == "v0.9.0"
    assert stored.pop(checksums.CHECKSUM_FILE).decode() == sha256sum_text(files)
    assert stored == files


def test_the_lock_tag_admits_exactly_one_of_two_simultaneous_runs(registry):
    ref = ReleaseRef.from_tag("v0.9.1")
    stores = [OCIReleaseStore(_host(registry), "ferry/releases", insecure=True, settle=1.0)
              for _ in range(2)]
    barrier = threading.Barrier(2)
    outcomes: dict[str, object] = {}

    def contend(index: int) -> None:
        barrier.wait()
        try:
            outcomes[f"run{index}"] = stores[index].acquire_lease(ref, f"run{index}", ttl=30)
        except LeaseHeld as exc:
            outcomes[f"run{index}"] = exc

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [name for name, got in outcomes.items() if not isinstance(got, LeaseHeld)]
    assert len(winners) == 1, outcomes
    lock = httpx.get(f"{registry}/v2/ferry/releases/manifests/v0.9.1.ferry-lease",
                     headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}).json()
    assert json.dumps(lock).count(winners[0]) == 1


def test_a_lease_taken_over_after_expiry_is_lost_by_its_first_holder(registry):
    ref = ReleaseRef.from_tag("v0.9.2")
    store = OCIReleaseStore(_host(registry), "ferry/releases", insecure=True, settle=0.01)
    first = store.acquire_lease(ref, "first", ttl=1.0)
    with pytest.raises(LeaseHeld) as held:
        store.acquire_lease(ref, "second", ttl=30)
    assert held.value.holder == "first"
    time.sleep(max(0.0, first.expires_at - time.time()) + 0.05)
    second = store.acquire_lease(ref, "second", ttl=30)
    with pytest.raises(LeaseLost):
        first.renew(30)
    first.release()  # must leave the second run's claim alone
    with pytest.raises(LeaseHeld):
        store.acquire_lease(ref, "third", ttl=30)
    second.release()
    store.acquire_lease(ref, "third", ttl=30).release()
    store.close()


def test_failed_blob_uploads_are_retried_and_checksum_layer_comes_last(registry, tmp_path,
                                                                      sleeps):
    files = payloads("flaky", 4)
    proxy = FaultProxy(registry, every=2, action="500",
                       match=lambda m, p: m == "PUT" and "/blobs/uploads/" in p)
    with running(proxy) as url:
        store = OCIReleaseStore(_host(url), "ferry/releases", insecure=True, settle=0.01)
        report = publish(store, "v0.9.3", make_dist(tmp_path / "d", files),
                         PublishOptions(retry_delays=(0.01, 0.02), parallel=1), sleep=sleeps)
        store.close()
    assert report.ok, report.problems
    injected = [e for e in proxy.log if e.outcome == "injected 500"]
    assert injected and sleeps.delays == [0.01] * len(injected)
    manifest, stored = _release(registry, "ferry/releases", "v0.9.3")
    assert stored.pop(checksums.CHECKSUM_FILE).decode() == sha256sum_text(files)
    assert stored == files
    # the checksum blob's upload is the last blob upload the registry saw
    checksum_digest = next(layer["digest"] for layer in manifest["layers"]
                           if layer["annotations"][TITLE] == checksums.CHECKSUM_FILE)
    blob_puts = [e for e in proxy.log
                 if e.outcome == "forwarded 201" and "/blobs/uploads/" in e.path]
    assert checksum_digest.replace(":", "%3A") in blob_puts[-1].path
