"""GGUF creates: wrap each uploaded GGUF blob as a layer, as-is (reference 2.4).

The digest never changes, so a client that uploaded the file once gets a model that points at
that very blob. Split GGUFs (`<prefix>-00001-of-0000N.gguf`) are merged into one standalone GGUF
blob (the first part's KVs minus `split.*`, every part's tensors, data re-aligned), the way
llama.cpp's `gguf-split --merge` does. Each GGUF blob's key/values are cached once in
`metadata/` (registry.gguf), which is where `/api/tags` and `/api/show` read them from.
"""

from __future__ import annotations

import re
import struct
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

from registry import media_types as mt
from registry.digests import Digest
from registry.gguf import GGUFError, GGUFHeader, ensure_metadata, read_header
from registry.manifests import Descriptor, ModelConfig
from registry.store import BlobWriter, Store
from workflows.create.config_blob import human_number
from workflows.create.errors import CreateError
from workflows.create.write import CHUNK_BYTES, CancelSignal, Progress, check_cancel

MAX_SPLIT_PARTS = 1024
_SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def gguf_layers(files: Mapping[str, Digest], store: Store, progress: Progress,
                cancel: CancelSignal) -> tuple[list[Descriptor], ModelConfig]:
    """The model/adapter/projector layers for `files`, plus a config from the main model."""
    singles, splits = _group_splits(files)
    layers: list[tuple[Descriptor, GGUFHeader]] = []
    for rel, digest in singles:
        check_cancel(cancel)
        progress({"status": "parsing GGUF"})
        layers.append(_wrap(rel, digest, store))
        progress({"status": f"using existing layer {digest}"})
    for prefix, parts in splits.items():
        check_cancel(cancel)
        progress({"status": "merging split GGUF"})
        digest = merge_split(prefix, parts, store, cancel)
        layers.append(_wrap(f"{prefix}.gguf", digest, store))
        progress({"status": f"creating new layer {digest}"})
    models = [h for d, h in layers if d.media_type == mt.MODEL]
    if len(models) != 1:
        raise CreateError(f"expected exactly one GGUF model file, got {len(models)}")
    return [d for d, _ in layers], gguf_config(models[0], [h for _, h in layers])


def _wrap(rel: str, digest: Digest, store: Store) -> tuple[Descriptor, GGUFHeader]:
    try:
        header = read_header(store.blob_path(digest))
    except GGUFError as exc:
        raise CreateError(exc.message, rel) from exc
    media_type = _media_type(header)
    if media_type == mt.MODEL and "tokenizer.ggml.tokens" not in (*header.kv, *header.omitted):
        raise CreateError("GGUF model has no tokenizer (tokenizer.ggml.tokens); nothing can "
                          "run it", rel)
    ensure_metadata(store, digest)
    if media_type == mt.MODEL:
        _cache_tokenizer(store, digest)
    return Descriptor(media_type, digest, store.blob_size(digest)), header


def _cache_tokenizer(store: Store, digest: Digest) -> None:
    """The runner's tokenizer files for the model, built once here (runner/gguf_tokenizer.py);
    imported late: it needs the runner's libraries (MLX, tokenizers), which the server does not
    need to start, and where they are missing the runner builds the files at its first load."""
    try:
        from runner.gguf_tokenizer import ensure_cached
    except ImportError:
        return
    ensure_cached(store, digest)


def _media_type(header: GGUFHeader) -> str:
    kind = header.kv.get("general.type")
    if kind == "adapter":
        return mt.ADAPTER
    if kind in ("mmproj", "projector") or header.architecture == "clip":
        return mt.PROJECTOR
    return mt.MODEL


def gguf_config(model: GGUFHeader, headers: list[GGUFHeader]) -> ModelConfig:
    arch = model.architecture
    caps = ["completion"]
    template = model.kv.get("tokenizer.chat_template")
    if isinstance(template, str) and "tools" in template:
        caps.append("tools")
    if isinstance(template, str) and "<think>" in template:
        caps.append("thinking")
    projector = any(_media_type(h) == mt.PROJECTOR for h in headers)
    if projector or model.arch_value("vision.block_count"):
        caps.append("vision")
    context, embedding = model.arch_value("context_length"), model.arch_value("embedding_length")
    return ModelConfig(
        model_format="gguf",
        model_family=arch,
        model_families=[arch] if arch else None,
        model_type=human_number(model.parameter_count),
        file_type=model.file_type,
        capabilities=caps,
        context_length=context if isinstance(context, int) else None,
        embedding_length=embedding if isinstance(embedding, int) else None,
    )


def _group_splits(files: Mapping[str, Digest]
                  ) -> tuple[list[tuple[str, Digest]], dict[str, dict[int, tuple[str, Digest]]]]:
    singles: list[tuple[str, Digest]] = []
    splits: dict[str, dict[int, tuple[str, Digest]]] = defaultdict(dict)
    counts: dict[str, int] = {}
    for rel, digest in sorted(files.items()):
        match = _SPLIT_RE.match(Path(rel).name)
        if match is None or int(match["count"]) <= 1:
            singles.append((rel, digest))
            continue
        prefix = str(Path(rel).with_name(match["prefix"]))
        counts[prefix] = int(match["count"])
        splits[prefix][int(match["no"])] = (rel, digest)
    for prefix, parts in splits.items():
        if counts[prefix] > MAX_SPLIT_PARTS:
            raise CreateError(f"split GGUF {prefix} has {counts[prefix]} parts; the limit is "
                              f"{MAX_SPLIT_PARTS}")
        if sorted(parts) != list(range(1, counts[prefix] + 1)):
            raise CreateError(f"split GGUF {prefix} needs parts 1..{counts[prefix]}, got "
                              f"{sorted(parts)}")
    return singles, splits


def merge_split(prefix: str, parts: dict[int, tuple[str, Digest]], store: Store,
                cancel: CancelSignal) -> Digest:
    """Concatenate a split GGUF into one file blob; returns its digest."""
    paths = [store.blob_path(parts[i][1]) for i in sorted(parts)]
    try:
        headers = [read_header(p) for p in paths]
    except GGUFError as exc:
        raise CreateError(exc.message, prefix) from exc
    first = headers[0]
    keys = [k for k in first.spans if not k.startswith("split.")]
    bases, cursor = [], 0
    for path, header in zip(paths, headers, strict=True):
        bases.append(cursor)
        data = path.stat().st_size - header.data_offset
        cursor += -(-data // first.alignment) * first.alignment
    with store.blob_writer() as writer:
        count = sum(len(h.tensors) for h in headers)
        writer.write(b"GGUF" + struct.pack("<IQQ", first.version, count, len(keys)))
        with open(paths[0], "rb") as fh:
            for key in keys:
                start, end = first.spans[key]
                fh.seek(start)
                writer.write(fh.read(end - start))
        infos = _tensor_infos(headers, bases)
        writer.write(infos)
        written = 24 + sum(e - s for s, e in (first.spans[k] for k in keys)) + len(infos)
        writer.write(b"\0" * (-written % first.alignment))
        for path, header in zip(paths, headers, strict=True):
            _copy_data(path, header.data_offset, writer, first.alignment, cancel)
        return writer.commit()


def _tensor_infos(headers: list[GGUFHeader], bases: list[int]) -> bytes:
    out = bytearray()
    for header, base in zip(headers, bases, strict=True):
        for t in header.tensors:
            name = t.name.encode()
            out += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(t.shape))
            out += b"".join(struct.pack("<Q", d) for d in t.shape)
            out += struct.pack("<IQ", t.ggml_type, base + t.offset)
    return bytes(out)


def _copy_data(path: Path, data_offset: int, writer: BlobWriter, alignment: int,
               cancel: CancelSignal) -> None:
    """One part's data section, padded to the alignment so the next part's offsets hold."""
    size = path.stat().st_size - data_offset
    with open(path, "rb") as fh:
        fh.seek(data_offset)
        while chunk := fh.read(CHUNK_BYTES):
            check_cancel(cancel)
            writer.write(chunk)
    writer.write(b"\0" * (-size % alignment))
