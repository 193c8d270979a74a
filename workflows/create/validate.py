"""Validation before any MLX work: the checkpoint must be one ferry's runner can load.

Checks that need only the inventory (config.json and headers): the architecture is one a
`runner/models/<model_type>.py` file serves, and every tensor that file's `tensor_shapes` lists
is present with the shape the config implies. Asking the architecture file imports MLX; where it
is missing that is `QuantRuntimeUnavailable` (503). Each failure is a CreateError naming the file
and the problem.
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Any

from runner.models import module_for_architecture, supported_architectures
from runner.quant import QuantType, UnknownQuantType, parse_quant_type
from workflows.create.errors import CreateError
from workflows.create.inventory import CONFIG_FILE, FLOAT_DTYPES, Inventory, TensorInfo

_LAYER_RE = re.compile(r"^(?:language_model\.)?model\.layers\.(\d+)\.")
# ModelArgs sizes that must be positive integers when present (every architecture's names).
_POSITIVE_INTS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "num_experts",
                  "moe_intermediate_size", "num_experts_per_tok")


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
    if not inv.architecture:
        raise CreateError("architectures[0] is missing", config_name)
    module, args = model_args(inv.config, config_name)
    tensors = _model_names(inv, module)
    for name, shape in _shapes(module, args, config_name).items():
        info = tensors.get(name)
        if info is None:
            raise CreateError(f"tensor {name!r} is missing from the safetensors files")
        if info.shape != shape:
            raise CreateError(f"tensor {name!r} has shape {list(info.shape)} but config.json "
                              f"implies {list(shape)}", info.file.name)
        if info.dtype not in FLOAT_DTYPES:
            raise CreateError(f"tensor {name!r} has dtype {info.dtype}; only BF16, F16 and F32 "
                              "checkpoints can be imported", info.file.name)
    _check_optional_part(module, args, tensors, config_name)
    layers = getattr(args, "num_hidden_layers", None)
    if layers is not None:  # encoders such as Nomic BERT count theirs otherwise
        _check_layer_indices(tensors, layers)
    return model_type_of(module)


def _check_optional_part(module: ModuleType, args: Any, tensors: dict[str, TensorInfo],
                         where: str) -> None:
    """A part the checkpoint may leave out (Nemotron-H's MTP head): all of it or none, in the
    shapes the config implies, so a wrong head fails here and not when the runner loads it."""
    optional = getattr(module, "optional_tensor_shapes", None)
    if optional is None:
        return
    try:
        shapes: dict[str, tuple[int, ...]] = optional(args)
    except (TypeError, ValueError, KeyError, ZeroDivisionError) as exc:
        raise CreateError(f"does not describe a model ferry can load: {exc}", where) from exc
    present = [name for name in shapes if name in tensors]
    if not present:
        return
    for name, shape in shapes.items():
        info = tensors.get(name)
        if info is None:
            raise CreateError(f"tensor {name!r} is missing: the checkpoint carries part of "
                              f"the multi-token-prediction head (e.g. {present[0]!r})")
        if info.shape != shape:
            raise CreateError(f"tensor {name!r} has shape {list(info.shape)} but config.json "
                              f"implies {list(shape)}", info.file.name)


def _model_names(inv: Inventory, module: ModuleType) -> dict[str, TensorInfo]:
    """The inventory's tensors by checkpoint name and, where the architecture renames them at
    load (`tensor_name`, e.g. gemma3's newer transformers layout), by the model's name too."""
    rename = getattr(module, "tensor_name", None)
    if rename is None:
        return inv.tensors
    return {**inv.tensors, **{rename(name): info for name, info in inv.tensors.items()}}


def model_type_of(module: ModuleType) -> str:
    return module.__name__.rsplit(".", 1)[1]


def _module(arch: str, where: str) -> ModuleType:
    module = module_for_architecture(arch)
    if module is None:
        raise CreateError(f"unsupported architecture {arch!r}: ferry's runner supports "
                          f"{', '.join(supported_architectures())}", where)
    return module


def _check_layer_indices(tensors: dict[str, TensorInfo], layers: int) -> None:
    for name, info in tensors.items():
        match = _LAYER_RE.match(name)
        if match and int(match.group(1)) >= layers:
            raise CreateError(f"tensor {name!r} is beyond num_hidden_layers={layers}",
                              info.file.name)


def model_args(config: dict[str, Any], where: str = CONFIG_FILE) -> tuple[ModuleType, Any]:
    """The architecture file serving `architectures[0]`, and its ModelArgs for the config; every
    size it holds must be a positive integer."""
    archs = config.get("architectures")
    arch = str(archs[0]) if isinstance(archs, list) and archs else ""
    module = _module(arch, where)
    try:
        args = module.ModelArgs.from_dict({**config, "model_type": model_type_of(module)})
    except (TypeError, ValueError, KeyError, ZeroDivisionError) as exc:
        raise CreateError(f"does not describe a {arch} ferry can load: {exc}", where) from exc
    for key in _POSITIVE_INTS:
        value = getattr(args, key, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value <= 0):
            raise CreateError(f"{key} must be a positive integer, got {value!r}", where)
    return module, args


def _shapes(module: ModuleType, args: Any, where: str) -> dict[str, tuple[int, ...]]:
    try:
        shapes: dict[str, tuple[int, ...]] = module.tensor_shapes(args)
    except (TypeError, ValueError, KeyError, ZeroDivisionError) as exc:
        raise CreateError(f"does not describe a model ferry can load: {exc}", where) from exc
    if any(not isinstance(d, int) or d <= 0 for shape in shapes.values() for d in shape):
        raise CreateError("implies a tensor with an empty or invalid dimension", where)
    return shapes


def expected_shapes(config: dict[str, Any], where: str = CONFIG_FILE
                    ) -> dict[str, tuple[int, ...]]:
    """Every tensor the config's architecture needs, with its shape; the architecture file
    (`runner/models/<model_type>.py`, its `tensor_shapes`) is what knows them."""
    return _shapes(*model_args(config, where), where)
