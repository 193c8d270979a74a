"""`ferry login`: check a username and password against a registry, then save them (0600).

The check is the registry's own: its `/v2/` challenge names the token realm, and the token
endpoint must accept the credentials for `registry:catalog:*` (the scope every account may ask
for). A registry that asks for no credentials cannot check them, so nothing is saved for it.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from registry.transfer.auth import Authenticator, save_credentials
from registry.transfer.errors import AuthFailed, UpstreamError
from registry.transfer.safe import DnsResolver, RedirectPolicy, Resolver
from registry.transfer.session import SafeSession, build_ssl_context


def registry_base(registry: str, insecure: bool) -> httpx.URL:
    """`host[:port]` or `scheme://host[:port]` as the registry's base URL."""
    text = registry.strip().rstrip("/")
    if "://" not in text:
        text = f"{'http' if insecure else 'https'}://{text}"
    url = httpx.URL(text)
    if url.scheme == "http" and not insecure:
        raise AuthFailed("insecure protocol http; pass --insecure for a private registry")
    return url.copy_with(path="/")


def with_catalog_scope(challenge: str) -> str:
    """A Bearer challenge without a scope, asking for `registry:catalog:*`."""
    if challenge.strip().lower().startswith("bearer ") and "scope=" not in challenge:
        return challenge.rstrip() + ',scope="registry:catalog:*"'
    return challenge


async def login(registry: str, username: str, password: str, *, home: Path,
                insecure: bool = False, ca_file: str = "",
                resolver: Resolver | None = None) -> None:
    """Authenticate once against `GET /v2/` (answering its challenge); save on success."""
    verified = False
    base = registry_base(registry, insecure)
    policy = RedirectPolicy(base, insecure, resolver or DnsResolver())
    session = SafeSession(policy, build_ssl_context(ca_file))
    auth = Authenticator(session, home / "credentials.json", home / "id_ed25519",
                         credentials=(username, password))
    try:
        for attempt in (1, 2):
            reply = await session.send("GET", base.join("/v2/"), authorization=auth.header)
            challenge = reply.response.headers.get("www-authenticate", "")
            await reply.aclose()
            if reply.status != 401:
                break
            if attempt == 2 or not challenge:
                raise AuthFailed("unauthorized: the registry refused the username or password")
            await auth.refresh(with_catalog_scope(challenge), None)
            verified = True
        if reply.status >= 400:
            raise UpstreamError(reply.status, "", str(reply.url))
        if not verified:
            raise AuthFailed(f"{base.netloc.decode('ascii')} asks for no credentials, so it "
                             "cannot check them; nothing was saved")
    finally:
        await session.aclose()
    save_credentials(home / "credentials.json", auth.registry_host, username, password)
