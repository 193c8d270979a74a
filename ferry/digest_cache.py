"""The CLI's memory of file digests, so `ferry create` re-run on an unchanged checkpoint neither
hashes nor sends its weights again.

An entry is keyed by the file's absolute path and holds (device, inode, size, mtime_ns) with
the digest the server verified; a file whose stat differs in any of them is hashed (streamed)
again. Like make or rsync, it trusts that a rewrite changes the mtime. The cache is one small
JSON file, written atomically; a corrupt or missing one is simply empty.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path

from registry.digests import Digest
from registry.errors import InvalidDigest

MAX_ENTRIES = 4096


def _identity(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


class DigestCache:
    def __init__(self, file: Path) -> None:
        self.file = file
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError):
            data = {}
        self._entries: dict[str, dict] = data if isinstance(data, dict) else {}

    def get(self, path: Path) -> Digest | None:
        entry = self._entries.get(str(path.resolve()))
        if not isinstance(entry, dict):
            return None
        try:
            if entry.get("stat") != _identity(path):
                return None
            return Digest.parse(str(entry.get("digest")))
        except (OSError, ValueError, InvalidDigest):
            return None

    def put(self, path: Path, digest: Digest) -> None:
        """Remember `digest` for `path` as it is now, and save (best effort)."""
        key = str(path.resolve())
        self._entries.pop(key, None)
        self._entries[key] = {"stat": _identity(path), "digest": str(digest)}
        while len(self._entries) > MAX_ENTRIES:
            self._entries.pop(next(iter(self._entries)))
        with contextlib.suppress(OSError):
            self.file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.file.with_name(f".{self.file.name}-{secrets.token_hex(6)}")
            tmp.write_text(json.dumps(self._entries))
            os.replace(tmp, self.file)
