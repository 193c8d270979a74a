"""What the pull-through cache mirrors, and how: one `Upstream` per repository prefix."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from registry.errors import FerryError
from registry.transfer.retry import RetryPolicy
from registry.transfer.safe import Resolver

DEFAULT_TTL = 300.0


class ProxyConfigError(FerryError):
    """A `--proxy` value ferry cannot use."""


@dataclass(frozen=True)
class Upstream:
    """One upstream registry; `prefix` selects the repositories it serves ("" for all).

    The repository name is the same on both sides: `library/llama3.2` here is `library/llama3.2`
    upstream, so a client's mirror entry needs no rewriting of names.
    """

    prefix: str
    base: httpx.URL  # scheme://host[:port], no credentials
    credentials: tuple[str, str] | None = field(default=None, repr=False)

    @property
    def insecure(self) -> bool:
        """Writing `http://` is the operator's consent to plain http for this upstream, and so
        (as `--insecure` does for a pull) to its redirects reaching private addresses; an
        https upstream gets the strict rules."""
        return self.base.scheme == "http"

    @property
    def shown(self) -> str:
        return str(self.base)

    def serves(self, repo: str) -> bool:
        return not self.prefix or repo == self.prefix or repo.startswith(self.prefix + "/")


@dataclass(frozen=True)
class ProxyConfig:
    upstreams: tuple[Upstream, ...]
    local: tuple[str, ...] = ()  # namespaces kept local: pushes allowed, never fetched upstream
    ttl: float = DEFAULT_TTL  # a cached tag younger than this is served without asking upstream
    max_bytes: int = 0  # > 0: evict least recently pulled models above this many stored bytes
    home: Path = field(default_factory=lambda: Path.home() / ".ferry")  # credentials and key
    ca_file: str = ""
    stall_timeout: float = 30.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    resolver: Resolver | None = None
    segment_bytes: int = 16 * 1024 * 1024  # a missing blob is fetched in Range requests of this
    segment_window: int = 4  # size, this many at once (segments.py)

    def upstream_for(self, repo: str) -> Upstream | None:
        """The upstream that `repo` mirrors (the longest matching prefix), or None if local."""
        if any(repo == ns or repo.startswith(ns + "/") for ns in self.local):
            return None
        matching = [u for u in self.upstreams if u.serves(repo)]
        return max(matching, key=lambda u: len(u.prefix), default=None)


def parse_upstreams(values: Sequence[str]) -> tuple[Upstream, ...]:
    """`URL` or `prefix=URL` entries (comma-separated or repeated) into Upstreams.

    A URL may carry `user:password@` for Basic or token auth; it is stripped from the URL and
    never shown. Without a scheme it means https.
    """
    upstreams = []
    for value in values:
        for entry in (e.strip() for e in value.split(",")):
            if entry:
                upstreams.append(_parse_upstream(entry))
    prefixes = [u.prefix for u in upstreams]
    if len(set(prefixes)) != len(prefixes):
        raise ProxyConfigError("two --proxy entries mirror the same namespace prefix")
    return tuple(upstreams)


def _parse_upstream(entry: str) -> Upstream:
    prefix, sep, url = entry.partition("=")
    if not sep or "://" in prefix:
        prefix, url = "", entry
    prefix = prefix.strip().strip("/")
    if "://" not in url:
        url = "https://" + url
    try:
        parsed = httpx.URL(url.strip())
    except (httpx.InvalidURL, ValueError) as exc:
        raise ProxyConfigError(f"invalid --proxy URL {url!r}: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ProxyConfigError(f"--proxy needs an http or https URL with a host, got {url!r}")
    credentials = None
    if parsed.username:
        credentials = (parsed.username, parsed.password or "")
    base = httpx.URL(scheme=parsed.scheme, host=parsed.host, port=parsed.port)
    return Upstream(prefix, base, credentials)
