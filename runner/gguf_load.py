"""A GGUF model layer -> config.json, tokenizer files and MLX weights (issue 13).

The file's header is parsed once (registry.gguf, keeping the tokenizer's long arrays) and each
tensor's bytes are read when it is converted, a block tensor's a slab of rows at a time, so the
process never holds more than one slab of source bytes (a float tensor's whole bytes) beside the
converted weights (a memory map would keep every touched page resident until the end of the
load, doubling the peak); the configuration comes from the per-blob metadata cache
(`metadata/sha256-<hex>.json`) the model server wrote at create, never from a second pass. The
`gguf` package supplies llama.cpp's type table and the K-quant dequantizers.

Tensors are renamed from llama.cpp's names (`blk.N.attn_q.weight`) to the architecture module's
(`model.layers.N.self_attn.q_proj.weight`); a module undoes llama.cpp's conventions for its family
in an optional `from_gguf(weights, args)` (llama's Q/K row permutation, gemma's `1 + w` norms).
F32/F16/BF16 load as they are, except that on the native path on a GPU the F32 ones (norms,
biases) take the file's half type (`GGUFFile.compute_dtype`), so activations and the KV cache
stay 2 bytes a value as the file's own precision implies (not on a CPU: `half_activations`).
Q4_0, Q4_1, Q8_0 and Q4_K are affine per 32 values already, so their blocks are repacked into
MLX affine triples (group size 32) exactly, with no float copy. Q6_K is repacked at 6 bits the
same way, each group of 32 on the step of its coarser sub-block of 16 (`_repack_q6_k`). On the
native path the symmetric ones (Q4_0, Q8_0, Q6_K) keep only their scales: every bias is -z times
its scale, derived per call (runner/nn/quantized.py), so the weights take less than the file.
Q5_0/Q5_1/Q5_K, Q3_K and Q2_K are dequantized one tensor at a time and requantized to an MLX
affine width whose step is no coarser than the source's (6, 4 and 4 bits: a Q3_K or Q2_K
sub-block of 16 spans at most the range of its group of 32), so no value moves by more than the
source's own rounding; anything else is refused with the tensor's name and type.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T

from registry.gguf import GGUFError, GGUFHeader, read_header
from runner.quant import QuantType

REQUANT_SLAB_VALUES = 1 << 20  # values dequantized at once when requantizing
QK = 32  # llama.cpp's block size for Q4_0, Q4_1, Q8_0 (and MLX's group size for them)
# Requantized types: the MLX affine width whose error is no worse than the source's.
_REQUANT_BITS = {T.Q5_0: 6, T.Q5_1: 6, T.Q2_K: 4, T.Q3_K: 4, T.Q5_K: 6}
_FLOATS = {T.F32: np.float32, T.F16: np.float16}
_KNOWN = frozenset(int(t) for t in T)
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}
# llama.cpp block tensor -> module path under model.layers.N (a module may override entries).
BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
# config.json key <- `<arch>.<key>` in the GGUF metadata.
_CONFIG_KEYS = {
    "max_position_embeddings": "context_length", "hidden_size": "embedding_length",
    "num_hidden_layers": "block_count", "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
    "sliding_window": "attention.sliding_window", "num_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
    "final_logit_softcapping": "final_logit_softcapping",
    "attn_logit_softcapping": "attn_logit_softcapping",
}


class GGUFLoadError(ValueError):
    """The GGUF file cannot run here; the message names the tensor or key and why."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: int
    shape: tuple[int, ...]  # llama.cpp's order: innermost dimension first
    path: Path
    start: int  # absolute file offset of its data
    nbytes: int  # what its type and shape imply

    @property
    def data(self) -> np.ndarray:
        """Its raw bytes, read now (fewer than `nbytes` if the file is short)."""
        return self.read(0, self.nbytes)

    def available(self) -> int:
        """How many of its `nbytes` the file holds."""
        return max(0, min(self.nbytes, self.path.stat().st_size - self.start))

    def read(self, offset: int, size: int) -> np.ndarray:
        """`size` bytes of its data from `offset`, read now: a block tensor is converted a
        slab of rows at a time, so its source bytes are never all in memory at once (a 32k
        vocabulary's Q8_0 head is 26 MB)."""
        with open(self.path, "rb") as fh:
            fh.seek(self.start + offset)
            return np.frombuffer(fh.read(size), dtype=np.uint8)


class TensorSource(Protocol):
    """What `convert_tensor` reads: a GGUFTensor, or the same bytes held elsewhere."""

    @property
    def name(self) -> str: ...

    @property
    def tensor_type(self) -> int: ...

    def available(self) -> int: ...

    def read(self, offset: int, size: int) -> np.ndarray: ...


@dataclass
class GGUFFile:
    """An open GGUF file: its parsed header and its tensors by name (data read on demand)."""

    path: Path
    header: GGUFHeader
    tensors: dict[str, GGUFTensor]

    def float32_bytes(self) -> int:
        return sum(math.prod(t.shape) * 4 for t in self.tensors.values())

    def field(self, key: str) -> Any:
        """A metadata value by key (tokenizer arrays included, until `drop_arrays`), or None."""
        return self.header.kv.get(key)

    def drop_arrays(self) -> None:
        """Forget the long metadata arrays (the tokenizer's tokens, merges, scores and types:
        ~6 MB of Python objects for a 32k vocabulary) once the tokenizer files are built; the
        weights are loaded after, so they would otherwise be held through the load's peak."""
        self.header.kv = {k: v for k, v in self.header.kv.items() if not isinstance(v, list)}

    def compute_dtype(self) -> mx.Dtype | None:
        """The half type the file computes in on the native path: bfloat16 for a BF16 file,
        float16 for F16 and every block type (their scales are float16); None for an all-F32
        file. Its F32 tensors (norms, biases) are cast to it: left in float32 they would promote
        every activation, and the KV cache, to float32 (twice the memory, the file's precision
        no better for it)."""
        kinds = {int(t.tensor_type) for t in self.tensors.values()}
        if int(T.BF16) in kinds:
            return mx.bfloat16
        return mx.float16 if kinds - {int(T.F32)} else None


def open_gguf(path: Path, keep_arrays: bool = True) -> GGUFFile:
    """The file's header and tensors; `keep_arrays`: with the tokenizer's long arrays (only
    needed to build its tokenizer files)."""
    try:
        header = read_header(path, keep_arrays=keep_arrays)
    except GGUFError as exc:
        raise GGUFLoadError(f"cannot read GGUF {path.name}: {exc.message}") from exc
    tensors = {t.name: GGUFTensor(t.name, t.ggml_type, t.shape, path,
                                  header.data_offset + t.offset, _nbytes(t.ggml_type, t.shape))
               for t in header.tensors}
    return GGUFFile(path, header, tensors)


def _nbytes(kind: int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor's data; 0 for a type this gguf package does not know."""
    if kind not in _KNOWN:
        return 0
    block, size = gguf.GGML_QUANT_SIZES[T(kind)]
    return math.prod(shape) // block * size


def gguf_config(kv: dict[str, Any], file: GGUFFile, module: ModuleType) -> dict[str, Any]:
    """config.json for the model, from the cached key/values (and tensor names)."""
    arch = str(kv.get("general.architecture") or "")
    config: dict[str, Any] = {"architectures": [module.ARCHITECTURES[0]],
                              "model_type": module.__name__.rsplit(".", 1)[1]}
    for key, gguf_key in _CONFIG_KEYS.items():
        value = kv.get(f"{arch}.{gguf_key}")
        if isinstance(value, list) and value and all(v == value[0] for v in value):
            value = value[0]  # per-layer arrays that do not vary
        if value is not None:
            config[key] = value
    tensors = file.tensors
    if "token_embd.weight" not in tensors:
        raise GGUFLoadError("GGUF has no token_embd.weight tensor")
    config["vocab_size"] = int(tensors["token_embd.weight"].shape[1])
    config["tie_word_embeddings"] = "output.weight" not in tensors
    config.update(_rope_scaling(kv, arch, file))
    for key in ("bos_token_id", "eos_token_id"):
        value = kv.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int):
            config[key] = value
    if hasattr(module, "gguf_config"):
        config = module.gguf_config(config, kv)
    return config


def _rope_scaling(kv: dict[str, Any], arch: str, file: GGUFFile) -> dict[str, Any]:
    kind = kv.get(f"{arch}.rope.scaling.type")
    factors = file.tensors.get("rope_freqs.weight")
    if factors is not None:  # llama 3's frequency scaling, precomputed by llama.cpp
        return {"rope_scaling": {"rope_type": "freq_factors",
                                 "factors": factors.data.view(np.float32).tolist()}}
    if kind in (None, "none"):
        return {}
    factor = kv.get(f"{arch}.rope.scaling.factor")
    return {"rope_scaling": {"rope_type": str(kind), "factor": factor}}


def module_path(name: str, overrides: dict[str, str]) -> str | None:
    """The module parameter name for a llama.cpp tensor name; None for one with no place."""
    stem, _, kind = name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{kind}"
    match = _BLOCK_RE.match(name)
    if match is None:
        return None
    path = {**BLOCK_NAMES, **overrides}.get(match[2])
    return None if path is None else f"model.layers.{match[1]}.{path}.{match[3]}"


def read_weights(file: GGUFFile, module: ModuleType, args: Any, compute: str,
                 skip: frozenset[str] = frozenset()
                 ) -> tuple[dict[str, mx.array], dict[str, QuantType]]:
    """Every tensor under its module name; quant types by module path (as load.py expects).
    Tensors named in `skip` are checked (shape, length) but not loaded."""
    overrides = getattr(module, "GGUF_BLOCK_NAMES", {})
    expected = _expected_shapes(module, args)
    dense_dtype = file.compute_dtype() if compute == "native" and half_activations() else None
    head = "lm_head" if "output.weight" in file.tensors else "model.embed_tokens"
    wide_head = compute == "native" and not half_activations()
    weights: dict[str, mx.array] = {}
    qtypes: dict[str, QuantType] = {}
    for tensor in file.tensors.values():
        if tensor.name == "rope_freqs.weight":
            continue  # folded into the config's rope_scaling
        name = module_path(tensor.name, overrides)
        if name is None:
            raise GGUFLoadError(f"GGUF tensor {tensor.name} has no place in {module.__name__}")
        shape = tuple(int(d) for d in reversed(tensor.shape))
        want = expected.get(name)
        if want is not None and want != shape:
            raise GGUFLoadError(f"GGUF tensor {tensor.name} has shape {list(shape)} but the "
                                f"metadata implies {list(want)}")
        if tensor.name in skip:
            check_rows(tensor, shape)
            continue
        parts, qtype = convert_tensor(tensor, shape, compute, dense_dtype,
                                      derive_biases=compute == "native")
        mx.eval(*parts.values())
        mx.clear_cache()
        module_name = name.rsplit(".", 1)[0]
        if qtype is None:
            weights[name] = parts["weight"]
            continue
        qtypes[module_name] = qtype
        if wide_head and module_name == head:
            parts = widened_scales(parts)
        weights.update({f"{module_name}.{k}": v for k, v in parts.items()})
    if hasattr(module, "from_gguf"):
        weights = module.from_gguf(weights, args)
    return weights, qtypes


def widened_scales(parts: dict[str, mx.array]) -> dict[str, mx.array]:
    """The output head's scales and biases as float32 (exactly: widened from float16), for
    float32 activations (a CPU's native path). MLX's quantized matmul casts float16 ones to the
    activations' type on every call: for a head that is vocabulary x hidden / 32 groups twice
    over (6 MB for 32k x 768), made anew at every decoded token and the request's peak. Held
    widened, they cost half that, once; a symmetric head's biases, derived per call from the
    widened scales (runner/nn/quantized.py), are made in float32 directly, cast from nothing."""
    widened: dict[str, mx.array] = {k: parts[k].astype(mx.float32)
                                    for k in ("scales", "biases") if k in parts}
    mx.eval(*widened.values())
    return {**parts, **widened}


def half_activations() -> bool:
    """Whether the native path should compute in the file's half type: on a GPU, yes. MLX's CPU
    kernels are far slower on float16 activations than on float32 (quantized_matmul of one
    768-wide row by a 4-bit 2048x768 matrix: 279 ms against 12 ms, measured), so on a CPU
    the F32 norms are kept and activations stay float32, at twice their memory."""
    return mx.default_device().type != mx.DeviceType.cpu


def _expected_shapes(module: ModuleType, args: Any) -> dict[str, tuple[int, ...]]:
    """The architecture's checkpoint shapes, for the names a GGUF holds the same way."""
    try:
        return dict(module.tensor_shapes(args))
    except (TypeError, ValueError, KeyError) as exc:
        raise GGUFLoadError(f"GGUF metadata does not describe a model: {exc}") from exc


def convert_tensor(tensor: TensorSource, shape: tuple[int, ...], compute: str,
                   dense_dtype: mx.Dtype | None = None, derive_biases: bool = False
                   ) -> tuple[dict[str, mx.array], QuantType | None]:
    """One tensor as MLX arrays: {"weight"} dense, or {"weight", "scales", "biases"} with its
    quant type. With compute "float32", everything is dequantized to float32; otherwise an F32
    tensor becomes `dense_dtype` where one is given (GGUFFile.compute_dtype). With
    `derive_biases`, a symmetric type's (Q4_0, Q8_0, Q6_K: every bias -z * scale) come without
    biases and with `zero_point` z in the quant type, for layers that derive them per call
    (runner/nn/quantized.py): the native path's; the fused kernel reads stored ones."""
    if int(tensor.tensor_type) not in _KNOWN:
        raise GGUFLoadError(f"GGUF tensor {tensor.name} has unknown type {tensor.tensor_type}")
    kind = T(int(tensor.tensor_type))
    rows, row_bytes = _checked_rows(tensor, shape)
    if kind in _FLOATS or kind == T.BF16:
        dense = _dense(_read_rows(tensor, 0, rows, row_bytes), kind, shape)
        if compute == "float32":
            dense = dense.astype(mx.float32)
        elif kind == T.F32 and dense_dtype is not None:
            dense = dense.astype(dense_dtype)
        return {"weight": dense}, None
    if kind in _REPACKED:
        zero = _ZERO_POINTS.get(kind) if derive_biases and compute != "float32" else None
        parts = _in_slabs(tensor, (rows, row_bytes), shape, _REPACKED[kind], zero is None)
        bits = _REPACKED_BITS.get(kind, 4)
        name = kind.name.lower() + (f"-as-int{bits}" if kind in _REPACKED_BITS else "")
        qtype = QuantType(name, bits, QK, "affine", zero)
    elif kind in _REQUANT_BITS:
        parts, qtype = _requantize(tensor, (rows, row_bytes), kind, shape)
    else:
        raise GGUFLoadError(f"GGUF tensor {tensor.name} has type {kind.name}, which ferry's "
                            "runner cannot load (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, "
                            "Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)")
    if compute == "float32":
        dense = mx.dequantize(parts["weight"], parts["scales"], parts["biases"],
                              group_size=qtype.group_size, bits=qtype.bits)
        return {"weight": dense.astype(mx.float32)}, None
    return parts, qtype


def check_rows(tensor: TensorSource, shape: tuple[int, ...]) -> int:
    """The bytes per row of the tensor's data; a short or misshapen one is refused."""
    return _checked_rows(tensor, shape)[1]


def _checked_rows(tensor: TensorSource, shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, bytes per row) of the tensor's data; a short or misshapen one is refused."""
    kind = T(int(tensor.tensor_type))
    block, type_size = gguf.GGML_QUANT_SIZES[kind]
    if shape[-1] % block:
        raise GGUFLoadError(f"GGUF tensor {tensor.name}: row of {shape[-1]} is not a whole "
                            f"number of {kind.name} blocks")
    rows, row_bytes = math.prod(shape[:-1]), shape[-1] // block * type_size
    have = tensor.available()
    if have != rows * row_bytes:
        raise GGUFLoadError(f"GGUF tensor {tensor.name} is truncated: {have} of "
                            f"{rows * row_bytes} bytes")
    return rows, row_bytes


def _read_rows(tensor: TensorSource, start: int, count: int, row_bytes: int) -> np.ndarray:
    return tensor.read(start * row_bytes, count * row_bytes).reshape(count, row_bytes)


def _dense(data: np.ndarray, kind: T, shape: tuple[int, ...]) -> mx.array:
    if kind == T.BF16:
        return mx.array(data.view(np.uint16).reshape(shape)).view(mx.bfloat16)
    return mx.array(data.view(_FLOATS[kind]).reshape(shape))


def _in_slabs(tensor: TensorSource, layout: tuple[int, int], shape: tuple[int, ...],
              repack: Callable[[np.ndarray], dict[str, np.ndarray]], biases: bool = True
              ) -> dict[str, mx.array]:
    """Repack the tensor's data (`layout`: rows, bytes per row) a slab of rows at a time, read
    as it goes, so neither its source bytes nor the unpacked temporaries of a large tensor
    exist all at once; without `biases`, those are left out (a symmetric type's)."""
    rows, row_bytes = layout
    step = max(1, REQUANT_SLAB_VALUES // shape[-1])
    slabs = ({k: mx.array(v) for k, v in
              repack(_read_rows(tensor, start, min(step, rows - start), row_bytes)).items()
              if biases or k != "biases"}
             for start in range(0, rows, step))
    return _assembled(slabs, rows, shape)


def _assembled(slabs: Iterator[dict[str, mx.array]], rows: int,
               shape: tuple[int, ...]) -> dict[str, mx.array]:
    """Slabs of rows written in place into one MLX array per part, each slab evaluated and
    freed before the next is made: the tensor exists once, not as slabs plus their
    concatenation (nor as a NumPy copy beside the MLX one)."""
    out: dict[str, mx.array] = {}
    start = 0
    for slab in slabs:
        length = 0
        for key, value in slab.items():
            if key not in out:
                out[key] = mx.zeros((rows, value.shape[1]), value.dtype)
            out[key][start:start + len(value)] = value
            length = len(value)
        mx.eval(*out.values())
        start += length
    return {key: value.reshape(*shape[:-1], -1) for key, value in out.items()}


def _repack_q8_0(data: np.ndarray) -> dict[str, np.ndarray]:
    """Q8_0 blocks (f16 d, 32 int8) as MLX affine 8-bit: q + 128, scale d, bias -128 d."""
    blocks = data.reshape(len(data), -1, 34)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return {"weight": q.reshape(len(data), -1).view(np.uint32), "scales": scale,
            "biases": scale * np.float16(-128)}


def _repack_q4(data: np.ndarray, offset: bool) -> dict[str, np.ndarray]:
    """Q4_0 (f16 d, 16 bytes of nibbles; w = d (q - 8)) and Q4_1 (f16 d, f16 m; w = d q + m)
    as MLX affine 4-bit. llama.cpp puts values i and i + 16 in one byte; MLX packs in order."""
    blocks = data.reshape(len(data), -1, 20 if offset else 18)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    nibbles = blocks[..., 4:] if offset else blocks[..., 2:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
    words = np.ascontiguousarray((q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8))
    bias = (blocks[..., 2:4].copy().view(np.float16)[..., 0] if offset
            else scale * np.float16(-8))
    return {"weight": words.reshape(len(data), -1).view(np.uint32), "scales": scale,
            "biases": bias}


def _repack_q4_k(data: np.ndarray) -> dict[str, np.ndarray]:
    """Q4_K super-blocks (256 values: f16 d and dmin, 6-bit scale and min for each of 8
    sub-blocks of 32, 4-bit values) as MLX affine 4-bit, group 32: scale d*sc, bias -dmin*m."""
    rows = len(data)
    blocks = data.reshape(rows, -1, 144)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    low, high, tail = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    sc = np.concatenate([low & 63, (tail & 0xF) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 63, (tail >> 4) | ((high >> 6) << 4)], axis=-1)
    nibbles = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)  # 4 chunks of 2 sub-blocks
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=3).reshape(rows, -1)
    words = np.ascontiguousarray((q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8))
    return {"weight": words.view(np.uint32),
            "scales": (d[..., None] * sc).astype(np.float16).reshape(rows, -1),
            "biases": (-(dmin[..., None] * mins)).astype(np.float16).reshape(rows, -1)}


def _repack_q6_k(data: np.ndarray) -> dict[str, np.ndarray]:
    """Q6_K super-blocks (256 values: 6-bit q, an int8 scale per sub-block of 16, f16 d;
    w = d sc (q - 32)) as MLX affine 6-bit, group 32. A group holds two sub-blocks; its step is
    the coarser one's, d sc (bias -32 d sc), so that sub-block is kept exactly and the finer one
    is rounded to its grid: no value moves by more than half the source's step for its group
    (MLX has no groups of 16). 7 bits a value where 8-bit took 9, for llama.cpp's Q*_K_M
    ffn_down and output tensors."""
    rows = len(data)
    blocks = data.reshape(-1, 210)
    count = len(blocks)
    low = (blocks[:, :128].reshape(count, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]) & 15
    high = (blocks[:, 128:192].reshape(count, 2, 1, 32)
            >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    q = (low.reshape(count, 2, 4, 32) | (high << 4)).reshape(count, 8, 2, 16)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    step = (d * blocks[:, 192:208].view(np.int8)).reshape(count, 8, 2)  # per sub-block
    coarse = np.abs(step[..., 1]) > np.abs(step[..., 0])
    scale = np.where(coarse, step[..., 1], step[..., 0]).astype(np.float16)  # per group
    wide = scale.astype(np.float32)[..., None]
    factor = np.divide(step, wide, out=np.zeros_like(step), where=wide != 0)  # 1 if coarse
    k = q.astype(np.float32)  # the one float temporary, worked on in place
    k -= 32
    k *= factor[..., None]
    np.rint(k, out=k)
    k += 32
    np.clip(k, 0, 63, out=k)
    fours = k.astype(np.uint8).reshape(rows, -1, 4)
    del k
    packed = fours[..., 0].astype(np.uint32)
    for i in (1, 2, 3):
        packed |= fours[..., i].astype(np.uint32) << (6 * i)
    words = np.stack([packed, packed >> 8, packed >> 16], axis=-1).astype(np.uint8)
    return {"weight": words.reshape(rows, -1).view(np.uint32),
            "scales": scale.reshape(rows, -1),
            "biases": (scale * np.float16(-32)).reshape(rows, -1)}


_REPACKED: dict[T, Callable[[np.ndarray], dict[str, np.ndarray]]] = {
    T.Q8_0: _repack_q8_0, T.Q4_0: lambda d: _repack_q4(d, False),
    T.Q4_1: lambda d: _repack_q4(d, True), T.Q4_K: _repack_q4_k, T.Q6_K: _repack_q6_k,
}
_REPACKED_BITS = {T.Q8_0: 8, T.Q6_K: 6}  # the others: 4
# Symmetric types: w = d (q - z), so each MLX bias is -z * scale (see convert_tensor).
_ZERO_POINTS = {T.Q4_0: 8, T.Q8_0: 128, T.Q6_K: 32}


def _requantize(tensor: TensorSource, layout: tuple[int, int], kind: T, shape: tuple[int, ...]
                ) -> tuple[dict[str, mx.array], QuantType]:
    """Other block types: dequantized and quantized to MLX affine a slab of rows at a time, so
    no float copy of a whole tensor (an output head is the size of the vocabulary) is held."""
    bits = _REQUANT_BITS[kind]
    rows, row_bytes = layout
    step = max(1, REQUANT_SLAB_VALUES // shape[-1])

    def slabs() -> Iterator[dict[str, mx.array]]:
        for start in range(0, rows, step):
            data = _read_rows(tensor, start, min(step, rows - start), row_bytes)
            dense = mx.array(gguf.quants.dequantize(data, kind))
            parts = mx.quantize(dense.astype(mx.float16), group_size=QK, bits=bits)
            yield dict(zip(("weight", "scales", "biases"), parts, strict=True))

    parts = _assembled(slabs(), rows, shape)
    return parts, QuantType(f"{kind.name.lower()}-as-int{bits}", bits, QK, "affine")
