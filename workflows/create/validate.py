"""Validation before any MLX work: the checkpoint must be one ferry's runner can load.

Checks that need only the inventory (config.json and headers): the architecture is registered
in `runner.models` (read without importing mlx), and every tensor the architecture needs is
present with the shape the config implies (hidden size, layer count, heads, vocab). Each failure
is a CreateError naming the file and the problem.
"""

from __future__ import annotations

import re
from typing import Any

from runner.models import get_model_module, model_type_for_architecture, supported_architectures
from runner.quant import QuantType, UnknownQuantType, parse_quant_type
from workflows.create.errors import CreateError
from workflows.create.inventory import CONFIG_FILE, FLOAT_DTYPES, Inventory

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def parse_quantize(quantize: str | None, draft_quantize: str | None,
                   has_draft: bool) -> tuple[QuantType | None, QuantType | None]:
    """Resolve the requested types up front; `--draft-quantize` needs a DRAFT."""
    if draft_quantize and not has_draft:
        raise CreateError("draft_quantize requires a DRAFT model (draft_files)")
    try:
        target = parse_quant_type(quantize) if quantize else None
        draft = parse_quant_type(draft_quantize) if draft_quantize else None
    except UnknownQuantType as exc:
        raise CreateError(str(exc)) from exc
    return target, draft


def validate_checkpoint(inv: Inventory, where: str = "") -> str:
    """Check architecture and tensor shapes; return the runner's model_type for it."""
    config_name = f"{where}{CONFIG_FILE}"
    arch = inv.architecture
    if not arch:
        raise CreateError("architectures[0] is missing", config_name)
    model_type = model_type_for_architecture(arch)
    if model_type is None:
        raise CreateError(f"unsupported architecture {arch!r}: ferry's runner supports "
                          f"{', '.join(supported_architectures())}", config_name)
    expected = _architecture_shapes(inv.config, config_name, model_type)
    for name, shape in expected.items():
        info = inv.tensors.get(name)
        if info is None:
            if name == "lm_head.weight" and inv.config.get("tie_word_embeddings"):
                continue
            raise CreateError(f"tensor {name!r} is missing from the safetensors files")
        if info.shape != shape:
            raise CreateError(f"tensor {name!r} has shape {list(info.shape)} but config.json "
                              f"implies {list(shape)}", info.file.name)
        if info.dtype not in FLOAT_DTYPES:
            raise CreateError(f"tensor {name!r} has dtype {info.dtype}; only BF16, F16 and F32 "
                              "checkpoints can be imported", info.file.name)
    _check_layer_indices(inv, int(inv.config.get("num_hidden_layers") or 0))
    return model_type


def _architecture_shapes(config: dict[str, Any], where: str,
                         model_type: str) -> dict[str, tuple[int, ...]]:
    """The architecture file's own layout when it declares one, else the llama family's."""
    module = get_model_module(model_type)
    if not hasattr(module, "expected_shapes"):
        return expected_shapes(config, where, model_type)
    try:
        return module.expected_shapes(config)
    except ValueError as exc:
        raise CreateError(str(exc), where) from exc


def _check_layer_indices(inv: Inventory, layers: int) -> None:
    for name, info in inv.tensors.items():
        match = _LAYER_RE.match(name)
        if match and int(match.group(1)) >= layers:
            raise CreateError(f"tensor {name!r} is beyond num_hidden_layers={layers}",
                              info.file.name)


def _int(config: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CreateError(f"{key} must be a positive integer, got {value!r}", where)
    return value


def expected_shapes(config: dict[str, Any], where: str,
                    model_type: str) -> dict[str, tuple[int, ...]]:
    """Every tensor a llama-family decoder needs, with the shape config.json implies."""
    hidden = _int(config, "hidden_size", where)
    layers = _int(config, "num_hidden_layers", where)
    heads = _int(config, "num_attention_heads", where)
    kv_heads = _int(config, "num_key_value_heads", where, heads)
    head_dim = _int(config, "head_dim", where, hidden // heads)
    inter = _int(config, "intermediate_size", where)
    vocab = _int(config, "vocab_size", where)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden),
                                          "model.norm.weight": (hidden,),
                                          "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{p}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
        })
        if model_type == "qwen3":
            shapes[f"{p}.self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{p}.self_attn.k_norm.weight"] = (head_dim,)
    return shapes
