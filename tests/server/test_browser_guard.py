"""A web page the user opens must not drive the model server: foreign origins, foreign Host
names (DNS rebinding) and browser form encodings are refused; CLI and script requests pass."""

from __future__ import annotations

import json

import httpx
import pytest

from ferry.config import Settings

COPY = json.dumps({"source": "missing", "destination": "stolen"})


def asgi_client(settings: Settings) -> httpx.AsyncClient:
    from ferry.app import build_model_server

    transport = httpx.ASGITransport(app=build_model_server(settings))
    return httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:11434")


def test_origins_and_allowed_hosts_are_read_from_the_environment() -> None:
    env = {"FERRY_ORIGINS": "https://chat.example, http://*.lan:*", "FERRY_ALLOWED_HOSTS": "a,b"}
    settings = Settings.from_env(env)
    assert settings.origins == ("https://chat.example", "http://*.lan:*")
    assert settings.allowed_hosts == ("a", "b")
    assert Settings.from_env({}).origins == ()


def test_a_cross_site_text_plain_post_is_refused(model_server: str, store) -> None:
    with httpx.Client(base_url=model_server) as http:
        r = http.post("/api/copy", content=COPY, headers={
            "Origin": "https://attacker.example", "Content-Type": "text/plain"})
        assert r.status_code == 403
        assert "origin" in r.json()["error"]
        assert "access-control-allow-origin" not in r.headers
        r = http.post("/api/pull", json={"model": "10.0.0.1:9/x/y", "insecure": True},
                      headers={"Origin": "null"})
        assert r.status_code == 403


def test_requests_without_an_origin_pass_and_loopback_pages_get_cors(model_server: str) -> None:
    with httpx.Client(base_url=model_server) as http:
        assert http.get("/api/tags").status_code == 200
        r = http.get("/api/tags", headers={"Origin": "http://localhost:3000"})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
        for origin in ("http://127.0.0.1", "https://[::1]:8443", "vscode-webview://abc"):
            assert http.get("/api/tags", headers={"Origin": origin}).status_code == 200


def test_preflight_is_answered_only_for_allowed_origins(model_server: str) -> None:
    ask = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type"}
    with httpx.Client(base_url=model_server) as http:
        r = http.options("/api/copy", headers={"Origin": "http://localhost:5173", **ask})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://localhost:5173"
        r = http.options("/api/copy", headers={"Origin": "https://evil.example", **ask})
        assert r.status_code == 403
        assert "access-control-allow-origin" not in r.headers


def test_a_foreign_host_name_is_refused_on_a_loopback_listener(model_server: str) -> None:
    with httpx.Client(base_url=model_server) as http:
        r = http.get("/api/tags", headers={"Host": "attacker.example"})
        assert r.status_code == 403 and "host" in r.json()["error"]
        assert http.get("/api/tags", headers={"Host": "attacker.example:11434"}).status_code == 403
        for host in ("localhost", "localhost:11434", "127.0.0.1:1", "[::1]:11434", "a.localhost"):
            assert http.get("/api/tags", headers={"Host": host}).status_code == 200, host


def test_form_encodings_are_refused_on_state_changing_routes(model_server: str) -> None:
    with httpx.Client(base_url=model_server) as http:
        for kind in ("text/plain", "multipart/form-data; boundary=x", "TEXT/PLAIN;charset=utf-8"):
            r = http.post("/api/copy", content=COPY, headers={"Content-Type": kind})
            assert r.status_code == 415 and "application/json" in r.json()["error"]
        r = http.post("/api/copy", content=COPY, headers={
            "Content-Type": "application/x-www-form-urlencoded", "Sec-Fetch-Site": "cross-site"})
        assert r.status_code == 415
        # `curl -d '{...}'`: JSON under the url-encoded type, from a tool, not a browser
        r = http.post("/api/copy", content=COPY,
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 404  # parsed and handled: the source model is not there
        r = http.post("/api/copy", content=COPY, headers={"Content-Type": "application/json"})
        assert r.status_code == 404
        assert http.get("/api/tags", headers={"Content-Type": "text/plain"}).status_code == 200


@pytest.mark.parametrize("origin", ["https://chat.example", "http://box.lan:8080"])
async def test_configured_origins_are_allowed(origin: str, tmp_path) -> None:
    settings = Settings.from_env({"FERRY_HOME": str(tmp_path),
                                  "FERRY_ORIGINS": "https://chat.example,http://*.lan:*"})
    async with asgi_client(settings) as http:
        r = await http.get("/api/version", headers={"Origin": origin})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        r = await http.get("/api/version", headers={"Origin": "https://chat.example.evil"})
        assert r.status_code == 403


async def test_allowed_hosts_decide_on_a_public_listener(tmp_path) -> None:
    base = {"FERRY_HOME": str(tmp_path), "FERRY_HOST": "0.0.0.0:11434"}
    async with asgi_client(Settings.from_env(base)) as http:  # not set: the operator's choice
        assert (await http.get("/api/version", headers={"Host": "gpu.corp"})).status_code == 200
    settings = Settings.from_env({**base, "FERRY_ALLOWED_HOSTS": "*.corp,models.example"})
    async with asgi_client(settings) as http:
        for host, status in (("gpu.corp:11434", 200), ("models.example", 200),
                             ("localhost", 200), ("attacker.example", 403)):
            r = await http.get("/api/version", headers={"Host": host})
            assert r.status_code == status, host
