"""Quantization types shared by create (which writes them) and the runner (which reads them).

Canonical names and aliases follow Ollama's x/quant (reference 2.2). Each blob written by create
records `quant_type` and `group_size` in its safetensors `__metadata__`; the runner reads them
back through `QuantType.from_metadata`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantType:
    name: str  # canonical: int4, int8, nvfp4, mxfp4, mxfp8
    bits: int
    group_size: int
    mode: str  # MLX quantization mode: affine, nvfp4, mxfp4, mxfp8

    @property
    def has_bias(self) -> bool:
        """Affine modes store a per-group bias beside the scale; the fp modes do not."""
        return self.mode == "affine"

    @property
    def eight_bit(self) -> QuantType:
        """The 8-bit type of this family, for promoted tensors like lm_head."""
        return QUANT_TYPES["int8"] if self.mode == "affine" else QUANT_TYPES["mxfp8"]


QUANT_TYPES: dict[str, QuantType] = {
    "int4": QuantType("int4", 4, 64, "affine"),
    "int8": QuantType("int8", 8, 64, "affine"),
    "nvfp4": QuantType("nvfp4", 4, 16, "nvfp4"),
    "mxfp4": QuantType("mxfp4", 4, 32, "mxfp4"),
    "mxfp8": QuantType("mxfp8", 8, 32, "mxfp8"),
}
_ALIASES = {"q4": "int4", "fp4": "int4", "q8": "int8", "fp8": "int8"}


class UnknownQuantType(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(
            f"unsupported quantize type {name!r}: supported types are "
            f"{', '.join(QUANT_TYPES)}"
        )
        self.name = name


def parse_quant_type(name: str) -> QuantType:
    """Resolve a user-given name or alias, case-insensitively."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in QUANT_TYPES:
        raise UnknownQuantType(name)
    return QUANT_TYPES[key]
