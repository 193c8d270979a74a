"""An untied GGUF token embedding left in the file and read row by row (a CPU's native path).

An untied embedding only serves lookups: a prompt touches a few hundred of its rows, decode one
per token, yet loaded it is the vocabulary's whole table (13 MiB for the small fixture's 32k x
768 Q4_0, 25 MiB in Q8_0). Each lookup reads just its rows' bytes (`os.preadv`, as
runner/nn/mapped_embedding.py does for a safetensors blob on the fused path; a memory map would
fault whole neighbourhoods of the file in) and converts them the way the loader converts the
whole tensor (`convert_tensor`, then MLX's dequantize), so the rows are bitwise those of the
loaded table. The lookup reads its ids on the host, so the next decode step's graph waits for
the current token (a few ms a token at the CPU's ~150 ms); on a GPU the table is loaded.
Blobs are immutable and content-addressed, so the open file stays valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from runner.gguf_load import GGUFTensor, check_rows, convert_tensor
from runner.nn.mapped_embedding import read_rows, unique_rows


@dataclass(frozen=True)
class _Rows:
    """Some rows' bytes of a GGUF tensor, as `convert_tensor` reads a tensor."""

    name: str
    tensor_type: int
    data: np.ndarray  # uint8 [rows, bytes per row]

    def available(self) -> int:
        return self.data.size

    def read(self, offset: int, size: int) -> np.ndarray:
        return self.data.reshape(-1)[offset:offset + size]


class GGUFEmbedding(nn.Module):
    """Rows of the GGUF tensor `tensor` (shape [rows, dims]), read and converted on lookup."""

    def __init__(self, tensor: GGUFTensor, shape: tuple[int, int]) -> None:
        super().__init__()
        self.n_rows, self.n_cols = shape
        self.row_bytes = check_rows(tensor, shape)
        self.name, self.tensor_type, self.start = tensor.name, tensor.tensor_type, tensor.start
        self.file = open(tensor.path, "rb")  # noqa: SIM115 - held for the module's lifetime

    def __call__(self, ids: mx.array) -> mx.array:
        index, wanted, where = unique_rows(ids, self.n_rows)
        data = np.empty((wanted.size, self.row_bytes), dtype=np.uint8)
        read_rows(self.file.fileno(), self.start, self.row_bytes, wanted, data, f"GGUF {self.name}")
        rows = _Rows(self.name, self.tensor_type, data)
        parts, qtype = convert_tensor(rows, (wanted.size, self.n_cols), "native")
        table = parts["weight"] if qtype is None else mx.dequantize(
            parts["weight"], parts["scales"], parts.get("biases"), group_size=qtype.group_size,
            bits=qtype.bits, mode=qtype.mode)
        return table[mx.array(where.reshape(index.shape))]

    def as_linear(self, x: mx.array) -> mx.array:
        raise NotImplementedError("a GGUF row embedding serves lookups only (untied heads)")
