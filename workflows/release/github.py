"""GitHub Releases store (REST API v3; `api_url` points at GitHub Enterprise if needed).

Serializing runs on GitHub has two layers: the workflow's `concurrency` group (one release job
per version at a time, see `.github/workflows/release.yaml`) and, inside ferry, a lease asset
named `ferry-release.lease` on the release. Asset names are unique per release, so uploading it
is an atomic create; its label carries the holder and expiry and is renewed in place. A run
also refuses to start while another asset is visibly mid-upload (state other than "uploaded",
updated within the lease lifetime). The lease asset is never listed as a release asset.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import httpx

from workflows.release.store import (
    LeaseHeld,
    LeaseLost,
    LocalAsset,
    Progress,
    ReleaseError,
    ReleaseRef,
    RemoteAsset,
    StoreError,
    transient_status,
)

LEASE_ASSET = "ferry-release.lease"


def _label(holder: str, expires_at: float) -> str:
    return f"lease {holder} until {expires_at:.3f}"


def _label_expiry(label: str | None) -> float:
    try:
        return float((label or "").rsplit(" ", 1)[1])
    except (IndexError, ValueError):
        return 0.0  # unreadable: treat as expired rather than block releases forever


def _label_holder(label: str | None) -> str:
    parts = (label or "").split(" ")
    return parts[1] if len(parts) == 4 else "(unknown)"


class GitHubLease:
    def __init__(self, store: GitHubReleaseStore, asset_id: int, holder: str,
                 expires_at: float) -> None:
        self._store, self._asset_id = store, asset_id
        self.holder, self.expires_at = holder, expires_at

    def renew(self, ttl: float) -> None:
        expires_at = time.time() + ttl
        response = self._store._call("PATCH", self._store._repo(f"releases/assets/"
                                                                f"{self._asset_id}"),
                                     json={"label": _label(self.holder, expires_at)},
                                     ok=(200, 404))
        if response.status_code == 404:
            raise LeaseLost("the lease asset was removed: another run took the release over")
        self.expires_at = expires_at

    def release(self) -> None:
        with contextlib.suppress(StoreError):  # if unreachable, it expires on its own
            self._store._call("DELETE", self._store._repo(f"releases/assets/{self._asset_id}"),
                              ok=(204, 404))


class GitHubReleaseStore:
    def __init__(self, owner: str, repo: str, token: str | None, api_url: str,
                 transport: httpx.BaseTransport | None = None) -> None:
        if not token:
            raise ReleaseError("GITHUB_TOKEN is not set; the GitHub Releases API needs a token")
        self.owner, self.repo = owner, repo
        self.description = f"github://{owner}/{repo}"
        self.api_url = api_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/vnd.github+json",
                   "X-GitHub-Api-Version": "2022-11-28", "User-Agent": "ferry-release"}
        self.client = httpx.Client(headers=headers, timeout=httpx.Timeout(60, connect=10),
                                   transport=transport, follow_redirects=False)
        self._release: dict[str, Any] | None = None
        self._created = False
        self._lock = threading.Lock()

    def _repo(self, path: str) -> str:
        return f"{self.api_url}/repos/{self.owner}/{self.repo}/{path}"

    def _call(self, method: str, url: str, ok: tuple[int, ...] = (200,),
              **kwargs: Any) -> httpx.Response:
        """One request; any status outside `ok` becomes a classified StoreError."""
        try:
            response = self.client.request(method, url, **kwargs)
        except httpx.TransportError as exc:
            raise StoreError(f"{method} {url}: {exc!r}", transient=True) from exc
        if response.status_code not in ok:
            detail = response.text[:200]
            raise StoreError(f"{method} {url}: {response.status_code} {detail}",
                             transient=transient_status(response.status_code),
                             status=response.status_code)
        return response

    def _pages(self, url: str) -> Iterator[dict[str, Any]]:
        """Every item of a paginated listing, following `Link: rel="next"`."""
        next_url: str | None = f"{url}?per_page=100"
        while next_url:
            response = self._call("GET", next_url)
            yield from response.json()
            next_url = response.links.get("next", {}).get("url")

    def _find_release(self, ref: ReleaseRef) -> dict[str, Any] | None:
        for release in self._pages(self._repo("releases")):
            if release.get("name") == ref.name:
                return release
        return None

    def _ensure_release(self, ref: ReleaseRef) -> dict[str, Any]:
        with self._lock:
            if self._release is None:
                self._release = self._find_release(ref)
            if self._release is None:
                body = {"tag_name": ref.tag, "name": ref.name, "draft": True,
                        "prerelease": ref.prerelease, "generate_release_notes": True}
                self._release = self._call("POST", self._repo("releases"), ok=(201,),
                                           json=body).json()
                self._created = True
            return self._release

    def _raw_assets(self, ref: ReleaseRef) -> list[dict[str, Any]]:
        release = self._ensure_release(ref)
        return list(self._pages(self._repo(f"releases/{release['id']}/assets")))

    def acquire_lease(self, ref: ReleaseRef, holder: str, ttl: float) -> GitHubLease:
        now = time.time()
        for asset in self._raw_assets(ref):
            if asset["name"] == LEASE_ASSET:
                expires_at = _label_expiry(asset.get("label"))
                if expires_at > now:
                    raise LeaseHeld(_label_holder(asset.get("label")), expires_at)
                self._call("DELETE", self._repo(f"releases/assets/{asset['id']}"), ok=(204, 404))
            elif asset.get("state", "uploaded") != "uploaded" and _recent(asset, now, ttl):
                raise LeaseHeld(f"a run that is mid-upload ({asset['name']} is "
                                f"{asset.get('state')})", None)
        expires_at = now + ttl
        response = self._upload(ref, LEASE_ASSET, json.dumps({"holder": holder}).encode(),
                                label=_label(holder, expires_at), ok=(201, 422))
        if response.status_code == 422:
            raise LeaseHeld("(another run created its lease first)", None)
        return GitHubLease(self, int(response.json()["id"]), holder, expires_at)

    def retag(self, ref: ReleaseRef) -> str:
        release = self._ensure_release(ref)
        if self._created:
            return "created"
        if release.get("tag_name") == ref.tag:
            return "unchanged"
        updated = self._call("PATCH", self._repo(f"releases/{release['id']}"),
                             json={"tag_name": ref.tag}).json()
        with self._lock:
            self._release = updated
        return f"moved from {release.get('tag_name')}"

    def list_assets(self, ref: ReleaseRef, with_digests: bool = False) -> list[RemoteAsset]:
        out = []
        for asset in self._raw_assets(ref):
            if asset["name"] == LEASE_ASSET:
                continue
            digest = asset.get("digest") or ""
            sha = digest.split(":", 1)[1] if digest.startswith("sha256:") else None
            out.append(RemoteAsset(name=asset["name"], size=int(asset["size"]), sha256=sha,
                                   handle=str(asset["id"])))
        return out

    def delete_asset(self, ref: ReleaseRef, asset: RemoteAsset) -> None:
        self._call("DELETE", self._repo(f"releases/assets/{asset.handle}"), ok=(204, 404))

    def upload_asset(self, ref: ReleaseRef, asset: LocalAsset, progress: Progress) -> None:
        response = self._upload(ref, asset.name, asset.read_chunks(progress), ok=(201, 422),
                                size=asset.size)
        if response.status_code != 422:
            return
        # The name exists: an earlier attempt stored it but its answer was lost (or a stale
        # asset appeared). Keep it if it is exactly our file, else replace it.
        for old in self.list_assets(ref):
            if old.name != asset.name:
                continue
            if old.sha256 == asset.sha256 and old.size == asset.size:
                return
            self.delete_asset(ref, old)
        self._upload(ref, asset.name, asset.read_chunks(progress), ok=(201,), size=asset.size)

    def _upload(self, ref: ReleaseRef, name: str, content: Any, ok: tuple[int, ...],
                label: str | None = None, size: int | None = None) -> httpx.Response:
        upload_url = self._ensure_release(ref)["upload_url"].split("{", 1)[0]
        params = {"name": name, **({"label": label} if label else {})}
        length = size if size is not None else len(content)
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(length)}
        return self._call("POST", upload_url, ok=ok, params=params, content=content,
                          headers=headers)

    def close(self) -> None:
        self.client.close()


def _recent(asset: dict[str, Any], now: float, ttl: float) -> bool:
    stamp = asset.get("updated_at")
    if not stamp:
        return True
    return now - datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() < ttl

