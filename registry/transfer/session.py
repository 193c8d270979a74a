"""HTTP for the transfer client: redirects followed by hand, each hop pinned to its checked address.

httpx pools connections by the URL's host. We send requests to the checked IP (with the original
`Host` header and the `sni_hostname` extension, so TLS still verifies the name), so one shared
client would pool by IP and could hand a connection verified for one name to another name that
resolved to the same address. Hence one client, and so one pool, per (scheme, hostname, port).
A plain-http pool connects through `plain_socket.SocketBackend` (literal addresses only), whose
large bodies `Reply.pieces()` reads straight from the socket.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import httpcore._async.http11 as _http11
import httpx

from registry.errors import FerryError, TooLarge
from registry.transfer.errors import UpstreamError
from registry.transfer.plain_socket import lean_body, transport_for
from registry.transfer.safe import HopChain, RedirectPolicy, check_hop

REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
# httpcore receives at most 64 KiB per socket read; blob bodies are large, and each read costs
# Python-level work in h11 and httpx, so bigger reads cut the pull's CPU per byte by about a
# third (bench/transfer.py). It is a class attribute with no per-client knob: raise it, never
# lower it, for the whole process (a larger cap changes nothing for small responses).
_READ_BYTES = 256 * 1024
if getattr(_http11.AsyncHTTP11Connection, "READ_NUM_BYTES", _READ_BYTES) < _READ_BYTES:
    _http11.AsyncHTTP11Connection.READ_NUM_BYTES = _READ_BYTES
USER_AGENT = "ferry/0.1 (transfer)"
RELEASE_BYTES = 16 * 1024  # a reply body up to this size is read off so its connection is kept

Body = bytes | Callable[[], AsyncIterator[bytes]] | None
# A piece of a body: bytes from httpx, or a view of a buffer of its own from the lean path.
Piece = bytes | memoryview


@dataclass(frozen=True)
class Reply:
    """A response (streamed: the caller closes it) and the URL that produced it."""

    response: httpx.Response
    url: httpx.URL

    @property
    def status(self) -> int:
        return self.response.status_code

    async def aclose(self) -> None:
        await self.response.aclose()

    async def release(self) -> None:
        """Close a reply whose body the caller does not want, reading it first when it is
        known to be tiny (a HEAD, a 204, `Content-Length` up to RELEASE_BYTES) so that the
        connection goes back to the pool: httpcore closes a connection whose response was not
        read to its end, and a new one per request cost a push of many small blobs a connect
        (and the registry a connection) for each of its requests."""
        response = self.response
        length = response.headers.get("content-length", "")
        small = (response.request.method == "HEAD" or response.status_code in (204, 304)
                 or (length.isdigit() and int(length) <= RELEASE_BYTES))
        try:
            if small and "transfer-encoding" not in response.headers:
                async for _chunk in response.aiter_raw():
                    pass
        except httpx.HTTPError:
            pass  # the connection is dropped on close, as it would have been
        finally:
            await response.aclose()

    async def pieces(self) -> AsyncIterator[Piece]:
        """The raw body (no decoding) in pieces: straight from the socket in large buffers where
        the connection allows it (plain_socket.py), else as httpx reads it."""
        lean = lean_body(self.response)
        if lean is None:
            async for chunk in self.response.aiter_raw():
                yield chunk
            return
        stream, length = lean
        async for piece in stream.body(length):
            yield piece

    async def read_capped(self, limit: int, what: str) -> bytes:
        """The whole body, refused (TooLarge) as soon as it passes `limit`; closes the reply.
        For manifests, which are read into memory: a lying server cannot make us hold more."""
        body = bytearray()
        try:
            async for chunk in self.response.aiter_bytes():
                body += chunk
                if len(body) > limit:
                    raise TooLarge(what, limit, len(body))
        finally:
            await self.aclose()
        return bytes(body)


def build_ssl_context(ca_file: str = "") -> ssl.SSLContext:
    """System trust, or the CA bundle from SSL_CERT_FILE (read by Settings) for private CAs."""
    if ca_file:
        return ssl.create_default_context(cafile=ca_file)
    return httpx.create_ssl_context(trust_env=False)


class SafeSession:
    """Sends requests under a `RedirectPolicy`; never follows a redirect without checking it."""

    def __init__(self, policy: RedirectPolicy, ssl_context: ssl.SSLContext | None = None,
                 stall_timeout: float = 30.0, user_agent: str = USER_AGENT) -> None:
        self.policy = policy
        self.ssl_context = ssl_context or build_ssl_context()
        # A read that sees no byte for `stall_timeout` raises ReadTimeout, which is retried.
        self.timeout = httpx.Timeout(stall_timeout, connect=30.0, pool=None)
        self.user_agent = user_agent
        self._pools: dict[tuple[str, str, int | None], httpx.AsyncClient] = {}

    def _pool(self, url: httpx.URL) -> httpx.AsyncClient:
        key = (url.scheme, url.host.lower(), url.port)
        client = self._pools.get(key)
        if client is None:
            # trust_env=False: a proxy from the environment would undo the address pinning.
            limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
            client = httpx.AsyncClient(
                transport=transport_for(url.scheme, self.ssl_context, limits),
                timeout=self.timeout, follow_redirects=False, trust_env=False)
            self._pools[key] = client
        return client

    async def send(self, method: str, url: httpx.URL | str, *,
                   headers: Mapping[str, str] | None = None, content: Body = None,
                   authorization: str | None = None, follow: bool = True) -> Reply:
        """Send, following up to `max_hops` redirects by hand; the reply's body is unread."""
        url = httpx.URL(url)
        chain = HopChain()
        while True:
            hop = await check_hop(url, self.policy, chain)
            response = await self._send_hop(method, hop.url, hop.connect_url, hop.host_header,
                                            hop.extensions, headers, content, authorization)
            if not follow or response.status_code not in REDIRECT_STATUSES:
                return Reply(response, url)
            location = response.headers.get("location")
            await response.aclose()
            if not location:
                raise UpstreamError(response.status_code, "redirect without a Location", str(url))
            try:
                # userinfo in a Location would become a Basic header: never send it on
                url = url.join(location).copy_with(username=None, password=None)
            except (httpx.InvalidURL, ValueError) as exc:
                raise FerryError(f"invalid redirect Location {location[:200]!r}: {exc}") from exc
            if response.status_code == 303 or (
                    response.status_code in (301, 302) and method == "POST"):
                method, content = "GET", None
            chain.redirects += 1

    async def _send_hop(self, method: str, url: httpx.URL, connect_url: httpx.URL, host: str,
                        extensions: dict[str, str], headers: Mapping[str, str] | None,
                        content: Body, authorization: str | None) -> httpx.Response:
        hop_headers = {"User-Agent": self.user_agent, **(headers or {}), "Host": host}
        # Credentials go to the registry's own origin only, never to a CDN or any other hop.
        if authorization and self.policy.is_registry_origin(url):
            hop_headers["Authorization"] = authorization
        body = content() if callable(content) else content
        client = self._pool(url)
        request = client.build_request(method, connect_url, headers=hop_headers, content=body,
                                       extensions=extensions)
        return await client.send(request, stream=True)

    async def aclose(self) -> None:
        for client in self._pools.values():
            await client.aclose()
        self._pools.clear()
