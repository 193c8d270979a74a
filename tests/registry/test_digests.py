"""sha256 digests: both spellings, strict validation, and the streaming hasher."""

from __future__ import annotations

import hashlib

import pytest

from registry.digests import Digest, Hasher, sha256_file
from registry.errors import InvalidDigest

HEX = "0123456789abcdef" * 4


@pytest.mark.parametrize("text", [f"sha256:{HEX}", f"sha256-{HEX}", f"sha256:{HEX.upper()}"])
def test_both_spellings_parse_to_one_lowercase_digest(text):
    digest = Digest.parse(text)
    assert digest.hex == HEX
    assert str(digest) == f"sha256:{HEX}"
    assert digest.filename == f"sha256-{HEX}"
    assert digest.short == HEX[:12]
    assert Digest.is_valid(text)


@pytest.mark.parametrize("text, reason", [
    (f"sha256:{HEX[:-1]}", "expected 64 hex characters, got 63"),
    (f"sha256:{HEX}0", "expected 64 hex characters, got 65"),
    ("sha256:", "expected 64 hex characters, got 0"),
    (f"sha256:{HEX[:-1]}g", "only hex characters"),
    (f"sha256:{HEX[:-1]}/", "only hex characters"),
    (f"sha512:{HEX}", "only sha256 is supported"),
    (f"SHA256:{HEX}", "only sha256 is supported"),
    (HEX, "expected sha256:<64 hex>"),
    ("", "expected sha256:<64 hex>"),
    (f"sha256:{HEX}\n", "expected 64 hex characters, got 65"),
    (f" sha256:{HEX}", "sha256"),
    (f"sha256:{HEX}/../x", "expected 64 hex characters"),
])
def test_malformed_digests_are_rejected_with_the_reason(text, reason):
    with pytest.raises(InvalidDigest) as info:
        Digest.parse(text)
    assert reason in info.value.message
    assert not Digest.is_valid(text)


def test_non_strings_are_rejected():
    with pytest.raises(InvalidDigest):
        Digest.parse(None)  # type: ignore[arg-type]
    assert not Digest.is_valid(123)  # type: ignore[arg-type]


def test_hasher_streams_and_counts(tmp_path):
    data = b"ferry" * 100_000
    hasher = Hasher()
    for start in range(0, len(data), 4096):
        hasher.update(memoryview(data)[start:start + 4096])
    assert hasher.digest() == Digest.of(data) == Digest(hashlib.sha256(data).hexdigest())
    assert hasher.size == len(data)
    clone = hasher.copy()
    clone.update(b"!")
    assert hasher.digest() == Digest.of(data) and clone.size == len(data) + 1
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert sha256_file(str(path), chunk_size=1000) == (Digest.of(data), len(data))
