"""Domain exceptions shared by the registry code.

They carry fields, not HTTP statuses: the two API edges (`service/errors.py` for the OCI
distribution API, `api_errors.py` for the Ollama-style model API) map them to wire errors.

    FerryError
    ├── InvalidName          a model name or repository that breaks the naming rules
    ├── InvalidDigest        a digest string that is not sha256:<64 hex>
    ├── DigestMismatch       bytes whose sha256 is not the one promised
    ├── SizeMismatch         bytes whose length is not the one promised
    ├── InvalidManifest      manifest JSON that fails validation
    ├── TooLarge             a body over a named limit
    ├── NotFound             a model, manifest or blob that is not there
    └── Conflict             a request that collides with the current state
"""

from __future__ import annotations


class FerryError(Exception):
    """Base of ferry's domain errors; `str(exc)` is the message shown to users."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidName(FerryError):
    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"invalid model name {name!r}: {reason}")
        self.name = name
        self.reason = reason


class InvalidDigest(FerryError):
    def __init__(self, digest: str, reason: str = "expected sha256:<64 lowercase hex>") -> None:
        super().__init__(f"invalid digest {digest!r}: {reason}")
        self.digest = digest


class DigestMismatch(FerryError):
    def __init__(self, expected: str, actual: str) -> None:
        super().__init__(f'digest mismatch, expected "{expected}", got "{actual}"')
        self.expected = expected
        self.actual = actual


class SizeMismatch(FerryError):
    def __init__(self, expected: int, actual: int, what: str = "blob") -> None:
        super().__init__(f"{what} size mismatch, expected {expected} bytes, got {actual}")
        self.expected = expected
        self.actual = actual


class InvalidManifest(FerryError):
    def __init__(self, reason: str) -> None:
        super().__init__(f"invalid manifest: {reason}")
        self.reason = reason


class TooLarge(FerryError):
    def __init__(self, what: str, limit: int, size: int | None = None) -> None:
        got = f" (got {size} bytes)" if size is not None else ""
        super().__init__(f"{what} exceeds the limit of {limit} bytes{got}")
        self.what = what
        self.limit = limit
        self.size = size


class NotFound(FerryError):
    pass


class Conflict(FerryError):
    pass
