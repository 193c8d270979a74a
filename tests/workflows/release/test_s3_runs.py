"""Overlapping and interrupted `ferry release publish` runs against S3 (moto server mode).

Runs are real subprocesses of the CLI, so a kill is a real kill; the fault proxy slows uploads
down so that the runs overlap and the kill lands mid-way.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest

from ferry.cli import main
from workflows.release import checksums
from workflows.release.s3 import S3ReleaseStore
from workflows.release.store import LeaseHeld, LeaseLost, ReleaseRef

from .fault_proxy import FaultProxy, running
from .s3_helpers import (
    bucket_files,
    cli_command,
    cli_env,
    client,
    make_dist,
    new_bucket,
    payloads,
    sha256sum_text,
)

pytestmark = pytest.mark.usefixtures("aws_env")
REF = ReleaseRef.from_tag("v2.0.0")


def _slow_puts(upstream: str, delay: float) -> FaultProxy:
    return FaultProxy(upstream, delay=delay,
                      match=lambda m, p: m == "PUT" and "/rel/v2.0.0/" in p)


def _args(bucket: str, dist, *extra: str) -> list[str]:
    return ["--tag", "v2.0.0", "--dist", str(dist), "--store", f"s3://{bucket}/rel",
            "--retry-delays", "0.01,0.02", *extra]


def _wait_for(proxy: FaultProxy, proc: subprocess.Popen, method: str, path: str,
              outcome: str = "") -> None:
    """Wait until the proxy has seen a matching request (e.g. a refused lease write)."""
    deadline = time.monotonic() + 60
    while not any(e.outcome.startswith(outcome) for e in proxy.entries(method, path)):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)


def test_two_runs_for_one_version_never_interleave(s3_server, tmp_path):
    bucket = new_bucket(s3_server)
    runs = {label: payloads(label, 4, size=2048) for label in ("alpha", "beta")}
    proxy = _slow_puts(s3_server, 0.05)
    proxy.gate = threading.Event()  # alpha's uploads wait here until beta is waiting
    procs: dict[str, subprocess.Popen] = {}
    with running(proxy) as url:
        for label, files in runs.items():
            procs[label] = subprocess.Popen(
                cli_command(*_args(bucket, make_dist(tmp_path / label, files), "--parallel",
                                   "2", "--lease-ttl", "10", "--lease-wait", "60")),
                env=cli_env(url), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if label == "alpha":  # alpha holds the lease and is uploading (held at the gate)
                _wait_for(proxy, procs[label], "PUT", "/rel/v2.0.0/alpha")
            else:  # beta tried to take the lease and was refused
                _wait_for(proxy, procs[label], "PUT", "/rel/v2.0.0.lock", "forwarded 412")
        proxy.gate.set()
        outputs = {label: proc.communicate(timeout=120) for label, proc in procs.items()}
    for label, proc in procs.items():
        assert proc.returncode == 0, outputs[label]
    assert "waiting: another run holds the release lease" in outputs["beta"][1], outputs["beta"][1]
    # the asset uploads form two blocks, one run's then the other's
    order = [e.path.rsplit("/", 1)[1].split("-")[0] for e in proxy.entries("PUT", "/rel/v2.0.0/")
             if not e.path.endswith(checksums.CHECKSUM_FILE)]
    assert order == ["alpha"] * 4 + ["beta"] * 4, order
    stored = bucket_files(s3_server, bucket, "rel/v2.0.0")
    assert stored.pop(checksums.CHECKSUM_FILE).decode() == sha256sum_text(runs["beta"])
    assert stored == runs["beta"]


def test_simultaneous_lease_attempts_admit_exactly_one(s3_server):
    bucket = new_bucket(s3_server)
    stores = [S3ReleaseStore(bucket, "rel", endpoint_url=s3_server) for _ in range(4)]
    barrier = threading.Barrier(len(stores))
    winners: list[str] = []

    def contend(index: int) -> None:
        barrier.wait()
        try:
            stores[index].acquire_lease(REF, f"run{index}", ttl=60)
            winners.append(f"run{index}")
        except LeaseHeld:
            pass

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(len(stores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(winners) == 1
    for store in stores:
        store.close()


def test_a_run_fails_cleanly_when_told_not_to_wait(s3_server, tmp_path, capsys):
    bucket = new_bucket(s3_server)
    store = S3ReleaseStore(bucket, "rel", endpoint_url=s3_server)
    lease = store.acquire_lease(REF, "other-run", ttl=60)
    dist = make_dist(tmp_path / "dist", payloads("x", 2))
    code = main(["release", "publish", *_args(bucket, dist, "--endpoint-url", s3_server,
                                              "--lease-wait", "0")])
    assert code == 1
    assert "another run holds the release lease: other-run" in capsys.readouterr().err
    assert bucket_files(s3_server, bucket, "rel/v2.0.0") == {}
    lease.release()
    store.close()


def test_a_killed_run_leaves_no_checksum_and_the_next_run_completes(s3_server, tmp_path):
    bucket = new_bucket(s3_server)
    killed_files = payloads("killed", 9, size=1024) | {"stale.bin": b"from the killed run"}
    proxy = _slow_puts(s3_server, 0.3)
    with running(proxy) as url:
        proc = subprocess.Popen(
            cli_command(*_args(bucket, make_dist(tmp_path / "one", killed_files),
                               "--parallel", "1", "--lease-ttl", "2", "--lease-wait", "0")),
            env=cli_env(url), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while len([e for e in proxy.entries("PUT", "/rel/v2.0.0/")
                   if e.outcome.startswith("forwarded")]) < 2:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        proc.kill()
        proc.wait()
    leftover = bucket_files(s3_server, bucket, "rel/v2.0.0")
    assert leftover and checksums.CHECKSUM_FILE not in leftover
    lock = json.loads(client(s3_server).get_object(Bucket=bucket, Key="rel/v2.0.0.lock")
                      ["Body"].read())
    assert lock["expires_at"] > 0  # the dead run's lease is still there, until it expires

    files = payloads("next", 3, size=1024)
    code = main(["release", "publish", *_args(bucket, make_dist(tmp_path / "two", files),
                                              "--endpoint-url", s3_server,
                                              "--lease-ttl", "5", "--lease-wait", "30")])
    assert code == 0
    stored = bucket_files(s3_server, bucket, "rel/v2.0.0")
    assert stored.pop(checksums.CHECKSUM_FILE).decode() == sha256sum_text(files)
    assert stored == files


def test_lease_is_exclusive_expires_and_is_lost_to_a_takeover(s3_server):
    bucket = new_bucket(s3_server)
    store = S3ReleaseStore(bucket, "rel", endpoint_url=s3_server)
    first = store.acquire_lease(REF, "first", ttl=2.0)
    with pytest.raises(LeaseHeld) as held:
        store.acquire_lease(REF, "second", ttl=60)
    assert held.value.holder == "first"
    first.renew(1.0)
    time.sleep(max(0.0, first.expires_at - time.time()) + 0.05)
    second = store.acquire_lease(REF, "second", ttl=60)
    with pytest.raises(LeaseLost):
        first.renew(60)
    first.release()  # must not remove the second run's lease
    with pytest.raises(LeaseHeld):
        store.acquire_lease(REF, "third", ttl=60)
    second.release()
    store.acquire_lease(REF, "third", ttl=60).release()
    store.close()


def _publish_in_thread(store, dist, ttl: float):
    from workflows.release.job import PublishOptions, publish

    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["report"] = publish(store, "v2.0.0", dist, PublishOptions(
                retry_delays=(0.01,), parallel=1, lease_ttl=ttl, lease_wait=0))
        except Exception as exc:
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_the_lease_is_renewed_while_a_run_outlives_its_ttl(s3_server, tmp_path):
    bucket = new_bucket(s3_server)
    files = payloads("long", 6, size=512)
    # A 3 s lease renewed every second outlives a 2 s stall of a loaded machine (1.5 s was
    # taken by the intruder once in a full run on 2 cores); the run lasts 6 x 1.2 s.
    proxy = _slow_puts(s3_server, 1.2)
    with running(proxy) as url:
        store = S3ReleaseStore(bucket, "rel", endpoint_url=url)
        thread, result = _publish_in_thread(store, make_dist(tmp_path / "d", files), ttl=3.0)
        while not proxy.entries("PUT", "/rel/v2.0.0/") and thread.is_alive():
            time.sleep(0.01)  # the run holds the lease once it uploads
        started = time.monotonic()
        other = S3ReleaseStore(bucket, "rel", endpoint_url=s3_server)
        while thread.is_alive():
            with pytest.raises(LeaseHeld):
                other.acquire_lease(REF, "intruder", ttl=60).release()
            time.sleep(0.1)
        thread.join()
        lasted = time.monotonic() - started
        store.close()
        other.close()
    assert lasted > 6.0  # twice the 3 s lease, so it was renewed throughout
    assert result["report"].ok, result  # type: ignore[union-attr]
    stored = bucket_files(s3_server, bucket, "rel/v2.0.0")
    assert set(stored) == {*files, checksums.CHECKSUM_FILE}


def test_a_run_whose_lease_is_taken_stops_without_a_checksum_file(s3_server, tmp_path):
    bucket = new_bucket(s3_server)
    proxy = _slow_puts(s3_server, 0.25)
    with running(proxy) as url:
        store = S3ReleaseStore(bucket, "rel", endpoint_url=url)
        thread, result = _publish_in_thread(store, make_dist(tmp_path / "d", payloads("x", 6)),
                                            ttl=0.6)
        while not proxy.entries("PUT", "/rel/v2.0.0/"):
            time.sleep(0.02)
        # another party overwrites the lock object: the next renewal's If-Match fails
        client(s3_server).put_object(Bucket=bucket, Key="rel/v2.0.0.lock",
                                     Body=json.dumps({"holder": "thief", "expires_at": 1e12}))
        thread.join(timeout=60)
        store.close()
    report = result.get("report")
    if report is not None:  # the lost lease failed the remaining uploads
        assert not report.ok and any("lease" in (a.error or "") for a in report.assets)
    else:
        assert isinstance(result["error"], LeaseLost)
    assert checksums.CHECKSUM_FILE not in bucket_files(s3_server, bucket, "rel/v2.0.0")
