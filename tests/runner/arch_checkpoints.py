"""Tiny random-weight checkpoints for the architectures the fixture script does not write
(qwen2, mistral, gemma3 text and multimodal, qwen3_moe; llama at other sizes): config.json,
model.safetensors (float32) and the tokenizer files of the fixture's tiny llama, so mlx-lm and
ferry load the very same files."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from runner.models import model_module

_BASE = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
         "max_position_embeddings": 2048, "bos_token_id": 0, "eos_token_id": 1,
         "hidden_act": "silu", "torch_dtype": "float32"}
CONFIGS = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "head_dim": 32, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
                "sliding_window": None, "tie_word_embeddings": False},
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
               "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
               "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 32,
               "sliding_window": 8, "sliding_window_pattern": 2, "num_hidden_layers": 4,
               "hidden_activation": "gelu_pytorch_tanh"},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                  "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                  "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                  "tie_word_embeddings": False},
}
# Gemma3ForConditionalGeneration: the same text model nested in text_config, plus a vision part
CONFIGS["gemma3_mm"] = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "vocab_size": 2048, "mm_tokens_per_image": 4, "image_token_index": 2047,
    "vision_config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                      "num_attention_heads": 2, "image_size": 16, "patch_size": 4,
                      "model_type": "siglip_vision_model"},
    "text_config": {**_BASE, **CONFIGS["gemma3"], "model_type": "gemma3_text"},
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
# the runner module that serves each fixture (gemma3's config says model_type gemma3_text)
RUNNER_TYPE = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral", "gemma3": "gemma3_text",
               "qwen3_moe": "qwen3_moe", "gemma3_mm": "gemma3"}


def config_for(arch: str, **changes) -> dict:
    if "text_config" in CONFIGS[arch]:
        return {**CONFIGS[arch], **changes}
    return {**_BASE, **CONFIGS[arch], **changes}


def write_checkpoint(out: Path, arch: str, tokenizer_from: Path, **changes) -> Path:
    """The checkpoint dir for `arch`; every tensor its runner module's `tensor_shapes` lists."""
    out.mkdir(parents=True, exist_ok=True)
    config = config_for(arch, **changes)
    module = model_module(RUNNER_TYPE[arch])
    shapes = module.tensor_shapes(module.ModelArgs.from_dict(config))
    tensors = {name: _random(name, shape, arch) for name, shape in shapes.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    for name in _TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, out / name)
    return out


def _random(name: str, shape: tuple[int, ...], arch: str) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if name.endswith("norm.weight"):  # gemma's norms scale by (1 + w): centre them on 0
        centre = 0.0 if arch.startswith("gemma3") else 1.0
        return (centre + rng.standard_normal(shape) * 0.1).astype(np.float32)
    return (rng.standard_normal(shape) * 0.02).astype(np.float32)
