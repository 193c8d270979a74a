"""Manifest -> tensor blobs -> Model (reference 3.2).

The checkpoint contract (written by workflows/create, see its write.py): JSON layers named by
path (config.json, tokenizer.json, ...), Modelfile layers (template, system, params), and one
tensor layer per tensor whose blob is a standalone safetensors file. A quantized tensor `N` comes
as `N` (packed), `N.scale` and, for affine modes, `N.bias`; `N.bias` is a quantization bias only
when `N.scale` exists, otherwise it is an ordinary layer bias. A draft model for speculative
decoding (config blob `draft` block, or `draft/config.json` plus `draft.` tensors) is loaded the
same way into a second model, its tensor names with the prefix stripped. A manifest whose model
is a GGUF layer (and no tensor layers) is read by runner/gguf_load.py: config from the blob's
metadata cache, tokenizer layers built from the file's metadata, tensors renamed and converted
(an untied token embedding on a CPU's native path stays in the file: runner/gguf_embedding.py).

Compute paths (`FERRY_COMPUTE`): "native" keeps every tensor as stored (bf16 matmuls, quantized
matmuls); "float32" dequantizes and upcasts each tensor as it is read, so every matmul is a dense
float32 GEMM (the only kind MLX's CPU backend hands to BLAS, ~75x faster with OpenBLAS); "fused"
keeps affine 2/4/8-bit weights packed (`runner/nn/fused_linear.py`: a fused dequantize-and-
multiply kernel for decode, per-block dequantization for BLAS in prefill), keeps dense bf16
linear weights as stored (`FusedDenseLinear`: a bf16 kernel for decode, a per-layer float32
copy for prefill) and upcasts the rest like float32, except an untied embedding, which only
serves lookups and stays as stored; the KV cache of a half-precision checkpoint holds float16
(`_stored_dtype`), and MLX keeps no pool of freed buffers (see `load_model`).
"auto" on a CPU picks fused when the kernel builds and the model is quantized or holds bf16
linear weights (measured with bench/runner.py: faster decode than float32 at the stored size,
where float32 takes 8x an int4 model's size and 2x a bf16 one's), else float32 when the float32
weights fit the memory budget, else native.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import psutil
from mlx.utils import tree_flatten, tree_unflatten
from tokenizers import Tokenizer

from registry import media_types as mt
from registry.digests import Digest
from registry.errors import FerryError
from registry.gguf import ensure_metadata
from registry.manifests import ModelConfig
from registry.names import Name
from registry.safetensors_header import logical_tensors, read_header
from registry.store import Store
from runner import gguf_tokenizer
from runner.gguf_embedding import GGUFEmbedding
from runner.gguf_load import (
    GGUFFile,
    GGUFLoadError,
    GGUFTensor,
    gguf_config,
    half_activations,
    open_gguf,
    read_weights,
)
from runner.gguf_tokenizer import eos_ids
from runner.kernels import qmatvec
from runner.models import model_module, model_types, module_for_architecture, module_for_gguf
from runner.nn.embedding import Embedding
from runner.nn.fused_linear import FusedDenseLinear, FusedQuantizedLinear, fused_supported
from runner.nn.linear import Linear
from runner.nn.mapped_embedding import MappedEmbedding, mappable
from runner.quant import QuantType

Release = Callable[[], None]
Progress = Callable[[float], None]
FLOAT32_BUDGET = 0.7  # share of available memory float32 weights may take under "auto"
DRAFT_PREFIX = "draft."
EMBEDDING = "model.embed_tokens"  # the token embedding's module path in every architecture
GGUF_EMBEDDING = "token_embd.weight"  # llama.cpp's name for it
KV_DTYPE = mx.float16  # the fused path's KV cache for half-precision checkpoints (_stored_dtype)
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
MMAP_THRESHOLD = 1 << 20  # blocks this large are mapped apart, and unmapped when freed


class LoadError(RuntimeError):
    """The model cannot be loaded here; the message says why."""


@dataclass
class ModelFiles:
    """Everything in a manifest except tensor data."""

    config: dict[str, Any]
    files: dict[str, bytes]  # JSON layers by their path name
    template: str | None
    system: str | None
    params: dict[str, Any]
    tensor_blobs: list[tuple[str, Digest]]  # (layer name, digest), drafts excluded
    draft_config: dict[str, Any] | None = None  # the draft's config.json, when there is one
    draft_blobs: list[tuple[str, Digest]] = field(default_factory=list)
    draft_prefix: str = DRAFT_PREFIX
    gguf: GGUFFile | None = None  # the open GGUF model layer, until its weights are loaded
    # a GGUF's tokenizer as built from its metadata, until ModelTokenizer takes it (its
    # tokenizer.json need not be parsed again)
    tokenizer: Tokenizer | None = None


@dataclass
class LoadedModel:
    model: nn.Module
    files: ModelFiles
    compute: str  # "float32" or "native"
    weights_bytes: int
    load_seconds: float
    draft: nn.Module | None = None
    context_length: int = field(init=False)

    def __post_init__(self) -> None:
        self.context_length = int(self.files.config.get("max_position_embeddings") or 4096)


def read_model_files(store: Store, name: str) -> ModelFiles:
    manifest = store.get_model(Name.parse_valid(name)).manifest()
    blob_config = _config_blob(store, manifest.config.digest if manifest.config else None)
    prefix = str((blob_config.draft or {}).get("tensor_prefix") or DRAFT_PREFIX)
    files: dict[str, bytes] = {}
    tensors: list[tuple[str, Digest]] = []
    drafts: list[tuple[str, Digest]] = []
    text: dict[str, str] = {}
    gguf: Digest | None = None
    for layer in manifest.layers:
        if layer.media_type == mt.MODEL:
            gguf = layer.digest
        elif layer.media_type == mt.JSON and layer.name:
            files[layer.name] = store.read_blob(layer.digest)
        elif layer.media_type == mt.TENSOR and layer.name:
            is_draft = layer.name.startswith(prefix)
            (drafts if is_draft else tensors).append((layer.name, layer.digest))
        elif layer.media_type in (mt.TEMPLATE, mt.PROMPT, mt.SYSTEM, mt.PARAMS):
            text[layer.media_type] = store.read_blob(layer.digest).decode()
    params = json.loads(text[mt.PARAMS]) if mt.PARAMS in text else {}
    if gguf is not None and not tensors:
        return _gguf_files(store, name, gguf, files, text, params)
    if "config.json" not in files:
        raise LoadError(f"model {name} has no config.json layer")
    if not tensors:
        raise LoadError(f"model {name} has no tensor layers and no GGUF model layer")
    return ModelFiles(json.loads(files["config.json"]), files,
                      text.get(mt.TEMPLATE, text.get(mt.PROMPT)), text.get(mt.SYSTEM), params,
                      tensors, *_draft_parts(name, blob_config, files, drafts), prefix)


def _gguf_files(store: Store, name: str, digest: Digest, files: dict[str, bytes],
                text: dict[str, str], params: dict[str, Any]) -> ModelFiles:
    """A GGUF model's config and tokenizer layers, as a safetensors manifest would carry them;
    the manifest's own JSON layers (if any) win."""
    try:
        cached = gguf_tokenizer.cached_files(store, digest)
        gguf = open_gguf(store.blob_path(digest), keep_arrays=cached is None)
        kv = ensure_metadata(store, digest)["kv"]
        arch = str(kv.get("general.architecture") or "")
        module = module_for_gguf(arch)
        if module is None:
            raise GGUFLoadError(f"GGUF architecture {arch!r} is not supported")
        config = gguf_config(kv, gguf, module)
        config["eos_token_id"] = eos_ids(gguf) or config.get("eos_token_id")
        built = None
        if cached is None:  # a model pulled, or created before the cache existed
            built, cached = gguf_tokenizer.build_tokenizer(gguf)
            with contextlib.suppress(OSError):  # a read-only store: build it every load
                gguf_tokenizer.cache_files(store, digest, cached)
        # the manifest's own tokenizer wins
        tokenizer = None if "tokenizer.json" in files else built
        files = {**cached, **files}
        del built
        gguf.drop_arrays()
        trim_heap()  # the tokenizer build's freed buffers, before the weights arrive
    except (GGUFLoadError, FerryError) as exc:
        raise LoadError(f"model {name}: {exc}") from exc
    return ModelFiles(config, files, text.get(mt.TEMPLATE, text.get(mt.PROMPT)),
                      text.get(mt.SYSTEM), params, [], gguf=gguf, tokenizer=tokenizer)


def return_large_frees(threshold: int = MMAP_THRESHOLD) -> None:
    """Have glibc serve every allocation of `threshold` bytes or more from its own mapping,
    handed back to the OS when freed (mallopt M_MMAP_THRESHOLD; elsewhere nothing). By default
    the threshold rises to the largest block freed so far (up to 32 MiB): once a GGUF load has
    freed one tensor's raw bytes (26 MB for a 32k x 768 Q8_0 head), blocks up to that size come
    from the heap and stay resident after they are freed, under the weights and then under
    every request. A process-wide setting, for the runner process: on the small fixture's Q8_0
    GGUF it cut the load's peak RSS by 27 MiB and the first request's by 15 MiB; the medium
    int4 model's runner held 616 MiB after a 608-token request without it, 519 MiB with it
    (prefill's per-layer float32 weights and attention scores, freed, left resident)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, threshold)


def trim_heap() -> None:
    """Hand the C heap's freed pages back to the OS (glibc's malloc_trim; elsewhere nothing):
    building a tokenizer frees tens of MB of parse buffers that glibc would otherwise keep,
    resident, under the weights loaded next."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _config_blob(store: Store, digest: Digest | None) -> ModelConfig:
    return ModelConfig.from_json(store.read_blob(digest)) if digest is not None else ModelConfig()


def _draft_parts(name: str, blob_config: ModelConfig, files: dict[str, bytes],
                 drafts: list[tuple[str, Digest]]
                 ) -> tuple[dict[str, Any] | None, list[tuple[str, Digest]]]:
    """The draft's config.json and tensor blobs; (None, []) when the model has no draft. The
    config blob names the draft's config file; without a `draft` block, its layers decide."""
    path = str((blob_config.draft or {}).get("config") or "draft/config.json")
    if blob_config.draft is None and not (drafts and path in files):
        return None, []
    if path not in files or not drafts:
        raise LoadError(f"model {name} declares a draft but lacks its {path} or tensors")
    return json.loads(files[path]), drafts


def float32_bytes(store: Store, files: ModelFiles) -> int:
    """What the weights take once dequantized to float32 (headers only, no data read)."""
    if files.gguf is not None:
        return files.gguf.float32_bytes()
    total = 0
    for _, digest in files.tensor_blobs + files.draft_blobs:
        total += sum(t.elements * 4 for t in logical_tensors(read_header(store.blob_path(digest))))
    return total


def is_quantized(store: Store, files: ModelFiles) -> bool:
    """Whether any tensor blob holds quantized weights (headers only)."""
    for _, digest in files.tensor_blobs:
        header = read_header(store.blob_path(digest))
        if any(key.endswith(".scale") and key[:-6] in header for key in header):
            return True
    return False


def has_bf16_linears(store: Store, files: ModelFiles) -> bool:
    """Whether a safetensors model stores any 2-D bf16 weight besides its embedding: the fused
    path's bf16 kernel serves those (headers only)."""
    for _, digest in files.tensor_blobs:
        header = read_header(store.blob_path(digest))
        for key, entry in header.items():
            if (isinstance(entry, dict) and entry.get("dtype") == "BF16"
                    and len(entry.get("shape", ())) == 2 and _dense_candidate(key)):
                return True
    return False


def choose_compute(setting: str, store: Store, files: ModelFiles) -> str:
    if setting == "fused" and not qmatvec.available():
        raise LoadError("FERRY_COMPUTE=fused needs the fused kernel, which cannot be built here "
                        "(is a C compiler installed?)")
    if setting in ("native", "float32", "fused"):
        return setting
    if mx.default_device().type != mx.DeviceType.cpu:
        return "native"
    if files.gguf is None and qmatvec.available() and (is_quantized(store, files)
                                                       or has_bf16_linears(store, files)):
        return "fused"
    budget = psutil.virtual_memory().available * FLOAT32_BUDGET
    return "float32" if float32_bytes(store, files) <= budget else "native"


def _quant_type(metadata: dict[str, str], key: str) -> QuantType | None:
    per_tensor = {k[len(key) + 1:]: v for k, v in metadata.items() if k.startswith(key + ".")}
    return QuantType.from_metadata(per_tensor or metadata)


def load_safetensors(path: str) -> tuple[dict[str, mx.array], dict[str, str]]:
    """A safetensors file's arrays and its string metadata (mx.load's return type is a union
    over every format; this is the one shape it has for safetensors with metadata)."""
    loaded = mx.load(path, format="safetensors", return_metadata=True)
    if not isinstance(loaded, tuple):
        raise LoadError(f"{Path(path).name}: expected safetensors arrays and metadata")
    arrays, metadata = loaded
    return arrays, {str(k): str(v) for k, v in metadata.items()}


def read_blob_tensors(path: str, compute: str) -> tuple[dict[str, mx.array], dict[str, QuantType]]:
    """One blob's tensors under module parameter names; quant types by module path."""
    arrays, metadata = load_safetensors(path)
    weights: dict[str, mx.array] = {}
    qtypes: dict[str, QuantType] = {}
    for key, array in arrays.items():
        if key.endswith((".scale", ".bias")) and key.rsplit(".", 1)[0] + ".scale" in arrays:
            continue  # quantization companions, taken with their tensor below
        if key + ".scale" not in arrays:
            keep = compute == "fused" and array.dtype == mx.bfloat16 and _dense_candidate(key)
            weights[key] = array if keep or not _upcast(compute, key) else array.astype(mx.float32)
            continue
        qtype = _quant_type(metadata, key)
        if qtype is None:
            raise LoadError(f"tensor {key} has scales but no quant_type metadata")
        scale, bias = arrays[key + ".scale"], arrays.get(key + ".bias")
        module = key.removesuffix(".weight")
        in_dims = array.shape[-1] * 32 // qtype.bits
        if compute == "float32" or (compute == "fused" and not fused_supported(qtype, in_dims)):
            weights[key] = _dequantize_float32(array, scale, bias, qtype)
            continue
        qtypes[module] = qtype
        weights[f"{module}.weight"], weights[f"{module}.scales"] = array, scale
        if qtype.has_bias and bias is not None:
            weights[f"{module}.biases"] = bias
    return weights, qtypes


def _dequantize_float32(packed: mx.array, scale: mx.array, bias: mx.array | None,
                        qtype: QuantType) -> mx.array:
    """Affine scales are widened first, so each weight is scale * q + bias in float32 exactly
    as the fused kernel computes it (not rounded to the scales' bf16)."""
    if qtype.has_bias:
        scale = scale.astype(mx.float32)
        bias = bias.astype(mx.float32) if bias is not None else None
    return mx.dequantize(packed, scale, bias if qtype.has_bias else None,
                         group_size=qtype.group_size, bits=qtype.bits,
                         mode=qtype.mode).astype(mx.float32)


def _upcast(compute: str, key: str) -> bool:
    """Dense tensors become float32 on the float32 and fused paths, except (fused) embeddings,
    which serve lookups (a tied head is upcast after loading, see `assign_weights`)."""
    return compute == "float32" or (compute == "fused" and "embed_tokens" not in key)


def _stored_dtype(weights: dict[str, mx.array], model: nn.Module) -> mx.Dtype | None:
    """The half precision the checkpoint computes in, read off its token embedding as stored
    (a quantized one's scales); None for a float32 checkpoint (or one this cannot tell).

    For such a model the fused path keeps its KV cache in `KV_DTYPE` instead of the
    activations' float32: half the bytes, and the cache is what grows with the context (the
    medium fixture's 608 positions: 139 MB in float32, held twice while the prefix cache copies
    it out). mlx-lm's cache takes its activations' dtype, bf16 for these checkpoints; float16
    (what llama.cpp and Ollama store by default) keeps 3 more mantissa bits: with it greedy
    tokens stay identical to the float32 path on every parity fixture, where bf16 changed one
    (llama int8, token 6)."""
    embedding = model["model"].get("embed_tokens") if "model" in model else None
    dtype = getattr(embedding, "dtype", None)  # a MappedEmbedding's
    if not isinstance(embedding, MappedEmbedding):
        stored = weights.get(EMBEDDING + ".scales", weights.get(EMBEDDING + ".weight"))
        dtype = stored.dtype if stored is not None else None
    return dtype if dtype is not None and dtype in (mx.bfloat16, mx.float16) else None


def _dense_candidate(key: str) -> bool:
    """A weight the bf16 kernel may serve, if its module turns out to be a `Linear` (see
    `dense_modules`); embeddings are left to `_upcast`."""
    return key.endswith(".weight") and "embed_tokens" not in key


def dense_modules(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Fused path: swap each `Linear` whose weight was kept bf16 for `FusedDenseLinear`, and
    upcast every other kept bf16 tensor (a 2-D weight of some other module) to float32."""
    modules = dict(model.named_modules())
    swaps = []
    for key, array in weights.items():
        if array.dtype != mx.bfloat16 or not _dense_candidate(key):
            continue
        path = key.removesuffix(".weight")
        module = modules.get(path)
        if type(module) is Linear and array.ndim == 2:
            out_dims, in_dims = array.shape
            swaps.append((path, FusedDenseLinear(in_dims, out_dims, bias="bias" in module)))
        else:
            weights[key] = array.astype(mx.float32)
    if swaps:
        model.update_modules(tree_unflatten(swaps))


def quantize_modules(model: nn.Module, qtypes: dict[str, QuantType], compute: str) -> None:
    """Swap each dense layer whose tensor is stored quantized for its quantized twin (on the
    fused path, linear layers get the fused kernel's twin)."""
    swaps = [(path, _quantized(module, qtypes[path], compute))
             for path, module in model.named_modules() if path in qtypes]
    missing = set(qtypes) - {path for path, _ in swaps}
    if missing:
        raise LoadError(f"quantized tensors for unknown layers: {', '.join(sorted(missing))}")
    model.update_modules(tree_unflatten(swaps))


def _quantized(module: nn.Module, qtype: QuantType, compute: str) -> nn.Module:
    if compute == "fused" and isinstance(module, Linear):
        out_dims, in_dims = module["weight"].shape
        return FusedQuantizedLinear(in_dims, out_dims, qtype, bias="bias" in module)
    return module.to_quantized(qtype)


def build_model(config: dict[str, Any]) -> tuple[nn.Module, Any]:
    """The Model for a config.json: its `model_type` names the module, else `architectures[0]`
    finds it."""
    model_type = config.get("model_type")
    archs = config.get("architectures") or [""]
    if model_type in model_types():
        module = model_module(str(model_type))
    else:  # no model_type, or one no file is named after (gemma3's multimodal config)
        found = module_for_architecture(str(archs[0]))
        if found is None:
            raise LoadError(f"model type {model_type!r} (architecture {archs[0]!r}) is not "
                            f"supported; supported: {', '.join(model_types())}")
        module, model_type = found, found.__name__.rsplit(".", 1)[1]
    return module.Model(module.ModelArgs.from_dict({**config, "model_type": model_type})), module


def parameter_bytes(model: nn.Module) -> int:
    flat: dict[str, mx.array] = {}
    tree_flatten(model.parameters(), destination=flat)
    return sum(a.nbytes for a in flat.values())


def load_model(store: Store, name: str, compute: str = "auto",
               progress: Progress | None = None, release: Release = mx.clear_cache,
               files: ModelFiles | None = None) -> LoadedModel:
    """Load `name` (and its draft): every tensor blob once, transformed as the compute path
    needs, evaluated, then MLX's buffer pool released so load-time temporaries leave nothing
    held. `files`: its `read_model_files`, when the caller read them first (the runner builds
    the tokenizer from them before the weights arrive, so the tokenizer's parse buffers never
    sit on top of the weights)."""
    started = time.perf_counter()
    files = read_model_files(store, name) if files is None else files
    path = choose_compute(compute, store, files)
    if path == "fused" or mx.default_device().type == mx.DeviceType.cpu:
        # MLX keeps freed buffers for reuse until `release` (every prefill chunk, every 256
        # tokens): prefill's transients (per-layer float32 weights, attention scores) then sit
        # in that pool beside the live ones and raise the peak. Without it, peak RSS fell by
        # ~21 MiB (small fixture, int4) and 28 MiB (medium), decode no slower within noise.
        # On the native path decode grows the pool too, by the attention buffers whose size
        # changes every token: ~1.4 MiB every 8 tokens (small fixture, Q4_0 GGUF), 17 MiB held
        # after 64 tokens. On a CPU a buffer is plain memory, cheap to allocate; not on a GPU.
        mx.set_cache_limit(0)
    total = max(1, len(files.tensor_blobs) + len(files.draft_blobs))

    def step(done: int) -> None:
        if progress is not None:
            progress(done / total)

    if files.gguf is not None:
        model = load_gguf_weights(name, files.config, files.gguf, path)
        files.gguf = None  # the header and its tokenizer arrays are not needed any more
        files.tokenizer = None  # a caller that did not take it parses tokenizer.json instead
        step(1)
    else:
        model = load_weights(store, name, files.config, files.tensor_blobs, path, "", step)
    draft = None
    if files.draft_config is not None and _draft_fits(name, files):
        offset = len(files.tensor_blobs)
        draft = load_weights(store, f"{name} (draft)", files.draft_config, files.draft_blobs,
                             path, files.draft_prefix, lambda done: step(offset + done))
    release()
    trim_heap()
    nbytes = sum(parameter_bytes(m) for m in (model, draft) if m is not None)
    return LoadedModel(model, files, path, nbytes, time.perf_counter() - started, draft)


def _mapped_embedding(model: nn.Module, store: Store, blobs: list[tuple[str, Digest]],
                      compute: str, prefix: str) -> tuple[Digest, Path, str] | None:
    """On the fused path, the blob of an untied, unquantized embedding, to be memory-mapped
    (`runner/nn/mapped_embedding.py`) rather than loaded; None when that does not apply."""
    args = getattr(model, "args", None)
    if compute != "fused" or args is None or args.tie_word_embeddings:
        return None
    key = prefix + EMBEDDING + ".weight"
    for layer_name, digest in blobs:
        path = store.blob_path(digest)
        if layer_name == key and mappable(path, key):
            return digest, path, key
    return None


def _draft_fits(name: str, files: ModelFiles) -> bool:
    """A draft must score the target's token ids: same vocabulary size, or it is not used
    (the model still runs, without speculation)."""
    ours, theirs = files.config.get("vocab_size"), (files.draft_config or {}).get("vocab_size")
    if ours == theirs:
        return True
    print(f"model {name}: draft vocabulary ({theirs}) differs from the model's ({ours}); "
          "decoding without the draft", file=sys.stderr, flush=True)
    return False


def load_weights(store: Store, name: str, config: dict[str, Any],
                 blobs: list[tuple[str, Digest]], compute: str, prefix: str,
                 progress: Callable[[int], None]) -> nn.Module:
    """One model from its blobs; `prefix` (a draft's `draft.`) is stripped from tensor names."""
    model, module = build_model(config)
    weights: dict[str, mx.array] = {}
    qtypes: dict[str, QuantType] = {}
    mapped = _mapped_embedding(model, store, blobs, compute, prefix)
    for done, (_, digest) in enumerate(blobs, 1):
        if mapped is not None and digest == mapped[0]:
            progress(done)
            continue
        blob_weights, blob_qtypes = read_blob_tensors(str(store.blob_path(digest)), compute)
        mx.eval(list(blob_weights.values()))  # upcast now: the source arrays are freed as we go
        weights.update({k.removeprefix(prefix): v for k, v in blob_weights.items()})
        qtypes.update({k.removeprefix(prefix): v for k, v in blob_qtypes.items()})
        progress(done)
    rename = getattr(module, "tensor_name", None)
    if rename is not None:  # a checkpoint that names tensors otherwise than the model does
        weights = {rename(k): v for k, v in weights.items()}
        qtypes = {rename(k): v for k, v in qtypes.items()}
    if hasattr(module, "sanitize"):
        weights = module.sanitize(weights)
    fit = getattr(model, "fit_weights", None)
    if fit is not None:  # parts a config declares but a checkpoint may lack (an MTP head)
        fit(weights)
    if mapped is not None:
        model.update_modules(tree_unflatten([(EMBEDDING, MappedEmbedding(*mapped[1:]))]))
    if compute == "fused":
        model.kv_dtype = KV_DTYPE if _stored_dtype(weights, model) is not None else None
        dense_modules(model, weights)
    return assign_weights(name, model, weights, qtypes, compute)


def load_gguf_weights(name: str, config: dict[str, Any], gguf: GGUFFile,
                      compute: str) -> nn.Module:
    """One model from an open GGUF file (runner/gguf_load.py does the renaming and conversion).
    An untied token embedding on a CPU's native path stays in the file (`row_embedding`)."""
    try:
        model, module = build_model(config)
        rows = row_embedding(model, gguf, compute)
        skip = frozenset() if rows is None else frozenset({GGUF_EMBEDDING})
        weights, qtypes = read_weights(gguf, module, model.args, compute, skip)
        if rows is not None:
            model.update_modules(tree_unflatten([(EMBEDDING, GGUFEmbedding(*rows))]))
    except (GGUFLoadError, ValueError, OSError) as exc:
        raise LoadError(f"model {name}: {exc}") from exc
    if compute == "native" and not half_activations() and gguf.compute_dtype() is not None:
        # float32 activations (a CPU keeps the file's F32 norms): the KV cache still holds
        # 2 bytes a value, as llama.cpp's does for the same file, not 4
        model.kv_dtype = KV_DTYPE
    return assign_weights(name, model, weights, qtypes, compute)


def row_embedding(model: nn.Module, gguf: GGUFFile, compute: str
                  ) -> tuple[GGUFTensor, tuple[int, int]] | None:
    """The GGUF token embedding to read row by row (runner/gguf_embedding.py) instead of
    loading, with its [rows, dims] shape: on a CPU's native path, when it only serves lookups
    (the file has its own output head) and sits where this module reads it; else None."""
    tensor = gguf.tensors.get(GGUF_EMBEDDING)
    args = getattr(model, "args", None)
    if (compute != "native" or half_activations() or tensor is None or args is None
            or args.tie_word_embeddings or "output.weight" not in gguf.tensors
            or type(dict(model.named_modules()).get(EMBEDDING)) is not Embedding
            or len(tensor.shape) != 2):
        return None
    return tensor, (int(tensor.shape[1]), int(tensor.shape[0]))


def assign_weights(name: str, model: nn.Module, weights: dict[str, mx.array],
                   qtypes: dict[str, QuantType], compute: str) -> nn.Module:
    """Swap in quantized layers, load `weights` strictly, and evaluate them."""
    if getattr(model, "args", None) is not None and model.args.tie_word_embeddings:
        # a tied model has no head of its own: drop one a checkpoint carries anyway (at the
        # top, or under a wrapper such as gemma3's `language_model.`), quantized or not
        heads = {k.rsplit(".", 1)[0] for k in weights if k.rsplit(".", 2)[-2:-1] == ["lm_head"]}
        for key in [k for k in weights if k.rsplit(".", 1)[0] in heads]:
            del weights[key]
        qtypes = {k: v for k, v in qtypes.items() if k not in heads}
        embedding = weights.get(EMBEDDING + ".weight")
        if compute == "fused" and embedding is not None and embedding.dtype != mx.uint32:
            # The tied head multiplies by the embedding every token: BLAS needs float32.
            weights[EMBEDDING + ".weight"] = embedding.astype(mx.float32)
    quantize_modules(model, qtypes, compute)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise LoadError(f"model {name}: {exc}") from exc
    del weights
    mx.eval(model.parameters())
    return model
