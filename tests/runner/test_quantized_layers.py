"""Symmetric affine layers (runner/nn/quantized.py): biases derived from the scales per call give
the same results as the same layer holding them, for every quantized layer kind."""

from __future__ import annotations

import mlx.core as mx
import pytest

from runner.nn.embedding import QuantizedEmbedding
from runner.nn.linear import QuantizedLinear
from runner.nn.switch_linear import QuantizedSwitchLinear
from runner.quant import QuantType


def _symmetric(shape: tuple[int, ...], bits: int) -> tuple[mx.array, mx.array, int]:
    """Packed values and float16 scales; the biases are -zero * scale, as GGUF's Q4_0/Q8_0."""
    packed, _, _ = mx.quantize(mx.random.normal(shape, key=mx.random.key(0)), group_size=32,
                               bits=bits)
    scales = (mx.random.uniform(shape=(*shape[:-1], shape[-1] // 32), key=mx.random.key(1))
              * 0.01).astype(mx.float16)
    return packed, scales, 1 << (bits - 1)


def _pair(cls, args, shape, bits):  # type: ignore[no-untyped-def]
    packed, scales, zero = _symmetric(shape, bits)
    stored = cls(*args, QuantType("q", bits, 32, "affine"))
    derived = cls(*args, QuantType("q", bits, 32, "affine", zero))
    stored.update({"weight": packed, "scales": scales, "biases": scales * -zero})
    derived.update({"weight": packed, "scales": scales})
    return stored, derived


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_linear_with_derived_biases_matches_stored(bits, dtype):
    stored, derived = _pair(QuantizedLinear, (256, 64), (64, 256), bits)
    assert "biases" not in derived
    x = mx.random.normal((2, 3, 256), key=mx.random.key(2)).astype(dtype)
    assert mx.array_equal(derived(x), stored(x))


def test_embedding_lookup_and_tied_head_with_derived_biases_match_stored():
    stored, derived = _pair(QuantizedEmbedding, (100, 128), (100, 128), 4)
    ids = mx.array([[0, 5, 99, 5]])
    assert mx.array_equal(derived(ids), stored(ids))
    x = mx.random.normal((1, 2, 128), key=mx.random.key(3))
    assert mx.array_equal(derived.as_linear(x), stored.as_linear(x))


def test_switch_linear_with_derived_biases_matches_stored():
    stored, derived = _pair(QuantizedSwitchLinear, (128, 64, 4), (4, 64, 128), 8)
    x = mx.random.normal((3, 1, 1, 128), key=mx.random.key(4))
    indices = mx.array([[0], [3], [1]])
    assert mx.array_equal(derived(x, indices), stored(x, indices))


def test_quant_type_stores_biases_unless_symmetric():
    assert QuantType("int4", 4, 64, "affine").stored_bias
    assert not QuantType("q4_0", 4, 32, "affine", 8).stored_bias
    assert not QuantType("mxfp4", 4, 32, "mxfp4").stored_bias
