"""The fused compute path: the C kernels against MLX's dequantized (or upcast bf16) matmul, the
layers' decode and prefill branches, and greedy decoding of created quantized and bf16 models
against the float32 path."""

from __future__ import annotations

import mlx.core as mx
import mlx_models
import numpy as np
import pytest
from mlx.utils import tree_flatten

from runner.generate import Generator
from runner.kernels import qmatvec
from runner.kv_cache import KVCache, new_caches
from runner.load import load_model
from runner.nn.fused_linear import DECODE_ROWS, FusedDenseLinear, FusedQuantizedLinear
from runner.quant import QuantType
from runner.sample import Options
from runner.tokenizer import ModelTokenizer

model_store, created_model = mlx_models.model_store, mlx_models.created_model  # fixtures

PROMPT = [0, 2, 379, 480, 203, 76, 698, 346, 351, 73, 3, 2, 1000, 17]
pytestmark = pytest.mark.skipif(not qmatvec.available(), reason="no C compiler for the kernel")


def _layer(out_dims: int, in_dims: int, bits: int, group: int, scale_dtype: mx.Dtype,
           seed: int) -> tuple[FusedQuantizedLinear, mx.array]:
    """A fused layer holding mx.quantize's output, and the float32 weights it stands for."""
    weight = mx.random.normal((out_dims, in_dims), key=mx.random.key(seed)).astype(scale_dtype)
    packed, scales, biases = mx.quantize(weight, group_size=group, bits=bits)
    layer = FusedQuantizedLinear(in_dims, out_dims, QuantType(f"int{bits}", bits, group,
                                                              "affine"))
    layer.update({"weight": packed, "scales": scales, "biases": biases})
    dense = mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32),
                          group_size=group, bits=bits)
    return layer, dense


def _relative_error(ours: mx.array, reference: mx.array) -> float:
    return (mx.abs(ours - reference).max() / mx.abs(reference).max()).item()


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("out_dims,groups", [(1, 1), (37, 3), (130, 2)])
@pytest.mark.parametrize("rows", [1, 3, DECODE_ROWS + 5])
def test_kernel_matches_mlx_dequantized_matmul(bits, group, out_dims, groups, rows):
    in_dims = group * groups
    layer, dense = _layer(out_dims, in_dims, bits, group, mx.bfloat16, seed=bits * group + rows)
    x = mx.random.normal((rows, in_dims), key=mx.random.key(out_dims))
    assert _relative_error(layer(x), x @ dense.T) <= 1e-4


@pytest.mark.parametrize("scale_dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_kernel_takes_every_scale_dtype_and_batched_leading_dims(scale_dtype):
    layer, dense = _layer(48, 256, 4, 64, scale_dtype, seed=7)
    x = mx.random.normal((2, 1, 256), key=mx.random.key(3))
    y = layer(x)
    assert y.shape == (2, 1, 48) and y.dtype == mx.float32
    assert _relative_error(y, x @ dense.T) <= 1e-4


def test_unsupported_widths_are_refused_not_miscomputed():
    assert not qmatvec.supports(3, 64, "affine", 128)
    assert not qmatvec.supports(4, 32, "mxfp4", 128)
    assert not qmatvec.supports(4, 64, "affine", 96)
    with pytest.raises(ValueError, match="unsupported layer"):
        qmatvec.qmatmul(np.zeros((1, 96), np.float32), np.zeros((2, 12), np.uint32),
                        np.zeros((2, 1), np.float32), np.zeros((2, 1), np.float32), 4, 64)


@pytest.mark.parametrize("out_dims,in_dims", [(1, 1), (5, 7), (37, 40), (64, 768), (130, 1029)])
@pytest.mark.parametrize("rows", [1, 3, DECODE_ROWS + 5])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_layer_matches_the_float32_matmul(out_dims, in_dims, rows, bias):
    """Odd widths exercise the vector loop's 32- and 8-wide tails; rows past DECODE_ROWS take
    the prefill branch."""
    key = mx.random.key(out_dims * in_dims + rows)
    weight = mx.random.normal((out_dims, in_dims), key=key).astype(mx.bfloat16)
    layer = FusedDenseLinear(in_dims, out_dims, bias=bias)
    layer.update({"weight": weight, **({"bias": mx.arange(out_dims) / 7} if bias else {})})
    x = mx.random.normal((1, rows, in_dims), key=mx.random.key(rows))
    reference = x @ weight.astype(mx.float32).T + (mx.arange(out_dims) / 7 if bias else 0)
    y = layer(x)
    assert y.shape == (1, rows, out_dims) and y.dtype == mx.float32
    assert _relative_error(y, reference) <= 1e-5


def test_bf16_kernel_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="does not fit"):
        qmatvec.matmul_bf16(np.zeros((1, 8), np.float32), np.zeros((2, 9), np.uint16))
    with pytest.raises(ValueError, match="does not fit"):
        qmatvec.matmul_bf16(np.zeros((1, 8), np.float32), np.zeros((2, 8), np.float32))


def _greedy(loaded, tokens: int = 32) -> list[str]:
    tokenizer = ModelTokenizer(loaded.files.files, loaded.files.config)
    tokenizer.eos_ids.clear()  # random weights: compare every token, never stop early
    generator = Generator(loaded.model, tokenizer, loaded.context_length)
    pieces = list(generator.generate(PROMPT, Options(temperature=0, num_predict=tokens)))
    assert pieces.pop().eval_count == tokens
    return pieces


@pytest.mark.parametrize("arch,quant", [("llama", "int4"), ("qwen3", "int4"), ("llama", "int8")])
def test_greedy_tokens_identical_to_the_float32_path(model_store, created_model, arch, quant):
    name = created_model(arch, quant)
    fused = load_model(model_store, name, "fused")
    assert fused.compute == "fused"
    assert type(fused.model.layers[0].mlp.up_proj).__name__ == "FusedQuantizedLinear"
    full = load_model(model_store, name, "float32")
    assert fused.weights_bytes < full.weights_bytes / 2
    # (native is not compared: it keeps activations in bf16 and drifts after ~20 tokens)
    assert _greedy(fused) == _greedy(full)


@pytest.mark.parametrize("quant", ["int4", None])
def test_fused_kv_cache_holds_float16_and_float32s_holds_float32(model_store, created_model,
                                                                 quant):
    name = created_model("llama", quant)
    for compute, dtype in (("fused", mx.float16), ("float32", mx.float32)):
        model = load_model(model_store, name, compute).model
        caches = new_caches(model)
        model(mx.array([PROMPT]), caches)
        mx.eval([c.state for c in caches])
        assert {c.keys.dtype for c in caches} == {c.values.dtype for c in caches} == {dtype}
    cache = KVCache()
    cache.update_and_fetch(mx.ones((1, 2, 3, 4)), mx.ones((1, 2, 3, 4)))
    assert cache.keys.dtype == mx.float32  # without a model's kv_dtype: the writes' own


def test_the_fused_path_keeps_no_pool_of_freed_buffers(model_store, created_model):
    previous = mx.set_cache_limit(1 << 30)
    try:
        model = load_model(model_store, created_model("llama", "int4"), "fused").model
        logits = model(mx.array([PROMPT * 4]))  # prefill-sized: float32 transients per layer
        mx.eval(logits)
        del logits
        assert mx.get_cache_memory() == 0
    finally:
        mx.set_cache_limit(previous)


def test_an_untied_embedding_is_mapped_from_its_blob_and_a_tied_one_loaded(model_store,
                                                                           created_model):
    llama = load_model(model_store, created_model("llama", "int4"), "fused")
    embedding = llama.model.model.embed_tokens
    assert type(embedding).__name__ == "MappedEmbedding"
    assert "embed_tokens" not in str(dict(tree_flatten(llama.model.parameters())).keys())
    reference = load_model(model_store, created_model("llama", "int4"), "native")
    ids = mx.array([[5, 0, 2047, 5]])
    assert mx.array_equal(embedding(ids), reference.model.model.embed_tokens(ids))
    assert mx.array_equal(embedding(mx.array([7])), reference.model.model.embed_tokens.weight[7:8])
    with pytest.raises(IndexError, match="out of range"):
        embedding(mx.array([[3, 2048]]))
    qwen3 = load_model(model_store, created_model("qwen3", "int4"), "fused")
    assert qwen3.model.model.embed_tokens.weight.dtype == mx.float32  # the tied head's BLAS


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_models_keep_bf16_linears_and_decode_as_float32_does(model_store, created_model,
                                                                   arch):
    name = created_model(arch)
    fused = load_model(model_store, name, "fused")
    layer = fused.model.layers[0]
    assert type(layer.mlp.up_proj).__name__ == "FusedDenseLinear"
    assert layer.mlp.up_proj.weight.dtype == mx.bfloat16
    assert layer.input_layernorm.weight.dtype == mx.float32  # activations stay float32
    full = load_model(model_store, name, "float32")
    kept = [m.weight.nbytes for _, m in fused.model.named_modules()
            if type(m).__name__ == "FusedDenseLinear"]
    assert len(kept) >= 7 * len(fused.model.layers)  # q, k, v, o, gate, up, down
    mapped = type(fused.model.model.embed_tokens).__name__ == "MappedEmbedding"  # untied
    embedding = full.model.model.embed_tokens.weight.nbytes if mapped else 0
    assert fused.weights_bytes == full.weights_bytes - sum(kept) - embedding  # bf16: half each
    assert _greedy(fused) == _greedy(full)


def test_auto_keeps_quantized_and_bf16_models_as_stored(model_store, created_model):
    assert load_model(model_store, created_model("llama", "int4"), "auto").compute == "fused"
    assert load_model(model_store, created_model("llama"), "auto").compute == "fused"


def test_types_without_a_kernel_run_dense_on_the_fused_path(model_store, created_model):
    loaded = load_model(model_store, created_model("llama", "mxfp4"), "fused")
    assert loaded.compute == "fused"
    up = loaded.model.layers[0].mlp.up_proj
    assert type(up).__name__ == "Linear" and up.weight.dtype == mx.float32
    full = load_model(model_store, created_model("llama", "mxfp4"), "float32")
    tokens = mx.array([PROMPT])
    assert mx.abs(loaded.model(tokens) - full.model(tokens)).max().item() <= 1e-4
