"""`publish` against GitHub Releases: a local server (fake_github.py) stands in for the public
API (api.github.com), which tests cannot reach; it implements the endpoints the store uses
with the API's status codes."""

from __future__ import annotations

import time

import pytest
from conftest import serve_app

from ferry.cli import main
from workflows.release import checksums
from workflows.release.github import LEASE_ASSET, GitHubReleaseStore
from workflows.release.job import PublishOptions, publish
from workflows.release.store import ReleaseError

from .fake_github import FakeGitHub
from .s3_helpers import make_dist, payloads, sha256sum_text

DELAYS = (0.01, 0.02)


@pytest.fixture
def github():
    fake = FakeGitHub()
    with serve_app(fake.app()) as url:
        fake.base_url = url
        yield fake


def _store(fake: FakeGitHub) -> GitHubReleaseStore:
    return GitHubReleaseStore("o", "r", token=fake.token, api_url=fake.base_url)


def _cli(fake: FakeGitHub, tag: str, dist, monkeypatch, *extra: str) -> int:
    monkeypatch.setenv("GITHUB_TOKEN", fake.token)
    return main(["release", "publish", "--tag", tag, "--dist", str(dist), "--store",
                 "github://o/r", "--api-url", fake.base_url, "--retry-delays", "0.01,0.02",
                 *extra])


def test_publish_creates_a_draft_prerelease_and_uploads_checksums_last(
        github, tmp_path, monkeypatch):
    files = payloads("ferry", 4)
    assert _cli(github, "v1.3.0-rc1", make_dist(tmp_path / "d", files), monkeypatch) == 0
    (release,) = github.releases
    assert release["name"] == "v1.3.0" and release["tag_name"] == "v1.3.0-rc1"
    assert release["draft"] and release["prerelease"]
    stored = github.asset_files(release["id"])
    assert stored.pop(checksums.CHECKSUM_FILE).decode() == sha256sum_text(files)
    assert stored == files  # the lease asset is gone again
    uploads = [url for method, url in github.log if method == "POST" and "/uploads/" in url
               and LEASE_ASSET not in url]
    assert uploads[-1].endswith("name=" + checksums.CHECKSUM_FILE)


def test_existing_release_moves_to_the_new_tag_and_loses_its_old_assets(
        github, tmp_path, monkeypatch, capsys):
    old = github.add_release("v1.3.0", "v1.3.0-rc1", {"stale.zip": b"old", "sha256sum.txt": b"x"})
    files = payloads("final", 2)
    assert _cli(github, "v1.3.0", make_dist(tmp_path / "d", files), monkeypatch) == 0
    assert old["tag_name"] == "v1.3.0" and len(github.releases) == 1
    stored = github.asset_files(old["id"])
    assert stored.pop(checksums.CHECKSUM_FILE).decode() == sha256sum_text(files)
    assert stored == files
    assert "moved from v1.3.0-rc1" in capsys.readouterr().out


def test_failed_and_lost_uploads_are_retried_with_the_configured_delays(
        github, tmp_path, sleeps):
    files = payloads("p", 3)
    github.fail_uploads = {"p-0.tar.gz": ["502", "502"], "p-1.tar.gz": ["lost"]}
    store = _store(github)
    report = publish(store, "v1.4.0", make_dist(tmp_path / "d", files),
                     PublishOptions(retry_delays=DELAYS, parallel=3), sleep=sleeps)
    store.close()
    assert report.ok, report.problems
    attempts = {a.name: a.attempts for a in report.assets}
    assert attempts["p-0.tar.gz"] == 3 and attempts["p-1.tar.gz"] == 2
    assert sorted(sleeps.delays) == sorted([*DELAYS, DELAYS[0]])
    stored = github.asset_files(github.releases[0]["id"])
    assert stored.pop(checksums.CHECKSUM_FILE).decode() == sha256sum_text(files)
    assert stored == files


def test_an_upload_that_keeps_failing_leaves_no_checksum_file(github, tmp_path, monkeypatch,
                                                              capsys):
    github.fail_uploads = {"p-1.tar.gz": ["502"] * 3}
    code = _cli(github, "v1.5.0", make_dist(tmp_path / "d", payloads("p", 3)), monkeypatch)
    assert code == 1
    assert "p-1.tar.gz" in capsys.readouterr().err
    stored = github.asset_files(github.releases[0]["id"])
    assert checksums.CHECKSUM_FILE not in stored and "p-1.tar.gz" not in stored


def test_a_live_lease_or_a_mid_upload_asset_stops_a_second_run(github, tmp_path, monkeypatch,
                                                              capsys):
    release = github.add_release("v1.6.0", "v1.6.0", {})
    github._store_asset(release["id"], LEASE_ASSET, b"{}",
                        f"lease other-host:1:abc until {time.time() + 60:.3f}")
    dist = make_dist(tmp_path / "d", payloads("p", 1))
    assert _cli(github, "v1.6.0", dist, monkeypatch, "--lease-wait", "0") == 1
    assert "another run holds the release lease: other-host:1:abc" in capsys.readouterr().err
    github.assets[release["id"]] = []
    github._store_asset(release["id"], "half.zip", b"12", None, state="open")
    assert _cli(github, "v1.6.0", dist, monkeypatch, "--lease-wait", "0") == 1
    assert "mid-upload (half.zip is open)" in capsys.readouterr().err


def test_an_expired_lease_is_taken_over(github, tmp_path, monkeypatch):
    release = github.add_release("v1.7.0", "v1.7.0", {})
    expired = f"lease dead:1:x until {time.time() - 1}"
    github._store_asset(release["id"], LEASE_ASSET, b"{}", expired)
    files = payloads("p", 1)
    assert _cli(github, "v1.7.0", make_dist(tmp_path / "d", files), monkeypatch) == 0
    assert set(github.asset_files(release["id"])) == {*files, checksums.CHECKSUM_FILE}


def test_a_missing_token_is_a_clear_error():
    with pytest.raises(ReleaseError, match="GITHUB_TOKEN"):
        GitHubReleaseStore("o", "r", token=None, api_url="http://127.0.0.1:9")
