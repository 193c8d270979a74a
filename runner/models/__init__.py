"""The architecture registry: one module per `model_type`, found by name, as mlx-lm does.

Each `runner/models/<model_type>.py` exports `ModelArgs` (a dataclass whose `from_dict` ignores
unknown keys), `Model`, `ARCHITECTURES` (the Hugging Face `architectures[0]` names it serves),
`tensor_shapes(args)` (every checkpoint tensor it needs, with the shape its config implies; what
create validates), and optionally `sanitize(weights)`. Nothing else lists architectures, so adding
one means adding one file. Importing a module imports MLX; where MLX is missing the lookup raises
`QuantRuntimeUnavailable`, which the create API answers with 503.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from runner.quant import QuantRuntimeUnavailable


def model_types() -> list[str]:
    """The `model_type` of every architecture file (no import needed)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def model_module(model_type: str) -> ModuleType:
    """Import `runner.models.<model_type>`; a clear ValueError when there is none. config.json
    spells some types with a hyphen (`xlm-roberta`), module names cannot."""
    model_type = model_type.replace("-", "_")
    if model_type not in model_types():
        raise ValueError(f"model type {model_type!r} is not supported; supported: "
                         f"{', '.join(model_types())}")
    try:
        return importlib.import_module(f"{__name__}.{model_type}")
    except ImportError as exc:
        raise QuantRuntimeUnavailable(
            f"MLX is not available on this server ({exc}); models cannot be built here") from exc


def module_for_architecture(architecture: str) -> ModuleType | None:
    """The module whose `ARCHITECTURES` names `architecture`, or None."""
    for model_type in model_types():
        module = model_module(model_type)
        if architecture in module.ARCHITECTURES:
            return module
    return None


def supported_architectures() -> list[str]:
    return sorted(name for t in model_types() for name in model_module(t).ARCHITECTURES)


def module_for_gguf(architecture: str) -> ModuleType | None:
    """The module whose `GGUF_ARCHITECTURES` names a GGUF `general.architecture`, or None."""
    for model_type in model_types():
        module = model_module(model_type)
        if architecture in getattr(module, "GGUF_ARCHITECTURES", ()):
            return module
    return None


def is_embedding_architecture(architecture: str) -> bool:
    """An architecture that embeds text rather than generating it (its module's
    `EMBEDDING_ARCHITECTURES`: encoders, and decoders saved without their LM head)."""
    module = module_for_architecture(architecture)
    return module is not None and architecture in getattr(module, "EMBEDDING_ARCHITECTURES", ())


def supports_vision(architecture: str) -> bool:
    """An architecture whose runner module encodes images (its `VISION_ARCHITECTURES`)."""
    module = module_for_architecture(architecture)
    return module is not None and architecture in getattr(module, "VISION_ARCHITECTURES", ())
