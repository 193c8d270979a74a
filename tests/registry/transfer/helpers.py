"""Helpers for the transfer tests: models in a local store, a counting resolver, fast options."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from registry import media_types as mt
from registry.digests import Digest
from registry.manifests import Descriptor, build_manifest
from registry.names import Name
from registry.store import Store
from registry.transfer.client import TransferOptions
from registry.transfer.retry import RetryPolicy
from registry.transfer.safe import IPAddress


class StaticResolver:
    """Maps test host names to loopback addresses and counts every lookup.

    Only makes names resolvable; the address policy that judges the answers is the real one.
    `answers` may hold a list of answers per name, used one per lookup (to simulate rebinding).
    """

    def __init__(self, answers: Mapping[str, str | Sequence[str]]) -> None:
        self.answers = dict(answers)
        self.lookups: list[str] = []

    async def resolve(self, host: str) -> Sequence[IPAddress]:
        self.lookups.append(host)
        value = self.answers.get(host)
        if value is None:
            return []
        if isinstance(value, str):
            return [ipaddress.ip_address(value)]
        index = min(self.lookups.count(host) - 1, len(value) - 1)
        return [ipaddress.ip_address(value[index])]


def fast_options(home: Path, **changes: object) -> TransferOptions:
    """Small parts and chunks, quick retries: the same code paths at test sizes."""
    values: dict[str, object] = {
        "home": home,
        "part_min": 64 * 1024,
        "part_max": 256 * 1024,
        "chunk_size": 64 * 1024,
        "small_blob_max": 8 * 1024,
        "checkpoint_bytes": 64 * 1024,
        "progress_interval": 0.0,
        "retry": RetryPolicy(attempts=6, initial=0.01, cap=0.05),
        "max_streams": 4,
    }
    values.update(changes)
    return TransferOptions(**values)  # type: ignore[arg-type]


def make_model(store: Store, name: str, sizes: Sequence[int], seed: int = 0) -> bytes:
    """Random layers of `sizes` bytes plus a config, published under `name`; returns the raw
    manifest."""
    layers = []
    for i, size in enumerate(sizes):
        data = _random_bytes(size, seed * 1000 + i)
        digest = store.blob_writer().write_all(data)
        layers.append(Descriptor(mt.MODEL if i == 0 else mt.TENSOR, digest, size))
    config_bytes = f'{{"model_format":"gguf","seed":{seed}}}'.encode()
    config = Descriptor(mt.DOCKER_CONFIG, store.blob_writer().write_all(config_bytes),
                        len(config_bytes))
    raw = build_manifest(config, layers)
    store.write_manifest(Name.parse_valid(name), raw)
    return raw


def _random_bytes(size: int, seed: int) -> bytes:
    import random

    return random.Random(seed).randbytes(size)


def blob_bytes(store: Store, digest: Digest) -> bytes:
    return store.blob_path(digest).read_bytes()


def store_files(store: Store) -> list[str]:
    """Every file under the store (relative), to prove nothing was left behind."""
    found = []
    for root, _dirs, files in os.walk(store.root):
        for file in files:
            found.append(str(Path(root, file).relative_to(store.root)))
    return sorted(found)
