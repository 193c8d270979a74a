"""The checksum manifest: `sha256sum.txt` over every file in the dist dir, in `sha256sum` format.

Files are hashed once, before anything is uploaded; the same numbers are used to verify the
release afterwards, so a file that changes on disk mid-run shows up as a mismatch.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from workflows.release.store import LocalAsset, ReleaseError

CHECKSUM_FILE = "sha256sum.txt"
_CHUNK = 1024 * 1024
_TEMP_PREFIX = f".{CHECKSUM_FILE}."


def hash_file(path: Path) -> tuple[int, str]:
    """(size, sha256 hex) of a file, read in chunks so memory stays flat."""
    sha = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest()


def scan_dist(dist: Path) -> list[LocalAsset]:
    """Every regular file directly in `dist` except the checksum file, sorted by name."""
    if not dist.is_dir():
        raise ReleaseError(f"dist directory {dist} does not exist")
    assets = []
    for path in sorted(dist.iterdir(), key=lambda p: p.name):
        if path.name == CHECKSUM_FILE or path.name.startswith(_TEMP_PREFIX) or not path.is_file():
            continue  # the manifest itself, or a temp file a crashed run left behind
        if "\n" in path.name or "\\" in path.name:  # sha256sum would escape these lines
            raise ReleaseError(f"{path.name!r}: asset names cannot hold newlines or backslashes")
        size, digest = hash_file(path)
        assets.append(LocalAsset(name=path.name, path=path, size=size, sha256=digest))
    if not assets:
        raise ReleaseError(f"dist directory {dist} holds no files to publish")
    return assets


def render(assets: list[LocalAsset]) -> bytes:
    """`<hex>  <name>` lines (two spaces: sha256sum's text mode), sorted by name."""
    lines = [f"{a.sha256}  {a.name}\n" for a in sorted(assets, key=lambda a: a.name)]
    return "".join(lines).encode()


def parse(text: str) -> dict[str, str]:
    """name -> sha256 hex from a `sha256sum` file (text or binary mode markers)."""
    entries = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        digest, _, name = line.partition(" ")
        entries[name.lstrip(" *")] = digest.lower()
    return entries


def write_checksum_file(dist: Path, assets: list[LocalAsset]) -> LocalAsset:
    """Write `sha256sum.txt` into `dist` atomically (temp file, rename) and describe it."""
    data = render(assets)
    fd, temp = tempfile.mkstemp(dir=dist, prefix=_TEMP_PREFIX)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        target = dist / CHECKSUM_FILE
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return LocalAsset(name=CHECKSUM_FILE, path=target, size=len(data),
                      sha256=hashlib.sha256(data).hexdigest())
