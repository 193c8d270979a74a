"""Quantization types shared by create (which writes them) and the runner (which reads them).

Canonical names and aliases follow Ollama's x/quant (reference 2.2). Each blob written by create
records `quant_type` and `group_size` in its safetensors `__metadata__`; the runner reads them
back through `QuantType.from_metadata`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from runner import quant_cpu


@dataclass(frozen=True)
class QuantType:
    name: str  # canonical: int4, int8, nvfp4, mxfp4, mxfp8
    bits: int
    group_size: int
    mode: str  # MLX quantization mode: affine, nvfp4, mxfp4, mxfp8
    # Symmetric affine (GGUF's Q4_0, Q8_0, Q6_K: w = d (q - z)): every bias is -z * scale, so a
    # layer holds only its scales and computes the biases per call (`stored_bias` is False).
    zero_point: int | None = None

    @property
    def has_bias(self) -> bool:
        """Affine modes have a per-group bias beside the scale; the fp modes do not."""
        return self.mode == "affine"

    @property
    def stored_bias(self) -> bool:
        """Whether a layer of this type holds its biases (not symmetric affine)."""
        return self.has_bias and self.zero_point is None

    @property
    def eight_bit(self) -> QuantType:
        """The 8-bit type of this family, for promoted tensors like lm_head."""
        return QUANT_TYPES["int8"] if self.mode == "affine" else QUANT_TYPES["mxfp8"]

    def metadata(self) -> dict[str, str]:
        """The blob `__metadata__` create writes for a tensor of this type."""
        return {"quant_type": self.name, "group_size": str(self.group_size)}

    @classmethod
    def from_metadata(cls, metadata: dict[str, str] | None) -> QuantType | None:
        """The type a blob's `__metadata__` names; None for an unquantized blob."""
        if not metadata or "quant_type" not in metadata:
            return None
        base = parse_quant_type(metadata["quant_type"])
        group = metadata.get("group_size", "")
        return replace(base, group_size=int(group)) if group.isdigit() else base


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


class QuantRuntimeUnavailable(RuntimeError):
    """MLX cannot be imported here, so nothing can be quantized (the API answers 503)."""


def load_mlx():  # type: ignore[no-untyped-def]
    """Import `mlx.core` lazily, so that name checks and planning work where MLX is missing."""
    try:
        import mlx.core as mx
    except ImportError as exc:  # pragma: no cover - depends on the platform
        raise QuantRuntimeUnavailable(
            f"MLX is not available on this server ({exc}); safetensors imports need it"
        ) from exc
    return mx


def quantize(weight, qtype: QuantType) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """Quantize one MLX array; returns `weight` (packed uint32), `scale` and, for affine, `bias`.

    The keys name the parts only; the writer turns them into `<tensor>`, `<tensor>.scale` and
    `<tensor>.bias` inside the blob. The outputs are evaluated, so the caller can drop `weight`.
    """
    mx = load_mlx()
    parts: Any = None
    if (qtype.mode in quant_cpu.FP_MODES and weight.ndim >= 2
            and weight.shape[-1] % qtype.group_size == 0
            and quant_cpu.fast_path(qtype.mode, qtype.bits, qtype.group_size,
                                    quant_cpu.dtype_tag(weight.dtype))):
        parts = quant_cpu.fp_quantize(weight, qtype.mode, qtype.group_size)
    if parts is None:
        parts = mx.quantize(weight, group_size=qtype.group_size, bits=qtype.bits,
                            mode=qtype.mode)
    mx.eval(*parts)
    out: dict[str, object] = {"weight": parts[0], "scale": parts[1]}
    if qtype.has_bias:
        out["bias"] = parts[2]
    return out


def dequantize(packed, scale, bias, qtype: QuantType):  # type: ignore[no-untyped-def]
    """The inverse of `quantize` (lossy): back to a float array in the scale's dtype."""
    mx = load_mlx()
    return mx.dequantize(packed, scale, bias if qtype.has_bias else None,
                         group_size=qtype.group_size, bits=qtype.bits, mode=qtype.mode)

