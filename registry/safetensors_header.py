"""Safetensors headers of tensor layers, read without touching tensor data (reference 2.7).

A tensor layer (`application/vnd.ollama.image.tensor`) is a standalone safetensors file: an
8-byte little-endian header length, a JSON header, then the data. For a quantized tensor `W` the
blob holds `W` (packed uint32), `W.scale` and, for affine modes, `W.bias`; `__metadata__` carries
`quant_type` and `group_size`, or `<W>.quant_type` / `<W>.group_size` per tensor. `show` reports
each logical tensor once, with the quant type and the unpacked shape, the way Ollama's
`x/server/show.go` does.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from registry.errors import InvalidManifest

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
_COMPANIONS = (".scale", ".bias")


@dataclass(frozen=True)
class TensorInfo:
    """One logical tensor: its name, type (dtype or quant type) and unpacked shape."""

    name: str
    type: str
    shape: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "shape": list(self.shape)}


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file; InvalidManifest names what is wrong with it."""
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) != 8:
            raise InvalidManifest(f"tensor blob {path.name} is too short for a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise InvalidManifest(f"tensor blob {path.name} declares a {length}-byte header")
        raw = fh.read(length)
    if len(raw) != length:
        raise InvalidManifest(f"tensor blob {path.name} has a truncated safetensors header")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidManifest(f"tensor blob {path.name}: header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise InvalidManifest(f"tensor blob {path.name}: header must be a JSON object")
    return header


def logical_tensors(header: dict[str, Any]) -> list[TensorInfo]:
    """Tensors of one blob, quantized ones folded with their `.scale`/`.bias` companions."""
    metadata = header.get("__metadata__")
    metadata = metadata if isinstance(metadata, dict) else {}
    entries = {k: v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
    companions = {
        name + suffix
        for name in entries
        for suffix in _COMPANIONS
        if name + ".scale" in entries and name + suffix in entries
    }
    tensors = []
    for name, entry in entries.items():
        if name in companions:
            continue
        shape = tuple(int(x) for x in entry.get("shape", []))
        dtype = str(entry.get("dtype", ""))
        scale = entries.get(name + ".scale")
        if scale is not None:
            quant = _quant_field(metadata, name, "quant_type")
            group = _quant_field(metadata, name, "group_size")
            shape = _unpacked_shape(shape, scale, quant, group)
            dtype = quant.upper() if quant else dtype
        tensors.append(TensorInfo(name, dtype, shape))
    return tensors


def _quant_field(metadata: dict[str, Any], name: str, key: str) -> str:
    value = metadata.get(f"{name}.{key}", metadata.get(key, ""))
    return str(value) if value is not None else ""


def _unpacked_shape(packed: tuple[int, ...], scale: dict[str, Any], quant: str,
                    group: str) -> tuple[int, ...]:
    """The logical shape of a packed tensor: last dim from scales x group size, or from bits."""
    if not packed:
        return packed
    scale_shape = [int(x) for x in scale.get("shape", [])]
    if group.isdigit() and scale_shape:
        last = scale_shape[-1] * int(group)
    else:
        bits = 8 if quant.endswith("8") else 4
        last = packed[-1] * 32 // bits
    return (*packed[:-1], last)
