"""Model names, parsed exactly as Ollama parses them (reference 1.1).

    [scheme://]host/namespace/model:tag[@sha256:<hex>]

The parse works from the right, so `host:port/ns/model` keeps its port; empty parts take the
defaults `registry.ollama.ai`, `library`, `latest` and `https`. Every part must start with an
ASCII letter, digit or `_`; a part can never contain `/`, so a valid name cannot escape the
manifests directory (`..`, absolute paths and `%2e%2e` are all invalid).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from registry.digests import Digest
from registry.errors import InvalidDigest, InvalidName

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
DEFAULT_SCHEME = "https"
MISSING = "!MISSING!"

_MAX_LEN = {"host": 350, "namespace": 80, "model": 80, "tag": 80}


def _is_word_char(ch: str) -> bool:
    return ch.isascii() and (ch.isalnum() or ch == "_")


def part_error(kind: str, value: str) -> str | None:
    """Why `value` is not a valid `kind` part, or None when it is."""
    if value == MISSING:
        return f"{kind} is empty"
    if not value:
        return f"{kind} is missing"
    if len(value) > _MAX_LEN[kind]:
        return f"{kind} is longer than {_MAX_LEN[kind]} characters"
    if not _is_word_char(value[0]):
        return f"{kind} must start with a letter, digit or underscore"
    for ch in value[1:]:
        if _is_word_char(ch) or ch in "-_":
            continue
        if ch == "." and kind != "namespace":
            continue
        if ch == ":" and kind == "host":
            continue
        return f"{kind} contains the character {ch!r}"
    return None


def _cut_last(text: str, sep: str) -> tuple[str, str, bool]:
    index = text.rfind(sep)
    if index < 0:
        return text, "", False
    return text[:index], text[index + len(sep):], True


def _cut_promised(text: str, sep: str) -> tuple[str, str, bool]:
    before, after, found = _cut_last(text, sep)
    if not found:
        return text, "", False
    return before or MISSING, after or MISSING, True


@dataclass(frozen=True)
class Name:
    """A parsed, default-merged model name. Equality is case-insensitive, as in Ollama."""

    host: str
    namespace: str
    model: str
    tag: str
    scheme: str = DEFAULT_SCHEME
    digest: str = ""

    # -- parsing -------------------------------------------------------------------------------

    @classmethod
    def parse_bare(cls, text: str) -> Name:
        """Split without merging defaults; absent parts are empty strings."""
        digest = ""
        text, raw_digest, has_digest = _cut_last(text, "@")
        if has_digest:
            digest = raw_digest or MISSING
        host = namespace = tag = scheme = ""
        if text.rfind(":") > text.rfind("/"):
            text, tag, _ = _cut_promised(text, ":")
        text, model, found = _cut_promised(text, "/")
        if not found:
            return cls(host, namespace, text, tag, scheme, digest)
        text, namespace, found = _cut_promised(text, "/")
        if not found:
            return cls(host, text, model, tag, scheme, digest)
        scheme, sep, host = text.partition("://")
        if not sep:
            host, scheme = scheme, ""
        return cls(host, namespace, model, tag, scheme, digest)

    @classmethod
    def parse(cls, text: str) -> Name:
        """Parse and merge defaults; the result may still be invalid (see `error`)."""
        bare = cls.parse_bare(text)
        return cls(
            host=bare.host or DEFAULT_HOST,
            namespace=bare.namespace or DEFAULT_NAMESPACE,
            model=bare.model,
            tag=bare.tag or DEFAULT_TAG,
            scheme=bare.scheme or DEFAULT_SCHEME,
            digest=bare.digest,
        )

    @classmethod
    def parse_valid(cls, text: str) -> Name:
        """Parse and validate; raises InvalidName naming the broken part."""
        if not isinstance(text, str) or not text.strip():
            raise InvalidName(str(text), "a model name is required")
        name = cls.parse(text)
        reason = name.error()
        if reason is not None:
            raise InvalidName(text, reason)
        return name

    def error(self) -> str | None:
        """Why this name is not fully qualified and valid, or None."""
        for kind in ("host", "namespace", "model", "tag"):
            reason = part_error(kind, getattr(self, kind))
            if reason is not None:
                return reason
        if self.scheme not in ("http", "https"):
            return f"unsupported scheme {self.scheme!r}"
        if self.digest:
            try:
                Digest.parse(self.digest)
            except InvalidDigest as exc:
                return exc.message
        return None

    @property
    def is_valid(self) -> bool:
        return self.error() is None

    # -- rendering -----------------------------------------------------------------------------

    def __str__(self) -> str:
        text = f"{self.host}/{self.namespace}/{self.model}:{self.tag}"
        return f"{text}@{self.digest}" if self.digest else text

    def display_shortest(self) -> str:
        """`model:tag`, prefixed with what differs from the defaults (Ollama's DisplayShortest)."""
        prefix = ""
        if self.host.lower() != DEFAULT_HOST:
            prefix = f"{self.host}/{self.namespace}/"
        elif self.namespace.lower() != DEFAULT_NAMESPACE:
            prefix = f"{self.namespace}/"
        return f"{prefix}{self.model}:{self.tag}"

    @property
    def repository(self) -> str:
        """The registry repository path: `namespace/model`."""
        return f"{self.namespace}/{self.model}"

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{self.host}"

    @property
    def manifest_relpath(self) -> PurePosixPath:
        """Where the manifest lives under `manifests/`, in the case the user gave."""
        return PurePosixPath(self.host, self.namespace, self.model, self.tag)

    # -- comparison ----------------------------------------------------------------------------

    def _key(self) -> tuple[str, ...]:
        return tuple(p.lower() for p in (self.host, self.namespace, self.model, self.tag))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Name):
            return NotImplemented
        return self._key() == other._key() and self.digest.lower() == other.digest.lower()

    def __hash__(self) -> int:
        return hash((self._key(), self.digest.lower()))


def parse_repository(text: str) -> str:
    """Validate an OCI repository path (`a/b/c`, lower-case components); return it unchanged.

    The distribution spec's grammar: components of `[a-z0-9]+((\\.|_|__|-+)[a-z0-9]+)*` joined by
    `/`. Used by the registry service, which accepts any depth, not only `namespace/model`.
    """
    component = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
    if len(text) > 255 or not re.fullmatch(rf"{component}(?:/{component})*", text):
        raise InvalidName(text, "repository names are lower-case components joined by '/'")
    return text
