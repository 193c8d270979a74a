"""Requests to one upstream registry, through the transfer client's own machinery.

Every hop goes through `SafeSession` (redirects by hand, each checked and pinned to the address
that was checked), auth through `Authenticator` (Basic, the Bearer token flow, Ollama's Ed25519
key; the proxy's own credentials, never a client's), and the caller retries with the transfer
client's `RetryPolicy`, so a mirror fetches exactly as `ferry pull` would.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from registry import media_types as mt
from registry.digests import Digest
from registry.errors import InvalidManifest
from registry.service.proxy.config import ProxyConfig, Upstream
from registry.transfer.auth import Authenticator
from registry.transfer.client import send_authorized
from registry.transfer.errors import TransferError, UpstreamError
from registry.transfer.safe import DnsResolver, RedirectPolicy
from registry.transfer.session import Reply, SafeSession, build_ssl_context

_MAX_AUTHENTICATORS = 1024


@dataclass(frozen=True)
class FetchedManifest:
    raw: bytes
    content_type: str | None
    digest: Digest


class UpstreamClient:
    """One upstream: a session (one connection pool per host) and a token per repository."""

    def __init__(self, upstream: Upstream, config: ProxyConfig) -> None:
        self.upstream = upstream
        self.config = config
        policy = RedirectPolicy(upstream.base, upstream.insecure,
                                config.resolver or DnsResolver())
        self.session = SafeSession(policy, build_ssl_context(config.ca_file),
                                   config.stall_timeout, user_agent="ferry/0.1 (proxy)")
        self._auth: dict[str, Authenticator] = {}

    def _authenticator(self, repo: str) -> Authenticator:
        """Tokens are scoped to a repository, so each repository keeps its own."""
        auth = self._auth.get(repo)
        if auth is None:
            if len(self._auth) >= _MAX_AUTHENTICATORS:
                self._auth.clear()
            home = self.config.home
            auth = Authenticator(self.session, home / "credentials.json", home / "id_ed25519",
                                 self.upstream.credentials)
            self._auth[repo] = auth
        return auth

    def url(self, repo: str, path: str) -> httpx.URL:
        return self.upstream.base.join(f"/v2/{repo}/{path}")

    async def request(self, method: str, repo: str, path: str,
                      headers: dict[str, str] | None = None,
                      ok: tuple[int, ...] = (200,)) -> Reply:
        return await send_authorized(self.session, self._authenticator(repo), method,
                                     self.url(repo, path), headers=headers, ok=ok)

    async def manifest_digest(self, repo: str, reference: str) -> Digest | None:
        """HEAD the manifest: the digest the upstream names, or None when it names none."""
        reply = await self.request("HEAD", repo, f"manifests/{reference}",
                                   {"Accept": mt.MANIFEST_ACCEPT})
        await reply.aclose()
        claimed = reply.response.headers.get("docker-content-digest", "")
        return Digest.parse(claimed) if Digest.is_valid(claimed) else None

    async def manifest(self, repo: str, reference: str, limit: int) -> FetchedManifest:
        """GET the manifest, at most `limit` bytes; a `Docker-Content-Digest` that does not
        match the body is a lie and fails (InvalidManifest)."""
        reply = await self.request("GET", repo, f"manifests/{reference}",
                                   {"Accept": mt.MANIFEST_ACCEPT})
        body = await reply.read_capped(limit, "manifest")
        digest = Digest.of(body)
        claimed = reply.response.headers.get("docker-content-digest")
        if claimed and (not Digest.is_valid(claimed) or Digest.parse(claimed) != digest):
            raise InvalidManifest(f"the upstream's Docker-Content-Digest {claimed} does not "
                                  f"match the manifest it sent ({digest})")
        return FetchedManifest(body, reply.response.headers.get("content-type"), digest)

    async def open_blob(self, repo: str, digest: Digest, offset: int) -> Reply:
        """GET the blob from `offset` (a Range when > 0); the caller reads and closes it."""
        headers = {"Accept-Encoding": "identity"}
        if offset:
            headers["Range"] = f"bytes={offset}-"
        reply = await self.request("GET", repo, f"blobs/{digest}", headers, ok=(200, 206))
        if reply.status != (206 if offset else 200):
            await reply.aclose()
            raise TransferError(f"the upstream answered {reply.status} to a request for bytes "
                                f"{offset}- of {digest}; it ignored or misread the Range")
        return reply

    async def open_blob_range(self, repo: str, digest: Digest, first: int, last: int) -> Reply:
        """GET bytes [first, last] of the blob: a 206, or a 200 from a registry without Range."""
        headers = {"Accept-Encoding": "identity", "Range": f"bytes={first}-{last}"}
        return await self.request("GET", repo, f"blobs/{digest}", headers, ok=(200, 206))

    async def open_blob_start(self, repo: str, digest: Digest, segment: int) -> Reply:
        """The first request for a blob: its first `segment` bytes (a 206 names its size), or
        the whole blob (200) where ranges are not served; an empty blob has no range (416)."""
        try:
            return await self.open_blob_range(repo, digest, 0, segment - 1)
        except UpstreamError as exc:
            if exc.status != 416:
                raise
        return await self.open_blob(repo, digest, 0)

    async def blob_size(self, repo: str, digest: Digest) -> int | None:
        reply = await self.request("HEAD", repo, f"blobs/{digest}")
        await reply.aclose()
        length = reply.response.headers.get("content-length", "")
        return int(length) if length.isdigit() else None

    async def aclose(self) -> None:
        await self.session.aclose()
