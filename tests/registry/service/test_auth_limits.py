"""Per-client limits: a client over its request budget or its open upload sessions gets 429 with
Retry-After; another client is unaffected."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from registry.service.auth.limits import LimitSettings, RequestBuckets, UploadSlots

from .auth_fixtures import basic, get_token, serve_auth_registry, write_auth_file


def test_a_client_over_its_request_budget_gets_429_and_another_does_not(
        tmp_path: Path) -> None:
    auth_file = write_auth_file(tmp_path)
    audit = tmp_path / "audit.log"
    with serve_auth_registry(tmp_path, auth_file, LimitSettings(rate=0.5, burst=6),
                             audit=audit) as url:
        alice = get_token(url, basic("alice", "alice-pw"), "repository:team/a:pull")
        bob = get_token(url, basic("bob", "bob-pw"), "repository:team/a:pull")
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {alice}"}) as a:
            codes = [a.get("/v2/team/a/tags/list").status_code for _ in range(8)]
            assert codes[:6] == [404] * 6 and codes[6:] == [429, 429], codes
            r = a.get("/v2/team/a/tags/list")
            assert r.json()["errors"][0]["code"] == "TOOMANYREQUESTS"
            assert r.headers["Docker-Distribution-API-Version"] == "registry/2.0"
            assert int(r.headers["Retry-After"]) >= 1
        r = httpx.get(f"{url}/v2/team/a/tags/list", headers={"Authorization": f"Bearer {bob}"})
        assert r.status_code == 404  # bob's budget is his own
    denials = [json.loads(x) for x in audit.read_text().splitlines()]
    assert any(d["status"] == 429 and d["subject"] == "alice" for d in denials)


def test_open_upload_sessions_are_capped_per_client(tmp_path: Path) -> None:
    auth_file = write_auth_file(tmp_path)
    with serve_auth_registry(tmp_path, auth_file, LimitSettings(max_uploads=2)) as url:
        alice = get_token(url, basic("alice", "alice-pw"), "repository:team/a:pull,push")
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {alice}"}) as a:
            first = a.post("/v2/team/a/blobs/uploads/")
            assert a.post("/v2/team/a/blobs/uploads/").status_code == 202
            assert first.status_code == 202
            r = a.post("/v2/team/a/blobs/uploads/")
            assert r.status_code == 429 and r.headers["Retry-After"]
            assert a.delete(first.headers["Location"]).status_code == 204
            assert a.post("/v2/team/a/blobs/uploads/").status_code == 202


def test_the_bucket_refills_at_its_rate() -> None:
    buckets = RequestBuckets(rate=2.0, burst=2)
    assert buckets.take("c", now=0.0) == 0 and buckets.take("c", now=0.0) == 0
    assert buckets.take("c", now=0.0) == 0.5
    assert buckets.take("c", now=0.5) == 0
    assert buckets.take("other", now=0.5) == 0


def test_upload_slots_count_only_live_sessions_at_the_cap() -> None:
    """Below the cap the sessions are not scanned; at it, those older than the ttl stop
    counting, so an abandoned upload frees its slot."""
    slots = UploadSlots(limit=2, ttl=60.0)
    slots.opened("c", "u1")
    assert not slots.full("c")
    slots.opened("c", "u2")
    assert slots.full("c")
    slots._open["c"]["u1"] -= 120.0  # u1 abandoned two minutes ago
    assert not slots.full("c")
    assert list(slots._open["c"]) == ["u2"]
    slots.closed("c", "u2")
    assert not slots.full("c") and "c" not in slots._open
