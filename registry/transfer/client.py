"""One registry, one repository: URLs, auth on 401, and status classification.

Pull and push talk to the registry only through `RegistryClient.request`, which sends through the
`SafeSession` (so every hop is checked), adds the token only on the registry's own origin,
answers one 401 with a fresh token, and turns error statuses into domain errors: 404 not found,
429/5xx transient (retried by the caller's policy), other 4xx final.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from registry.manifests import MAX_MANIFEST_BYTES
from registry.names import Name
from registry.transfer.auth import Authenticator
from registry.transfer.errors import (
    AuthFailed,
    RegistryNotFound,
    TransferError,
    TransientStatus,
    UpstreamError,
)
from registry.transfer.retry import RetryPolicy, caused_by_tls, parse_retry_after
from registry.transfer.safe import DnsResolver, RedirectPolicy, Resolver
from registry.transfer.session import Body, Reply, SafeSession, build_ssl_context

MB = 1000 * 1000


@dataclass(frozen=True)
class TransferOptions:
    """Knobs of one pull or push; defaults follow Ollama (reference 1.6, 1.7)."""

    home: Path = field(default_factory=lambda: Path.home() / ".ferry")
    insecure: bool = False
    max_streams: int = 8
    # Smaller than Ollama's [100 MB, 1000 MB] / 16: the in-order hasher trails the parts in
    # flight, so small parts leave little to hash (and fsync) after the last byte arrives.
    part_min: int = 16 * MB
    part_max: int = 256 * MB
    parts_target: int = 64
    chunk_size: int = 100 * MB
    small_blob_max: int = 4 * 1024 * 1024  # fetched whole into memory, no part state
    checkpoint_bytes: int = 16 * 1024 * 1024
    stall_timeout: float = 30.0
    max_manifest_bytes: int = MAX_MANIFEST_BYTES
    noprune: bool = False
    ca_file: str = ""
    progress_interval: float = 0.06
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    resolver: Resolver | None = None
    mirrors: tuple[tuple[str, str], ...] = ()  # (registry host, mirror URL), tried in order
    mirrors_only: bool = False  # never fall back to the registry host itself (air-gapped)

    @property
    def credentials_path(self) -> Path:
        return self.home / "credentials.json"

    @property
    def key_path(self) -> Path:
        return self.home / "id_ed25519"

    def part_size(self, total: int) -> int:
        return max(self.part_min, min(self.part_max, total // self.parts_target))


def parse_target(text: str, insecure: bool) -> tuple[Name, httpx.URL]:
    """The model name and its registry's base URL, checked before any network call.

    A name without a scheme uses https, or http under --insecure; an explicit `http://` needs
    --insecure (Ollama's "insecure protocol http").
    """
    name = Name.parse_valid(text)
    scheme = Name.parse_bare(text).scheme or ("http" if insecure else "https")
    if scheme == "http" and not insecure:
        raise TransferError("insecure protocol http; pass --insecure for a private registry")
    return name, httpx.URL(f"{scheme}://{name.host}")


class RegistryClient:
    """Requests against one repository of one registry, for one pull or push."""

    def __init__(self, name: Name, base: httpx.URL, options: TransferOptions) -> None:
        self.name = name
        self.options = options
        self.base = base
        policy = RedirectPolicy(self.base, options.insecure, options.resolver or DnsResolver())
        self.session = SafeSession(policy, build_ssl_context(options.ca_file),
                                   options.stall_timeout)
        self.auth = Authenticator(self.session, options.credentials_path, options.key_path)

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.aclose()

    def url(self, path: str) -> httpx.URL:
        """`/v2/<namespace>/<model>/<path>` on the registry."""
        return self.base.join(f"/v2/{self.name.repository}/{path}")

    async def request(self, method: str, url: httpx.URL | str, *,
                      headers: Mapping[str, str] | None = None, content: Body = None,
                      ok: tuple[int, ...] = (200,)) -> Reply:
        """Send with auth; return the (unread) reply if its status is in `ok`, else raise."""
        return await send_authorized(self.session, self.auth, method, url, headers=headers,
                                     content=content, ok=ok)


async def send_authorized(session: SafeSession, auth: Authenticator, method: str,
                          url: httpx.URL | str, *, headers: Mapping[str, str] | None = None,
                          content: Body = None, ok: tuple[int, ...] | None = None) -> Reply:
    """Send through `session` with `auth`'s header, answering one 401 challenge from the
    registry's own origin with a fresh token. With `ok`, a status outside it raises the
    classified error; without, any status but 401 comes back. The reply is unread.
    A streamed `content` must be a callable, so the retry after a 401 can send it again.
    The client, the release publisher and the registry's pull-through cache all send this way."""
    for attempt in (1, 2):
        stale = auth.header
        try:
            reply = await session.send(method, url, headers=headers, content=content,
                                       authorization=stale)
        except httpx.ConnectError as exc:
            if caused_by_tls(exc, "WRONG_VERSION_NUMBER"):
                raise TransferError(f"{httpx.URL(url).netloc.decode()} does not speak https; "
                                    "pass --insecure for a plain-http private registry"
                                    ) from exc
            raise
        if reply.status != 401:
            break
        challenge = reply.response.headers.get("www-authenticate", "")
        await reply.aclose()
        if attempt == 2 or not challenge or not session.policy.is_registry_origin(reply.url):
            raise AuthFailed("unauthorized: access denied")
        await auth.refresh(challenge, stale)
    if ok is None or reply.status in ok:
        return reply
    await raise_for_status(reply)
    return reply


async def raise_for_status(reply: Reply) -> None:
    """Close the reply and raise the domain error for its status."""
    try:
        body = (await reply.response.aread())[:2000].decode("utf-8", "replace")
    except httpx.HTTPError:
        body = ""
    finally:
        await reply.aclose()
    status, url = reply.status, str(reply.url)
    if status == 404:
        raise RegistryNotFound("file does not exist")
    if status == 429 or status >= 500:
        retry_after = parse_retry_after(reply.response.headers.get("retry-after"))
        raise TransientStatus(status, body, url, retry_after)
    raise UpstreamError(status, body, url)
