"""Real clients through the mirror: skopeo copies through the proxy, and the official `ollama`
client pulls through `ferry serve` configured with the proxy as a mirror."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import ollama
from conftest import serve_app

from ferry.app import build_model_server
from ferry.config import Settings
from registry.manifests import parse_manifest
from registry.names import Name
from registry.store import Store
from tests.registry.transfer.helpers import blob_bytes

from .proxy_fixtures import proxy_config, proxy_registry, publish, upstream_registry
from .test_skopeo_interop import POLICY, build_oci_layout, run_skopeo, skopeo  # noqa: F401

ORIGIN = "origin.invalid"


def test_skopeo_copies_an_image_through_the_proxy(skopeo: str, tmp_path: Path) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps(POLICY))
    source = tmp_path / "src"
    digest = build_oci_layout(source, "v1")
    with upstream_registry(tmp_path / "upstream") as upstream:
        run_skopeo(skopeo, policy, "copy", "--dest-tls-verify=false", "--preserve-digests",
                   f"oci:{source}:v1", f"docker://{upstream.host}/ferry/interop/image:v1")
        config = proxy_config(f"http://{upstream.host}", tmp_path / "ph")
        with proxy_registry(tmp_path / "proxy", config) as (proxy, _app):
            ref = f"docker://{proxy}/ferry/interop/image:v1"
            inspected = json.loads(run_skopeo(skopeo, policy, "inspect", "--tls-verify=false",
                                              ref))
            assert inspected["Digest"] == digest
            out = tmp_path / "out"
            run_skopeo(skopeo, policy, "copy", "--src-tls-verify=false", "--preserve-digests",
                       ref, f"oci:{out}:v1")
            gets = {path for method, path, _ in upstream.log.requests
                    if method == "GET" and "/blobs/" in path}
            upstream.stop.close()
            again = tmp_path / "again"  # the upstream is gone; the cache serves it all
            run_skopeo(skopeo, policy, "copy", "--src-tls-verify=false", "--preserve-digests",
                       ref, f"oci:{again}:v1")
    original = sorted(p.name for p in (source / "blobs" / "sha256").iterdir())
    for copy in (out, again):
        assert sorted(p.name for p in (copy / "blobs" / "sha256").iterdir()) == original
        for name in original:
            assert (copy / "blobs" / "sha256" / name).read_bytes() == (
                source / "blobs" / "sha256" / name).read_bytes()
    assert len(gets) == 4  # config and three layers, each fetched upstream once


def test_the_ollama_client_pulls_through_ferry_serve_with_a_mirror(tmp_path: Path) -> None:
    source = Store(tmp_path / "source")
    with upstream_registry(tmp_path / "upstream") as upstream:
        raw = asyncio.run(publish(source, f"{upstream.host}/library/tiny:latest",
                                  [40_000, 800], tmp_path / "pub"))
        config = proxy_config(f"http://{upstream.host}", tmp_path / "ph")
        with proxy_registry(tmp_path / "proxy", config) as (proxy, _app):
            settings = Settings.from_env({
                "FERRY_HOME": str(tmp_path / "home"),
                "FERRY_MIRRORS": f"{ORIGIN}=http://{proxy}",
                "FERRY_MIRRORS_ONLY": "1",  # origin.invalid is never looked up
            })
            with serve_app(build_model_server(settings)) as url:
                client = ollama.Client(host=url)
                statuses = [p.status for p in client.pull(f"{ORIGIN}/library/tiny",
                                                          stream=True)]
    assert statuses[-1] == "success"
    store = Store(settings.models_dir)
    assert store.read_manifest(Name.parse_valid(f"{ORIGIN}/library/tiny:latest")) == raw
    for desc in parse_manifest(raw, None).references():
        assert blob_bytes(store, desc.digest) == blob_bytes(source, desc.digest)
