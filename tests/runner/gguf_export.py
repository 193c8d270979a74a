"""Export a fixture checkpoint dir to GGUF the way llama.cpp's convert_hf_to_gguf.py does, with
the `gguf` package (the reference writer): llama.cpp tensor names, llama's Q/K row permutation,
1-D tensors kept F32, the tokenizer as `tokenizer.ggml.*` metadata. Written independently of
runner/gguf_load.py, so a test that round-trips through both checks one against the other."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T

from tests.runner.kquants import quantize_q4_k, quantize_q6_k

# HF module path under model.layers.N -> llama.cpp block tensor name.
_BLOCK = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
}
_EXPERT_RE = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")
_GEMMA3_BLOCK = {**_BLOCK, "post_attention_layernorm": "post_attention_norm",
                 "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_PERMUTED = {"llama"}  # architectures whose Q/K rows llama.cpp permutes
_FILE_TYPES = {"F16": 1, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "F32": 0, "Q4_K": 15, "BF16": 32}
_K_QUANTS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


def gguf_name(name: str, arch: str = "llama") -> str:
    stem, _, kind = name.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{kind}"
    match = re.match(r"^model\.layers\.(\d+)\.(.+)$", stem)
    assert match, name
    names = _GEMMA3_BLOCK if arch == "gemma3" else _BLOCK
    return f"blk.{match[1]}.{names[match[2]]}.{kind}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def export_gguf(checkpoint: Path, out: Path, qtype: str = "F16", pre: str = "gpt-2",
                tokenizer_json: str | None = None, tokenizer: bool = True,
                metadata: dict | None = None) -> Path:
    """`metadata` overrides config.json values in the written metadata only (bad files)."""
    config = json.loads((checkpoint / "config.json").read_text())
    # llama.cpp's architecture names; Mistral (v0.x) GGUFs say llama, and are permuted alike
    arch = {"gemma3_text": "gemma3", "gemma3": "gemma3", "qwen3_moe": "qwen3moe",
            "mistral": "llama"}.get(config["model_type"], config["model_type"])
    writer = gguf.GGUFWriter(out, arch)
    _write_config(writer, {**config, **(metadata or {})}, qtype)
    if tokenizer:
        _write_tokenizer(writer, checkpoint, pre, tokenizer_json)
    if (config.get("rope_scaling") or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config))
    for name, array in _tensors(checkpoint).items():
        if arch in _PERMUTED and ".q_proj." in name:
            array = permute(array, config["num_attention_heads"])
        elif arch in _PERMUTED and ".k_proj." in name:
            array = permute(array, config["num_key_value_heads"])
        if arch == "gemma3" and name.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp's Gemma3Model stores norm gains as 1 + w
        _add_tensor(writer, gguf_name(name, arch), array, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def llama3_rope_factors(config: dict) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors: Llama 3 scaling as per-pair factors."""
    scaling = config["rope_scaling"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    freqs = 1.0 / (config["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _tensors(checkpoint: Path) -> dict[str, np.ndarray]:
    """Every tensor, per-expert ones stacked into `<group>.<proj>.weight` as llama.cpp does."""
    arrays: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, np.ndarray]] = {}
    for path in sorted(checkpoint.glob("*.safetensors")):
        for name, value in mx.load(str(path)).items():
            array = np.array(value.astype(mx.float32))
            match = _EXPERT_RE.match(name)
            if match:
                experts.setdefault(f"{match[1]}.{match[3]}.weight", {})[int(match[2])] = array
            else:
                arrays[name] = array
    for name, parts in experts.items():
        arrays[name] = np.stack([parts[i] for i in sorted(parts)])
    return arrays


def _add_tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray, qtype: str) -> None:
    if array.ndim == 1 or qtype == "F32":
        writer.add_tensor(name, array.astype(np.float32))
    elif qtype == "F16":
        writer.add_tensor(name, array.astype(np.float16))
    else:
        kind = _k_quant_type(name, array, qtype)
        rows = array.reshape(-1, array.shape[-1])
        data = (_K_QUANTS[kind.name](rows) if kind.name in _K_QUANTS
                else gguf.quants.quantize(rows, kind))
        data = data.reshape(*array.shape[:-1], -1)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)


def _k_quant_type(name: str, array: np.ndarray, qtype: str) -> T:
    """Q4_K "M"-style: Q6_K for the output and ffn_down, Q4_K elsewhere; Q8_0 for rows that are
    not whole 256-blocks (as llama.cpp falls back)."""
    if qtype != "Q4_K":
        return getattr(T, qtype)
    if array.shape[-1] % 256:
        return T.Q8_0
    return T.Q6_K if name.startswith("output.") or "ffn_down" in name else T.Q4_K


def _write_config(writer: gguf.GGUFWriter, config: dict, qtype: str) -> None:
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_file_type(_FILE_TYPES[qtype])
    if "num_experts" in config:  # qwen3_moe
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if "sliding_window_pattern" in config:  # gemma3
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern(config["sliding_window_pattern"])


def _write_tokenizer(writer: gguf.GGUFWriter, checkpoint: Path, pre: str,
                     tokenizer_json: str | None) -> None:
    data = json.loads(tokenizer_json or (checkpoint / "tokenizer.json").read_text())
    tok_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    vocab = dict(data["model"]["vocab"])
    for added in data["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in data["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab[tok_config["bos_token"]])
    writer.add_eos_token_id(vocab[tok_config["eos_token"]])
    writer.add_eot_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok_config["chat_template"])
