"""Shared helpers for the create tests: put files in the store, read models back."""

from __future__ import annotations

import json
from pathlib import Path

from registry.digests import Digest
from registry.manifests import ModelConfig, parse_manifest
from registry.names import Name
from registry.store import Store


def upload_dir(store: Store, directory: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Write every file of `directory` into the store as a blob; the create `files` map."""
    files = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name not in skip:
            files[path.name] = str(store.blob_writer().write_all(path.read_bytes()))
    return files


def read_model(store: Store, name: str) -> tuple[dict, ModelConfig]:
    """The manifest JSON and config of `name`."""
    raw = store.read_manifest(Name.parse(name))
    manifest = parse_manifest(raw)
    assert manifest.config is not None
    return json.loads(raw), ModelConfig.from_json(store.read_blob(manifest.config.digest))


def layer_path(store: Store, layer: dict) -> Path:
    return store.blob_path(Digest.parse(layer["digest"]))


def stage_tree(store: Store) -> list[Path]:
    """Leftover create staging dirs in the models dir."""
    return sorted(store.root.glob(".create-*"))
