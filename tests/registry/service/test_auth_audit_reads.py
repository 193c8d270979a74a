"""What the access middleware audits: every write, and a read only when it is refused.

Reads skip the middleware's response watching (the refusal's status comes from the error
handler instead), so this checks end to end that a refused GET, HEAD and token request are
still recorded with their status, and that granted reads leave no line.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from registry.service.auth.limits import LimitSettings

from .auth_fixtures import basic, get_token, read_audit, serve_auth_registry, write_auth_file
from .conftest import push_blob

VERSION = "Docker-Distribution-API-Version"  # on every response, added by the access middleware


async def test_refused_reads_and_every_write_are_audited_granted_reads_are_not(
        tmp_path: Path) -> None:
    auth_file, audit = write_auth_file(tmp_path), tmp_path / "audit.log"
    with serve_auth_registry(tmp_path, auth_file, LimitSettings(rate=1000, max_uploads=10),
                             audit=audit) as url:
        alice = get_token(url, basic("alice", "alice-pw"), "repository:team/app:pull,push")
        bob = get_token(url, basic("bob", "bob-pw"), "repository:team/app:pull")
        async with httpx.AsyncClient(base_url=url,
                                     headers={"Authorization": f"Bearer {alice}"}) as client:
            digest = await push_blob(client, "team/app", b"audited")
            for method in ("GET", "HEAD"):
                r = await client.request(method, f"/v2/team/app/blobs/{digest}")
                assert r.status_code == 200 and r.headers[VERSION] == "registry/2.0"
                r = await client.request(method, f"/v2/team/other/blobs/{digest}")
                assert r.status_code == 401  # alice's token names team/app only
                assert r.headers[VERSION] == "registry/2.0"
            r = await client.post("/v2/team/app/blobs/uploads/")  # a write carries it too
            assert r.status_code == 202 and r.headers[VERSION] == "registry/2.0"
            assert (await client.delete(r.headers["Location"])).status_code == 204
        r = httpx.head(f"{url}/v2/team/app/blobs/{digest}", headers={"Authorization": "Bearer x"})
        assert r.status_code == 401
        r = httpx.get(f"{url}/v2/team/app/blobs/{digest}",
                      headers={"Authorization": f"Bearer {bob}"})
        assert r.status_code == 200
        r = httpx.get(f"{url}/token", headers={"Authorization": basic("bob", "wrong")})
        assert r.status_code == 401
    records = read_audit(audit)
    reads = [(x["method"], x["path"], x["status"], x["subject"]) for x in records
             if x["method"] in ("GET", "HEAD")]
    assert reads == [
        ("GET", f"/v2/team/other/blobs/{digest}", 401, "alice"),
        ("HEAD", f"/v2/team/other/blobs/{digest}", 401, "alice"),
        ("HEAD", f"/v2/team/app/blobs/{digest}", 401, "anonymous"),
        ("GET", "/token", 401, "anonymous"),
    ], reads
    writes = [(x["method"], x["status"], x["subject"]) for x in records
              if x["method"] in ("POST", "PUT")]
    assert writes == [("POST", 202, "alice"), ("PUT", 201, "alice"), ("POST", 202, "alice")]
