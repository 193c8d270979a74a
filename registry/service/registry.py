"""The registry's state: one BlobStore and the layers that give its keys meaning."""

from __future__ import annotations

from dataclasses import dataclass

from registry.manifests import MAX_MANIFEST_BYTES
from registry.service.blobs import Blobs
from registry.service.revisions import Revisions
from registry.service.storage.base import BlobStore
from registry.service.tags import TagStore
from registry.service.uploads import Uploads

DEFAULT_UPLOAD_SESSION_TTL = 24 * 3600.0


@dataclass
class Registry:
    store: BlobStore
    blobs: Blobs
    uploads: Uploads
    tags: TagStore
    revisions: Revisions
    max_manifest_bytes: int

    @classmethod
    def open(
        cls,
        store: BlobStore,
        max_manifest_bytes: int = MAX_MANIFEST_BYTES,
        upload_session_ttl: float = DEFAULT_UPLOAD_SESSION_TTL,
        max_blob_bytes: int = 0,
    ) -> Registry:
        """`max_blob_bytes`: the largest blob an upload may store; 0 means no limit."""
        blobs = Blobs(store)
        return cls(
            store=store,
            blobs=blobs,
            uploads=Uploads(store, blobs, upload_session_ttl, max_blob_bytes),
            tags=TagStore(store),
            revisions=Revisions(store, blobs, max_manifest_bytes),
            max_manifest_bytes=max_manifest_bytes,
        )
