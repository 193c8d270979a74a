"""The local models directory, byte-compatible with Ollama's (reference 1.4).

    <models>/
      blobs/sha256-<hex>                 content, named by digest, mode 0644
      blobs/sha256-<hex>-partial[-N]     a pull in progress (data, per-part state)
      blobs/.tmp-<random>                a write in progress (never a valid digest name)
      manifests/<host>/<ns>/<model>/<tag>  raw manifest bytes
      metadata/sha256-<hex>.json         per-blob metadata (GGUF key/values), removed with the blob

Writes go to a temp name in the destination directory, are fsynced, then renamed, so a reader
sees the old file or the new one, never a mix; a crash leaves only temp files, which `prune()`
sweeps once they are an hour old (younger ones may belong to a write still in progress).
How bytes become a blob (stream in and verify, or adopt a verified file) is `blob_writer.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from registry.blob_writer import TMP_PREFIX, BlobWriter, adopt_blob, fsync_dir
from registry.digests import Digest
from registry.errors import InvalidManifest, NotFound
from registry.manifests import Manifest, parse_manifest
from registry.names import Name

PRUNE_GRACE_SECONDS = 3600.0
# workflows/create/stage.py stages a create's files in `<models>/.create-<id>/` (registry may not
# import workflows, so the name is repeated here; a test checks the two agree).
CREATE_STAGE_PREFIX = ".create-"


@dataclass(frozen=True)
class ModelEntry:
    """One manifest found in the store."""

    name: Name
    path: Path
    raw: bytes
    modified_at: float

    @property
    def digest(self) -> Digest:
        return Digest.of(self.raw)

    def manifest(self) -> Manifest:
        return parse_manifest(self.raw)


# files derived from a blob, cached beside its metadata: a GGUF's tokenizer files, built from
# its metadata arrays (runner/gguf_tokenizer.py) so the runner need not build them each load
DERIVED_KINDS = ("tokenizer",)


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write `data` to `path` so readers see the old content or the new, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{TMP_PREFIX}{path.name}-{secrets.token_hex(6)}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


class Store:
    """The local models dir. Every method blocks on the disk; async callers run the slow ones
    in a thread (`BlobWriter.write_stream` does so itself)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.blobs_dir = self.root / "blobs"
        self.manifests_dir = self.root / "manifests"
        self.metadata_dir = self.root / "metadata"
        # Serializes manifest writes against deletes so a blob is never removed while a
        # manifest that needs it is being published.
        self.lock = threading.RLock()

    # -- blobs ---------------------------------------------------------------------------------

    def blob_path(self, digest: Digest) -> Path:
        return self.blobs_dir / digest.filename

    def has_blob(self, digest: Digest) -> bool:
        return self.blob_path(digest).is_file()

    def blob_size(self, digest: Digest) -> int:
        try:
            return self.blob_path(digest).stat().st_size
        except FileNotFoundError as exc:
            raise NotFound(f'blob "{digest}" not found') from exc

    def read_blob(self, digest: Digest) -> bytes:
        try:
            return self.blob_path(digest).read_bytes()
        except FileNotFoundError as exc:
            raise NotFound(f'blob "{digest}" not found') from exc

    def blob_writer(self, expected: Digest | None = None,
                    expected_size: int | None = None) -> BlobWriter:
        """The one way new bytes become a blob: stream in, verify, publish (`blob_writer.py`)."""
        return BlobWriter(self.blobs_dir, expected, expected_size)

    def adopt_blob(self, path: Path, digest: Digest, sync_dir: bool = True) -> Path:
        """Publish a file in `blobs/` the caller already verified and fsynced (pull, create)."""
        return adopt_blob(self.blobs_dir, path, digest, sync_dir)

    def delete_blob(self, digest: Digest) -> None:
        self.blob_path(digest).unlink(missing_ok=True)
        self._delete_metadata(digest)

    def _delete_metadata(self, digest: Digest) -> None:
        self.metadata_path(digest).unlink(missing_ok=True)
        for kind in DERIVED_KINDS:
            self.derived_path(digest, kind).unlink(missing_ok=True)

    # -- metadata ------------------------------------------------------------------------------

    def metadata_path(self, digest: Digest) -> Path:
        return self.metadata_dir / f"{digest.filename}.json"

    def derived_path(self, digest: Digest, kind: str) -> Path:
        """A file derived from the blob and cached beside its metadata (`DERIVED_KINDS`),
        removed with the blob."""
        if kind not in DERIVED_KINDS:
            raise ValueError(f"unknown derived file kind {kind!r}")
        return self.metadata_dir / f"{digest.filename}.{kind}.json"

    def read_metadata(self, digest: Digest) -> dict | None:
        try:
            data = json.loads(self.metadata_path(digest).read_bytes())
        except (FileNotFoundError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def write_metadata(self, digest: Digest, data: dict) -> None:
        atomic_write(self.metadata_path(digest), json.dumps(data, sort_keys=True).encode())

    # -- manifests -----------------------------------------------------------------------------

    def manifest_path(self, name: Name) -> Path:
        """The manifest path for `name`, matching an existing entry case-insensitively."""
        exact = self.manifests_dir.joinpath(*name.manifest_relpath.parts)
        if exact.exists():
            return exact
        current = self.manifests_dir
        for part in name.manifest_relpath.parts:
            match = _find_casefold(current, part)
            if match is None:
                return exact
            current = match
        return current

    def read_manifest(self, name: Name) -> bytes:
        try:
            return self.manifest_path(name).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise NotFound(f"model '{name.display_shortest()}' not found") from exc

    def get_model(self, name: Name) -> ModelEntry:
        path = self.manifest_path(name)
        try:
            raw = path.read_bytes()
            mtime = path.stat().st_mtime
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise NotFound(f"model '{name.display_shortest()}' not found") from exc
        return ModelEntry(name, path, raw, mtime)

    def write_manifest(self, name: Name, raw: bytes) -> Digest:
        """Validate and publish manifest bytes atomically; every blob must already be here."""
        manifest = parse_manifest(raw)
        missing = [str(d) for d in sorted(manifest.blob_digests()) if not self.has_blob(d)]
        if missing:
            raise InvalidManifest(f"references blobs not in the store: {', '.join(missing)}")
        with self.lock:
            path = self.manifest_path(name)
            atomic_write(path, raw)
        return Digest.of(raw)

    def list_models(self) -> list[ModelEntry]:
        """Every manifest exactly four levels under `manifests/` (host/ns/model/tag)."""
        entries = []
        for path in sorted(self.manifests_dir.glob("*/*/*/*")):
            if not path.is_file() or path.name.startswith(TMP_PREFIX):
                continue
            host, ns, model, tag = path.relative_to(self.manifests_dir).parts
            name = Name(host, ns, model, tag)
            if not name.is_valid:
                continue
            with contextlib.suppress(OSError):
                entries.append(ModelEntry(name, path, path.read_bytes(), path.stat().st_mtime))
        return entries

    def referenced_digests(self, exclude: Path | None = None) -> set[Digest]:
        """Blobs (config and layers) any readable manifest uses; corrupt manifests count none."""
        found: set[Digest] = set()
        for entry in self.list_models():
            if exclude is not None and entry.path == exclude:
                continue
            with contextlib.suppress(InvalidManifest, ValueError):
                found |= entry.manifest().blob_digests()
        return found

    def delete_model(self, name: Name) -> list[Digest]:
        """Remove a manifest, prune empty dirs, then blobs no other manifest references."""
        with self.lock:
            entry = self.get_model(name)
            try:
                used = entry.manifest().blob_digests()
            except InvalidManifest:
                used = set()
            entry.path.unlink()
            self._prune_empty_dirs(entry.path.parent)
            return self._remove_unreferenced(used)

    def remove_unused_after_replace(self, previous: bytes | None) -> list[Digest]:
        """After a manifest was replaced: delete blobs only the old manifest used."""
        if not previous:
            return []
        try:
            old = parse_manifest(previous).blob_digests()
        except InvalidManifest:
            return []
        with self.lock:
            return self._remove_unreferenced(old)

    def _remove_unreferenced(self, candidates: set[Digest]) -> list[Digest]:
        still_used = self.referenced_digests()
        removed = []
        for digest in sorted(candidates - still_used):
            self.delete_blob(digest)
            removed.append(digest)
        return removed

    def _prune_empty_dirs(self, start: Path) -> None:
        current = start
        while current != self.manifests_dir and self.manifests_dir in current.parents:
            try:
                current.rmdir()
            except OSError:
                return
            current = current.parent

    def copy_model(self, source: Name, destination: Name) -> None:
        raw = self.read_manifest(source)
        with self.lock:
            atomic_write(self.manifest_path(destination), raw)

    # -- maintenance ---------------------------------------------------------------------------

    def prune(self, now: float | None = None,
              grace: float = PRUNE_GRACE_SECONDS) -> list[Path]:
        """Remove unreferenced blobs and leftover temp/partial files older than `grace`."""
        now = time.time() if now is None else now
        removed: list[Path] = []
        with self.lock:
            used = self.referenced_digests()
            for path in self._iter_files(self.blobs_dir):
                if now - _mtime(path) < grace:
                    continue
                if Digest.is_valid(path.name) and Digest.parse(path.name) in used:
                    continue
                path.unlink(missing_ok=True)
                if Digest.is_valid(path.name):
                    self._delete_metadata(Digest.parse(path.name))
                removed.append(path)
            for directory in (self.manifests_dir, self.metadata_dir):
                for path in self._iter_files(directory, recursive=True):
                    if path.name.startswith(TMP_PREFIX) and now - _mtime(path) >= grace:
                        path.unlink(missing_ok=True)
                        removed.append(path)
            removed += self._prune_create_stages(now, grace)
        return removed

    def _prune_create_stages(self, now: float, grace: float) -> list[Path]:
        """Staging dirs of creates that died without cleaning up (a crash or a kill): a live
        create removes its own, and prune runs as the server starts, before any create."""
        removed = []
        for path in self.root.glob(f"{CREATE_STAGE_PREFIX}*"):
            if path.is_dir() and not path.is_symlink() and now - _mtime(path) >= grace:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        return removed

    @staticmethod
    def _iter_files(directory: Path, recursive: bool = False) -> Iterator[Path]:
        if not directory.is_dir():
            return
        paths = directory.rglob("*") if recursive else directory.iterdir()
        for path in paths:
            if path.is_file():
                yield path


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")


def _find_casefold(directory: Path, part: str) -> Path | None:
    try:
        for child in directory.iterdir():
            if child.name.lower() == part.lower():
                return child
    except (FileNotFoundError, NotADirectoryError):
        return None
    return None
