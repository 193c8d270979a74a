"""Two authenticated replicas on one S3 bucket (moto) with the same auth file: a token one issues
the other accepts, and what one stores the other serves to it."""

from __future__ import annotations

from pathlib import Path

import httpx

from .auth_fixtures import basic, get_token, serve_auth_registry, write_auth_file
from .conftest import push_image, s3_store


async def test_replicas_on_one_bucket_accept_each_others_tokens(
        s3_server: str, tmp_path: Path) -> None:
    auth_file = write_auth_file(tmp_path)
    first = s3_store(s3_server)
    second = s3_store(s3_server, bucket=first.bucket)
    with serve_auth_registry(tmp_path / "a", auth_file, store=first) as url_a, \
            serve_auth_registry(tmp_path / "b", auth_file, store=second) as url_b:
        token = get_token(url_a, basic("alice", "alice-pw"), "repository:team/shared:pull,push")
        headers = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(base_url=url_b, headers=headers, timeout=60) as b:
            raw, digest = await push_image(b, "team/shared", "v1")
        async with httpx.AsyncClient(base_url=url_a, headers=headers, timeout=60) as a:
            r = await a.get("/v2/team/shared/manifests/v1")
            assert r.status_code == 200 and r.content == raw
        reader = get_token(url_b, basic("bob", "bob-pw"), "repository:team/shared:pull")
        r = httpx.get(f"{url_a}/v2/team/shared/manifests/{digest}",
                      headers={"Authorization": f"Bearer {reader}"})
        assert r.status_code == 200
        r = httpx.delete(f"{url_a}/v2/team/shared/manifests/{digest}",
                         headers={"Authorization": f"Bearer {reader}"})
        assert r.status_code == 401
