"""OCI registry release store: a release is one OCI artifact manifest, tagged with the version.

    <repo>:v1.2.0              artifactType application/vnd.ferry.release.v1; one layer per
                               asset (`org.opencontainers.image.title` = file name); the git
                               tag in the `org.ferry.release.tag` annotation
    <repo>:v1.2.0.ferry-lease  the lease: holder and expiry annotations, no payload

Assets are content-addressed blobs, so an upload is "push the blob, then rewrite the manifest
with that layer replaced"; the rewrite is a read-modify-write done under an in-process lock
(the lease keeps other processes out). The distribution API has no conditional tag writes, so
the lock tag uses Fischer's timed mutual exclusion: read (free or expired), write our claim,
wait `settle` seconds, read again and hold the lease only if our claim survived. That is safe
as long as a contender's read-to-write gap (one HTTP round trip) is shorter than `settle`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from registry import bounded_json
from registry import media_types as mt
from registry.errors import FerryError
from registry.manifests import MAX_MANIFEST_BYTES
from registry.transfer.auth import Authenticator
from registry.transfer.client import send_authorized
from registry.transfer.errors import TransientStatus
from registry.transfer.safe import DnsResolver, RedirectPolicy, Resolver, shown
from registry.transfer.session import SafeSession, build_ssl_context
from workflows.release.store import (
    LeaseHeld,
    LeaseLost,
    LocalAsset,
    Progress,
    ReleaseRef,
    RemoteAsset,
    StoreError,
    transient_status,
)

ARTIFACT_TYPE = "application/vnd.ferry.release.v1"
LEASE_TYPE = "application/vnd.ferry.release.lease.v1"
TITLE = "org.opencontainers.image.title"
TAG_ANNOTATION = "org.ferry.release.tag"
HOLDER, EXPIRES = "org.ferry.lease.holder", "org.ferry.lease.expires"
EMPTY_DIGEST = "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
EMPTY: dict[str, Any] = {"mediaType": mt.OCI_EMPTY, "size": 2, "digest": EMPTY_DIGEST}


class OCILease:
    def __init__(self, store: OCIReleaseStore, tag: str, holder: str, expires_at: float) -> None:
        self._store, self._tag = store, tag
        self.holder, self.expires_at = holder, expires_at

    def renew(self, ttl: float) -> None:
        current = self._store._get_manifest(self._tag)
        if current is None or _annotation(current, HOLDER) != self.holder:
            raise LeaseLost(f"the lock tag {self._tag} now belongs to another run")
        expires_at = time.time() + ttl
        self._store._put_lease(self._tag, self.holder, expires_at)
        self.expires_at = expires_at

    def release(self) -> None:
        try:
            current = self._store._get_manifest(self._tag)
            if current is not None and _annotation(current, HOLDER) == self.holder:
                self._store._put_lease(self._tag, self.holder, 0.0)  # expired: free for all
        except StoreError:
            pass  # it expires on its own


def _annotation(manifest: dict[str, Any], key: str) -> str:
    return str((manifest.get("annotations") or {}).get(key, ""))


class OCIReleaseStore:
    """The release store over one repository. Its HTTP is the transfer client's (one registry
    client, not two): `SafeSession` checks and pins every hop, `Authenticator` answers Bearer
    and Basic challenges with the user's `ferry login` credentials or key, and a token goes
    only to the registry's own origin, upload `Location`s included. The store's methods are
    synchronous (the publish job runs them on threads), so the async client runs on a private
    event loop thread."""

    def __init__(self, host: str, repo: str, insecure: bool = False, settle: float = 1.0,
                 home: Path | None = None, ca_file: str = "",
                 resolver: Resolver | None = None) -> None:
        self.host, self.repo, self.settle = host, repo, settle
        self.description = f"oci://{host}/{repo}"
        scheme = "http" if insecure else "https"
        self.base = f"{scheme}://{host}/v2/{repo}"
        registry = httpx.URL(f"{scheme}://{host}")
        home = home or Path.home() / ".ferry"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="ferry-release-oci")
        self._thread.start()
        policy = RedirectPolicy(registry, insecure, resolver or DnsResolver())
        self.session = SafeSession(policy, build_ssl_context(ca_file), stall_timeout=60.0)
        self.auth = Authenticator(self.session, home / "credentials.json", home / "id_ed25519")
        self._manifest_lock = threading.Lock()
        self._config_pushed = False

    # -- HTTP ---------------------------------------------------------------------------------

    def _call(self, method: str, url: str, ok: tuple[int, ...], *,
              headers: dict[str, str] | None = None, content: Any = None) -> _Answer:
        """One request (one 401 answered with a token), its body read; classified errors."""
        future = asyncio.run_coroutine_threadsafe(
            self._request(method, url, headers, content), self._loop)
        try:
            answer = future.result()
        except (httpx.TransportError, TransientStatus) as exc:
            raise StoreError(f"{method} {shown(httpx.URL(url))}: {exc!r}", transient=True
                             ) from exc
        except (FerryError, httpx.HTTPError) as exc:
            raise StoreError(f"{method} {shown(httpx.URL(url))}: {exc}", transient=False) from exc
        if answer.status not in ok:
            raise StoreError(f"{method} {shown(httpx.URL(url))}: {answer.status} "
                             f"{answer.text[:200]}",
                             transient=transient_status(answer.status), status=answer.status)
        return answer

    async def _request(self, method: str, url: str, headers: dict[str, str] | None,
                       content: Any) -> _Answer:
        body = _async_body(content) if content is not None and not isinstance(
            content, bytes) else content
        reply = await send_authorized(self.session, self.auth, method, url, headers=headers,
                                      content=body)
        # Every reply read here is a manifest or a small status body: capped like a manifest,
        # so a misbehaving registry cannot make the publisher hold an unbounded body.
        data = await reply.read_capped(MAX_MANIFEST_BYTES, "registry reply")
        return _Answer(reply.status, reply.response.headers, data, reply.url)

    # -- manifests ----------------------------------------------------------------------------

    def _get_manifest(self, tag: str) -> dict[str, Any] | None:
        response = self._call("GET", f"{self.base}/manifests/{tag}", ok=(200, 404),
                              headers={"Accept": mt.OCI_MANIFEST})
        return None if response.status == 404 else dict(response.json())

    def _put_manifest(self, tag: str, manifest: dict[str, Any]) -> None:
        self._ensure_config()
        raw = json.dumps(manifest, separators=(",", ":"), sort_keys=True).encode()
        self._call("PUT", f"{self.base}/manifests/{tag}", ok=(201,), content=raw,
                   headers={"Content-Type": mt.OCI_MANIFEST})

    def _manifest(self, artifact_type: str, layers: list[dict[str, Any]],
                  annotations: dict[str, str]) -> dict[str, Any]:
        return {"schemaVersion": 2, "mediaType": mt.OCI_MANIFEST, "artifactType": artifact_type,
                "config": dict(EMPTY), "layers": layers, "annotations": annotations}

    def _ensure_config(self) -> None:
        if not self._config_pushed:
            self._push_blob(EMPTY_DIGEST, 2, [b"{}"], lambda sent: None)
            self._config_pushed = True

    # -- lease --------------------------------------------------------------------------------

    def _put_lease(self, tag: str, holder: str, expires_at: float) -> None:
        annotations = {HOLDER: holder, EXPIRES: f"{expires_at:.3f}"}
        self._put_manifest(tag, self._manifest(LEASE_TYPE, [dict(EMPTY)], annotations))

    def _live_holder(self, tag: str) -> tuple[str, float] | None:
        current = self._get_manifest(tag)
        if current is None:
            return None
        expires_at = float(_annotation(current, EXPIRES) or 0)
        return (_annotation(current, HOLDER), expires_at) if expires_at > time.time() else None

    def acquire_lease(self, ref: ReleaseRef, holder: str, ttl: float) -> OCILease:
        tag = f"{ref.name}.ferry-lease"
        live = self._live_holder(tag)
        if live is not None and live[0] != holder:
            raise LeaseHeld(*live)
        expires_at = time.time() + ttl
        self._put_lease(tag, holder, expires_at)
        time.sleep(self.settle)
        live = self._live_holder(tag)
        if live is None or live[0] != holder:
            raise LeaseHeld(*(live or ("(another run, just now)", None)))
        return OCILease(self, tag, holder, expires_at)

    # -- release ------------------------------------------------------------------------------

    def retag(self, ref: ReleaseRef) -> str:
        with self._manifest_lock:
            current = self._get_manifest(ref.name)
            if current is None:
                layers: list[dict[str, Any]] = []
                action = "created"
            else:
                layers = list(current.get("layers", []))
                old = _annotation(current, TAG_ANNOTATION)
                action = "unchanged" if old == ref.tag else f"moved from {old}"
            self._put_manifest(ref.name, self._release_manifest(ref, layers))
        return action

    def _release_manifest(self, ref: ReleaseRef, layers: list[dict[str, Any]]) -> dict[str, Any]:
        annotations = {TAG_ANNOTATION: ref.tag, "org.opencontainers.image.version": ref.name,
                       "org.ferry.release.prerelease": str(ref.prerelease).lower()}
        ordered = sorted(layers, key=lambda layer: _annotation(layer, TITLE))
        return self._manifest(ARTIFACT_TYPE, ordered, annotations)

    def _rewrite_layers(self, ref: ReleaseRef, name: str, layer: dict[str, Any] | None) -> None:
        """Replace (or with None, drop) the layer titled `name`, from a fresh manifest read."""
        with self._manifest_lock:
            current = self._get_manifest(ref.name) or {}
            layers = [x for x in current.get("layers", []) if _annotation(x, TITLE) != name]
            if layer is not None:
                layers.append(layer)
            self._put_manifest(ref.name, self._release_manifest(ref, layers))

    def list_assets(self, ref: ReleaseRef, with_digests: bool = False) -> list[RemoteAsset]:
        current = self._get_manifest(ref.name) or {}
        return [RemoteAsset(name=_annotation(layer, TITLE), size=int(layer["size"]),
                            sha256=str(layer["digest"]).split(":", 1)[1],
                            handle=str(layer["digest"]))
                for layer in current.get("layers", [])]

    def delete_asset(self, ref: ReleaseRef, asset: RemoteAsset) -> None:
        self._rewrite_layers(ref, asset.name, None)

    def upload_asset(self, ref: ReleaseRef, asset: LocalAsset, progress: Progress) -> None:
        digest = f"sha256:{asset.sha256}"
        self._push_blob(digest, asset.size, asset.read_chunks(progress), progress)
        layer = {"mediaType": "application/octet-stream", "digest": digest, "size": asset.size,
                 "annotations": {TITLE: asset.name}}
        self._rewrite_layers(ref, asset.name, layer)

    def _push_blob(self, digest: str, size: int, content: Any, progress: Progress) -> None:
        """POST a session, then PUT the whole blob with its digest (skipped if present)."""
        if self._call("HEAD", f"{self.base}/blobs/{digest}", ok=(200, 404)).status == 200:
            progress(size)
            return
        started = self._call("POST", f"{self.base}/blobs/uploads/", ok=(202,))
        location = started.url.join(started.headers.get("location", ""))
        self._call("PUT", str(location.copy_merge_params({"digest": digest})), ok=(201,),
                   content=content, headers={"Content-Type": "application/octet-stream",
                                             "Content-Length": str(size)})

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.session.aclose(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@dataclass(frozen=True)
class _Answer:
    status: int
    headers: httpx.Headers
    content: bytes
    url: httpx.URL

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return bounded_json.loads(self.content)


def _async_body(chunks: Iterable[bytes]) -> Callable[[], AsyncIterator[bytes]]:
    """A sync iterable of chunks as the session's streamed body (read once: no 401 replay;
    the publish job retries the whole upload instead)."""
    async def stream() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk
    return stream

