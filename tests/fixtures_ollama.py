"""Models dirs built by hand, byte for byte as Ollama writes them (reference 1.2-1.4).

Nothing here uses ferry's store: blobs are `blobs/sha256-<hex>` (mode 0644), manifests are
`manifests/<host>/<ns>/<model>/<tag>` holding Go `json.Encoder` output (compact, trailing
newline), and the config blob carries the fields Ollama's create writes. So a test that lists,
shows or deletes these models proves ferry reads a real Ollama store, not its own output.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
OLLAMA = "application/vnd.ollama.image."

TEMPLATE = "{{ if .System }}<|system|>{{ .System }}{{ end }}<|user|>{{ .Prompt }}<|assistant|>"
TOOLS_TEMPLATE = "{{ if .Tools }}tools: {{ .Tools }}{{ end }}{{ .Prompt }}"


def go_json(obj: Any) -> bytes:
    """What Go's json.Encoder writes: compact, HTML-safe escapes aside, plus a newline."""
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def fake_gguf(tag: bytes = b"") -> bytes:
    """Bytes that start like a GGUF file (magic, version 3, zero tensors and keys)."""
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 0) + tag


@dataclass
class OllamaModelsDir:
    """Writes blobs and manifests into `root` the way Ollama does."""

    root: Path
    written: dict[str, Path] = field(default_factory=dict)

    def blob(self, data: bytes) -> dict[str, Any]:
        """Write a blob; return its descriptor fields (digest, size)."""
        hexdigest = hashlib.sha256(data).hexdigest()
        path = self.root / "blobs" / f"sha256-{hexdigest}"
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        path.write_bytes(data)
        os.chmod(path, 0o644)
        return {"digest": f"sha256:{hexdigest}", "size": len(data)}

    def layer(self, kind: str, data: bytes, **extra: Any) -> dict[str, Any]:
        return {"mediaType": OLLAMA + kind, **self.blob(data), **extra}

    def manifest(self, name: str, config: dict[str, Any], layers: list[dict[str, Any]],
                 host: str = "registry.ollama.ai", namespace: str = "library") -> bytes:
        """Write the manifest for `model:tag` under host/namespace; return its bytes."""
        model, _, tag = name.partition(":")
        cfg = {"mediaType": DOCKER_CONFIG, **self.blob(go_json(config))}
        raw = go_json({"schemaVersion": 2, "mediaType": DOCKER_MANIFEST, "config": cfg,
                       "layers": layers})
        path = self.root / "manifests" / host / namespace / model / (tag or "latest")
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        path.write_bytes(raw)
        os.chmod(path, 0o644)
        self.written[name] = path
        return raw

    def gguf_model(self, name: str, weights: bytes | None = None, template: str = TEMPLATE,
                   params: dict[str, Any] | None = None, license_text: str = "MIT License",
                   system: str = "", host: str = "registry.ollama.ai",
                   namespace: str = "library") -> bytes:
        """A GGUF model as `ollama pull` leaves it: model, template, license, params layers."""
        weights = fake_gguf() if weights is None else weights
        layers = [self.layer("model", weights)]
        if template:
            layers.append(self.layer("template", template.encode()))
        if system:
            layers.append(self.layer("system", system.encode()))
        if license_text:
            layers.append(self.layer("license", license_text.encode()))
        if params is not None:
            layers.append(self.layer("params", json.dumps(params).encode()))
        model_blob = layers[0]["digest"]
        config = {
            "model_format": "gguf", "model_family": "llama", "model_families": ["llama"],
            "model_type": "8.0B", "file_type": "Q4_0", "architecture": "amd64", "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": [model_blob]},
        }
        return self.manifest(name, config, layers, host=host, namespace=namespace)

    def tensor_model(self, name: str, namespace: str = "library") -> bytes:
        """An MLX model as create writes it: one dense and one int4-packed tensor blob."""
        dense = safetensors_blob({"model.embed_tokens.weight": ("BF16", [64, 16])})
        packed = safetensors_blob(
            {"model.layers.0.mlp.up_proj.weight": ("U32", [32, 8]),
             "model.layers.0.mlp.up_proj.weight.scale": ("BF16", [32, 1]),
             "model.layers.0.mlp.up_proj.weight.bias": ("BF16", [32, 1])},
            metadata={"quant_type": "int4", "group_size": "64"},
        )
        config_json = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                       "hidden_size": 16, "num_hidden_layers": 1,
                       "max_position_embeddings": 256, "vocab_size": 64,
                       "num_attention_heads": 2}
        layers = [
            self.layer("tensor", dense, name="model.embed_tokens.weight"),
            self.layer("tensor", packed, name="model.layers.0.mlp.up_proj.weight"),
            self.layer("json", json.dumps(config_json).encode(), name="config.json"),
        ]
        config = {"model_format": "safetensors", "file_type": "int4", "requires": "0.19.0",
                  "capabilities": ["completion", "thinking"], "renderer": "qwen3-coder",
                  "parser": "qwen3"}
        return self.manifest(name, config, layers, namespace=namespace)

    def gguf_metadata(self, weights_digest: str, kv: dict[str, Any],
                      omitted: list[str] | None = None) -> Path:
        """The per-blob metadata file of reference 2.8 for a model blob."""
        path = self.root / "metadata" / f"{weights_digest.replace(':', '-')}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"ollama_version": "0.12.0", "kv": kv, "omitted": omitted or []}
        path.write_text(json.dumps(doc))
        return path


def safetensors_blob(tensors: dict[str, tuple[str, list[int]]],
                     metadata: dict[str, str] | None = None) -> bytes:
    """A standalone safetensors file with zeroed data for `{name: (dtype, shape)}`."""
    sizes = {"BF16": 2, "F16": 2, "F32": 4, "U32": 4, "U8": 1}
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * sizes[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(offset)
