"""The architecture registry: one module per `model_type`, found by name.

Each `runner/models/<model_type>.py` exports `ModelArgs` (a dataclass whose `from_dict` ignores
unknown keys), `Model`, optionally `sanitize(weights)`, and `ARCHITECTURES`: the Hugging Face
`architectures[0]` names it serves (e.g. `("LlamaForCausalLM",)`). The create pipeline asks this
registry which checkpoints it may accept; it never imports mlx to do so (`supported_*` read only
module-level names, which is why model modules import mlx lazily only if they must, or
the caller accepts the import).
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

# model_type -> HF architecture names. Kept here, beside the modules, so that validation (create)
# can answer "is this supported?" without importing mlx; a test checks it matches the modules.
ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "llama": ("LlamaForCausalLM",),
    "qwen3": ("Qwen3ForCausalLM",),
    "nemotron_h": ("NemotronHForCausalLM",),
}


def supported_model_types() -> list[str]:
    return sorted(ARCHITECTURES)


def supported_architectures() -> list[str]:
    return sorted(name for names in ARCHITECTURES.values() for name in names)


def model_type_for_architecture(architecture: str) -> str | None:
    for model_type, names in ARCHITECTURES.items():
        if architecture in names:
            return model_type
    return None


def get_model_module(model_type: str) -> ModuleType:
    """Import `runner.models.<model_type>`; a clear ValueError when there is none."""
    known = {m.name for m in pkgutil.iter_modules(__path__)}
    if model_type not in known or model_type not in ARCHITECTURES:
        raise ValueError(
            f"model type {model_type!r} is not supported; supported: "
            f"{', '.join(supported_model_types())}"
        )
    return importlib.import_module(f"{__name__}.{model_type}")


def get_model_class(model_type: str) -> tuple[type, type]:
    """(Model, ModelArgs) for a config.json `model_type`."""
    module = get_model_module(model_type)
    return module.Model, module.ModelArgs
