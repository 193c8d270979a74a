"""Gemma 3 vision (runner/models/gemma3.py) against references written from transformers'
modelling equations in numpy: the SigLIP tower and projector features, and the attention mask
that lets an image's tokens see each other both ways."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from runner.models import gemma3

TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "query_pre_attn_scalar": 16, "sliding_window": 8, "sliding_window_pattern": 2,
        "max_position_embeddings": 256, "model_type": "gemma3_text"}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "image_size": 32, "patch_size": 8,
          "model_type": "siglip_vision_model"}
CONFIG = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
          "vocab_size": 300, "text_config": TEXT, "vision_config": VISION,
          "mm_tokens_per_image": 4, "image_token_index": 299, "boi_token_index": 297,
          "eoi_token_index": 298}


def random_model(seed: int = 0) -> gemma3.Model:
    """A float32 model with every parameter drawn at random (norm gains included)."""
    model = gemma3.Model(gemma3.ModelArgs.from_dict(CONFIG))
    rng = np.random.default_rng(seed)
    params = {k: mx.array(rng.normal(0, 0.2, v.shape).astype(np.float32))
              for k, v in tree_flatten(model.parameters())}
    model.update(tree_unflatten(list(params.items())))
    return model


def _layer_norm(x, w, b, eps=1e-6):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def reference_features(p: dict, pixels: np.ndarray) -> np.ndarray:
    """SiglipVisionModel + Gemma3MultiModalProjector, channels-first as transformers has it."""
    top = "vision_tower.vision_model"
    conv = p[f"{top}.embeddings.patch_embedding.weight"]  # (D, kh, kw, C) as MLX holds it
    d, patch = conv.shape[0], conv.shape[1]
    img = pixels[0]  # (H, W, C)
    side = img.shape[0] // patch
    patches = img.reshape(side, patch, side, patch, 3).transpose(0, 2, 1, 3, 4)
    h = patches.reshape(side * side, -1) @ conv.reshape(d, -1).T
    h = h + p[f"{top}.embeddings.patch_embedding.bias"]
    h = h + p[f"{top}.embeddings.position_embedding.weight"]
    heads = VISION["num_attention_heads"]
    for i in range(VISION["num_hidden_layers"]):
        q = f"{top}.encoder.layers.{i}"
        x = _layer_norm(h, p[f"{q}.layer_norm1.weight"], p[f"{q}.layer_norm1.bias"])
        qkv = [(x @ p[f"{q}.self_attn.{n}.weight"].T + p[f"{q}.self_attn.{n}.bias"])
               .reshape(-1, heads, d // heads).transpose(1, 0, 2) for n in ("q_proj", "k_proj",
                                                                            "v_proj")]
        att = _softmax(qkv[0] @ qkv[1].transpose(0, 2, 1) / math.sqrt(d // heads)) @ qkv[2]
        att = att.transpose(1, 0, 2).reshape(-1, d)
        h = h + att @ p[f"{q}.self_attn.out_proj.weight"].T + p[f"{q}.self_attn.out_proj.bias"]
        x = _layer_norm(h, p[f"{q}.layer_norm2.weight"], p[f"{q}.layer_norm2.bias"])
        x = _gelu_tanh(x @ p[f"{q}.mlp.fc1.weight"].T + p[f"{q}.mlp.fc1.bias"])
        h = h + x @ p[f"{q}.mlp.fc2.weight"].T + p[f"{q}.mlp.fc2.bias"]
    h = _layer_norm(h, p[f"{top}.post_layernorm.weight"], p[f"{top}.post_layernorm.bias"])
    # projector: (N, D) -> (D, side, side) -> AvgPool2d(k) -> (tokens, D) -> RMSNorm -> @ W
    grid = h.T.reshape(d, side, side)
    k = side // int(math.sqrt(CONFIG["mm_tokens_per_image"]))
    pooled = grid.reshape(d, side // k, k, side // k, k).mean((2, 4)).reshape(d, -1).T
    w = p["multi_modal_projector.mm_soft_emb_norm.weight"]
    normed = pooled / np.sqrt((pooled ** 2).mean(-1, keepdims=True) + 1e-6) * (1 + w)
    return normed @ p["multi_modal_projector.mm_input_projection_weight"]


def _params(model: gemma3.Model) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def test_vision_features_match_reference() -> None:
    model = random_model()
    pixels = np.random.default_rng(1).uniform(-1, 1, (1, 32, 32, 3)).astype(np.float32)
    ours = np.array(model.encode_images(mx.array(pixels)))
    expected = reference_features(_params(model), pixels.astype(np.float64))
    assert ours.shape == (1, 4, TEXT["hidden_size"])
    np.testing.assert_allclose(ours[0], expected, atol=1e-3, rtol=1e-3)


def _prompt(features_seed: int) -> tuple[mx.array, mx.array, list[tuple[int, int]]]:
    ids = [2, 5, 297, 299, 299, 299, 299, 298, 7, 9]
    pixels = np.random.default_rng(features_seed).uniform(-1, 1, (1, 32, 32, 3))
    return mx.array([ids]), mx.array(pixels.astype(np.float32)), [(3, 7)]


def test_image_tokens_attend_both_ways() -> None:
    """With the span, the first image token sees the last one (its logits depend on it);
    without it, attention is causal; text before the image never sees the image."""
    model = random_model()
    ids, pixels, spans = _prompt(2)
    features = model.encode_images(pixels)
    changed = mx.concatenate([features[:, :3], features[:, 3:] + 1.0], axis=1)
    both = [np.array(model(ids, spans=spans, features=f)) for f in (features, changed)]
    causal = [np.array(model(ids, features=f)) for f in (features, changed)]
    assert not np.allclose(both[0][0, 3], both[1][0, 3], atol=1e-4)
    np.testing.assert_allclose(causal[0][0, :6], causal[1][0, :6], atol=1e-5)
    np.testing.assert_allclose(both[0][0, :3], both[1][0, :3], atol=1e-5)


def _reference_logits(model: gemma3.Model, h: np.ndarray, spans) -> np.ndarray:
    """The text decoder from transformers' Gemma 3 equations, with its token_type_ids mask
    (causal, windowed on sliding layers, or-ed with same-image bidirectionality)."""
    p = _params(model)
    t = TEXT
    n, hd = h.shape[0], t["head_dim"]
    pos = np.arange(n)

    def rms(x, w, eps=1e-6):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * (1 + w)

    def rope(x, base):
        inv = 1.0 / base ** (np.arange(0, hd, 2) / hd)
        ang = pos[:, None] * inv[None]
        cos, sin = np.cos(ang), np.sin(ang)
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    for i in range(t["num_hidden_layers"]):
        q = f"language_model.model.layers.{i}"
        sliding = (i + 1) % t["sliding_window_pattern"] != 0
        base = 10000.0 if sliding else 1000000.0
        x = rms(h, p[f"{q}.input_layernorm.weight"])
        heads = [(x @ p[f"{q}.self_attn.{m}_proj.weight"].T).reshape(n, -1, hd)
                 for m in ("q", "k", "v")]
        qs = rope(rms(heads[0], p[f"{q}.self_attn.q_norm.weight"]).transpose(1, 0, 2), base)
        ks = rope(rms(heads[1], p[f"{q}.self_attn.k_norm.weight"]).transpose(1, 0, 2), base)
        vs = heads[2].transpose(1, 0, 2)
        group = qs.shape[0] // ks.shape[0]
        ks, vs = np.repeat(ks, group, 0), np.repeat(vs, group, 0)
        ok = pos[None] <= pos[:, None]
        if sliding:
            ok &= pos[None] > pos[:, None] - t["sliding_window"]
        for a, z in spans:
            inside = (pos >= a) & (pos < z)
            ok |= inside[:, None] & inside[None]
        scores = qs @ ks.transpose(0, 2, 1) / math.sqrt(t["query_pre_attn_scalar"])
        att = (_softmax(np.where(ok, scores, -np.inf)) @ vs).transpose(1, 0, 2).reshape(n, -1)
        h = h + rms(att @ p[f"{q}.self_attn.o_proj.weight"].T,
                    p[f"{q}.post_attention_layernorm.weight"])
        x = rms(h, p[f"{q}.pre_feedforward_layernorm.weight"])
        x = _gelu_tanh(x @ p[f"{q}.mlp.gate_proj.weight"].T) * (x @ p[f"{q}.mlp.up_proj.weight"].T)
        down = x @ p[f"{q}.mlp.down_proj.weight"].T
        h = h + rms(down, p[f"{q}.post_feedforward_layernorm.weight"])
    h = rms(h, p["language_model.model.norm.weight"])
    return h @ p["language_model.model.embed_tokens.weight"].T


@pytest.mark.parametrize("with_span", [True, False])
def test_logits_match_reference(with_span: bool) -> None:
    model = random_model(3)
    ids, pixels, spans = _prompt(4)
    spans = spans if with_span else []
    features = model.encode_images(pixels)
    embedded = np.array(model.embed(ids, features))[0].astype(np.float64)
    ours = np.array(model(ids, spans=spans, features=features))[0]
    np.testing.assert_allclose(ours, _reference_logits(model, embedded, spans), atol=1e-3,
                               rtol=1e-3)
    scale = np.float32(mx.array(TEXT["hidden_size"] ** 0.5, mx.bfloat16).item())
    table = np.array(model.language_model.model.embed_tokens.weight)
    np.testing.assert_allclose(embedded[2], table[297] * scale, rtol=1e-6)
    np.testing.assert_allclose(embedded[3:7], np.array(features)[0], rtol=1e-6)


def test_chunked_prefill_with_a_cache_matches_one_forward() -> None:
    """The generator prefills in chunks that never split a span: same logits as one call."""
    from runner.kv_cache import KVCache
    model = random_model(5)
    ids, pixels, spans = _prompt(6)
    features = model.encode_images(pixels)
    whole = np.array(model(ids, spans=spans, features=features))[0]
    caches = [KVCache() for _ in model.layers]
    model(ids[:, :3], caches)
    middle = np.array(model(ids[:, 3:8], caches, spans=[(0, 4)], features=features))[0]
    last = np.array(model(ids[:, 8:], caches))[0]
    np.testing.assert_allclose(middle, whole[3:8], atol=1e-4)
    np.testing.assert_allclose(last, whole[8:], atol=1e-4)
