"""Helpers for the failure-injection tests: the stand-in runner's command and sized manifests."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from registry import media_types as mt
from registry.manifests import Descriptor, build_manifest
from registry.names import Name
from registry.store import Store

FAKE_RUNNER = Path(__file__).with_name("fake_runner.py")


def fake_command(*extra: str) -> Callable[[str, int], list[str]]:
    """A scheduler `command` that starts fake_runner.py with `extra` behaviour flags."""
    def command(name: str, port: int) -> list[str]:
        return [sys.executable, str(FAKE_RUNNER), "--model", name, "--port", str(port), *extra]
    return command


def add_model(store: Store, text: str, tensor_bytes: int = 1024) -> Name:
    """A manifest with one tensor layer of `tensor_bytes`, enough for the scheduler's sizing."""
    config = json.dumps({"model_format": "safetensors"}).encode()
    cfg = Descriptor(mt.DOCKER_CONFIG, store.blob_writer().write_all(config), len(config))
    data = os.urandom(tensor_bytes)
    layer = Descriptor(mt.TENSOR, store.blob_writer().write_all(data), len(data), name="w")
    name = Name.parse_valid(text)
    store.write_manifest(name, build_manifest(cfg, [layer]))
    return name
