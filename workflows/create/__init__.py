"""Create: a safetensors checkpoint, GGUF files or an existing model -> a ferry model.

    source -> model layers and config -> Modelfile layers -> config blob -> manifest, written last

The source is one parameter of the one pipeline: a checkpoint dir (`Path`), a checkpoint uploaded
as blobs (`UploadedFiles`, staged into a temp dir here), `GGUFFiles` (wrapped unchanged) or a
`BaseModel` (FROM an existing model). A checkpoint goes: inventory (headers only) -> validate ->
plan (pure) -> write tensor blobs (quantized one tensor at a time) -> JSON layers.

`create()` is synchronous and meant for a worker thread; it takes the store, a progress callback
and a cancel signal (anything with `is_set()`), and checks the signal between tensors, so a
cancelled create stops within one tensor and publishes nothing. Blobs already written stay:
they are content-addressed, so a retry reuses them, and prune sweeps them if nothing does.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from registry import media_types as mt
from registry.digests import Digest
from registry.errors import NotFound
from registry.manifests import Descriptor, ModelConfig, build_manifest, parse_manifest
from registry.names import Name
from registry.store import Store
from registry.upload_sessions import Upload
from runner.quant import QuantType
from workflows.create.arrivals import Arrivals
from workflows.create.config_blob import apply_info, build_config, draft_block
from workflows.create.errors import CreateCancelled, CreateError
from workflows.create.gguf_import import gguf_layers
from workflows.create.inventory import Inventory, no_wait, take_inventory
from workflows.create.plan import plan_model
from workflows.create.stage import staged_dir
from workflows.create.validate import validate_checkpoint
from workflows.create.write import (
    CancelSignal,
    Progress,
    check_cancel,
    write_bytes_layer,
    write_file_layer,
    write_plan,
)

__all__ = ["BaseModel", "CreateCancelled", "CreateError", "CreateOptions", "GGUFFiles",
           "Source", "UploadedFiles", "create", "modelfile_layers"]

MODELFILE_TYPES = frozenset({mt.TEMPLATE, mt.PROMPT, mt.SYSTEM, mt.PARAMS, mt.MESSAGES,
                             mt.LICENSE})
GGUF_QUANTIZE = ("create-time quantization is only supported for safetensors imports; "
                 "quantize GGUF models with llama.cpp tools before importing")


@dataclass(frozen=True)
class UploadedFiles:
    """A safetensors checkpoint already in the store as blobs, by relative path (the API's
    `files`); create stages it as a directory and removes that afterwards. `pending` are files
    still being uploaded (sessions, `registry.upload_sessions`): read as they arrive, and verified
    before anything is published."""

    files: Mapping[str, Digest]
    pending: Mapping[str, Upload] = field(default_factory=dict)


@dataclass(frozen=True)
class GGUFFiles:
    """GGUF blobs in the store, by file name; wrapped as layers with their digests unchanged."""

    files: Mapping[str, Digest]


@dataclass(frozen=True)
class BaseModel:
    """FROM an existing model: its manifest bytes."""

    manifest: bytes


Source = Path | UploadedFiles | GGUFFiles | BaseModel


@dataclass(frozen=True)
class CreateOptions:
    """Everything about a create except where its files are; validated by the caller."""

    quantize: QuantType | None = None
    draft_quantize: QuantType | None = None
    draft_dir: Path | UploadedFiles | None = None  # DRAFT checkpoint, a dir or uploaded files
    template: str | None = None
    system: str | None = None
    license: tuple[str, ...] = ()
    parameters: dict[str, Any] | None = None
    messages: list[Any] | None = None
    requires: str | None = None
    noprune: bool = False
    info: dict[str, Any] | None = None  # validated `info` overrides of config fields


def create(name: Name, source: Source, options: CreateOptions, store: Store,
           progress: Progress, cancel: CancelSignal) -> Digest:
    """Build and publish the model `name`; returns the manifest digest."""
    if isinstance(source, GGUFFiles) and (options.quantize or options.draft_quantize):
        raise CreateError(GGUF_QUANTIZE)
    pending = source.pending if isinstance(source, UploadedFiles) else {}
    arrivals = Arrivals(pending, cancel) if pending else None
    try:
        return _create(name, source, options, store, progress, cancel, arrivals)
    finally:
        if arrivals is not None:  # after the manifest: the sources' fsync is off its path
            arrivals.release()


def _create(name: Name, source: Source, options: CreateOptions, store: Store,
            progress: Progress, cancel: CancelSignal, arrivals: Arrivals | None) -> Digest:
    with contextlib.ExitStack() as stack:
        draft_root = _local_dir(options.draft_dir, store, cancel, stack)
        draft = _inventory(draft_root, "draft/") if draft_root is not None else None
        layers, config = _source_layers(source, options, draft, store, progress, cancel, stack,
                                        arrivals)
        if draft is not None:
            layers += _import_draft(draft, options, store, progress, cancel)
    layers += modelfile_layers(options, store)
    apply_info(config, options.info or {})
    if arrivals is not None:  # every uploaded byte matched its digest before anything is named
        progress({"status": "verifying uploads"})
        arrivals.wait_verified()
    return publish(name, config, layers, store, progress, cancel, options.noprune)


def _local_dir(source: Path | UploadedFiles | None, store: Store, cancel: CancelSignal,
               stack: contextlib.ExitStack, arrivals: Arrivals | None = None) -> Path | None:
    if isinstance(source, UploadedFiles):
        root = stack.enter_context(staged_dir(store, source.files, cancel, source.pending))
        if arrivals is not None:
            arrivals.attach(root)
        return root
    return source


def _source_layers(source: Source, options: CreateOptions, draft: Inventory | None,
                   store: Store, progress: Progress, cancel: CancelSignal,
                   stack: contextlib.ExitStack, arrivals: Arrivals | None = None,
                   ) -> tuple[list[Descriptor], ModelConfig]:
    """The model's own layers and its config blob, whatever it is made from."""
    if isinstance(source, GGUFFiles):
        if draft is not None:
            raise CreateError("DRAFT needs a safetensors model; GGUF drafts are not supported")
        return gguf_layers(source.files, store, progress, cancel)
    if isinstance(source, BaseModel):
        if options.quantize is not None:
            raise CreateError("quantize needs files to import; an existing model is not "
                              "requantized")
        return _from_base(source.manifest, store, draft)
    root = _local_dir(source, store, cancel, stack, arrivals)
    assert root is not None
    inv = _inventory(root, "", arrivals)
    model_type = validate_checkpoint(inv)
    known = source.files if isinstance(source, UploadedFiles) else {}
    return _import_target(inv, model_type, options, draft, store, progress, cancel, arrivals,
                          known)


def _inventory(root: Path, where: str, arrivals: Arrivals | None = None) -> Inventory:
    inv = take_inventory(root, arrivals.wait if arrivals is not None else no_wait)
    if where:
        validate_checkpoint(inv, where)
    return inv


def _import_target(inv: Inventory, model_type: str, options: CreateOptions,
                   draft: Inventory | None, store: Store, progress: Progress,
                   cancel: CancelSignal, arrivals: Arrivals | None = None,
                   known: Mapping[str, Digest] | None = None,
                   ) -> tuple[list[Descriptor], ModelConfig]:
    plan = plan_model(inv, options.quantize)
    # The JSON files first: they are all there already (while the weights may still arrive),
    # so whatever they cost is not in the tail after the last tensor. The manifest's order is
    # kept.
    json_layers = _json_layers(inv, plan.json_files, store, cancel, known)
    progress({"status": f"importing {len(plan.blobs)} tensors"})
    layers = write_plan(plan, store, progress, cancel, arrivals)
    return layers + json_layers, build_config(inv, plan, model_type, options.requires, draft)


def _import_draft(draft: Inventory, options: CreateOptions, store: Store, progress: Progress,
                  cancel: CancelSignal) -> list[Descriptor]:
    quant = options.draft_quantize or options.quantize
    plan = plan_model(draft, quant, prefix="draft.", draft=True)
    progress({"status": f"importing {len(plan.blobs)} draft tensors"})
    layers = write_plan(plan, store, progress, cancel)
    return layers + _json_layers(draft, plan.json_files, store, cancel)


def _json_layers(inv: Inventory, files: tuple[tuple[str, str], ...], store: Store,
                 cancel: CancelSignal, known: Mapping[str, Digest] | None = None,
                 ) -> list[Descriptor]:
    """A layer per file. A file uploaded as a blob (`known`: path -> digest) is that blob
    already, verified and durable, and its staged copy is a link to it: named as it is, not
    hashed, written and fsynced again."""
    layers = []
    for name, rel in files:
        check_cancel(cancel)
        digest = (known or {}).get(rel)
        if digest is not None and store.has_blob(digest):
            layers.append(Descriptor(mt.JSON, digest, store.blob_size(digest), name=name))
        else:
            layers.append(write_file_layer(store, inv.root / rel, name, mt.JSON))
    return layers


def _from_base(raw: bytes, store: Store,
               draft: Inventory | None) -> tuple[list[Descriptor], ModelConfig]:
    """FROM an existing model: its layers (Modelfile ones replaced later) and config."""
    base = parse_manifest(raw)
    if base.config is None:
        raise CreateError("the base model's manifest has no config")
    config = ModelConfig.from_json(store.read_blob(base.config.digest))
    layers = [d for d in base.layers if d.media_type not in MODELFILE_TYPES]
    if draft is not None:
        if config.model_format != "safetensors":
            raise CreateError("DRAFT needs a safetensors base model")
        layers = [d for d in layers if not (d.name or "").startswith(("draft.", "draft/"))]
        config.draft = draft_block(draft)
    return layers, config


def modelfile_layers(options: CreateOptions, store: Store) -> list[Descriptor]:
    """TEMPLATE, SYSTEM, PARAMETER, LICENSE and MESSAGE as their own layers (reference 1.3)."""
    layers = []
    if options.template:
        layers.append(write_bytes_layer(store, options.template.encode(), mt.TEMPLATE))
    if options.system:
        layers.append(write_bytes_layer(store, options.system.encode(), mt.SYSTEM))
    if options.parameters:
        layers.append(write_bytes_layer(store, json.dumps(options.parameters).encode(),
                                        mt.PARAMS))
    for text in options.license:
        layers.append(write_bytes_layer(store, text.encode(), mt.LICENSE))
    if options.messages:
        layers.append(write_bytes_layer(store, json.dumps(options.messages).encode(),
                                        mt.MESSAGES))
    return layers


def publish(name: Name, config: ModelConfig, layers: list[Descriptor], store: Store,
            progress: Progress, cancel: CancelSignal, noprune: bool) -> Digest:
    """Write the config blob, then the manifest (last), then drop what the old one alone used."""
    check_cancel(cancel)
    config_desc = write_bytes_layer(store, config.to_json(), mt.DOCKER_CONFIG)
    raw = build_manifest(config_desc, layers)
    progress({"status": "writing manifest"})
    previous = _previous_manifest(store, name)
    check_cancel(cancel)
    digest = store.write_manifest(name, raw)
    if previous is not None and previous != raw and not noprune:
        progress({"status": "removing unused layers"})
        store.remove_unused_after_replace(previous)
    progress({"status": "success"})
    return digest


def _previous_manifest(store: Store, name: Name) -> bytes | None:
    try:
        return store.read_manifest(name)
    except NotFound:
        return None
