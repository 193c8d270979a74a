"""A blob of several MiB through the pull-through cache: its segments and the clients' parts are
bodies large enough for the lean path (plain_socket.py), so their pieces land in reused buffers
(buffer_pool.py) while the cache keeps some for late joiners, queues others for its writer and
its subscribers, and the clients' own parts reuse buffers in the same process: every byte that
arrives anywhere must still be the blob's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from registry.manifests import parse_manifest
from registry.store import Store
from registry.transfer import plain_socket
from registry.transfer.pull import pull
from tests.registry.transfer.helpers import blob_bytes, fast_options

from .proxy_fixtures import proxy_config, proxy_registry, publish, upstream_registry

MiB = 1024 * 1024


async def test_clients_pulling_a_large_blob_at_once_through_a_cold_cache_get_its_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plain_socket, "POOL_IDLE_SECONDS", 3600.0)  # kept, to look at after
    plain_socket._POOL.clear_if_idle()
    source = Store(tmp_path / "source")
    with upstream_registry(tmp_path / "upstream") as upstream:
        raw = await publish(source, f"{upstream.host}/library/big:latest", [9 * MiB + 5, 2_000],
                            tmp_path / "publisher")
        manifest = parse_manifest(raw, None)
        config = proxy_config(f"http://{upstream.host}", tmp_path / "proxy-home",
                              segment_bytes=2 * MiB, segment_window=3)
        with proxy_registry(tmp_path / "proxy", config) as (proxy, _app):
            name = f"{proxy}/library/big:latest"
            clients = [Store(tmp_path / f"client-{i}") for i in range(3)]
            options = [fast_options(tmp_path / f"h{i}", insecure=True, part_min=3 * MiB,
                                    part_max=3 * MiB) for i in range(3)]
            await asyncio.gather(*(pull(name, client, option, lambda e: None)
                                   for client, option in zip(clients, options, strict=True)))
            for desc in manifest.references():
                assert upstream.blob_gets(desc.digest) <= -(-desc.size // (2 * MiB)), desc
                for client in clients:
                    assert blob_bytes(client, desc.digest) == blob_bytes(source, desc.digest)
    assert len(plain_socket._POOL) > 0  # the lean path ran: the buffers were pooled ones
