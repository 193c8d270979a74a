"""Token embeddings, dense or quantized; `as_linear` serves tied output heads."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from runner.nn.quantized import group_biases, quantized_matmul
from runner.quant import QuantType


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dims: int) -> None:
        super().__init__()
        self.weight = mx.zeros((num_embeddings, dims))

    def __call__(self, ids: mx.array) -> mx.array:
        return self["weight"][ids]

    def as_linear(self, x: mx.array) -> mx.array:
        """Logits against the embedding matrix (tie_word_embeddings)."""
        return x @ self["weight"].T

    def to_quantized(self, qtype: QuantType) -> QuantizedEmbedding:
        rows, dims = self["weight"].shape
        return QuantizedEmbedding(rows, dims, qtype)


class QuantizedEmbedding(nn.Module):
    """Rows are dequantized on lookup, so only the looked-up rows are ever expanded."""

    def __init__(self, num_embeddings: int, dims: int, qtype: QuantType) -> None:
        super().__init__()
        self.group_size = qtype.group_size
        self.bits = qtype.bits
        self.mode = qtype.mode
        self.zero_point = qtype.zero_point  # symmetric: biases derived (runner/nn/quantized.py)
        self.weight = mx.zeros((num_embeddings, dims * qtype.bits // 32), dtype=mx.uint32)
        self.scales = mx.zeros((num_embeddings, dims // qtype.group_size))
        if qtype.stored_bias:
            self.biases = mx.zeros((num_embeddings, dims // qtype.group_size))

    def __call__(self, ids: mx.array) -> mx.array:
        return mx.dequantize(self["weight"][ids], self["scales"][ids], group_biases(self, ids),
                             group_size=self.group_size, bits=self.bits, mode=self.mode)

    def as_linear(self, x: mx.array) -> mx.array:
        return quantized_matmul(self, x)
