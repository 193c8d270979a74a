"""Manifests in a repository: their exact bytes (stored as blobs), the revision links that say a
repository holds them, and the referrer links that answer the referrers API.

A manifest is accepted only when everything it needs is already in the repository: its config
and layers (linked blobs of the declared size) and, for an index, its child manifests. Its
`subject` need not exist (OCI 1.1 lets a referrer arrive before its subject).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from registry import media_types as mt
from registry.digests import Digest
from registry.manifests import Manifest, parse_manifest
from registry.service import paths
from registry.service.blobs import Blobs
from registry.service.errors import RegistryError
from registry.service.storage.base import BlobStore, KeyNotFound


@dataclass(frozen=True)
class StoredManifest:
    digest: Digest
    media_type: str
    raw: bytes


class Revisions:
    def __init__(self, store: BlobStore, blobs: Blobs, max_bytes: int) -> None:
        self.store = store
        self.blobs = blobs
        self.max_bytes = max_bytes

    async def media_type(self, repo: str, digest: Digest) -> str | None:
        """The manifest's media type when `repo` holds it, else None."""
        try:
            return (await self.store.get(paths.revision_link(repo, digest))).decode()
        except KeyNotFound:
            return None

    async def get(self, repo: str, digest: Digest) -> StoredManifest:
        media_type = await self.media_type(repo, digest)
        if media_type is None:
            raise RegistryError("MANIFEST_UNKNOWN", detail={"digest": str(digest)})
        try:
            raw = await self.store.get(paths.blob(digest))
        except KeyNotFound as exc:
            raise RegistryError("MANIFEST_UNKNOWN", detail={"digest": str(digest)}) from exc
        return StoredManifest(digest, media_type, raw)

    async def put(self, repo: str, raw: bytes, content_type: str | None,
                  check_references: bool = True) -> Manifest:
        """Validate, check references, store the exact bytes and link them into `repo`.

        The pull-through cache stores a manifest before its blobs (it fetches them on demand),
        so it passes `check_references=False`; a push never does."""
        manifest = parse_manifest(raw, content_type, self.max_bytes)
        if check_references:
            await self._check_references(repo, manifest)
        digest = manifest.digest
        if await self.blobs.stat_anywhere(digest) is None:
            staged = paths.staging(paths.blob(digest), uuid.uuid4().hex)
            await self.store.put(staged, raw)
            await self.store.commit(paths.blob(digest), staged)
        await self.store.put(paths.revision_link(repo, digest), manifest.media_type.encode())
        if manifest.subject is not None:
            link = paths.referrer_link(repo, manifest.subject.digest, digest)
            await self.store.put(link, json.dumps(referrer_descriptor(manifest)).encode())
        return manifest

    async def _check_references(self, repo: str, manifest: Manifest) -> None:
        for desc in manifest.references():
            if desc in manifest.manifests:
                found = await self.media_type(repo, desc.digest) is not None
            else:
                stat = await self.blobs.stat_for_manifest(repo, desc.digest)
                found = stat is not None
                if stat is not None and stat.size != desc.size:
                    raise RegistryError(
                        "MANIFEST_INVALID",
                        f"descriptor of {desc.digest} says {desc.size} bytes, "
                        f"the blob has {stat.size}",
                    )
            if not found:
                raise RegistryError(
                    "MANIFEST_BLOB_UNKNOWN", f"{desc.media_type} {desc.digest} is not in {repo}",
                    detail={"digest": str(desc.digest)},
                )

    async def delete(self, repo: str, digest: Digest) -> None:
        stored = await self.get(repo, digest)
        try:
            subject = parse_manifest(stored.raw, stored.media_type, len(stored.raw)).subject
        except Exception:  # stored bytes were validated on PUT; never block a delete on them
            subject = None
        if subject is not None:
            await self.store.delete(paths.referrer_link(repo, subject.digest, digest))
        await self.store.delete(paths.revision_link(repo, digest))

    async def digests(self, repo: str) -> list[Digest]:
        return [Digest(h) for h in await self.store.list(paths.revisions_dir(repo))]

    async def referrers(self, repo: str, subject: Digest) -> list[dict[str, Any]]:
        found = []
        directory = paths.referrers_dir(repo, subject)
        for hex_ in await self.store.list(directory):
            try:
                found.append(json.loads(await self.store.get(f"{directory}/{hex_}")))
            except (KeyNotFound, ValueError):
                continue  # removed meanwhile
        return found


def referrer_descriptor(manifest: Manifest) -> dict[str, Any]:
    """The descriptor the referrers API lists for `manifest` (OCI 1.1: artifactType falls back
    to the config's media type)."""
    desc: dict[str, Any] = {
        "mediaType": manifest.media_type,
        "digest": str(manifest.digest),
        "size": len(manifest.raw),
    }
    artifact_type = manifest.artifact_type
    if artifact_type is None and manifest.config is not None and not mt.is_index(
        manifest.media_type
    ):
        artifact_type = manifest.config.media_type
    if artifact_type:
        desc["artifactType"] = artifact_type
    if manifest.annotations:
        desc["annotations"] = manifest.annotations
    return desc
