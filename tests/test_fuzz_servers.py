"""A bounded, seeded fuzz of both servers: malformed names, digests, references, ranges, JSON
bodies and headers. Every answer is a 4xx or a success, never a 5xx; no body names a server
path; the stores are byte-for-byte unchanged. Fixed seed and budget, so it is repeatable and
takes seconds (issue 19).

Every request carries at least one malformed part, and no body ever holds a valid model name
for pull, push, copy, create or generate, so nothing may change and nothing leaves loopback.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import serve_app

SEED = 19
BUDGET = 400  # requests per server
HEX = hashlib.sha256(b"fuzz").hexdigest()
NINES = "9" * 5000

BAD_NAMES = ["UPPER/x", "a//b", "a/%2e%2e", "%2e%2e/x", "a%0a", "a%0A/b", "_x/y", "-x", "a" * 300,
             "a/" * 80 + "b", "%00", "%C3%A9", "a%20b", "a:b", "a.", "a..b", "a/b/", "%2F"]
BAD_DIGESTS = ["sha256:", "sha256:" + "g" * 64, f"sha256-{HEX}", f"SHA256:{HEX}",
               f"sha256:{HEX}%0a", f"sha256:{HEX.upper()}", "md5:abc", "sha256:" + "a" * 63,
               "sha256:" + "a" * 65, "%2e%2e", NINES, f"sha256:{HEX}%00", "sha512:" + HEX * 2]
BAD_REFERENCES = ["%2e%2e", "%2e", "v1%0a", "-v", "a" * 129, "sha256:x", "%00", "v1%20x",
                  "%C2%B2", "sha256-" + HEX, "latest%0d%0a"]
BAD_NUMBERS = [NINES, "²", "-1", "1e3", "0x10", " 1", "", "1" * 19 + "0"]
RANGES = [f"bytes={NINES}-", f"bytes=-{NINES}", "bytes=²-3", "bytes=5-1", "bytes=a-b",
          "bytes=0-0,1-1", "items=0-1", "bytes=-0", "bytes=", f"bytes=0-{NINES}"]
JSON_BODIES = [b"[" * 100_000, b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 60_000,
               ('{"model": ' + NINES + "}").encode(), b'{"model": NaN}', b"\xff\xfe{}",
               b"[]", b'"x"', b"12", b"{", b"null", b'{"model": 5}', b'{"model": ["x"]}',
               b'{"name": {"a": 1}}', b'{"stream": "yes", "model": "UPPER//x"}']


def bad_value(rng: random.Random) -> object:
    return rng.choice([rng.choice(BAD_NAMES), 5, None, [], {"a": 1}, True, "x" * 5000,
                       NINES, "../../etc/passwd", "/etc/passwd", "a\nb"])


def model_body(rng: random.Random) -> bytes:
    """A JSON body whose model name is never valid (so nothing is pulled, copied or made)."""
    if rng.random() < 0.4:
        return rng.choice(JSON_BODIES)
    body: dict[str, object] = {"model": rng.choice(BAD_NAMES).replace("%2e", ".")}
    for key in rng.sample(["source", "destination", "name", "stream", "insecure", "files",
                           "options", "messages", "prompt", "keep_alive", "format", "quantize"],
                          k=rng.randint(0, 4)):
        body[key] = bad_value(rng)
    if rng.random() < 0.3:
        body["files"] = {rng.choice(["../a", "a/../b", "/abs", "a" * 300, "x\\y", "d/" * 50 + "f",
                                     "ok.json"]): rng.choice([*BAD_DIGESTS, f"sha256:{HEX}"])}
    return json.dumps(body).encode()


def registry_request(rng: random.Random, repo: str, digest: str) -> dict:
    kind = rng.randrange(7)
    if kind == 0:
        return {"method": rng.choice(["GET", "HEAD", "DELETE"]),
                "url": f"/v2/{repo}/blobs/{rng.choice(BAD_DIGESTS)}"}
    if kind == 1:
        method = rng.choice(["GET", "HEAD", "DELETE", "PUT"])
        return {"method": method, "url": f"/v2/{repo}/manifests/{rng.choice(BAD_REFERENCES)}",
                "content": rng.choice(JSON_BODIES) if method == "PUT" else None}
    if kind == 2:
        return {"method": "GET", "url": f"/v2/{repo}/blobs/{digest}",
                "headers": {"Range": rng.choice(RANGES).encode()}}
    if kind == 3:
        where = rng.choice(["/v2/_catalog", f"/v2/{repo}/tags/list"])
        return {"method": "GET", "url": where, "params": {"n": rng.choice(BAD_NUMBERS)}}
    if kind == 4:
        name = rng.choice(BAD_NAMES)
        return {"method": rng.choice(["GET", "POST", "PUT", "PATCH", "DELETE"]),
                "url": f"/v2/{name}/" + rng.choice(["blobs/uploads/", "manifests/v1",
                                                     f"blobs/{digest}", "tags/list"])}
    if kind == 5:
        return {"method": "PUT", "url": f"/v2/{repo}/manifests/fuzz",
                "content": rng.choice([*JSON_BODIES[:4], b"{}", b'{"schemaVersion": 2}']),
                "headers": {"Content-Type": "application/vnd.oci.image.manifest.v1+json"}}
    return {"method": "PATCH", "url": f"/v2/{repo}/blobs/uploads/{'0' * 32}",
            "headers": {"Content-Range": rng.choice(RANGES).removeprefix("bytes=").encode()}}


def model_request(rng: random.Random, digest: str) -> dict:
    kind = rng.randrange(5)
    if kind == 0:
        return {"method": rng.choice(["HEAD", "POST"]),
                "url": f"/api/blobs/{rng.choice(BAD_DIGESTS)}", "content": b"x"}
    if kind == 1:
        method, path = rng.choice([("POST", "/api/pull"), ("POST", "/api/push"),
                                   ("POST", "/api/copy"), ("DELETE", "/api/delete"),
                                   ("POST", "/api/create"), ("POST", "/api/show"),
                                   ("POST", "/api/generate"), ("POST", "/api/chat"),
                                   ("POST", "/v1/chat/completions")])
        return {"method": method, "url": path, "content": model_body(rng)}
    if kind == 2:
        return {"method": "POST", "url": "/api/copy", "content": model_body(rng),
                "headers": rng.choice([{"Origin": "https://evil.example"},
                                       {"Content-Type": "text/plain"},
                                       {"Host": "attacker.example"}])}
    if kind == 3:
        return {"method": "GET", "url": rng.choice(["/api/tags", "/api/ps", "/api/version",
                                                    "/v1/models", "/v1/models/%2e%2e"]),
                "headers": {"X-Big": "a" * rng.choice([10, 70_000])}}
    return {"method": "POST", "url": "/api/show", "content": model_body(rng),
            "headers": {"Content-Length": rng.choice(["abc", NINES])}}


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def check(response: httpx.Response, secrets: list[str], request: dict) -> None:
    assert response.status_code < 500, (request, response.status_code, response.text[:300])
    for secret in secrets:
        assert secret not in response.text, (request, response.text[:300])


def send(http: httpx.Client, request: dict) -> httpx.Response | None:
    try:
        return http.request(request["method"], request["url"], content=request.get("content"),
                            params=request.get("params"), headers=request.get("headers"))
    except (httpx.RemoteProtocolError, httpx.LocalProtocolError):
        return None  # refused at the protocol level (a malformed head): no 5xx, no body


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[tuple[str, Path, str, str]]:
    from registry.service.app import BulkHttpProtocol, build_registry_app

    root = tmp_path / "registry"
    with serve_app(build_registry_app(root), http=BulkHttpProtocol) as url:
        with httpx.Client(base_url=url) as http:
            data = b"fuzz blob"
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            r = http.post("/v2/fuzz/repo/blobs/uploads/", params={"digest": digest},
                          content=data)
            assert r.status_code == 201
        yield url, root, "fuzz/repo", digest


def test_fuzz_the_registry(registry: tuple[str, Path, str, str]) -> None:
    url, root, repo, digest = registry
    rng = random.Random(SEED)
    before = tree_digest(root)
    with httpx.Client(base_url=url, timeout=30) as http:
        for _ in range(BUDGET):
            request = registry_request(rng, repo, digest)
            response = send(http, request)
            if response is not None:
                check(response, [str(root), str(root.parent)], request)
                if response.status_code >= 400 and request["method"] != "HEAD":
                    assert response.json()["errors"][0]["code"], request  # OCI's error JSON
    assert tree_digest(root) == before


def test_fuzz_the_model_server(settings) -> None:
    from ferry.app import build_model_server
    from registry.service.header_limits import HeaderLimitedProtocol

    rng = random.Random(SEED)
    app = build_model_server(settings.with_(noprune=True))
    with serve_app(app, http=HeaderLimitedProtocol) as url:
        root = settings.models_dir
        root.mkdir(parents=True, exist_ok=True)
        before = tree_digest(root)
        with httpx.Client(base_url=url, timeout=30) as http:
            for _ in range(BUDGET):
                request = model_request(rng, HEX)
                response = send(http, request)
                if response is not None:
                    check(response, [str(settings.home), str(root)], request)
                    if response.status_code >= 400 and request["method"] != "HEAD":
                        assert "error" in response.json(), request  # Ollama's (or OpenAI's)
        assert tree_digest(root) == before
