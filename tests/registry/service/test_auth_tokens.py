"""The Bearer token flow and authorization on every route, against a real registry on loopback."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from registry.service.auth.tokens import ISSUER, key_id

from .auth_fixtures import basic, get_token, read_audit, serve_auth_registry, write_auth_file
from .conftest import push_blob, push_image, sha


@pytest.fixture
def auth_file(tmp_path: Path) -> Path:
    return write_auth_file(tmp_path)


@pytest.fixture
def url(tmp_path: Path, auth_file: Path):
    with serve_auth_registry(tmp_path, auth_file, audit=tmp_path / "audit.log") as base:
        yield base


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_v2_challenges_then_a_token_from_basic_credentials_pushes_and_pulls(
        url: str, tmp_path: Path) -> None:
    r = httpx.get(f"{url}/v2/")
    assert r.status_code == 401
    assert r.headers["Docker-Distribution-API-Version"] == "registry/2.0"
    challenge = r.headers["WWW-Authenticate"]
    assert challenge == f'Bearer realm="{url}/token",service="ferry-registry"'
    r = httpx.get(f"{url}/v2/team/app/manifests/v1")
    assert r.status_code == 401 and r.json()["errors"][0]["code"] == "UNAUTHORIZED"
    # reads ask for push too (one token per repository); /token grants what the rules allow
    assert 'scope="repository:team/app:pull,push"' in r.headers["WWW-Authenticate"]

    token = get_token(url, basic("alice", "alice-pw"), "repository:team/app:pull,push")
    claims = jwt.decode(token, options={"verify_signature": False})
    assert claims["aud"] == "ferry-registry" and claims["sub"] == "alice"
    assert claims["access"] == [{"type": "repository", "name": "team/app",
                                 "actions": ["pull", "push"]}]
    async with httpx.AsyncClient(base_url=url, headers=bearer(token)) as client:
        assert (await client.get("/v2/")).status_code == 200
        raw, digest = await push_image(client, "team/app", "v1")
        r = await client.get("/v2/team/app/manifests/v1")
        assert r.status_code == 200 and r.content == raw
        r = await client.delete(f"/v2/team/app/manifests/{digest}")
        assert r.status_code == 401  # the token holds no delete
    lines = read_audit(tmp_path / "audit.log")
    writes = [x for x in lines if x["method"] == "PUT" and "/manifests/" in x["path"]]
    assert writes and writes[0]["subject"] == "alice" and writes[0]["status"] == 201
    assert writes[0]["repository"] == "team/app" and writes[0]["reference"] == "v1"
    assert any(x["status"] == 401 and x["method"] == "DELETE" for x in lines)


async def test_a_pull_only_user_can_neither_push_nor_leave_an_upload_session(
        url: str, tmp_path: Path) -> None:
    token = get_token(url, basic("bob", "bob-pw"), "repository:team/app:pull,push,delete")
    claims = jwt.decode(token, options={"verify_signature": False})
    assert claims["access"][0]["actions"] == ["pull"]  # the intersection with the rules
    async with httpx.AsyncClient(base_url=url, headers=bearer(token)) as client:
        r = await client.post("/v2/team/app/blobs/uploads/")
        assert r.status_code == 401
        assert 'scope="repository:team/app:pull,push"' in r.headers["WWW-Authenticate"]
        assert 'error="insufficient_scope"' in r.headers["WWW-Authenticate"]
        r = await client.post("/v2/team/app/blobs/uploads/", params={"digest": sha(b"x")},
                              content=b"x")
        assert r.status_code == 401
        r = await client.put("/v2/team/app/manifests/v1", content=b"{}",
                             headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
        assert r.status_code == 401
        r = await client.delete(f"/v2/team/app/blobs/{sha(b'x')}")
        assert r.status_code == 401
    assert not (tmp_path / "registry" / "repositories").exists()  # nothing stored, no session
    assert not (tmp_path / "registry" / "blobs").exists()


async def test_a_token_for_one_repository_does_not_open_another(url: str) -> None:
    token = get_token(url, basic("alice", "alice-pw"), "repository:team/a:pull,push")
    async with httpx.AsyncClient(base_url=url, headers=bearer(token)) as client:
        await push_image(client, "team/a", "v1")
        assert (await client.get("/v2/team/a/tags/list")).status_code == 200
        for method, path in (("GET", "/v2/team/b/tags/list"), ("POST", "/v2/team/b/blobs/uploads/"),
                             ("GET", "/v2/team/b/manifests/v1"),
                             ("GET", "/v2/team/b/referrers/" + sha(b"x"))):
            assert (await client.request(method, path)).status_code == 401, path


def forge(claims: dict, key: Ed25519PrivateKey, kid: str | None = None) -> str:
    return jwt.encode(claims, key, algorithm="EdDSA",
                      headers={"kid": kid or key_id(key.public_key())})


def test_tampered_expired_foreign_audience_unsigned_and_foreign_key_tokens_are_refused(
        url: str, auth_file: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    ours = serialization.load_pem_private_key(
        (auth_file.parent / "token-key.pem").read_bytes(), password=None)
    assert isinstance(ours, Ed25519PrivateKey)
    now = int(time.time())
    access = [{"type": "repository", "name": "team/app", "actions": ["pull"]}]
    good = {"iss": ISSUER, "sub": "alice", "aud": "ferry-registry", "iat": now,
            "exp": now + 60, "access": access}
    target = f"{url}/v2/team/app/tags/list"
    assert httpx.get(target, headers=bearer(forge(good, ours))).status_code == 404  # accepted
    header, _payload, signature = forge(good, ours).split(".")
    evil = dict(good, access=[dict(access[0], name="team/other")])
    tampered = ".".join([header, jwt.utils.base64url_encode(json.dumps(evil).encode()).decode(),
                         signature])
    unsigned = jwt.encode(good, None, algorithm="none", headers={"kid": key_id(ours.public_key())})
    refused = {
        "expired": forge(dict(good, iat=now - 600, exp=now - 300), ours),
        "wrong audience": forge(dict(good, aud="someone-else"), ours),
        "unsigned": unsigned,
        "foreign key": forge(good, Ed25519PrivateKey.generate()),
        "foreign key claiming our kid": forge(good, Ed25519PrivateKey.generate(),
                                              kid=key_id(ours.public_key())),
        "garbage": "not.a.token",
    }
    assert httpx.get(f"{url}/v2/team/other/tags/list",
                     headers=bearer(tampered)).status_code == 401
    for what, token in refused.items():
        r = httpx.get(target, headers=bearer(token))
        assert r.status_code == 401, what
        assert 'error="insufficient_scope"' in r.headers["WWW-Authenticate"], what


async def test_mount_from_a_repository_the_user_cannot_pull_uploads_instead(
        url: str, tmp_path: Path) -> None:
    secret = b"only in team/secret"
    token = get_token(url, basic("alice", "alice-pw"), "repository:team/secret:pull,push")
    async with httpx.AsyncClient(base_url=url, headers=bearer(token)) as client:
        await push_blob(client, "team/secret", secret)
    token = get_token(url, basic("alice", "alice-pw"), "repository:public/x:pull,push")
    async with httpx.AsyncClient(base_url=url, headers=bearer(token)) as client:
        r = await client.post("/v2/public/x/blobs/uploads/",
                              params={"mount": sha(secret), "from": "team/secret"})
        assert r.status_code == 202  # a session, not a mount: the token cannot pull the source
        r = await client.post("/v2/public/x/blobs/uploads/", params={"digest": sha(secret)})
        assert r.status_code == 202  # the body-less probe mounts nothing from elsewhere either
        assert (await client.get(f"/v2/public/x/blobs/{sha(secret)}")).status_code == 404
    both = get_token(url, basic("alice", "alice-pw"), "repository:public/y:pull,push",
                     "repository:team/secret:pull")
    async with httpx.AsyncClient(base_url=url, headers=bearer(both)) as client:
        r = await client.post("/v2/public/y/blobs/uploads/",
                              params={"mount": sha(secret), "from": "team/secret"})
        assert r.status_code == 201  # with pull on the source, the mount happens


async def test_catalog_lists_only_what_the_caller_may_pull(url: str) -> None:
    token = get_token(url, basic("alice", "alice-pw"), "repository:team/a:pull,push",
                      "repository:public/b:pull,push")
    async with httpx.AsyncClient(base_url=url, headers=bearer(token)) as client:
        await push_image(client, "team/a", "v1")
        await push_image(client, "public/b", "v1")
    assert httpx.get(f"{url}/v2/_catalog").status_code == 401
    for who, seen in ((None, ["public/b"]), (basic("bob", "bob-pw"), ["public/b", "team/a"])):
        token = get_token(url, who, "registry:catalog:*")
        r = httpx.get(f"{url}/v2/_catalog", headers=bearer(token))
        assert r.status_code == 200 and r.json()["repositories"] == seen
    anon = get_token(url, None, "repository:team/a:pull,push")
    assert jwt.decode(anon, options={"verify_signature": False})["access"] == []
    assert httpx.get(f"{url}/v2/public/b/manifests/v1",
                     headers=bearer(get_token(url, None, "repository:public/b:pull"))
                     ).status_code == 200


def test_wrong_credentials_and_malformed_requests_are_4xx_and_never_logged(
        url: str, tmp_path: Path) -> None:
    secret = "hunter2-very-secret"
    bad_headers = ["", "Bearer", "Basic", "Basic !!!notbase64", basic("alice", secret),
                   basic("nobody", secret), "Digest " + secret, "Basic " + "A" * 20000,
                   "Basic " + "w4Bhc2Q6eA==", "Basic " + "/w==", f"{'A' * 68}:{'B' * 88}"]
    for value in bad_headers:
        headers = {"Authorization": value} if value else {}
        r = httpx.get(f"{url}/token", params={"scope": "repository:team/a:pull"},
                      headers=headers)
        assert r.status_code in (200, 400, 401), (value[:40], r.status_code)
        if value and value != "Bearer":
            assert r.status_code == 401, value[:40]
        r = httpx.get(f"{url}/v2/team/a/tags/list", headers=headers)
        assert r.status_code == 401, value[:40]
    r = httpx.get(f"{url}/token", headers={"Authorization": b"Basic \xff\xfe"})
    assert r.status_code == 401
    for scope in ("repository", "repository:team/a", "repository:TEAM/A:pull",
                  "repository:team/a:fly", "registry:catalog:pull", "blob:x:pull"):
        r = httpx.get(f"{url}/token", params={"scope": scope})
        assert r.status_code == 400, scope
        assert r.json()["errors"][0]["code"] in ("UNSUPPORTED", "NAME_INVALID")
    many = [("scope", f"repository:team/r{i}:pull") for i in range(1000)]
    r = httpx.get(f"{url}/token", params=many, headers={"Authorization": basic("alice",
                                                                               "alice-pw")})
    assert r.status_code == 400 and "at most 64 scopes" in r.text
    r = httpx.get(f"{url}/token", params={"service": "other"})
    assert r.status_code == 401
    records = read_audit(tmp_path / "audit.log")
    assert len([r for r in records if r["status"] == 401 and r["path"] == "/token"]) >= 10
    log = json.dumps(records)
    assert secret not in log and "alice-pw" not in log and "Basic" not in log


def test_a_rotation_accepts_tokens_of_the_old_key_only_while_it_is_listed(
        tmp_path: Path, auth_file: Path) -> None:
    from registry.service.auth.config import load_auth_config
    from registry.service.auth.gate import Gate
    from registry.service.auth.scopes import Scope
    from registry.service.auth.userfile import write_signing_key

    old = Gate(load_auth_config(auth_file)).tokens.issue(
        "alice", [Scope("repository", "team/a", frozenset({"pull"}))]).token
    write_signing_key(auth_file.parent / "token-key-2.pem")
    text = auth_file.read_text().replace('signing_key = "token-key.pem"',
                                         'signing_key = "token-key-2.pem"')
    auth_file.write_text(text.replace("[token]\n", '[token]\nverify_keys = ["token-key.pem"]\n'))
    rotating = Gate(load_auth_config(auth_file)).tokens
    new = rotating.issue("alice", []).token
    assert rotating.verify(old) is not None and rotating.verify(new) is not None
    auth_file.write_text(text)  # the old key retired
    retired = Gate(load_auth_config(auth_file)).tokens
    assert retired.verify(old) is None and retired.verify(new) is not None


def test_an_authenticated_registry_gets_a_finite_blob_limit_by_default(tmp_path: Path,
                                                                       auth_file: Path) -> None:
    from ferry.app import DEFAULT_AUTH_MAX_BLOB_BYTES, build_registry_app
    from ferry.config import Settings

    base = Settings.from_env({"FERRY_HOME": str(tmp_path / "home")})
    open_app = build_registry_app(base)
    authed = build_registry_app(base.with_(registry_auth=str(auth_file)))
    assert open_app.state.registry.uploads.max_blob_bytes == 0
    assert authed.state.registry.uploads.max_blob_bytes == DEFAULT_AUTH_MAX_BLOB_BYTES == 64 << 30
    assert authed.state.auth is not None and open_app.state.auth is None
