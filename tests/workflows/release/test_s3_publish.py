"""`publish` against a real S3-compatible server (moto server mode) behind a fault-injecting proxy.

The proxy's request log is the ground truth for order: a request that arrives later was sent
later, and the job sends the checksum file only after every payload upload has answered.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from ferry.cli import main
from workflows.release import checksums
from workflows.release.job import PublishOptions, publish, verify
from workflows.release.s3 import S3ReleaseStore
from workflows.release.store import ReleaseRef

from .fault_proxy import FaultProxy, running
from .s3_helpers import bucket_files, client, make_dist, new_bucket, payloads, sha256sum_text

pytestmark = pytest.mark.usefixtures("aws_env")
DELAYS = (0.01, 0.02)


def _asset_put(prefix: str):
    return lambda method, path: method == "PUT" and f"/{prefix}/" in path


def _publish(url: str, bucket: str, dist: Path, sleeps, tag: str = "v1.2.0",
             parallel: int = 1, delays: tuple[float, ...] = DELAYS):
    store = S3ReleaseStore(bucket, "rel", endpoint_url=url)
    try:
        return publish(store, tag, dist, PublishOptions(retry_delays=delays, parallel=parallel),
                       sleep=sleeps)
    finally:
        store.close()


def _checksum_put_is_last(proxy: FaultProxy) -> None:
    puts = [e for e in proxy.entries("PUT", "/rel/v1.2.0/") if e.outcome.startswith("forwarded")]
    assert puts[-1].path.endswith("/" + checksums.CHECKSUM_FILE)
    assert sum(e.path.endswith(checksums.CHECKSUM_FILE) for e in puts) == 1


def test_every_payload_arrives_through_injected_500s_and_checksum_goes_last(
        s3_server, tmp_path, sleeps):
    files = payloads("ferry", 5)
    dist = make_dist(tmp_path / "dist", files)
    bucket = new_bucket(s3_server)
    proxy = FaultProxy(s3_server, match=_asset_put("rel/v1.2.0"), every=2, action="500")
    with running(proxy) as url:
        report = _publish(url, bucket, dist, sleeps)
    assert report.ok, report.problems
    injected = proxy.entries("PUT", "/rel/v1.2.0/")
    failures = [e for e in injected if e.outcome == "injected 500"]
    assert len(failures) >= 3
    # each failure was followed by the first configured delay, and by nothing longer
    assert sleeps.delays == [DELAYS[0]] * len(failures)
    stored = bucket_files(s3_server, bucket, "rel/v1.2.0")
    assert stored.pop(checksums.CHECKSUM_FILE).decode() == sha256sum_text(files)
    assert stored == files
    _checksum_put_is_last(proxy)


def test_dropped_responses_are_retried_and_the_release_verifies(s3_server, tmp_path, sleeps):
    files = payloads("drop", 4)
    dist = make_dist(tmp_path / "dist", files)
    bucket = new_bucket(s3_server)
    proxy = FaultProxy(s3_server, match=_asset_put("rel/v1.2.0"), every=3, action="drop")
    with running(proxy) as url:
        report = _publish(url, bucket, dist, sleeps)
    assert report.ok, report.problems
    dropped = [e for e in proxy.entries("PUT") if e.outcome.startswith("dropped")]
    assert dropped and sleeps.delays == [DELAYS[0]] * len(dropped)
    stored = bucket_files(s3_server, bucket, "rel/v1.2.0")
    assert stored.pop(checksums.CHECKSUM_FILE).decode() == sha256sum_text(files)
    assert stored == files


def test_uploads_run_in_parallel(s3_server, tmp_path, sleeps):
    files = payloads("par", 6, size=1024)
    dist = make_dist(tmp_path / "dist", files)
    bucket = new_bucket(s3_server)
    proxy = FaultProxy(s3_server, match=_asset_put("rel/v1.2.0"), delay=0.2)
    with running(proxy) as url:
        report = _publish(url, bucket, dist, sleeps, parallel=4)
    assert report.ok, report.problems
    assert proxy.max_in_flight >= 3
    _checksum_put_is_last(proxy)


def test_a_payload_that_keeps_failing_fails_the_run_without_a_checksum_file(
        s3_server, tmp_path, capsys):
    files = payloads("ok", 3) | {"bad.zip": b"never arrives"}
    dist = make_dist(tmp_path / "dist", files)
    bucket = new_bucket(s3_server)
    proxy = FaultProxy(s3_server, always=lambda m, p: m == "PUT" and p.endswith("/bad.zip"))
    with running(proxy) as url:
        code = main(["release", "publish", "--tag", "v1.2.0", "--dist", str(dist),
                     "--store", f"s3://{bucket}/rel", "--endpoint-url", url,
                     "--retry-delays", "0.01,0.02", "--parallel", "2"])
    err = capsys.readouterr().err
    assert code == 1
    assert "bad.zip" in err and "not uploading sha256sum.txt" in err
    assert "retry bad.zip in 0.01s" in err and "retry bad.zip in 0.02s" in err
    assert len(proxy.entries("PUT", "/bad.zip")) == 3  # one try and two retries
    assert not proxy.entries("PUT", checksums.CHECKSUM_FILE)
    stored = bucket_files(s3_server, bucket, "rel/v1.2.0")
    assert checksums.CHECKSUM_FILE not in stored
    assert set(stored) == set(files) - {"bad.zip"}


def test_retag_moves_the_release_and_old_assets_are_deleted_with_fresh_listings(
        s3_server, tmp_path, sleeps):
    bucket = new_bucket(s3_server)
    first = make_dist(tmp_path / "rc1", payloads("old", 3))
    assert _publish(s3_server, bucket, first, sleeps, tag="v1.2.0-rc1").ok
    files = payloads("new", 2)
    second = make_dist(tmp_path / "rc2", files)
    proxy = FaultProxy(s3_server, every=2, action="500",
                       match=lambda m, p: m == "DELETE" and "/rel/v1.2.0/" in p)
    with running(proxy) as url:
        report = _publish(url, bucket, second, sleeps, tag="v1.2.0-rc2")
    assert report.ok, report.problems
    assert report.retag == "moved from v1.2.0-rc1"
    assert report.deleted == 4  # three payloads and the old checksum file
    stored = bucket_files(s3_server, bucket, "rel/v1.2.0")
    assert stored.pop(checksums.CHECKSUM_FILE).decode() == sha256sum_text(files)
    assert stored == files
    deletes = [e for e in proxy.entries("DELETE", "/rel/v1.2.0/")]
    assert deletes[0].path.endswith("/" + checksums.CHECKSUM_FILE)
    # every failed delete is re-sent only after a fresh listing of the release
    log = proxy.entries()
    failed = [e for e in log if e.outcome == "injected 500"]
    assert failed
    for bad in failed:
        retry = next(e for e in log[bad.seq + 1:]
                     if e.path == bad.path and e.outcome == "forwarded 204")
        between = log[bad.seq + 1:retry.seq]
        assert any(e.method == "GET" and "list-type=2" in e.path for e in between)
    doc = json.loads(client(s3_server).get_object(Bucket=bucket, Key="rel/v1.2.0.json")
                     ["Body"].read())
    assert doc["tag"] == "v1.2.0-rc2" and doc["prerelease"] is True and doc["name"] == "v1.2.0"


def test_listing_with_digests_reports_what_s3_computed(s3_server, tmp_path, sleeps):
    files = payloads("dig", 2)
    bucket = new_bucket(s3_server)
    assert _publish(s3_server, bucket, make_dist(tmp_path / "d", files), sleeps).ok
    store = S3ReleaseStore(bucket, "rel", endpoint_url=s3_server)
    ref = ReleaseRef.from_tag("v1.2.0")
    digests = {a.name: a.sha256 for a in store.list_assets(ref, with_digests=True)}
    assert digests["dig-0.tar.gz"] == hashlib.sha256(files["dig-0.tar.gz"]).hexdigest()
    # an object replaced behind the job's back no longer verifies
    client(s3_server).put_object(Bucket=bucket, Key="rel/v1.2.0/dig-1.tar.gz",
                                 Body=files["dig-1.tar.gz"][::-1], ChecksumAlgorithm="SHA256")
    local = {a.name: a for a in checksums.scan_dist(tmp_path / "d")}
    problems = verify(store.list_assets(ref, with_digests=True), [local["dig-1.tar.gz"]])
    assert any(p.startswith("dig-1.tar.gz: sha256") for p in problems)
    store.close()
