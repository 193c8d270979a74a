"""The bodies of `/api/tags` entries and `/api/show`, built from the local store (reference 4.5).

List stays cheap (manifest, config blob, GGUF metadata file); show also reads the small text
layers, `config.json` and, for tensor models, the safetensors headers of every tensor layer.
A manifest whose blobs are missing cannot be shown: the error names the missing digest.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from registry import media_types as mt
from registry.errors import InvalidManifest, NotFound, TooLarge
from registry.manifests import Descriptor, Manifest, ModelConfig
from registry.model_info import GGUFKV, human_number, tensor_model_info
from registry.modelfile import ModelfileParts, parameters_text, render_modelfile
from registry.names import Name
from registry.safetensors_header import TensorInfo, logical_tensors, read_header
from registry.store import ModelEntry, Store

log = logging.getLogger("ferry.api")

MAX_TEXT_LAYER_BYTES = 64 * 1024 * 1024


class IncompleteModel(NotFound):
    """The manifest is there but a blob it needs is not (a 404 that names the blob)."""


@dataclass
class StoredModel:
    """A model's manifest and config blob, read once for one request."""

    entry: ModelEntry
    manifest: Manifest
    config: ModelConfig

    @classmethod
    def load(cls, store: Store, entry: ModelEntry) -> StoredModel:
        manifest = entry.manifest()
        if manifest.config is None:
            raise InvalidManifest("an image index is not a model; it has no config")
        config = ModelConfig.from_json(read_blob_limited(store, manifest.config))
        return cls(entry, manifest, config)

    @property
    def weights(self) -> Descriptor | None:
        found = self.manifest.layers_of(mt.MODEL)
        return found[0] if found else None

    def gguf(self, store: Store) -> GGUFKV | None:
        weights = self.weights
        return GGUFKV.from_metadata(store.read_metadata(weights.digest)) if weights else None


def read_blob_limited(store: Store, layer: Descriptor) -> bytes:
    """A small layer's bytes; missing blobs and oversized layers raise errors that name them."""
    if layer.size > MAX_TEXT_LAYER_BYTES:
        raise TooLarge(f"layer {layer.digest} ({layer.media_type})", MAX_TEXT_LAYER_BYTES,
                       layer.size)
    try:
        return store.read_blob(layer.digest)
    except NotFound as exc:
        raise IncompleteModel(f"model is incomplete: blob {layer.digest} ({layer.media_type}) is "
                       "missing from the store; pull or create it again") from exc


def _text(store: Store, layer: Descriptor) -> str:
    return read_blob_limited(store, layer).decode("utf-8", errors="replace")


def _json_layer(store: Store, layer: Descriptor, expect: type) -> Any:
    try:
        value = json.loads(read_blob_limited(store, layer))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidManifest(f"layer {layer.digest} ({layer.media_type}) is not JSON") from exc
    if not isinstance(value, expect):
        raise InvalidManifest(f"layer {layer.digest} ({layer.media_type}) must be a JSON "
                              f"{expect.__name__}")
    return value


def iso_time(timestamp: float) -> str:
    """A local time with its offset, like Go's RFC 3339 rendering of a file's mtime."""
    return datetime.fromtimestamp(timestamp).astimezone().isoformat()


def details(model: StoredModel, kv: GGUFKV | None) -> dict[str, Any]:
    """`details`: config blob values first, the GGUF metadata where the config is silent."""
    cfg = model.config
    weights = model.weights
    out: dict[str, Any] = {
        "parent_model": (weights.from_ or "") if weights else "",
        "format": cfg.model_format or ("gguf" if weights else ""),
        "family": cfg.model_family or (kv.architecture if kv else ""),
        "families": cfg.model_families,
        "parameter_size": cfg.model_type or (kv.parameter_size if kv else ""),
        "quantization_level": cfg.file_type or (kv.file_type if kv else ""),
    }
    context = cfg.context_length or (kv.get_int("context_length") if kv else None)
    embedding = cfg.embedding_length or (kv.get_int("embedding_length") if kv else None)
    if context:
        out["context_length"] = context
    if embedding:
        out["embedding_length"] = embedding
    return out


def template_capabilities(template: str) -> list[str]:
    """What a Modelfile TEMPLATE can render: tools, fill-in-the-middle, reasoning."""
    found = []
    if re.search(r"\.Tools\b", template):
        found.append("tools")
    if re.search(r"\.Suffix\b", template):
        found.append("insert")
    if "<think>" in template and "</think>" in template:
        found.append("thinking")
    return found


def capabilities(model: StoredModel, kv: GGUFKV | None, template: str) -> list[str]:
    """Ollama's Model.Capabilities: weights kind, config, then what the template uses."""
    found: list[str] = []
    if model.weights is not None:
        embeds = kv is not None and kv.get("pooling_type") is not None
        found.append("embedding" if embeds else "completion")
        if kv is not None and kv.get("vision.block_count") is not None:
            found.append("vision")
    found += model.config.capabilities or []
    found += template_capabilities(template)
    if model.manifest.layers_of(mt.PROJECTOR):
        found.append("vision")
    if not found:
        found.append("completion")
    return list(dict.fromkeys(found))


def tags_entry(store: Store, entry: ModelEntry) -> dict[str, Any] | None:
    """One `/api/tags` model, or None (logged) when its manifest or config is unusable."""
    try:
        model = StoredModel.load(store, entry)
    except (InvalidManifest, NotFound, TooLarge, ValueError) as exc:
        log.warning("skipping %s in the model list: %s", entry.name, exc)
        return None
    short = entry.name.display_shortest()
    kv = model.gguf(store)
    out: dict[str, Any] = {
        "name": short,
        "model": short,
        "modified_at": iso_time(entry.modified_at),
        "size": model.manifest.total_size,
        "digest": entry.digest.hex,
        "details": details(model, kv),
    }
    if model.config.capabilities:
        out["capabilities"] = model.config.capabilities
    return out


def list_tags(store: Store) -> list[dict[str, Any]]:
    """Every listable model, newest manifest first (Ollama sorts by mtime, stable)."""
    entries = sorted(store.list_models(), key=lambda e: -int(e.modified_at))
    return [item for item in (tags_entry(store, e) for e in entries) if item is not None]


def _tensors(store: Store, manifest: Manifest) -> list[TensorInfo]:
    tensors: list[TensorInfo] = []
    for layer in manifest.layers_of(mt.TENSOR):
        if not store.has_blob(layer.digest):
            raise IncompleteModel(f"model is incomplete: tensor blob {layer.digest} is missing")
        tensors += logical_tensors(read_header(store.blob_path(layer.digest)))
    return tensors


def _config_json(store: Store, manifest: Manifest) -> dict[str, Any]:
    for layer in manifest.layers_of(mt.JSON):
        if layer.name == "config.json":
            value: dict[str, Any] = _json_layer(store, layer, dict)
            return value
    return {}


def show_model(store: Store, name: Name, verbose: bool = False) -> dict[str, Any]:
    """The `/api/show` body for `name`; NotFound when there is no such model."""
    entry = store.get_model(name)
    model = StoredModel.load(store, entry)
    manifest = model.manifest
    kv = model.gguf(store)
    parts = _modelfile_parts(store, model, name)
    out: dict[str, Any] = {
        "license": "\n".join(parts.licenses),
        "modelfile": render_modelfile(parts),
        "parameters": parameters_text(parts.parameters),
        "template": parts.template,
        "system": parts.system,
        "renderer": model.config.renderer,
        "parser": model.config.parser,
        "details": details(model, kv),
        "messages": parts.messages,
        "model_info": kv.model_info(verbose) if kv else {},
        "capabilities": capabilities(model, kv, parts.template),
        "modified_at": iso_time(entry.modified_at),
        "requires": model.config.requires,
    }
    if manifest.layers_of(mt.TENSOR):
        tensors = _tensors(store, manifest)
        info = tensor_model_info(_config_json(store, manifest), tensors)
        out["model_info"] = info
        _fill_tensor_details(out["details"], info)
        if verbose:
            out["tensors"] = [t.to_dict() for t in tensors]
    return out


def _fill_tensor_details(details_out: dict[str, Any], info: dict[str, Any]) -> None:
    if not details_out["family"] and info["general.architecture"] != "unknown":
        details_out["family"] = info["general.architecture"]
    if not details_out["parameter_size"] and info["general.parameter_count"]:
        details_out["parameter_size"] = human_number(info["general.parameter_count"])
    if not details_out["format"]:
        details_out["format"] = "safetensors"


def _modelfile_parts(store: Store, model: StoredModel, name: Name) -> ModelfileParts:
    manifest = model.manifest
    weights = model.weights
    source = str(store.blob_path(weights.digest)) if weights else name.display_shortest()
    parts = ModelfileParts(
        source=source,
        short_name=name.display_shortest(),
        adapters=[str(store.blob_path(d.digest)) for d in manifest.layers_of(mt.ADAPTER)],
        projectors=[str(store.blob_path(d.digest)) for d in manifest.layers_of(mt.PROJECTOR)],
        renderer=model.config.renderer,
        parser=model.config.parser,
    )
    for layer in manifest.layers:
        if layer.media_type in (mt.TEMPLATE, mt.PROMPT):
            parts.template = _text(store, layer)
        elif layer.media_type == mt.SYSTEM:
            parts.system = _text(store, layer)
        elif layer.media_type == mt.LICENSE:
            parts.licenses.append(_text(store, layer))
        elif layer.media_type == mt.PARAMS:
            parts.parameters = _json_layer(store, layer, dict)
        elif layer.media_type == mt.MESSAGES:
            parts.messages = _json_layer(store, layer, list)
    return parts
