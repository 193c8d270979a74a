"""The model config blob for a safetensors import (reference 2.2 "Config blob", 2.3)."""

from __future__ import annotations

from typing import Any

from registry.manifests import ModelConfig
from runner.models import is_embedding_architecture, supports_vision
from workflows.create.errors import CreateError
from workflows.create.inventory import Inventory
from workflows.create.plan import ModelPlan

MIN_REQUIRES = "0.19.0"  # what Ollama writes for safetensors models; older Ollamas refuse them


def human_number(count: int) -> str:
    """Parameter counts as Ollama's format.HumanNumber prints them: 8B, 8.2B, 494.03M, 12K."""
    for scale, suffix, decimals in ((1e9, "B", 1), (1e6, "M", 2)):
        if count >= scale:
            value = count / scale
            shown = f"{value:.0f}" if value == int(value) else f"{value:.{decimals}f}"
            return shown + suffix
    if count >= 1000:
        return f"{count / 1000:.0f}K"
    return str(count)


def capabilities(inv: Inventory) -> list[str]:
    """`embedding` alone for an embedding architecture (it cannot generate); else `completion`
    always; tools/thinking from the chat template; vision when the config has a vision tower
    the runner encodes. Audio towers are kept but never advertised: no runner reads audio."""
    if is_embedding_architecture(inv.architecture):
        return ["embedding"]
    caps = ["completion"]
    template = inv.chat_template
    if "tools" in template:
        caps.append("tools")
    if "<think>" in template or "enable_thinking" in template:
        caps.append("thinking")
    if "vision_config" in inv.config and supports_vision(inv.architecture):
        caps.append("vision")
    return caps


def draft_block(draft: Inventory) -> dict[str, Any]:
    arch = draft.architecture or str(draft.config.get("model_type", ""))
    return {"model_format": "safetensors", "architecture": arch, "tensor_prefix": "draft.",
            "config": "draft/config.json"}


def build_config(inv: Inventory, plan: ModelPlan, model_type: str, requires: str | None,
                 draft: Inventory | None) -> ModelConfig:
    config = inv.config
    # GPT-2-style names (n_positions, n_embd) in Nomic BERT's config.json
    context = config.get("max_position_embeddings", config.get("n_positions"))
    hidden = config.get("hidden_size", config.get("n_embd"))
    return ModelConfig(
        model_format="safetensors",
        model_family=model_type,
        model_families=[model_type],
        model_type=human_number(plan.parameter_count),
        file_type=plan.file_type,
        requires=requires or MIN_REQUIRES,
        capabilities=capabilities(inv),
        draft=draft_block(draft) if draft is not None else None,
        architecture=inv.architecture,
        context_length=context if isinstance(context, int) else None,
        embedding_length=hidden if isinstance(hidden, int) else None,
    )


def check_requires(value: str) -> str:
    """A Modelfile REQUIRES: semver (`v` optional), not below MIN_REQUIRES."""
    text = value.strip().removeprefix("v")
    parts = text.split("-")[0].split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise CreateError(f"requires {value!r} is not a valid version (major.minor.patch)")
    if tuple(map(int, parts)) < tuple(map(int, MIN_REQUIRES.split("."))):
        raise CreateError(f"requires {value!r} is lower than the minimum {MIN_REQUIRES}")
    return text


_INFO_STRINGS = {"model_family": "model_family", "base_name": "base_name",
                 "quantization_level": "file_type", "parameter_size": "model_type"}
_INFO_INTS = ("context_length", "embedding_length")


def parse_info(value: Any) -> dict[str, Any]:
    """Validate a create request's `info` overrides (reference 2.1) before any work starts."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise CreateError("info must be an object")
    for key, item in value.items():
        if key == "capabilities":
            if not isinstance(item, list) or not all(isinstance(c, str) for c in item):
                raise CreateError("info.capabilities must be an array of strings")
        elif key in _INFO_STRINGS:
            if not isinstance(item, str):
                raise CreateError(f"info.{key} must be a string")
        elif key in _INFO_INTS:
            if not isinstance(item, int) or isinstance(item, bool) or item < 0:
                raise CreateError(f"info.{key} must be a non-negative integer")
        else:
            raise CreateError(f"info.{key} is not a field create can override")
    return dict(value)


def apply_info(config: ModelConfig, info: dict[str, Any]) -> None:
    """Overwrite the config's fields with the request's `info` overrides."""
    for key, item in info.items():
        if key in _INFO_STRINGS and _INFO_STRINGS[key] in ModelConfig._FIELDS:
            setattr(config, _INFO_STRINGS[key], item)
        elif key in _INFO_STRINGS:
            config.extra[_INFO_STRINGS[key]] = item
        else:
            setattr(config, key, list(item) if key == "capabilities" else item)
