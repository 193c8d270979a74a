"""What `show` and `list` report about a model's weights, from cheap sources only.

GGUF models: the per-blob metadata file (`metadata/sha256-<hex>.json`, reference 2.8) that create
and pull write; the GGUF itself is never opened here, so a model without that file shows what its
config blob says. Tensor (MLX) models: `config.json` plus the safetensors headers of the tensor
layers, as Ollama's `x/server/show.go` builds them (reference 2.7).
"""

from __future__ import annotations

from typing import Any

from registry.gguf import FILE_TYPES
from registry.safetensors_header import TensorInfo

# Keys Ollama drops from show's model_info: the display name and the (huge) chat template.
_HIDDEN_KV = ("general.name", "tokenizer.chat_template")


def human_number(count: int) -> str:
    """Ollama's format.HumanNumber: 8030261248 -> "8.0B", 494032768 -> "494.03M", 1500 -> "2K"."""
    for scale, suffix, decimals in ((1_000_000_000, "B", 1), (1_000_000, "M", 2)):
        if count >= scale:
            number = count / scale
            shown = f"{number:.0f}" if number.is_integer() else f"{number:.{decimals}f}"
            return shown + suffix
    return f"{count / 1000:.0f}K" if count >= 1000 else str(count)


class GGUFKV:
    """GGUF key/values from a metadata file, with Ollama's key qualification."""

    def __init__(self, kv: dict[str, Any]) -> None:
        self.kv = kv

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any] | None) -> GGUFKV | None:
        """None when the file is absent or foreign (no `kv` object, reference 2.8)."""
        if not metadata or not isinstance(metadata.get("kv"), dict):
            return None
        return cls(metadata["kv"])

    @property
    def architecture(self) -> str:
        value = self.kv.get("general.architecture")
        return value if isinstance(value, str) else ""

    def get(self, key: str) -> Any:
        """A key not under `general.`/`tokenizer.` is looked up under the architecture."""
        if not key.startswith(("general.", "tokenizer.")):
            key = f"{self.architecture}.{key}"
        return self.kv.get(key)

    def get_int(self, key: str) -> int | None:
        value = self.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def parameter_size(self) -> str:
        count = self.get_int("general.parameter_count")
        return human_number(count) if count else ""

    @property
    def file_type(self) -> str:
        value = self.get_int("general.file_type")
        return FILE_TYPES.get(value, "") if value is not None else ""

    def model_info(self, verbose: bool) -> dict[str, Any]:
        """Every key but the hidden ones; arrays only when verbose (Ollama sends null)."""
        info: dict[str, Any] = {}
        for key, value in self.kv.items():
            if key in _HIDDEN_KV:
                continue
            info[key] = value if verbose or not isinstance(value, list) else None
        return info


def tensor_model_info(config: dict[str, Any], tensors: list[TensorInfo]) -> dict[str, Any]:
    """model_info for a tensor model: config.json fields under Ollama's GGUF-style keys."""
    arch = config.get("model_type") or _first(config.get("architectures")) or "unknown"
    nested = config.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else {}

    def field(key: str) -> Any:
        value = config.get(key)
        return value if value is not None else text.get(key)

    info: dict[str, Any] = {
        "general.architecture": arch,
        "general.parameter_count": sum(t.elements for t in tensors),
    }
    for key, suffix in (
        ("max_position_embeddings", "context_length"),
        ("hidden_size", "embedding_length"),
        ("num_hidden_layers", "block_count"),
        ("num_attention_heads", "attention.head_count"),
        ("num_key_value_heads", "attention.head_count_kv"),
        ("intermediate_size", "feed_forward_length"),
        ("vocab_size", "vocab_size"),
        ("head_dim", "attention.key_length"),
    ):
        value = field(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            info[f"{arch}.{suffix}"] = value
    return info


def _first(value: Any) -> str:
    if isinstance(value, list) and value and isinstance(value[0], str):
        return value[0]
    return ""
