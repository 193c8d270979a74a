"""Media types: OCI, Docker and Ollama's model layer types."""

from __future__ import annotations

# manifests
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"

IMAGE_MANIFESTS = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
INDEX_MANIFESTS = frozenset({OCI_INDEX, DOCKER_MANIFEST_LIST})
MANIFESTS = IMAGE_MANIFESTS | INDEX_MANIFESTS

# configs
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_EMPTY = "application/vnd.oci.empty.v1+json"

# generic layers
OCI_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_TAR_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
DOCKER_LAYER_TAR_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"

# Ollama model layers (reference 1.3)
OLLAMA_PREFIX = "application/vnd.ollama.image."
MODEL = OLLAMA_PREFIX + "model"
DRAFT = OLLAMA_PREFIX + "draft"
ADAPTER = OLLAMA_PREFIX + "adapter"
PROJECTOR = OLLAMA_PREFIX + "projector"
TEMPLATE = OLLAMA_PREFIX + "template"
PROMPT = OLLAMA_PREFIX + "prompt"  # legacy name for TEMPLATE
SYSTEM = OLLAMA_PREFIX + "system"
PARAMS = OLLAMA_PREFIX + "params"
MESSAGES = OLLAMA_PREFIX + "messages"
LICENSE = OLLAMA_PREFIX + "license"
EMBED = OLLAMA_PREFIX + "embed"  # deprecated
TENSOR = OLLAMA_PREFIX + "tensor"
JSON = OLLAMA_PREFIX + "json"

# What a client sends as Accept when it fetches a manifest it may not know the type of.
MANIFEST_ACCEPT = ", ".join(
    [DOCKER_MANIFEST, OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST_LIST]
)


def is_manifest(media_type: str) -> bool:
    return media_type in MANIFESTS


def is_index(media_type: str) -> bool:
    return media_type in INDEX_MANIFESTS
