"""Random-weight Nemotron-H checkpoints, written by hand: config.json, one bf16 safetensors file
in the Hugging Face layout (the shapes runner.models.nemotron_h.expected_shapes names), and the
tokenizer files of the tiny llama fixture (same 2048-token vocabulary).

`mtp=` adds a multi-token-prediction head (`mtp.*`, attention + MoE, MTP_CONFIG): "random"
weights like the rest, or "echo": its eh_proj passes the target's hidden state through (and
drops the token embedding), so the head predicts again the token the target just predicted.
A random head's proposals are almost never right; the echo head's are right exactly where the
target repeats a token, so a test sees both acceptances and rejections."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np

from runner.models._nemotron_h_mtp import tensor_shapes as mtp_shapes
from runner.models.nemotron_h import expected_shapes

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "n_groups": 2,
    "ssm_state_size": 16,
    "conv_kernel": 4,
    "hybrid_override_pattern": "M*M-M*-",
    "num_hidden_layers": 7,
    "vocab_size": 2048,
    "layer_norm_epsilon": 1e-5,
    "attention_bias": False,
    "mlp_bias": False,
    "mamba_proj_bias": False,
    "use_bias": False,
    "use_conv_bias": True,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 4,
    "torch_dtype": "bfloat16",
}


MTP_CONFIG: dict[str, Any] = {
    "num_nextn_predict_layers": 1,
    "mtp_hybrid_override_pattern": "*E",
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 96,
    "n_shared_experts": 1,
    "n_group": 2,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
}


def mtp_tensors(config: dict[str, Any], kind: str, rng: np.random.Generator,
                prefix: str = "") -> dict[str, np.ndarray]:
    """The head's tensors for `config` (which holds MTP_CONFIG): "random" or "echo"."""
    tensors = {prefix + name: _values(name, shape, rng)
               for name, shape in mtp_shapes(config).items()}
    if kind == "echo":
        hidden = config["hidden_size"]
        tensors[prefix + "mtp.layers.0.eh_proj.weight"] = np.concatenate(
            [np.zeros((hidden, hidden)), np.eye(hidden)], axis=1)
    return tensors


def _values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Magnitudes that make every part matter: norm gains near 1, decays spread over a range,
    time steps between 0.01 and 0.1, a conv strong enough to mix neighbours."""
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape))
    if name.endswith("dt_bias"):
        dt = rng.uniform(0.01, 0.1, shape)
        return dt + np.log(-np.expm1(-dt))  # inverse softplus
    if name.endswith(".D") or name.endswith("norm.weight") or name.endswith("norm_f.weight"):
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if "conv1d" in name:
        return 0.3 * rng.standard_normal(shape)
    return 0.02 * rng.standard_normal(shape)


def write_safetensors_bf16(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        bits = (array.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        blobs.append(bits.tobytes())
        header[name] = {"dtype": "BF16", "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(blobs[-1])]}
        offset += len(blobs[-1])
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def write_nemotron_checkpoint(out: Path, tokenizer_dir: Path, seed: int = 0,
                              mtp: str | None = None, embed_scale: float = 1.0,
                              **overrides: Any) -> Path:
    config = {**TINY_CONFIG, **(MTP_CONFIG if mtp else {}), **overrides}
    config["num_hidden_layers"] = len(config["hybrid_override_pattern"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)
    tensors = {name: _values(name, shape, rng) for name, shape in expected_shapes(config).items()}
    tensors["backbone.embeddings.weight"] *= embed_scale
    if mtp:
        tensors.update(mtp_tensors(config, mtp, rng))
    write_safetensors_bf16(out / "model.safetensors", tensors)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)
    return out
