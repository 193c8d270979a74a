"""Malformed requests to the model server get a clear 4xx with Ollama's error JSON, never a
500 (issue 19, items 3 and 4)."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from registry import bounded_json

DEEP = b"[" * 100_000 + b"]" * 100_000
DEEP_OBJECT = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
HUGE_NUMBER = b'{"model": "m", "keep_alive": ' + b"9" * 5000 + b"}"
ROUTES = [("POST", "/api/show"), ("POST", "/api/copy"), ("DELETE", "/api/delete"),
          ("POST", "/api/pull"), ("POST", "/api/push"), ("POST", "/api/create"),
          ("POST", "/api/generate"), ("POST", "/api/chat"), ("POST", "/v1/chat/completions")]


@pytest.mark.parametrize("body", [DEEP, DEEP_OBJECT, HUGE_NUMBER, b'{"a": NaN}'])
def test_hostile_json_is_400_on_every_endpoint(model_server: str, body: bytes) -> None:
    with httpx.Client(base_url=model_server, timeout=30) as http:
        for method, path in ROUTES:
            r = http.request(method, path, content=body)
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]  # /v1 speaks OpenAI's {"error": {"message": ...}}
            message = error if isinstance(error, str) else error["message"]
            assert message.startswith("invalid JSON body"), path


def test_bounded_json_keeps_ordinary_documents() -> None:
    doc = b'{"a": [1, 2.5, {"b": "[[[[{{{{\\"]]]]"}], "c": -1e300, "d": 12345678901234567890}'
    assert bounded_json.loads(doc)["a"][2]["b"] == '[[[[{{{{"]]]]'
    nested = b"[" * bounded_json.MAX_DEPTH + b"]" * bounded_json.MAX_DEPTH
    assert isinstance(bounded_json.loads(nested), list)
    with pytest.raises(bounded_json.JSONLimitError):
        bounded_json.loads(b"[" + nested + b"]")


def test_blob_digests_with_a_trailing_newline_are_refused(model_server: str) -> None:
    data = b"blob bytes"
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with httpx.Client(base_url=model_server, timeout=30) as http:
        for path in (f"/api/blobs/{digest}%0a", f"/api/blobs/{digest}%0A"):
            assert http.post(path, content=data).status_code == 400
            assert http.head(path).status_code == 400
        assert http.post(f"/api/blobs/{digest}", content=data).status_code == 201
        assert http.head(f"/api/blobs/{digest}%0a").status_code == 400
