"""The model server's request body limit: a named setting, 413 with Ollama's error JSON, counted
while the body streams in."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from conftest import serve_app
from starlette.requests import Request

from registry.errors import TooLarge
from server.api_errors import read_limited

LIMIT = 4096
ERROR = {"error": f"request body exceeds the limit of {LIMIT} bytes"}


@pytest.fixture
def small_limit_server(settings) -> Iterator[str]:
    from ferry.app import build_model_server

    with serve_app(build_model_server(settings.with_(max_request_body_bytes=LIMIT))) as url:
        yield url


def test_limit_is_read_from_the_environment() -> None:
    from ferry.config import Settings

    assert Settings.from_env({}).max_request_body_bytes == 32 * 1024 * 1024
    env = {"FERRY_MAX_REQUEST_BYTES": "65536"}
    assert Settings.from_env(env).max_request_body_bytes == 65536


def test_a_body_over_the_limit_is_413_and_one_under_it_is_served(small_limit_server) -> None:
    padded = json.dumps({"model": "missing", "pad": "x" * LIMIT}).encode()
    fits = json.dumps({"model": "missing", "pad": "x" * (LIMIT - 100)}).encode()
    with httpx.Client(base_url=small_limit_server, timeout=30) as http:
        r = http.post("/api/show", content=padded)
        assert r.status_code == 413 and r.json() == ERROR
        r = http.post("/api/show", content=fits)
        assert r.status_code == 404  # read and parsed: the model simply is not there
        r = http.post("/api/copy", content=padded)
        assert r.status_code == 413 and r.json() == ERROR


def test_a_chunked_body_with_no_length_is_counted_as_it_arrives(small_limit_server) -> None:
    def body() -> Iterator[bytes]:
        yield b'{"model": "m", "pad": "'
        for _ in range(16):
            yield b"x" * 1024
        yield b'"}'

    with httpx.Client(base_url=small_limit_server, timeout=30) as http:
        r = http.post("/api/show", content=body())
        assert r.status_code == 413 and r.json() == ERROR


async def test_reading_stops_at_the_first_chunk_past_the_limit() -> None:
    sent = 0

    async def receive() -> dict:
        nonlocal sent
        sent += 1
        return {"type": "http.request", "body": b"x" * 1024, "more_body": True}  # endless

    request = Request({"type": "http", "method": "POST", "headers": []}, receive)
    with pytest.raises(TooLarge) as caught:
        await read_limited(request, LIMIT)
    assert caught.value.limit == LIMIT
    assert sent == LIMIT // 1024 + 1  # never more than one chunk past the limit was pulled
