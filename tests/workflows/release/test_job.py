"""Pure parts of the job: the checksum file, tag naming, verification and the retry policy."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from workflows.release import checksums
from workflows.release.job import verify
from workflows.release.retries import call_with_retries
from workflows.release.store import ReleaseError, ReleaseRef, RemoteAsset, StoreError

from .s3_helpers import make_dist, payloads


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="coreutils sha256sum not found")
def test_checksum_file_is_accepted_by_sha256sum_check(tmp_path):
    dist = make_dist(tmp_path / "d", payloads("a", 3) | {"with space.txt": b"x",
                                                         ".sha256sum.txt.tmp1": b"crash"})
    assets = checksums.scan_dist(dist)
    manifest = checksums.write_checksum_file(dist, assets)
    result = subprocess.run(["sha256sum", "-c", manifest.name], cwd=dist, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": OK") == 4
    assert [a.name for a in checksums.scan_dist(dist)] == sorted(a.name for a in assets)


def test_empty_or_missing_dist_is_refused(tmp_path):
    with pytest.raises(ReleaseError, match="does not exist"):
        checksums.scan_dist(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReleaseError, match="no files"):
        checksums.scan_dist(tmp_path / "empty")


@pytest.mark.parametrize("tag,name,pre", [("v1.2.0-rc2", "v1.2.0", True),
                                          ("v1.2.0", "v1.2.0", False),
                                          ("v10.0.1-beta.1", "v10.0.1", True)])
def test_release_name_is_the_tag_up_to_the_first_dash(tag, name, pre):
    ref = ReleaseRef.from_tag(tag)
    assert (ref.name, ref.prerelease) == (name, pre)


@pytest.mark.parametrize("tag", ["1.2.0", "v1.2", "v1.2.0-", "latest", "v1.2.0/x"])
def test_malformed_tags_are_refused(tag):
    with pytest.raises(ReleaseError):
        ReleaseRef.from_tag(tag)


def test_verify_names_every_missing_short_corrupt_and_foreign_asset(tmp_path):
    dist = make_dist(tmp_path / "d", {"a": b"aa", "b": b"bb", "c": b"cc"})
    local = checksums.scan_dist(dist)
    by_name = {a.name: a for a in local}
    remote = [RemoteAsset("a", 2, by_name["a"].sha256), RemoteAsset("b", 1, None),
              RemoteAsset("c", 2, "0" * 64), RemoteAsset("zzz", 5, None)]
    problems = verify(remote, local)
    assert problems == ["b: size 1, expected 2", f"c: sha256 {'0' * 64}, expected "
                        f"{by_name['c'].sha256}", "zzz: not part of this release's files"]
    assert verify(remote[:1], local[:1]) == []
    assert verify([], local[:1]) == ["a: missing from the release"]


def test_only_transient_errors_are_retried_with_the_configured_delays():
    waited: list[float] = []
    calls = iter([StoreError("503", transient=True), StoreError("500", transient=True), "ok"])

    def flaky() -> str:
        item = next(calls)
        if isinstance(item, Exception):
            raise item
        return item

    assert call_with_retries(flaky, (15, 30), waited.append) == "ok"
    assert waited == [15, 30]
    waited.clear()
    with pytest.raises(StoreError, match="403"):
        call_with_retries(lambda: (_ for _ in ()).throw(StoreError("403", transient=False)),
                          (15, 30), waited.append)
    assert waited == []


class _FlakyLeaseStore:
    """Answers acquire_lease from a script: errors to raise, then a lease."""

    def __init__(self, script: list) -> None:
        self.script = script

    def acquire_lease(self, ref, holder, ttl):
        item = self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        return item


def test_lease_acquisition_retries_transient_errors_and_polls_while_held():
    from workflows.release.lease import acquire
    from workflows.release.store import LeaseHeld

    waited: list[float] = []
    lease = object()
    store = _FlakyLeaseStore([StoreError("503", transient=True), LeaseHeld("other", None),
                              lease])
    got = acquire(store, ReleaseRef.from_tag("v1.0.0"), "me", ttl=60, wait=30, poll=2.5,
                  sleep=waited.append, delays=(0.5,))
    assert got is lease and waited == [0.5, 2.5]
    with pytest.raises(LeaseHeld):
        acquire(_FlakyLeaseStore([LeaseHeld("other", None)]), ReleaseRef.from_tag("v1.0.0"),
                "me", ttl=60, wait=0, poll=1, sleep=waited.append)
