"""Random-weight embedding checkpoints (BERT, Nomic BERT, XLM-RoBERTa, Qwen3Model) and numpy
references of their published equations, for parity tests and bench/embed.py.

Each checkpoint dir is what Hugging Face ships: config.json, model.safetensors (float32), a
tokenizer.json built with the `tokenizers` library (WordPiece for the BERTs, a word-level
vocabulary with RoBERTa's or Qwen's special tokens for the others), tokenizer_config.json, and
optionally sentence-transformers' modules.json and 1_Pooling/config.json.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

_TEXT = ("the quick brown fox jumps over lazy dog a an is was on in at to of and or cat sat "
         "mat ferry boat river sea model text vector embed run fast slow hello world why how "
         "what who red green blue one two three four five six seven eight nine ten")
WORDS = _TEXT.split()
HIDDEN, LAYERS, HEADS, INNER = 32, 2, 4, 64
POOLING_KEYS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
                "last": "pooling_mode_lasttoken"}

ARCHS = {"bert": "BertModel", "nomic_bert": "NomicBertModel", "xlm_roberta": "XLMRobertaModel",
         "qwen3": "Qwen3Model"}


def _bert_tokenizer() -> Tokenizer:
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    return tok


def _roberta_tokenizer() -> Tokenizer:
    vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return tok


def _qwen_tokenizer() -> Tokenizer:
    vocab = {t: i for i, t in enumerate(["<unk>", *WORDS, "<|endoftext|>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    eos = len(vocab) - 1
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", eos)])
    return tok


TOKENIZERS = {"bert": (_bert_tokenizer, {"pad_token": "[PAD]"}),
              "nomic_bert": (_bert_tokenizer, {"pad_token": "[PAD]"}),
              "xlm_roberta": (_roberta_tokenizer, {"pad_token": "<pad>"}),
              "qwen3": (_qwen_tokenizer, {"pad_token": "<|endoftext|>"})}


def config_for(kind: str, vocab: int) -> dict[str, Any]:
    common = {"architectures": [ARCHS[kind]], "vocab_size": vocab}
    if kind == "nomic_bert":
        return {**common, "model_type": "nomic_bert", "n_embd": HIDDEN, "n_layer": LAYERS,
                "n_head": HEADS, "n_inner": INNER, "n_positions": 128, "type_vocab_size": 2,
                "layer_norm_epsilon": 1e-12, "rotary_emb_fraction": 1.0,
                "rotary_emb_base": 1000, "activation_function": "swiglu",
                "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False}
    if kind == "qwen3":
        return {**common, "model_type": "qwen3", "hidden_size": HIDDEN,
                "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
                "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": INNER,
                "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "tie_word_embeddings": True}
    base = {**common, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "intermediate_size": INNER, "hidden_act": "gelu"}
    if kind == "xlm_roberta":
        return {**base, "model_type": "xlm-roberta", "max_position_embeddings": 66,
                "type_vocab_size": 1, "layer_norm_eps": 1e-5, "pad_token_id": 1}
    return {**base, "model_type": "bert", "max_position_embeddings": 64, "type_vocab_size": 2,
            "layer_norm_eps": 1e-12, "pad_token_id": 0}


def random_weights(kind: str, config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Every tensor the architecture's `tensor_shapes` names, random (norm scales near 1)."""
    from workflows.create.validate import expected_shapes

    shapes = expected_shapes(config)
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        scale = 0.02 if name.endswith("bias") else 0.2
        value = rng.standard_normal(shape).astype(np.float32) * scale
        if len(shape) == 1 and ("norm" in name.lower() or "ln" in name) and "bias" not in name:
            value += 1.0
        out[name] = value
    return out


def write_checkpoint(out: Path, kind: str, pooling: str | None = None, seed: int = 0,
                     sizes: dict[str, Any] | None = None) -> Path:
    """Write the checkpoint dir; `pooling` ("mean", "cls", "last") adds the
    sentence-transformers files that choose it; `sizes` overrides config keys (bench sizes)."""
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer, tok_config = TOKENIZERS[kind]
    tok = make_tokenizer()
    config = {**config_for(kind, tok.get_vocab_size()), **(sizes or {})}
    (out / "config.json").write_text(json.dumps(config))
    (out / "tokenizer.json").write_text(tok.to_str())
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
    save_file(random_weights(kind, config, seed), str(out / "model.safetensors"))
    if pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "",
                    "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize"}]
        (out / "modules.json").write_text(json.dumps(modules))
        (out / "1_Pooling").mkdir(exist_ok=True)
        (out / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": HIDDEN, POOLING_KEYS[pooling]: True}))
    return out


# -- numpy references ----------------------------------------------------------------------------

def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def _gelu(x: np.ndarray) -> np.ndarray:
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, heads: int,
            causal: bool = False) -> np.ndarray:
    """Unbatched multi-head attention: [L, heads*hd] inputs (kv may have fewer heads)."""
    length = q.shape[0]
    q = q.reshape(length, heads, -1).transpose(1, 0, 2)
    kv_heads = k.shape[1] // q.shape[2]
    k = np.repeat(k.reshape(length, kv_heads, -1).transpose(1, 0, 2), heads // kv_heads, 0)
    v = np.repeat(v.reshape(length, kv_heads, -1).transpose(1, 0, 2), heads // kv_heads, 0)
    scores = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[2])
    if causal:
        scores = scores + np.triu(np.full((length, length), -1e30), 1)
    return (_softmax(scores) @ v).transpose(1, 0, 2).reshape(length, -1)


def _rotate(x: np.ndarray, base: float) -> np.ndarray:
    """Rotary (rotate_half, non-interleaved) over the whole last axis of [L, heads, hd]."""
    length, _, dim = x.shape
    inv = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    angles = np.arange(length)[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(angles)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(angles)] * 2, -1)[:, None, :]
    half = dim // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def _linear(w: dict[str, np.ndarray], name: str, x: np.ndarray) -> np.ndarray:
    y = x @ w[f"{name}.weight"].T
    return y + w[f"{name}.bias"] if f"{name}.bias" in w else y


def bert_reference(w: dict[str, np.ndarray], config: dict[str, Any], ids: list[int],
                   roberta: bool = False) -> np.ndarray:
    """Last hidden states [L, hidden] of one unpadded text (HF BertModel/XLMRobertaModel)."""
    eps = config["layer_norm_eps"]
    pad = config["pad_token_id"]
    positions = np.arange(len(ids)) + (pad + 1 if roberta else 0)
    h = (w["embeddings.word_embeddings.weight"][ids]
         + w["embeddings.position_embeddings.weight"][positions]
         + w["embeddings.token_type_embeddings.weight"][0])
    h = _layer_norm(h, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}"
        qkv = [_linear(w, f"{p}.attention.self.{n}", h) for n in ("query", "key", "value")]
        ctx = _attend(*qkv, config["num_attention_heads"])
        ctx = _linear(w, f"{p}.attention.output.dense", ctx)
        h = _layer_norm(ctx + h, w[f"{p}.attention.output.LayerNorm.weight"],
                        w[f"{p}.attention.output.LayerNorm.bias"], eps)
        inner = _gelu(_linear(w, f"{p}.intermediate.dense", h))
        h = _layer_norm(_linear(w, f"{p}.output.dense", inner) + h,
                        w[f"{p}.output.LayerNorm.weight"], w[f"{p}.output.LayerNorm.bias"], eps)
    return h


def nomic_reference(w: dict[str, np.ndarray], config: dict[str, Any],
                    ids: list[int]) -> np.ndarray:
    """Last hidden states of NomicBertModel (contrastors' modeling code, post-norm, swiglu)."""
    eps, heads = config["layer_norm_epsilon"], config["n_head"]
    h = (w["embeddings.word_embeddings.weight"][ids]
         + w["embeddings.token_type_embeddings.weight"][0])
    h = _layer_norm(h, w["emb_ln.weight"], w["emb_ln.bias"], eps)
    length = len(ids)
    for i in range(config["n_layer"]):
        p = f"encoder.layers.{i}"
        q, k, v = np.split(_linear(w, f"{p}.attn.Wqkv", h), 3, axis=-1)
        q, k = (_rotate(t.reshape(length, heads, -1), config["rotary_emb_base"])
                .reshape(length, -1) for t in (q, k))
        attn = _linear(w, f"{p}.attn.out_proj", _attend(q, k, v, heads))
        h = _layer_norm(h + attn, w[f"{p}.norm1.weight"], w[f"{p}.norm1.bias"], eps)
        up, gate = _linear(w, f"{p}.mlp.fc11", h), _linear(w, f"{p}.mlp.fc12", h)
        mlp = _linear(w, f"{p}.mlp.fc2", up * gate / (1.0 + np.exp(-gate)))
        h = _layer_norm(h + mlp, w[f"{p}.norm2.weight"], w[f"{p}.norm2.bias"], eps)
    return h


def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def qwen3_reference(w: dict[str, np.ndarray], config: dict[str, Any],
                    ids: list[int]) -> np.ndarray:
    """Final-norm hidden states of Qwen3Model (HF modeling_qwen3, no cache)."""
    eps, heads, kv = config["rms_norm_eps"], config["num_attention_heads"], config[
        "num_key_value_heads"]
    length = len(ids)
    h = w["embed_tokens.weight"][ids]
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}"
        x = _rms(h, w[f"{p}.input_layernorm.weight"], eps)
        q = _linear(w, f"{p}.self_attn.q_proj", x).reshape(length, heads, -1)
        k = _linear(w, f"{p}.self_attn.k_proj", x).reshape(length, kv, -1)
        v = _linear(w, f"{p}.self_attn.v_proj", x)
        q = _rotate(_rms(q, w[f"{p}.self_attn.q_norm.weight"], eps), config["rope_theta"])
        k = _rotate(_rms(k, w[f"{p}.self_attn.k_norm.weight"], eps), config["rope_theta"])
        ctx = _attend(q.reshape(length, -1), k.reshape(length, -1), v, heads, causal=True)
        h = h + _linear(w, f"{p}.self_attn.o_proj", ctx)
        x = _rms(h, w[f"{p}.post_attention_layernorm.weight"], eps)
        gate, up = _linear(w, f"{p}.mlp.gate_proj", x), _linear(w, f"{p}.mlp.up_proj", x)
        h = h + _linear(w, f"{p}.mlp.down_proj", gate / (1.0 + np.exp(-gate)) * up)
    return _rms(h, w["norm.weight"], eps)


def reference_embedding(checkpoint: Path, kind: str, text: str, pooling: str) -> np.ndarray:
    """The L2-normalised pooled embedding of `text`, computed in numpy from the files."""
    from safetensors.numpy import load_file

    w = load_file(str(checkpoint / "model.safetensors"))
    config = json.loads((checkpoint / "config.json").read_text())
    ids = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(text).ids
    if kind == "nomic_bert":
        hidden = nomic_reference(w, config, ids)
    elif kind == "qwen3":
        hidden = qwen3_reference(w, config, ids)
    else:
        hidden = bert_reference(w, config, ids, roberta=kind == "xlm_roberta")
    pooled = {"cls": hidden[0], "last": hidden[-1], "mean": hidden.mean(0)}[pooling]
    return pooled / np.linalg.norm(pooled)
