"""sha256 digests: the one content address ferry uses.

Two spellings exist: `sha256:<hex>` on the wire and in manifests, `sha256-<hex>` as a blob file
name. `Digest.parse` accepts both and always renders the wire form; hex is normalised to lower case
because hashlib produces lower case and the store must find one file per content.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from registry.errors import InvalidDigest

# \Z, not $: `$` also matches before a trailing newline, which would let "sha256:<hex>\n" pass.
_DIGEST_RE = re.compile(r"^sha256[:-]([0-9a-fA-F]{64})\Z")
_WIRE_RE = re.compile(r"sha256:[0-9a-f]{64}")
ALGORITHM = "sha256"


@dataclass(frozen=True, order=True)
class Digest:
    hex: str

    @classmethod
    def parse(cls, text: str) -> Digest:
        """Parse `sha256:<hex>` or `sha256-<hex>`; anything else raises InvalidDigest."""
        if not isinstance(text, str):
            raise InvalidDigest(repr(text), "a digest must be a string")
        match = _DIGEST_RE.match(text)
        if match is None:
            raise InvalidDigest(text, _reason(text))
        return cls(match.group(1).lower())

    @classmethod
    def parse_wire(cls, text: str) -> Digest:
        """Only the canonical wire form, `sha256:<64 lower-case hex>` (the registry API's)."""
        if not isinstance(text, str) or _WIRE_RE.fullmatch(text) is None:
            reason = "expected sha256:<64 lower-case hex>" if Digest.is_valid(text) else None
            raise InvalidDigest(str(text)[:100], reason or _reason(str(text)))
        return cls(text[7:])

    @classmethod
    def of(cls, data: bytes) -> Digest:
        return cls(hashlib.sha256(data).hexdigest())

    @staticmethod
    def is_valid(text: str) -> bool:
        return isinstance(text, str) and _DIGEST_RE.match(text) is not None

    @staticmethod
    def is_wire(text: str) -> bool:
        return isinstance(text, str) and _WIRE_RE.fullmatch(text) is not None

    @property
    def filename(self) -> str:
        """The blob file name in an Ollama-compatible store: `sha256-<hex>`."""
        return f"{ALGORITHM}-{self.hex}"

    @property
    def short(self) -> str:
        """The 12-hex id Ollama shows in progress lines (`digest[7:19]`)."""
        return self.hex[:12]

    def __str__(self) -> str:
        return f"{ALGORITHM}:{self.hex}"


def _reason(text: str) -> str:
    algo, sep, rest = text.replace("-", ":", 1).partition(":")
    if not sep:
        return "expected sha256:<64 hex>"
    if algo != ALGORITHM:
        return f"unsupported algorithm {algo!r}; only sha256 is supported"
    if len(rest) != 64:
        return f"expected 64 hex characters, got {len(rest)}"
    return "the digest must contain only hex characters"


class Hasher:
    """Streaming sha256 that also counts bytes, so size and digest are checked together."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self.size = 0

    def update(self, chunk: bytes | bytearray | memoryview) -> None:
        self._sha.update(chunk)
        self.size += len(chunk)

    def digest(self) -> Digest:
        return Digest(self._sha.hexdigest())

    def copy(self) -> Hasher:
        clone = Hasher()
        clone._sha = self._sha.copy()
        clone.size = self.size
        return clone


def sha256_file(path: str, chunk_size: int = 4 * 1024 * 1024) -> tuple[Digest, int]:
    """Digest and size of a file, read in chunks."""
    hasher = Hasher()
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_size):
            hasher.update(chunk)
    return hasher.digest(), hasher.size
