"""The release job, in this order, each step before the next:

1. checksums: hash every file in the dist dir, write `sha256sum.txt`;
2. lease: take the release's exclusive lease (wait or fail), renewed while the job runs;
3. retag: create the release, or move the existing one to the new tag;
4. delete every old asset, re-listing before each retry (never a stale list);
5. upload the payloads in parallel, each retried after the configured delays;
6. only if every payload succeeded, upload `sha256sum.txt` (same retries);
7. verify: list the release and check names, sizes and digests against the manifest.

A failure in 4-6 leaves no checksum file behind, so consumers never see a manifest that
lists a payload that is missing or stale.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from workflows.release import checksums
from workflows.release.lease import LeaseKeeper, acquire, new_holder
from workflows.release.retries import call_with_retries
from workflows.release.store import (
    LeaseHeld,
    LocalAsset,
    ReleaseError,
    ReleaseRef,
    ReleaseStore,
    RemoteAsset,
    StoreError,
)


@dataclass(frozen=True)
class PublishOptions:
    retry_delays: tuple[float, ...] = (15.0, 30.0)
    parallel: int = 8
    lease_ttl: float = 300.0
    lease_wait: float = 900.0
    lease_poll: float = 5.0


@dataclass(frozen=True)
class Event:
    """What the job reports as it goes. kind: step, start, progress, retry, done, failed."""

    kind: str
    message: str = ""
    asset: str | None = None
    completed: int = 0
    total: int = 0
    delay: float = 0.0


@dataclass
class AssetResult:
    name: str
    size: int
    attempts: int = 0
    status: str = "pending"  # pending, uploaded, failed, skipped
    error: str | None = None


@dataclass
class PublishReport:
    ref: ReleaseRef
    assets: list[AssetResult] = field(default_factory=list)
    retag: str = ""
    deleted: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(a.status == "uploaded" for a in self.assets)


Emit = Callable[[Event], None]


def publish(store: ReleaseStore, tag: str, dist: Path, options: PublishOptions,
            emit: Emit = lambda event: None, sleep: Callable[[float], None] = time.sleep,
            holder: str | None = None) -> PublishReport:
    """Run the whole job; the report says what happened (`report.ok` only on full success).
    Raises ReleaseError for failures before the uploads (bad tag, lease held)."""
    ref = ReleaseRef.from_tag(tag)
    report = PublishReport(ref=ref)
    emit(Event("step", f"hashing files in {dist}"))
    payloads = checksums.scan_dist(dist)
    manifest = checksums.write_checksum_file(dist, payloads)
    report.assets = [AssetResult(a.name, a.size) for a in [*payloads, manifest]]
    emit(Event("step", f"taking the lease on release {ref.name} in {store.description}"))

    def on_wait(held: LeaseHeld) -> None:
        emit(Event("step", f"waiting: {held}"))

    lease = acquire(store, ref, holder or new_holder(), options.lease_ttl, options.lease_wait,
                    options.lease_poll, sleep, options.retry_delays, on_wait)
    with LeaseKeeper(lease, options.lease_ttl) as keeper:
        _run_locked(store, ref, payloads, manifest, options, emit, sleep, keeper, report)
    return report


def _run_locked(store: ReleaseStore, ref: ReleaseRef, payloads: list[LocalAsset],
                manifest: LocalAsset, options: PublishOptions, emit: Emit,
                sleep: Callable[[float], None], keeper: LeaseKeeper,
                report: PublishReport) -> None:
    results = {r.name: r for r in report.assets}
    delays = options.retry_delays
    report.retag = call_with_retries(lambda: store.retag(ref), delays, sleep)
    emit(Event("step", f"release {ref.name} -> tag {ref.tag}: {report.retag}"))
    keeper.check()
    report.deleted = delete_old_assets(store, ref, delays, sleep, emit)
    keeper.check()
    upload_all(store, ref, payloads, results, options, emit, sleep, keeper)
    failed = [r.name for r in report.assets if r.status == "failed"]
    if failed:
        results[manifest.name].status = "skipped"
        report.problems.append(f"not uploading {manifest.name}: failed: {', '.join(failed)}")
        return
    keeper.check()
    _upload_one(store, ref, manifest, results[manifest.name], delays, emit, sleep, keeper)
    if results[manifest.name].status != "uploaded":
        report.problems.append(f"{manifest.name} failed: {results[manifest.name].error}")
        return
    emit(Event("step", "verifying the release"))
    report.problems += verify(call_with_retries(
        lambda: store.list_assets(ref, with_digests=True), delays, sleep), [*payloads, manifest])


def delete_old_assets(store: ReleaseStore, ref: ReleaseRef, delays: Sequence[float],
                      sleep: Callable[[float], None], emit: Emit) -> int:
    """Delete every asset the release holds, the checksum file first; each retry starts from
    a fresh listing."""
    deleted = 0

    def attempt() -> None:
        nonlocal deleted
        failures = []
        # The old checksum file goes first, so it never lists payloads already deleted.
        listing = store.list_assets(ref)
        for asset in sorted(listing, key=lambda a: a.name != checksums.CHECKSUM_FILE):
            try:
                store.delete_asset(ref, asset)
                deleted += 1
            except StoreError as exc:
                if not exc.transient:
                    raise
                failures.append(f"{asset.name}: {exc}")
        if failures:
            raise StoreError("could not delete " + "; ".join(failures), transient=True)

    def on_retry(attempt_no: int, delay: float, exc: StoreError) -> None:
        emit(Event("retry", f"deleting old assets: {exc}", delay=delay))

    call_with_retries(attempt, delays, sleep, on_retry)
    emit(Event("step", f"deleted {deleted} old asset(s)"))
    return deleted


def upload_all(store: ReleaseStore, ref: ReleaseRef, payloads: list[LocalAsset],
               results: dict[str, AssetResult], options: PublishOptions, emit: Emit,
               sleep: Callable[[float], None], keeper: LeaseKeeper) -> None:
    """Upload the payloads with at most `options.parallel` in flight."""
    with ThreadPoolExecutor(max_workers=max(1, options.parallel),
                            thread_name_prefix="release-upload") as pool:
        futures = [pool.submit(_upload_one, store, ref, asset, results[asset.name],
                               options.retry_delays, emit, sleep, keeper)
                   for asset in payloads]
        for future in futures:
            future.result()


def _upload_one(store: ReleaseStore, ref: ReleaseRef, asset: LocalAsset, result: AssetResult,
                delays: Sequence[float], emit: Emit, sleep: Callable[[float], None],
                keeper: LeaseKeeper) -> None:
    """Upload one asset with retries; record the outcome in `result` instead of raising."""
    emit(Event("start", asset=asset.name, total=asset.size))

    def progress(sent: int) -> None:
        emit(Event("progress", asset=asset.name, completed=min(sent, asset.size),
                   total=asset.size))

    def attempt() -> None:
        keeper.check()
        result.attempts += 1
        store.upload_asset(ref, asset, progress)

    def on_retry(attempt_no: int, delay: float, exc: StoreError) -> None:
        emit(Event("retry", f"attempt {attempt_no} failed: {exc}", asset=asset.name,
                   delay=delay))

    try:
        call_with_retries(attempt, delays, sleep, on_retry)
    except ReleaseError as exc:
        result.status, result.error = "failed", str(exc)
        emit(Event("failed", str(exc), asset=asset.name))
        return
    result.status = "uploaded"
    emit(Event("done", asset=asset.name, completed=asset.size, total=asset.size))


def verify(remote: list[RemoteAsset], expected: list[LocalAsset]) -> list[str]:
    """Compare the release's listing with what was meant to be there; one line per problem."""
    problems = []
    listed = {a.name: a for a in remote}
    for asset in expected:
        got = listed.pop(asset.name, None)
        if got is None:
            problems.append(f"{asset.name}: missing from the release")
        elif got.size != asset.size:
            problems.append(f"{asset.name}: size {got.size}, expected {asset.size}")
        elif got.sha256 is not None and got.sha256 != asset.sha256:
            problems.append(f"{asset.name}: sha256 {got.sha256}, expected {asset.sha256}")
    problems += [f"{name}: not part of this release's files" for name in sorted(listed)]
    return problems
