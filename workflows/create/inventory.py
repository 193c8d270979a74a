"""Inventory of a staged checkpoint dir: config, JSON files and safetensors headers only.

Nothing here reads tensor data. Each safetensors header is checked as it is read (length, JSON,
dtype known, shape x dtype = byte size, offsets inside the file, no overlap), so a bad shard is
refused before any MLX work, with the file named in the error.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workflows.create.errors import CreateError

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
FLOAT_DTYPES = frozenset({"BF16", "F16", "F32"})
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
Wait = Callable[[Path, int], None]  # (file, end): return once its first `end` bytes are there


@dataclass(frozen=True)
class TensorInfo:
    """Where one source tensor's bytes are: `file` from absolute offset `start`, `nbytes` long."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int
    nbytes: int

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Inventory:
    """What a checkpoint dir holds; `json_files` are every non-weight file (relative paths)."""

    root: Path
    config: dict[str, Any]
    tensors: dict[str, TensorInfo]
    json_files: tuple[str, ...]
    chat_template: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures")
        if isinstance(archs, list) and archs and isinstance(archs[0], str):
            return archs[0]
        return ""


def no_wait(path: Path, end: int) -> None:
    """A stored file has all its bytes already."""


def read_header(path: Path, rel: str, wait: Wait = no_wait) -> dict[str, TensorInfo]:
    """Parse and check one safetensors file's header; tensors in data order. `wait` returns
    once a file still being uploaded has its first `end` bytes (its size is known up front)."""
    size = path.stat().st_size
    # Unbuffered: a read-ahead must not keep bytes of an upload from before they arrived.
    with open(path, "rb", buffering=0) as fh:
        wait(path, min(8, size))
        head = fh.read(8)
        if len(head) < 8:
            raise CreateError("truncated safetensors file: no header length", rel)
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise CreateError(f"safetensors header length {length} exceeds the file size "
                              f"({size} bytes)", rel)
        wait(path, 8 + length)
        raw = fh.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CreateError(f"safetensors header is not valid JSON: {exc}", rel) from exc
    if not isinstance(header, dict):
        raise CreateError("safetensors header must be a JSON object", rel)
    base = 8 + length
    tensors = [_tensor_info(name, entry, path, rel, base)
               for name, entry in header.items() if name != "__metadata__"]
    _check_layout(tensors, base, size - base, rel)
    return {t.name: t for t in sorted(tensors, key=lambda t: t.start)}


def _tensor_info(name: str, entry: Any, path: Path, rel: str, base: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise CreateError(f"tensor {name!r}: header entry must be an object", rel)
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise CreateError(f"tensor {name!r}: unknown dtype {dtype!r}", rel)
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CreateError(f"tensor {name!r}: shape must be a list of non-negative ints", rel)
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets))
            or offsets[0] > offsets[1]):
        raise CreateError(f"tensor {name!r}: data_offsets must be [begin, end]", rel)
    nbytes = offsets[1] - offsets[0]
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if nbytes != expected:
        raise CreateError(f"tensor {name!r}: shape {shape} x {dtype} is {expected} bytes but "
                          f"its offsets span {nbytes}", rel)
    return TensorInfo(name, dtype, tuple(shape), path, base + offsets[0], nbytes)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_layout(tensors: list[TensorInfo], base: int, data_size: int, rel: str) -> None:
    """Offsets inside the data section (which starts at `base`) and no two tensors overlapping."""
    end_of_previous, previous = 0, ""
    for t in sorted(tensors, key=lambda t: (t.start, t.nbytes)):
        begin = t.start - base
        if begin + t.nbytes > data_size:
            raise CreateError(f"tensor {t.name!r}: data ends at byte {begin + t.nbytes}, past "
                              f"the end of the file ({data_size} data bytes); truncated?", rel)
        if previous and begin < end_of_previous and t.nbytes:
            raise CreateError(f"tensors {previous!r} and {t.name!r} overlap", rel)
        end_of_previous, previous = max(end_of_previous, begin + t.nbytes), t.name


def read_json(path: Path, rel: str) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CreateError(f"not valid JSON: {exc}", rel) from exc


def take_inventory(root: Path, wait: Wait = no_wait) -> Inventory:
    """Read config.json, the shard index and every safetensors header under `root`."""
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    if CONFIG_FILE not in files:
        raise CreateError("config.json is missing; a safetensors import needs it")
    config = read_json(root / CONFIG_FILE, CONFIG_FILE)
    if not isinstance(config, dict):
        raise CreateError("must be a JSON object", CONFIG_FILE)
    shards = [f for f in files if f.endswith(".safetensors")]
    if not shards:
        raise CreateError("no *.safetensors files to import")
    tensors: dict[str, TensorInfo] = {}
    owner: dict[str, str] = {}
    for rel in shards:
        for name, info in read_header(root / rel, rel, wait).items():
            if name in tensors:
                raise CreateError(f"tensor {name!r} is also in {owner[name]}", rel)
            tensors[name], owner[name] = info, rel
    if INDEX_FILE in files:
        _check_index(root, set(files), owner)
    others = tuple(f for f in files if not f.endswith(".safetensors") and f != INDEX_FILE)
    return Inventory(root, config, tensors, others, _chat_template(root, set(files)))


def _check_index(root: Path, files: set[str], owner: dict[str, str]) -> None:
    """Every shard the index names is present and holds the tensors it is said to hold."""
    index = read_json(root / INDEX_FILE, INDEX_FILE)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CreateError("weight_map must be an object", INDEX_FILE)
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or shard not in files:
            raise CreateError(f"shard {shard!r} (holding {tensor!r}) is missing", INDEX_FILE)
        if owner.get(tensor) != shard:
            raise CreateError(f"tensor {tensor!r} is not in the header of {shard}", INDEX_FILE)


def _chat_template(root: Path, files: set[str]) -> str:
    """The chat template from chat_template.jinja or tokenizer_config.json, if any."""
    if "chat_template.jinja" in files:
        return (root / "chat_template.jinja").read_text(errors="replace")
    if "tokenizer_config.json" in files:
        data = read_json(root / "tokenizer_config.json", "tokenizer_config.json")
        template = data.get("chat_template") if isinstance(data, dict) else None
        if isinstance(template, str):
            return template
        if isinstance(template, list):  # named templates: [{"name", "template"}]
            return "\n".join(t.get("template", "") for t in template if isinstance(t, dict))
    return ""
