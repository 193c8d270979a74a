"""STORE specs -> ReleaseStore: `s3://BUCKET/PREFIX`, `github://OWNER/REPO`, `oci://HOST/NS/REPO`."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from workflows.release.store import ReleaseError, ReleaseStore


@dataclass(frozen=True)
class StoreOptions:
    """What the stores need from flags and settings; each store reads only its own fields."""

    github_token: str | None = None
    api_url: str | None = None  # GitHub (Enterprise) API base
    endpoint_url: str | None = None  # S3-compatible endpoint
    insecure: bool = False  # OCI over plain HTTP
    oci_settle: float = 1.0  # OCI lock tag: wait this long before trusting our claim


def open_store(spec: str, options: StoreOptions) -> ReleaseStore:
    """Parse a STORE spec and build its store; raises ReleaseError for a spec it cannot use."""
    scheme, _, rest = spec.partition("://")
    parts = urlsplit(f"//{rest}")
    path = parts.path.strip("/")
    if scheme == "s3" and parts.netloc:
        from workflows.release.s3 import S3ReleaseStore

        return S3ReleaseStore(parts.netloc, path, endpoint_url=options.endpoint_url)
    if scheme == "github" and parts.netloc and path and "/" not in path:
        from workflows.release.github import GitHubReleaseStore

        return GitHubReleaseStore(parts.netloc, path, token=options.github_token,
                                  api_url=options.api_url or "https://api.github.com")
    if scheme == "oci" and parts.netloc and path:
        from workflows.release.oci import OCIReleaseStore

        return OCIReleaseStore(parts.netloc, path, insecure=options.insecure,
                               settle=options.oci_settle)
    raise ReleaseError(f"store {spec!r} is not s3://BUCKET/PREFIX, github://OWNER/REPO "
                       "or oci://HOST/NS/REPO")
