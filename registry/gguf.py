"""GGUF header and key/value reader, and the per-blob metadata cache (reference 2.8).

Pure Python (the registry never imports mlx or gguf). A GGUF file is: magic `GGUF`, u32 version
(2 or 3), u64 tensor count, u64 KV count, the KVs (u64-length strings, u32 value type, value),
the tensor infos (name, u32 n_dims, u64 dims, u32 ggml type, u64 offset), then the data aligned
to `general.alignment` (default 32). All little-endian.

The model server caches each GGUF blob's KVs in `metadata/sha256-<hex>.json` once, as
`{"kv": {key: value}, "omitted": [keys]}`: arrays over 4096 elements (tokenizer vocabularies,
merges) and keys holding non-finite floats are left out and listed, so `/api/tags` and
`/api/show` never re-read a multi-gigabyte file. The store removes the file with its blob.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from registry.digests import Digest
from registry.errors import FerryError
from registry.store import Store

MAGIC = b"GGUF"
MAX_CACHED_ARRAY = 4096
DEFAULT_ALIGNMENT = 32
_MAX_STRING = 1 << 30
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_FLOATS = (6, 12)

# llama.cpp's llama_ftype, as `general.file_type` stores it.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4",
}

# ggml tensor type -> (values per block, bytes per block), from ggml.c's type traits.
TYPE_SIZES = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    9: (32, 36), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
    15: (256, 292), 16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18),
    21: (256, 110), 22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4),
    27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66),
    39: (32, 17),
}


class GGUFError(FerryError):
    """A file that is not a well-formed GGUF; the message says where it broke."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # relative to the data section


@dataclass
class GGUFHeader:
    version: int
    kv: dict[str, Any] = field(default_factory=dict)
    omitted: list[str] = field(default_factory=list)
    types: dict[str, int] = field(default_factory=dict)  # key -> GGUF value type
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> raw KV byte range
    tensors: list[TensorInfo] = field(default_factory=list)
    data_offset: int = 0
    alignment: int = DEFAULT_ALIGNMENT

    @property
    def parameter_count(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors)

    @property
    def architecture(self) -> str:
        arch = self.kv.get("general.architecture")
        return arch if isinstance(arch, str) else ""

    @property
    def file_type(self) -> str:
        value = self.kv.get("general.file_type")
        return FILE_TYPES.get(value, str(value)) if isinstance(value, int) else ""

    def arch_value(self, key: str) -> Any:
        """A key qualified as Ollama looks it up: `<general.architecture>.<key>`."""
        if key.startswith(("general.", "tokenizer.")):
            return self.kv.get(key)
        return self.kv.get(f"{self.architecture}.{key}")


class _Reader:
    def __init__(self, fh: BinaryIO, size: int) -> None:
        self.fh, self.size = fh, size

    def read(self, n: int) -> bytes:
        data = self.fh.read(n)
        if len(data) != n:
            raise GGUFError(f"truncated GGUF: wanted {n} bytes at offset {self.fh.tell()}")
        return data

    def skip(self, n: int) -> None:
        target = self.fh.tell() + n
        if target > self.size:
            raise GGUFError(f"truncated GGUF: a value runs past the end ({target} > {self.size})")
        self.fh.seek(target)

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        length = self.unpack("<Q")
        if length > _MAX_STRING or self.fh.tell() + length > self.size:
            raise GGUFError(f"GGUF string of {length} bytes runs past the end of the file")
        return self.read(length).decode("utf-8", errors="replace")


def _value(r: _Reader, vtype: int, limit: int | None) -> tuple[Any, bool]:
    """Read one value; returns (value, finite). Arrays longer than `limit` (None: no limit) are
    skipped and read as None."""
    if vtype in _SCALARS:
        value = r.unpack(_SCALARS[vtype])
        return value, not (vtype in _FLOATS and not math.isfinite(value))
    if vtype == _STRING:
        return r.string(), True
    if vtype != _ARRAY:
        raise GGUFError(f"unknown GGUF value type {vtype}")
    item_type, count = r.unpack("<I"), r.unpack("<Q")
    keep = limit is None or count <= limit
    if item_type in _SCALARS:
        size = struct.calcsize(_SCALARS[item_type])
        if not keep:
            r.skip(count * size)
            return None, True
        items = list(struct.unpack(f"<{count}{_SCALARS[item_type][1]}", r.read(count * size)))
        return items, item_type not in _FLOATS or all(math.isfinite(v) for v in items)
    items, finite = [], True
    for _ in range(count):
        item, ok = _value(r, item_type, limit if keep else 0)
        finite = finite and ok
        if keep:
            items.append(item)
    return (items if keep else None), finite


def read_header(path: Path, keep_arrays: bool = False) -> GGUFHeader:
    """Parse a GGUF file's KVs and tensor infos (no tensor data is read). Arrays over 4096
    elements are left out (listed in `omitted`) unless `keep_arrays` (the runner's tokenizer
    needs them; the metadata cache does not)."""
    size = path.stat().st_size
    with open(path, "rb", buffering=1 << 20) as fh:
        r = _Reader(fh, size)
        if r.read(4) != MAGIC:
            raise GGUFError(f"{path.name}: not a GGUF file (bad magic)")
        version = r.unpack("<I")
        if version not in (2, 3):
            raise GGUFError(f"{path.name}: unsupported GGUF version {version}")
        tensor_count, kv_count = r.unpack("<Q"), r.unpack("<Q")
        if kv_count > size or tensor_count > size:
            raise GGUFError(f"{path.name}: implausible counts in the GGUF header")
        header = GGUFHeader(version)
        for _ in range(kv_count):
            _read_kv(r, header, None if keep_arrays else MAX_CACHED_ARRAY)
        header.tensors = [_tensor_info(r) for _ in range(tensor_count)]
        alignment = header.kv.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0:
            alignment = DEFAULT_ALIGNMENT
        header.data_offset = -(-fh.tell() // alignment) * alignment
        header.alignment = alignment
    _check_extents(path, header, size)
    return header


def _check_extents(path: Path, header: GGUFHeader, size: int) -> None:
    """Every tensor of a known type must lie inside the file: a truncated download or copy is
    refused here, before anything tries to map it."""
    for t in header.tensors:
        block, nbytes = TYPE_SIZES.get(t.ggml_type, (0, 0))
        if not block:
            continue
        end = header.data_offset + t.offset + math.prod(t.shape) // block * nbytes
        if end > size:
            raise GGUFError(f"{path.name}: truncated GGUF: tensor {t.name} runs past the end "
                            f"of the file ({end} > {size} bytes)")


def _read_kv(r: _Reader, header: GGUFHeader, limit: int | None) -> None:
    start = r.fh.tell()
    key = r.string()
    vtype = r.unpack("<I")
    value, finite = _value(r, vtype, limit)
    header.types[key] = vtype
    header.spans[key] = (start, r.fh.tell())
    if value is None or not finite:
        header.omitted.append(key)
    else:
        header.kv[key] = value


def _tensor_info(r: _Reader) -> TensorInfo:
    name = r.string()
    n_dims = r.unpack("<I")
    if n_dims > 8:
        raise GGUFError(f"tensor {name!r} has {n_dims} dimensions")
    shape = tuple(r.unpack("<Q") for _ in range(n_dims))
    return TensorInfo(name, shape, r.unpack("<I"), r.unpack("<Q"))


def metadata_document(header: GGUFHeader) -> dict[str, Any]:
    return {"kv": header.kv, "omitted": sorted(header.omitted)}


def ensure_metadata(store: Store, digest: Digest) -> dict[str, Any]:
    """The blob's cached KV document, extracted and written (atomically) only if missing."""
    cached = store.read_metadata(digest)
    if cached is not None and isinstance(cached.get("kv"), dict):
        return cached
    document = metadata_document(read_header(store.blob_path(digest)))
    store.write_metadata(digest, document)
    return document
