"""Pull against ferry's registry service, with a blob CDN it redirects to (all on loopback)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from registry.errors import DigestMismatch
from registry.manifests import parse_manifest
from registry.names import Name
from registry.store import Store
from registry.transfer.errors import RedirectRefused
from registry.transfer.pull import pull
from registry.transfer.push import push
from registry.transfer.retry import RetryPolicy

from .conftest import registry_with_cdn
from .helpers import StaticResolver, fast_options, make_model, store_files

MiB = 1024 * 1024


async def _publish(source: Store, name: str, sizes: list[int], tmp_path: Path,
                   seed: int = 0) -> bytes:
    raw = make_model(source, name, sizes, seed)
    await push(name, source, fast_options(tmp_path / "publisher", insecure=True), lambda e: None)
    return raw


def _partials(store: Store) -> list[str]:
    return [f for f in store_files(store) if "-partial" in f]


async def _quiesce(cdn) -> None:
    """Wait until the CDN has stopped sending to the dead client, so counts start clean."""
    deadline = time.monotonic() + 30
    while cdn.active:
        assert time.monotonic() < deadline, "the CDN kept sending to a closed connection"
        await asyncio.sleep(0.01)


def _saved_completed(store: Store) -> dict[str, int]:
    """Bytes each partial blob's part states say are on disk."""
    done: dict[str, int] = {}
    for path in store.blobs_dir.glob("sha256-*-partial-*"):
        blob = path.name.rsplit("-partial-", 1)[0]
        done[blob] = done.get(blob, 0) + json.loads(path.read_bytes())["Completed"]
    return done


def _bytes_on_disk(store: Store, raw: bytes, saved: dict[str, int]) -> int:
    """What a resumed pull must not fetch again: finished blobs plus saved partial parts."""
    return sum(saved.values()) + sum(
        store.blob_size(d.digest) for d in parse_manifest(raw).references()
        if store.has_blob(d.digest))


async def test_pull_follows_the_cdn_redirect_without_sending_credentials(
        tmp_path: Path, source: Store, target: Store) -> None:
    with registry_with_cdn(tmp_path, source, cdn_host="cdn.test", token_auth=True) as (
            host, cdn, log):
        name = f"{host}/ns/model:v1"
        raw = await _publish(source, name, [3 * MiB + 17, 4096, 1], tmp_path)
        events: list[dict] = []
        options = fast_options(tmp_path / "client", insecure=True,
                               resolver=StaticResolver({"cdn.test": "127.0.0.1"}))
        await pull(name, target, options, events.append)
    assert target.read_manifest(Name.parse(name)) == raw
    for desc in parse_manifest(raw).references():
        assert target.blob_path(desc.digest).read_bytes() == source.read_blob(desc.digest)
    assert cdn.requests and all("authorization" not in r for r in cdn.requests)
    assert all(r["host"].startswith("cdn.test:") for r in cdn.requests)
    assert "Bearer token-for-tests" in log.authorizations  # the registry itself did get it
    statuses = [e["status"] for e in events]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    big = next(e for e in reversed(events) if e.get("total") == 3 * MiB + 17)
    assert big["completed"] == big["total"] and big["status"].startswith("pulling ")
    assert _partials(target) == []


async def test_a_cdn_on_a_loopback_address_is_refused_without_insecure(
        tmp_path: Path, source: Store, target: Store) -> None:
    """The user-named https registry is reachable; its redirect to a loopback CDN is not."""
    from registry.service.app import build_registry_app

    from .fakes import BlobCDN, RedirectBlobs
    from .tls import tls_server

    cdn = BlobCDN(source)
    with tls_server(cdn.app, "127.0.0.2", tmp_path) as (cdn_url, ca_file):
        app = RedirectBlobs(build_registry_app(tmp_path / "registry"), cdn_url)
        with tls_server(app, "127.0.0.1", tmp_path) as (reg_url, _):
            name = f"{reg_url.removeprefix('https://')}/ns/model:v1"
            raw = make_model(source, name, [1000])
            await push(name, source, fast_options(tmp_path / "p", ca_file=ca_file),
                       lambda e: None)
            with pytest.raises(RedirectRefused, match=r"127\.0\.0\.2.*loopback address"):
                await pull(name, target, fast_options(tmp_path / "c", ca_file=ca_file),
                           lambda e: None)
            assert cdn.requests == []
            # --insecure alone would mean plain http; the explicit scheme keeps https.
            await pull(f"https://{name}", target, fast_options(
                tmp_path / "c", ca_file=ca_file, insecure=True), lambda e: None)
    assert target.read_manifest(Name.parse(name)) == raw


@pytest.mark.parametrize("small_blob_max", [0, 4 * MiB], ids=["parts", "whole"])
async def test_a_wrong_blob_fails_the_pull_and_nothing_is_stored(
        tmp_path: Path, source: Store, target: Store, small_blob_max: int) -> None:
    with registry_with_cdn(tmp_path, source) as (host, cdn, _log):
        name = f"{host}/ns/model:v1"
        raw = await _publish(source, name, [600 * 1024], tmp_path)
        layer = parse_manifest(raw).layers[0]
        cdn.corrupt.add(str(layer.digest))
        options = fast_options(tmp_path / "c", insecure=True, small_blob_max=small_blob_max)
        with pytest.raises(DigestMismatch):
            await pull(name, target, options, lambda e: None)
    assert not target.has_blob(layer.digest)
    assert not target.manifest_path(Name.parse(name)).exists()
    assert _partials(target) == []


async def test_cancelled_pull_resumes_without_refetching_bytes_on_disk(
        tmp_path: Path, source: Store, target: Store) -> None:
    with registry_with_cdn(tmp_path, source) as (host, cdn, _log):
        name = f"{host}/ns/model:v1"
        raw = await _publish(source, name, [2 * MiB], tmp_path)
        total = parse_manifest(raw).total_size
        cdn.delay = 0.01
        options = fast_options(tmp_path / "c", insecure=True)
        task = asyncio.create_task(pull(name, target, options, lambda e: None))
        while cdn.bytes_served < 700 * 1024:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        saved = _saved_completed(target)
        on_disk = _bytes_on_disk(target, raw, saved)
        assert saved and 0 < on_disk < total
        cdn.delay = 0.0
        await _quiesce(cdn)
        cdn.bytes_served = 0
        await pull(name, target, options, lambda e: None)
    assert cdn.bytes_served == total - on_disk
    assert target.read_manifest(Name.parse(name)) == raw
    assert _partials(target) == []


_KILLED_PULL = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    sys.path[:0] = {paths!r}
    from registry.store import Store
    from transfer.helpers import fast_options
    from registry.transfer.pull import pull
    asyncio.run(pull({name!r}, Store({root!r}), fast_options(Path({home!r}), insecure=True),
                     lambda e: None))
""")


async def test_pull_killed_with_sigkill_resumes_from_its_part_states(
        tmp_path: Path, source: Store, target: Store) -> None:
    repo = Path(__file__).resolve().parents[3]
    with registry_with_cdn(tmp_path, source) as (host, cdn, _log):
        name = f"{host}/ns/model:v1"
        raw = await _publish(source, name, [2 * MiB], tmp_path)
        total = parse_manifest(raw).total_size
        cdn.delay = 0.01
        script = _KILLED_PULL.format(
            paths=[str(repo), str(repo / "tests" / "registry"), str(repo / "tests")],
            name=name, root=str(target.root), home=str(tmp_path / "c"))
        proc = subprocess.Popen([sys.executable, "-c", script])
        try:
            deadline = time.monotonic() + 60
            while cdn.bytes_served < 900 * 1024 and proc.poll() is None:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        saved = _saved_completed(target)
        on_disk = _bytes_on_disk(target, raw, saved)
        assert saved and 0 < on_disk < total
        cdn.delay = 0.0
        await _quiesce(cdn)
        cdn.bytes_served = 0
        await pull(name, target, fast_options(tmp_path / "c", insecure=True), lambda e: None)
    assert cdn.bytes_served == total - on_disk
    assert target.read_manifest(Name.parse(name)) == raw


async def test_pull_skips_present_blobs_and_bounds_concurrency(
        tmp_path: Path, source: Store, target: Store) -> None:
    with registry_with_cdn(tmp_path, source) as (host, cdn, _log):
        name = f"{host}/ns/model:v1"
        await _publish(source, name, [MiB, *[3000] * 12], tmp_path)
        cdn.delay = 0.002
        options = fast_options(tmp_path / "c", insecure=True, max_streams=3)
        await pull(name, target, options, lambda e: None)
        assert 1 < cdn.max_active <= 3
        cdn.bytes_served = 0
        events: list[dict] = []
        await pull(name, target, options, events.append)
    assert cdn.bytes_served == 0
    layer_events = [e for e in events if e["status"].startswith("pulling ") and "total" in e]
    assert layer_events and all(e["completed"] == e["total"] for e in layer_events)


@pytest.mark.parametrize("noprune", [False, True])
async def test_replacing_a_manifest_removes_blobs_only_it_used(
        tmp_path: Path, source: Store, target: Store, noprune: bool) -> None:
    with registry_with_cdn(tmp_path, source) as (host, _cdn, _log):
        name = f"{host}/ns/model:v1"
        old = await _publish(source, name, [5000, 6000], tmp_path, seed=1)
        options = fast_options(tmp_path / "c", insecure=True, noprune=noprune)
        await pull(name, target, options, lambda e: None)
        new = await _publish(source, name, [7000], tmp_path, seed=2)
        events: list[dict] = []
        await pull(name, target, options, events.append)
    old_only = parse_manifest(old).blob_digests() - parse_manifest(new).blob_digests()
    assert old_only
    assert all(target.has_blob(d) == noprune for d in old_only)
    assert ("removing unused layers" in [e["status"] for e in events]) != noprune
    assert all(target.has_blob(d) for d in parse_manifest(new).blob_digests())


async def test_a_body_cut_short_is_retried_from_where_it_stopped(
        tmp_path: Path, source: Store, target: Store) -> None:
    with registry_with_cdn(tmp_path, source) as (host, cdn, _log):
        name = f"{host}/ns/model:v1"
        raw = await _publish(source, name, [MiB], tmp_path)
        cdn.cut_after = 128 * 1024  # every response stops after 128 KiB
        options = fast_options(tmp_path / "c", insecure=True, max_streams=1, part_min=MiB,
                               part_max=MiB,
                               retry=RetryPolicy(attempts=20, initial=0.001, cap=0.01))
        await pull(name, target, options, lambda e: None)
    assert target.read_manifest(Name.parse(name)) == raw
    assert cdn.bytes_served == parse_manifest(raw).total_size  # no byte fetched twice


def test_pull_of_an_http_name_without_insecure_fails_before_any_request(
        tmp_path: Path, target: Store) -> None:
    from registry.transfer.errors import TransferError

    with pytest.raises(TransferError, match="insecure protocol http"):
        asyncio.run(pull("http://127.0.0.1:9/ns/m:t", target, fast_options(tmp_path),
                         lambda e: None))
    assert not os.path.exists(target.root)


async def test_a_stalled_body_is_retried_after_the_stall_timeout(
        tmp_path: Path, source: Store, target: Store) -> None:
    with registry_with_cdn(tmp_path, source) as (host, cdn, _log):
        name = f"{host}/ns/model:v1"
        raw = await _publish(source, name, [512 * 1024], tmp_path)
        cdn.stall_once = 2.0
        options = fast_options(tmp_path / "c", insecure=True, stall_timeout=0.3,
                               max_streams=1, part_min=MiB, part_max=MiB)
        await pull(name, target, options, lambda e: None)
        layer_requests = [r for r in cdn.requests if "range" in r]
    assert target.read_manifest(Name.parse(name)) == raw
    assert len(layer_requests) >= 2  # the stalled body, and its resumption
    assert any(not r["range"].startswith("bytes=0-") for r in layer_requests)


async def test_two_pulls_of_one_model_at_once_download_each_blob_once(
        tmp_path: Path, source: Store, target: Store) -> None:
    with registry_with_cdn(tmp_path, source) as (host, cdn, _log):
        name = f"{host}/ns/model:v1"
        raw = await _publish(source, name, [MiB, 2000], tmp_path)
        cdn.delay = 0.002
        options = fast_options(tmp_path / "c", insecure=True)
        await asyncio.gather(pull(name, target, options, lambda e: None),
                             pull(name, target, options, lambda e: None))
    assert cdn.bytes_served == parse_manifest(raw).total_size
    assert target.read_manifest(Name.parse(name)) == raw
    assert _partials(target) == []
