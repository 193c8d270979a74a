"""The key layout of the registry service: every object it keeps, by key, in one tree.

    blobs/sha256/<hh>/<hex>                               blob and manifest bytes, shared by
                                                          every repository (content addressed)
    repositories/<name>/                                  <name> may have any depth: a/b/c
        _layers/sha256/<hex>                              link: this repo may serve the blob
        _manifests/revisions/sha256/<hex>                 link: this repo holds the manifest;
                                                          content is the manifest media type
        _manifests/tags/<tag>/current                     the digest the tag points at now
                                                          (synced to history's last line)
        _manifests/tags/<tag>/history                     one line per tag move: "<ns> <digest>",
                                                          rewritten by compare-and-swap (tags.py)
        _referrers/sha256/<subject-hex>/<hex>             a manifest whose `subject` is
                                                          <subject-hex>; content: its descriptor
        _uploads/<uuid>/session                           JSON: started, repository
        _uploads/<uuid>/data                              the bytes received so far

A `<key>~tmp-<id>` beside a key is that key being written; listings never show it, and gc
removes those older than its grace period (a crash mid-commit leaves them). No legal repository,
tag or digest contains `~`, so the marker never hides live data.

`_layers`, `_manifests`, `_referrers` and `_uploads` cannot clash with repository components,
which never start with `_` (names.parse_repository). Links are small files, so a repository sees
only what was pushed or mounted into it while the bytes live once; garbage collection (gc.py)
removes bytes no link reaches.
"""

from __future__ import annotations

from registry.digests import Digest
from registry.service.storage.base import STAGING_MARKER

BLOBS = "blobs/sha256"
REPOSITORIES = "repositories"


def blob(digest: Digest) -> str:
    return f"{BLOBS}/{digest.hex[:2]}/{digest.hex}"


def layer_link(name: str, digest: Digest) -> str:
    return f"{REPOSITORIES}/{name}/_layers/sha256/{digest.hex}"


def revision_link(name: str, digest: Digest) -> str:
    return f"{REPOSITORIES}/{name}/_manifests/revisions/sha256/{digest.hex}"


def revisions_dir(name: str) -> str:
    return f"{REPOSITORIES}/{name}/_manifests/revisions/sha256"


def tags_dir(name: str) -> str:
    return f"{REPOSITORIES}/{name}/_manifests/tags"


def tag_current(name: str, tag: str) -> str:
    return f"{REPOSITORIES}/{name}/_manifests/tags/{tag}/current"


def tag_history(name: str, tag: str) -> str:
    return f"{REPOSITORIES}/{name}/_manifests/tags/{tag}/history"


def staging(key: str, unique: str) -> str:
    """A temporary key beside `key`, for bytes about to be committed to it."""
    return f"{key}{STAGING_MARKER}{unique}"


def referrers_dir(name: str, subject: Digest) -> str:
    return f"{REPOSITORIES}/{name}/_referrers/sha256/{subject.hex}"


def referrer_link(name: str, subject: Digest, digest: Digest) -> str:
    return f"{referrers_dir(name, subject)}/{digest.hex}"


def uploads_dir(name: str) -> str:
    return f"{REPOSITORIES}/{name}/_uploads"


def upload_session(name: str, upload_id: str) -> str:
    return f"{REPOSITORIES}/{name}/_uploads/{upload_id}/session"


def upload_data(name: str, upload_id: str) -> str:
    return f"{REPOSITORIES}/{name}/_uploads/{upload_id}/data"


def upload_dir(name: str, upload_id: str) -> str:
    return f"{REPOSITORIES}/{name}/_uploads/{upload_id}"


# Components that mark the end of a repository path while walking `repositories/`.
RESERVED = frozenset({"_layers", "_manifests", "_referrers", "_uploads"})
