"""Server staging: a create's `files` map (path -> blob digest) as a real directory.

Each blob is hard-linked (copied when the store's filesystem refuses) into a temp dir under the
models dir, at its relative path, so the inventory can read a normal checkpoint layout without
copying gigabytes. The temp dir is removed on every outcome (success, error, cancellation).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from registry.digests import Digest
from registry.errors import InvalidDigest
from registry.store import Store
from registry.upload_sessions import Upload, Uploads, parse_upload_ref
from workflows.create.arrivals import link_upload
from workflows.create.errors import CreateError
from workflows.create.write import CancelSignal, check_cancel

STAGE_PREFIX = ".create-"
METADATA_FILES = frozenset({"config.json", "generation_config.json",
                            "model.safetensors.index.json", "tokenizer_config.json",
                            "chat_template.jinja"})
GGUF_MAGIC = b"GGUF"
# A checkpoint is a flat dir or a few levels of subdirs; these bounds stay far inside what every
# filesystem allows (255-byte names, 4096-byte paths), so staging never fails on them.
MAX_PATH_COMPONENT_BYTES = 200
MAX_PATH_DEPTH = 16
MAX_PATH_BYTES = 1024


def check_relpath(path: Any, field: str) -> str:
    """A path that stays inside the staged dir: relative, `/`-separated, no `.`/`..`/empty parts."""
    if not isinstance(path, str) or not path or path == ".":
        raise CreateError(f"{field}: invalid path {path!r}")
    if "\\" in path or ":" in path or path.startswith("/") or "\x00" in path:
        raise CreateError(f"{field}: invalid path {path!r}")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise CreateError(f"{field}: invalid path {path!r}")
    shown = path if len(path) <= 80 else path[:77] + "..."
    if len(path.encode()) > MAX_PATH_BYTES or len(parts) > MAX_PATH_DEPTH:
        raise CreateError(f"{field}: path {shown!r} is longer than {MAX_PATH_BYTES} bytes or "
                          f"deeper than {MAX_PATH_DEPTH} directories")
    if any(len(part.encode()) > MAX_PATH_COMPONENT_BYTES for part in parts):
        raise CreateError(f"{field}: path {shown!r} has a name longer than "
                          f"{MAX_PATH_COMPONENT_BYTES} bytes")
    return path


def check_no_file_is_a_directory(paths: Iterable[str], field: str) -> None:
    """`a` and `a/b` cannot both be files: one name would be a file and a directory."""
    files = set(paths)
    for path in files:
        parts = path.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            if parent in files:
                raise CreateError(f"{field}: {parent!r} is a file, so {path!r} cannot be "
                                  "inside it")


def parse_files_map(value: Any, field: str, limit: int,
                    uploads: Uploads | None = None) -> tuple[dict[str, Digest], dict[str, Upload]]:
    """Validate a `files`/`draft_files` map: at most `limit` entries, safe paths, digests.

    With `uploads`, a `*.safetensors` file may instead name an upload session in progress
    (`upload:<id>`, see `registry.upload_sessions`); those come back apart (as digests once
    verified).
    """
    if not isinstance(value, dict):
        raise CreateError(f"{field} must be an object mapping paths to digests")
    if len(value) > limit:
        raise CreateError(f"{field} has {len(value)} entries; at most {limit} are allowed")
    out: dict[str, Digest] = {}
    pending: dict[str, Upload] = {}
    for path, digest in value.items():
        check_relpath(path, field)
        upload_id = parse_upload_ref(digest)
        if upload_id is not None:
            upload = _open_upload(uploads, upload_id, path, field)
            if upload.stored and upload.digest is not None:
                out[path] = upload.digest
            else:
                pending[path] = upload
            continue
        try:
            out[path] = Digest.parse(digest)
        except InvalidDigest as exc:
            raise CreateError(f"{field}[{path!r}]: {exc.message}") from exc
    check_no_file_is_a_directory([*out, *pending], field)
    return out, pending


def _open_upload(uploads: Uploads | None, upload_id: str, path: str, field: str) -> Upload:
    if uploads is None:
        raise CreateError(f"{field}[{path!r}]: name a blob digest here; upload "
                          "sessions are only for the model's own files")
    if not path.endswith(".safetensors"):
        raise CreateError(f"{field}[{path!r}]: only *.safetensors files may name an upload "
                          "session; upload other files with POST /api/blobs")
    upload = uploads.get(upload_id)
    if upload is None:
        raise CreateError(f"{field}[{path!r}]: upload {upload_id!r} not found")
    if upload.error is not None:
        raise CreateError(f"{field}[{path!r}]: the upload failed: {upload.error}")
    return upload


def require_blobs(store: Store, files: Mapping[str, Digest], metadata_limit: int) -> None:
    """Every blob present and a regular file; metadata files within their size limit."""
    for rel, digest in files.items():
        path = store.blob_path(digest)
        if not path.is_file() or path.is_symlink():
            raise CreateError(f'blob "{digest}" is missing; upload it with POST /api/blobs', rel)
        size = path.stat().st_size
        if PurePosixPath(rel).name in METADATA_FILES and size > metadata_limit:
            raise CreateError(f"metadata file is {size} bytes; the limit is {metadata_limit}",
                              rel)


def is_gguf(store: Store, rel: str, digest: Digest) -> bool:
    """By extension, else by the GGUF magic in the blob's first four bytes."""
    if rel.endswith(".gguf"):
        return True
    if rel.endswith(".safetensors"):
        return False
    with open(store.blob_path(digest), "rb") as fh:
        return fh.read(4) == GGUF_MAGIC


@contextlib.contextmanager
def staged_dir(store: Store, files: Mapping[str, Digest], cancel: CancelSignal,
               pending: Mapping[str, Upload] | None = None) -> Iterator[Path]:
    """Link `files` (and the temp files of `pending` uploads) into a fresh temp dir; yield it;
    always remove it."""
    root = store.root / f"{STAGE_PREFIX}{secrets.token_hex(8)}"
    root.mkdir(parents=True)
    try:
        for rel, digest in files.items():
            check_cancel(cancel)
            try:
                _link(store.blob_path(digest), root / rel)
            except OSError as exc:  # the message names the user's path, never the server's
                raise CreateError(f"file {rel!r} cannot be staged: "
                                  f"{exc.strerror or type(exc).__name__}") from None
        for rel, upload in (pending or {}).items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            try:
                link_upload(upload, root / rel, cancel)
            except OSError as exc:
                raise CreateError(f"file {rel!r} cannot be staged: "
                                  f"{exc.strerror or type(exc).__name__}") from None
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _link(blob: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(blob, target)
    except OSError:
        shutil.copyfile(blob, target)
