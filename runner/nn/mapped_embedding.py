"""An embedding table read from its blob through a memory map, for the fused compute path.

An untied embedding only serves lookups: a prompt touches a few hundred of its rows, decode one
per token. Mapping the blob instead of loading it keeps the untouched rows on disk (the page
cache may hold them, but they are not this process's memory), which is the largest single
saving for a quantized model whose embedding create keeps at source precision. Blobs are
immutable and content-addressed, so the mapping stays valid (even if the blob is deleted, the
open mapping keeps its pages).
"""

from __future__ import annotations

import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from registry.safetensors_header import read_header

# safetensors dtype -> (NumPy storage type, MLX type it stands for)
_DTYPES = {"BF16": (np.uint16, mx.bfloat16), "F16": (np.float16, mx.float16),
           "F32": (np.float32, mx.float32)}


def mappable(path: Path, key: str) -> bool:
    """Whether `key` in the blob at `path` is a dense 2-D tensor this layer can map."""
    entry = read_header(path).get(key)
    return (isinstance(entry, dict) and entry.get("dtype") in _DTYPES
            and len(entry.get("shape", ())) == 2)


class MappedEmbedding(nn.Module):
    """Rows of tensor `key` in the safetensors blob at `path`, looked up through `np.memmap`."""

    def __init__(self, path: Path, key: str) -> None:
        super().__init__()
        entry = read_header(path)[key]
        with open(path, "rb") as fh:
            (header_bytes,) = struct.unpack("<Q", fh.read(8))
        storage, self.dtype = _DTYPES[entry["dtype"]]
        start = 8 + header_bytes + int(entry["data_offsets"][0])
        self.rows = np.memmap(path, dtype=storage, mode="r", offset=start,
                              shape=tuple(int(d) for d in entry["shape"]))

    def __call__(self, ids: mx.array) -> mx.array:
        index = np.asarray(memoryview(ids.astype(mx.int64)))  # type: ignore[arg-type]
        found = mx.array(np.ascontiguousarray(self.rows[index]))
        return found.view(self.dtype) if self.dtype == mx.bfloat16 else found

    def as_linear(self, x: mx.array) -> mx.array:
        raise NotImplementedError("a mapped embedding serves lookups only (untied heads)")
