"""The create plan: which blobs to write, which tensors go in each, and at what precision.

Pure: it reads only the inventory (names, dtypes, shapes) and returns frozen dataclasses, so the
writer decides nothing and the policy is testable without MLX. The policy follows Ollama's x/create
(reference 2.2): norms, embeddings, biases, small, misaligned and non-2-D tensors, routing gates
and vision/audio towers stay at source precision; `lm_head` is promoted to the family's 8-bit
type; with int4 (and nvfp4/mxfp4 off the experts) `k_proj`, `v_proj` and `down_proj` are too.
Per-expert tensors are stacked into `[experts, out, in]` per layer and projection.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

from runner.quant import QuantType
from workflows.create.errors import CreateError
from workflows.create.inventory import Inventory, TensorInfo

MIN_QUANT_ELEMENTS = 1024
_UNQUANTIZED_MARKERS = ("embed", "norm", "ln_", "layernorm")
_TOWER_MARKERS = ("audio_tower", "embed_audio", "vision_tower", "vision_model", "visual.",
                  "multi_modal_projector", "mm_projector", "mlp1.", "sound_encoder.",
                  "sound_projection.")  # mlp1, sound_*: Nemotron-H VL's projector, audio tower
_ROUTING_GATES = (".mlp.gate.weight", ".mixer.gate.weight", ".shared_expert_gate.weight",
                  ".router.proj.weight")
_PROMOTED = (".k_proj", ".v_proj", "down_proj")
_EXPERT_RE = re.compile(
    r"^(?P<group>.+\.(?:mlp\.experts|mlp\.shared_experts|mlp\.switch_mlp|moe\.experts"
    r"|mixer\.experts|mixer\.shared_experts))\.(?P<index>\d+)\.(?P<proj>[^.]+)\.weight$"
)


@dataclass(frozen=True)
class TensorPlan:
    """One output tensor: its name in the blob, its sources (several when stacking experts)."""

    name: str
    sources: tuple[TensorInfo, ...]
    quant: QuantType | None

    @property
    def dtype(self) -> str:
        return self.sources[0].dtype

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.sources[0].shape
        return (len(self.sources), *first) if len(self.sources) > 1 else first

    @property
    def source_bytes(self) -> int:
        return sum(s.nbytes for s in self.sources)


@dataclass(frozen=True)
class BlobPlan:
    """One tensor layer: `name` is the layer name, `tensors` what its safetensors file holds."""

    name: str
    tensors: tuple[TensorPlan, ...]


@dataclass(frozen=True)
class ModelPlan:
    blobs: tuple[BlobPlan, ...]
    json_files: tuple[tuple[str, str], ...]  # (layer name, path relative to the staged dir)
    file_type: str
    parameter_count: int

    @property
    def total_bytes(self) -> int:
        return sum(t.source_bytes for b in self.blobs for t in b.tensors)


def tensor_quantization(name: str, shape: tuple[int, ...], requested: QuantType | None,
                        draft: bool = False, expert: bool = False) -> QuantType | None:
    """The type one tensor is stored at, or None to keep its source precision."""
    if requested is None or _kept_at_source(name, shape, draft, expert):
        return None
    promoted = _promoted(name, requested, draft, expert)
    chosen = requested.eight_bit if promoted else requested
    for candidate in (chosen, requested):
        if shape[-1] % candidate.group_size == 0:
            return candidate
    return None


def _promoted(name: str, requested: QuantType, draft: bool, expert: bool) -> bool:
    """lm_head (not a draft's) and, for 4-bit types, the precision-sensitive projections."""
    if name.endswith("lm_head.weight"):
        return not draft
    four_bit = requested.name == "int4" or (requested.name in ("nvfp4", "mxfp4") and not expert)
    return four_bit and any(marker in name for marker in _PROMOTED)


def _kept_at_source(name: str, shape: tuple[int, ...], draft: bool, expert: bool) -> bool:
    if name.startswith("mtp.") or ".mtp." in name:
        return True  # an inline MTP head: reference 2.2 names no policy, so source precision
    embedding = "embed_tokens" in name
    if any(m in name for m in _UNQUANTIZED_MARKERS) and not (draft and embedding):
        return True
    if name.endswith(".bias") or (not name.endswith(".weight") and not expert):
        return True
    if any(m in name for m in _TOWER_MARKERS) or any(name.endswith(g) for g in _ROUTING_GATES):
        return True
    if len(shape) != 2 and not (expert and len(shape) == 3):
        return True
    return math.prod(shape) < MIN_QUANT_ELEMENTS


def plan_model(inv: Inventory, requested: QuantType | None, prefix: str = "",
               draft: bool = False) -> ModelPlan:
    """Plan every blob of one checkpoint; `prefix` is `draft.` for a draft model's tensors."""
    plain, experts = _split_experts(inv.tensors)
    blobs = [_single(prefix, info, requested, draft) for info in plain]
    for group, projections in experts.items():
        blobs.extend(_expert_blobs(prefix, group, projections, requested, draft))
    names = [t.name for b in blobs for t in b.tensors]
    if len(names) != len(set(names)):
        dup = next(n for n in names if names.count(n) > 1)
        raise CreateError(f"two source tensors map to the output name {dup!r}")
    json_prefix = "draft/" if draft else ""
    json_files = tuple((json_prefix + rel, rel) for rel in inv.json_files)
    params = sum(info.elements for info in inv.tensors.values())
    return ModelPlan(tuple(blobs), json_files, _file_type(inv, requested), params)


def _file_type(inv: Inventory, requested: QuantType | None) -> str:
    if requested is not None:
        return requested.name
    dtypes = {info.dtype for info in inv.tensors.values()}
    return dtypes.pop() if len(dtypes) == 1 else "BF16" if "BF16" in dtypes else "F32"


def _single(prefix: str, info: TensorInfo, requested: QuantType | None, draft: bool) -> BlobPlan:
    quant = tensor_quantization(info.name, info.shape, requested, draft)
    name = prefix + info.name
    return BlobPlan(name, (TensorPlan(name, (info,), quant),))


def _split_experts(tensors: dict[str, TensorInfo]
                   ) -> tuple[list[TensorInfo], dict[str, dict[str, dict[int, TensorInfo]]]]:
    plain: list[TensorInfo] = []
    experts: dict[str, dict[str, dict[int, TensorInfo]]] = defaultdict(lambda: defaultdict(dict))
    for info in tensors.values():
        match = _EXPERT_RE.match(info.name)
        if match is None:
            plain.append(info)
        else:
            experts[match["group"]][match["proj"]][int(match["index"])] = info
    return plain, experts


def _expert_blobs(prefix: str, group: str, projections: dict[str, dict[int, TensorInfo]],
                  requested: QuantType | None, draft: bool) -> list[BlobPlan]:
    """Stack each projection's experts; one blob per group when they share a quantization."""
    tensors = []
    for proj, by_index in sorted(projections.items()):
        if sorted(by_index) != list(range(len(by_index))):
            raise CreateError(f"experts of {group}.{proj} are not numbered 0..{len(by_index)-1}")
        sources = tuple(by_index[i] for i in range(len(by_index)))
        if len({(s.dtype, s.shape) for s in sources}) != 1:
            raise CreateError(f"experts of {group}.{proj} differ in dtype or shape")
        name = f"{prefix}{group}.{proj}.weight"
        shape = (len(sources), *sources[0].shape)
        quant = tensor_quantization(name, shape, requested, draft, expert=True)
        tensors.append(TensorPlan(name, sources, quant))
    if len({t.quant for t in tensors}) == 1:
        return [BlobPlan(prefix + group, tuple(tensors))]
    return [BlobPlan(t.name, (t,)) for t in tensors]
