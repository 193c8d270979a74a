"""Manifests, descriptors and the model config blob.

A `Manifest` keeps the exact bytes it was parsed from (`raw`): the digest of a manifest is the
digest of those bytes, and ferry always stores and serves them unchanged. Parsing is strict:
schemaVersion 2, a known manifest media type, valid digests, non-negative integer sizes, and a
size limit, each failure an InvalidManifest that says which field is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from registry import bounded_json
from registry import media_types as mt
from registry.digests import Digest
from registry.errors import InvalidDigest, InvalidManifest, TooLarge

# The default manifest size limit (registry service, pull, FERRY_REGISTRY_MAX_MANIFEST_BYTES).
MAX_MANIFEST_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class Descriptor:
    """A content reference: an Ollama layer, an OCI descriptor or an index entry."""

    media_type: str
    digest: Digest
    size: int
    name: str | None = None  # Ollama tensor/json layers: path-style name
    from_: str | None = None  # Ollama: source model for a cross-repository mount
    annotations: dict[str, str] | None = None
    artifact_type: str | None = None
    platform: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Descriptor:
        if not isinstance(data, dict):
            raise InvalidManifest(f"{where} must be an object")
        media_type = data.get("mediaType")
        if not isinstance(media_type, str) or not media_type:
            raise InvalidManifest(f"{where}.mediaType must be a non-empty string")
        try:
            digest = Digest.parse(data.get("digest"))  # type: ignore[arg-type]
        except InvalidDigest as exc:
            raise InvalidManifest(f"{where}.digest: {exc.message}") from exc
        size = data.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidManifest(f"{where}.size must be a non-negative integer")
        known = {"mediaType", "digest", "size", "name", "from", "annotations", "artifactType",
                 "platform"}
        return cls(
            media_type=media_type,
            digest=digest,
            size=size,
            name=_optional_str(data, "name", where),
            from_=_optional_str(data, "from", where),
            annotations=_optional_annotations(data, where),
            artifact_type=_optional_str(data, "artifactType", where),
            platform=data.get("platform") if isinstance(data.get("platform"), dict) else None,
            extra={k: v for k, v in data.items() if k not in known},
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mediaType": self.media_type, "digest": str(self.digest),
                               "size": self.size}
        if self.name is not None:
            out["name"] = self.name
        if self.from_ is not None:
            out["from"] = self.from_
        if self.annotations is not None:
            out["annotations"] = self.annotations
        if self.artifact_type is not None:
            out["artifactType"] = self.artifact_type
        if self.platform is not None:
            out["platform"] = self.platform
        out.update(self.extra)
        return out


def _optional_str(data: dict[str, Any], key: str, where: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidManifest(f"{where}.{key} must be a string")
    return value


def _optional_annotations(data: dict[str, Any], where: str) -> dict[str, str] | None:
    value = data.get("annotations")
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise InvalidManifest(f"{where}.annotations must map strings to strings")
    return value


@dataclass(frozen=True)
class Manifest:
    """An image manifest (config + layers) or an index (manifests), with its exact bytes."""

    media_type: str
    raw: bytes
    config: Descriptor | None = None
    layers: tuple[Descriptor, ...] = ()
    manifests: tuple[Descriptor, ...] = ()
    subject: Descriptor | None = None
    artifact_type: str | None = None
    annotations: dict[str, str] | None = None

    @property
    def digest(self) -> Digest:
        return Digest.of(self.raw)

    @property
    def is_index(self) -> bool:
        return mt.is_index(self.media_type)

    def references(self) -> list[Descriptor]:
        """Every descriptor this manifest needs present: config, layers, child manifests."""
        refs: list[Descriptor] = []
        if self.config is not None:
            refs.append(self.config)
        refs.extend(self.layers)
        refs.extend(self.manifests)
        return refs

    def blob_digests(self) -> set[Digest]:
        """Digests of blobs (config and layers, not child manifests) this manifest uses."""
        found = {d.digest for d in self.layers}
        if self.config is not None:
            found.add(self.config.digest)
        return found

    @property
    def total_size(self) -> int:
        """Layers plus config, as Ollama reports a model's size."""
        return sum(d.size for d in self.layers) + (self.config.size if self.config else 0)

    def layers_of(self, media_type: str) -> list[Descriptor]:
        return [d for d in self.layers if d.media_type == media_type]


def parse_manifest(
    raw: bytes, content_type: str | None = None, max_bytes: int = MAX_MANIFEST_BYTES
) -> Manifest:
    """Parse and validate manifest bytes; `content_type` is the HTTP header, if any."""
    if len(raw) > max_bytes:
        raise TooLarge("manifest", max_bytes, len(raw))
    try:
        data = bounded_json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, bounded_json.JSONLimitError) as exc:
        raise InvalidManifest(f"not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidManifest("the top level must be a JSON object")
    version = data.get("schemaVersion")
    if version != 2 or isinstance(version, bool):
        raise InvalidManifest(f"schemaVersion must be 2, got {version!r}")
    media_type = _manifest_media_type(data, content_type)
    subject = data.get("subject")
    common: dict[str, Any] = {
        "media_type": media_type,
        "raw": bytes(raw),
        "subject": Descriptor.from_dict(subject, "subject") if subject is not None else None,
        "artifact_type": _optional_str(data, "artifactType", "manifest"),
        "annotations": _optional_annotations(data, "manifest"),
    }
    if mt.is_index(media_type):
        children = data.get("manifests")
        if not isinstance(children, list):
            raise InvalidManifest("manifests must be a list")
        descs = tuple(Descriptor.from_dict(c, f"manifests[{i}]") for i, c in enumerate(children))
        return Manifest(manifests=descs, **common)
    if "config" not in data:
        raise InvalidManifest("config is required")
    layers = data.get("layers", [])
    if not isinstance(layers, list):
        raise InvalidManifest("layers must be a list")
    return Manifest(
        config=Descriptor.from_dict(data["config"], "config"),
        layers=tuple(Descriptor.from_dict(x, f"layers[{i}]") for i, x in enumerate(layers)),
        **common,
    )


def _manifest_media_type(data: dict[str, Any], content_type: str | None) -> str:
    declared = data.get("mediaType")
    header = (content_type or "").split(";")[0].strip() or None
    if declared is not None and not isinstance(declared, str):
        raise InvalidManifest("mediaType must be a string")
    if declared and header and mt.is_manifest(header) and header != declared:
        raise InvalidManifest(f"Content-Type {header!r} does not match mediaType {declared!r}")
    media_type = declared or (header if header and mt.is_manifest(header) else None)
    if media_type is None:
        # OCI allows omitting mediaType; infer from the shape.
        media_type = mt.OCI_INDEX if "manifests" in data else mt.OCI_MANIFEST
    if not mt.is_manifest(media_type):
        raise InvalidManifest(f"unsupported manifest media type {media_type!r}")
    return media_type


def build_manifest(config: Descriptor, layers: list[Descriptor]) -> bytes:
    """Serialize an Ollama model manifest (Docker v2), as Ollama's create writes it."""
    doc = {
        "schemaVersion": 2,
        "mediaType": mt.DOCKER_MANIFEST,
        "config": config.to_dict(),
        "layers": [layer.to_dict() for layer in layers],
    }
    return (json.dumps(doc, separators=(",", ":")) + "\n").encode()


@dataclass
class ModelConfig:
    """The config blob of an Ollama model manifest; unknown keys survive a round trip."""

    model_format: str = ""
    model_family: str = ""
    model_families: list[str] | None = None
    model_type: str = ""
    file_type: str = ""
    renderer: str = ""
    parser: str = ""
    requires: str = ""
    capabilities: list[str] | None = None
    draft: dict[str, Any] | None = None
    architecture: str = ""
    os: str = ""
    context_length: int | None = None
    embedding_length: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    _FIELDS = ("model_format", "model_family", "model_families", "model_type", "file_type",
               "renderer", "parser", "requires", "capabilities", "draft", "architecture", "os",
               "context_length", "embedding_length")

    @classmethod
    def from_json(cls, raw: bytes) -> ModelConfig:
        try:
            data = json.loads(raw or b"{}")
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidManifest(f"config blob is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise InvalidManifest("config blob must be a JSON object")
        known = {k: data[k] for k in cls._FIELDS if k in data and data[k] is not None}
        extra = {k: v for k, v in data.items() if k not in cls._FIELDS}
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in self._FIELDS:
            value = getattr(self, key)
            if value not in (None, "", [], {}):
                out[key] = value
        out.update(self.extra)
        return out

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":")).encode()
