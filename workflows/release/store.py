"""The contract between the release job and the places releases live.

A store knows how to hold a lease, create or retag a release, and list, delete and upload its
assets. Everything about order, retries and verification lives in `job.py`, so the three stores
stay small and behave alike. Stores raise `StoreError` (transient or not) for every remote
failure, so the job can classify before it retries.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

_TAG_RE = re.compile(r"^v\d+\.\d+\.\d+(?:-[0-9A-Za-z][0-9A-Za-z.]*)?$")


class ReleaseError(Exception):
    """Base of the release workflow's errors; the message is what the CLI prints."""


class StoreError(ReleaseError):
    """A remote call failed. `transient` errors (connection, timeout, 429, 5xx) are retried."""

    def __init__(self, message: str, *, transient: bool, status: int | None = None) -> None:
        super().__init__(message)
        self.transient = transient
        self.status = status


class LeaseHeld(ReleaseError):
    """Another run holds the release's lease (or is visibly mid-upload)."""

    def __init__(self, holder: str, expires_at: float | None) -> None:
        until = f" until {expires_at:.0f} (unix time)" if expires_at is not None else ""
        super().__init__(f"another run holds the release lease: {holder}{until}")
        self.holder = holder
        self.expires_at = expires_at


class LeaseLost(ReleaseError):
    """Our lease expired or was taken over while we ran: stop before publishing anything more."""


def transient_status(status: int) -> bool:
    """HTTP statuses worth retrying: throttling and server errors."""
    return status == 429 or status >= 500


@dataclass(frozen=True)
class ReleaseRef:
    """A git tag and the release it belongs to: `v1.2.0-rc2` belongs to release `v1.2.0`."""

    tag: str
    name: str
    prerelease: bool

    @classmethod
    def from_tag(cls, tag: str) -> ReleaseRef:
        if not _TAG_RE.match(tag):
            raise ReleaseError(f"tag {tag!r} is not vX.Y.Z or vX.Y.Z-SUFFIX")
        name = tag.split("-", 1)[0]
        return cls(tag=tag, name=name, prerelease=name != tag)


@dataclass(frozen=True)
class LocalAsset:
    """A file to publish, hashed once up front; uploads and verification use these numbers."""

    name: str
    path: Path
    size: int
    sha256: str  # hex

    def read_chunks(self, progress: Progress, chunk_size: int = 256 * 1024) -> Iterator[bytes]:
        """The file's bytes for an upload body, reporting bytes sent as they go."""
        sent = 0
        with self.path.open("rb") as handle:
            while chunk := handle.read(chunk_size):
                sent += len(chunk)
                progress(sent)
                yield chunk


@dataclass(frozen=True)
class RemoteAsset:
    """An asset as a store lists it. `sha256` is None where the store gives no digest."""

    name: str
    size: int
    sha256: str | None = None
    handle: str = ""  # store-specific id (GitHub asset id, S3 key, OCI layer digest)


Progress = Callable[[int], None]  # bytes sent so far for the current attempt


class Lease(Protocol):
    """An exclusive, expiring claim on one release."""

    holder: str
    expires_at: float

    def renew(self, ttl: float) -> None:
        """Extend the claim by `ttl` seconds from now; raise LeaseLost if it is no longer ours."""

    def release(self) -> None:
        """Give the claim up; never raises for a claim that is already gone."""


class ReleaseStore(Protocol):
    """Where releases live. Methods are called from worker threads, so keep them thread-safe."""

    description: str

    def acquire_lease(self, ref: ReleaseRef, holder: str, ttl: float) -> Lease:
        """Take the release's lease atomically, or raise LeaseHeld naming the holder."""

    def retag(self, ref: ReleaseRef) -> str:
        """Point the release named `ref.name` at `ref.tag`, creating it if needed; say what
        was done ("created", "moved from v1.2.0-rc1", "unchanged")."""

    def list_assets(self, ref: ReleaseRef, with_digests: bool = False) -> list[RemoteAsset]:
        """The release's assets now (never cached), excluding the store's own lease marker."""

    def delete_asset(self, ref: ReleaseRef, asset: RemoteAsset) -> None:
        """Remove one asset; an asset that is already gone is not an error."""

    def upload_asset(self, ref: ReleaseRef, asset: LocalAsset, progress: Progress) -> None:
        """Upload one file under its name, replacing a same-named asset (a retry after a
        lost response must succeed)."""

    def close(self) -> None:
        """Release connections."""
