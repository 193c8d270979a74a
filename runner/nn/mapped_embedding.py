"""An embedding table left in its blob and read row by row, for the fused compute path.

An untied embedding only serves lookups: a prompt touches a few hundred of its rows, decode one
per token. Reading just those rows (`os.preadv` into a fresh buffer) instead of loading the table
keeps the rest out of this process's memory. An `np.memmap` of the table did not: the kernel's
fault-around and readahead map whole neighbourhoods of each touched row into the process, so a
480-token prompt of scattered ids made ~90% of a 49 MB table resident (measured: VmRSS +43 MiB of
file pages on the small fixture). Blobs are immutable and content-addressed, so the open file
stays valid (even if the blob is deleted, the open descriptor keeps its inode).
"""

from __future__ import annotations

import os
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
    """Whether `key` in the blob at `path` is a dense 2-D tensor this layer can read."""
    entry = read_header(path).get(key)
    return (isinstance(entry, dict) and entry.get("dtype") in _DTYPES
            and len(entry.get("shape", ())) == 2)


class MappedEmbedding(nn.Module):
    """Rows of tensor `key` in the safetensors blob at `path`, read on demand."""

    def __init__(self, path: Path, key: str) -> None:
        super().__init__()
        entry = read_header(path)[key]
        self.file = open(path, "rb")  # noqa: SIM115 - held for the module's lifetime
        (header_bytes,) = struct.unpack("<Q", self.file.read(8))
        self.storage, self.dtype = _DTYPES[entry["dtype"]]
        self.n_rows, self.n_cols = int(entry["shape"][0]), int(entry["shape"][1])
        self.row_bytes = self.n_cols * np.dtype(self.storage).itemsize
        self.start = 8 + header_bytes + int(entry["data_offsets"][0])

    def __call__(self, ids: mx.array) -> mx.array:
        index, wanted, where = unique_rows(ids, self.n_rows)
        table = np.empty((wanted.size, self.n_cols), dtype=self.storage)
        read_rows(self.file.fileno(), self.start, self.row_bytes, wanted, table, "embedding blob")
        found = mx.array(table[where.reshape(index.shape)])
        return found.view(self.dtype) if self.dtype == mx.bfloat16 else found

    def as_linear(self, x: mx.array) -> mx.array:
        raise NotImplementedError("a mapped embedding serves lookups only (untied heads)")


def unique_rows(ids: mx.array, n_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The looked-up ids (host), each distinct row once (sorted), and where each id's row is
    among them; an id outside [0, n_rows) is an IndexError."""
    index = np.asarray(memoryview(ids.astype(mx.int64)))  # type: ignore[arg-type]
    wanted, where = np.unique(index, return_inverse=True)
    if wanted.size and (wanted[0] < 0 or wanted[-1] >= n_rows):
        raise IndexError(f"token id out of range for a {n_rows}-row embedding")
    return index, wanted, where


def read_rows(fd: int, start: int, row_bytes: int, rows: np.ndarray, out: np.ndarray,
              what: str) -> None:
    """Read rows `rows` of a row-major table at byte `start` of `fd` into `out` (one per row);
    a short read is an OSError naming `what`."""
    for i, row in enumerate(rows.tolist()):
        got = os.preadv(fd, [memoryview(out[i]).cast("B")], start + row * row_bytes)
        if got != row_bytes:
            raise OSError(f"{what} is short: row {row} read {got} bytes")
