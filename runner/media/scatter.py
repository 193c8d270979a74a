"""Image features into the embedding sequence, one rule for every vision model.

A prompt's image tokens come either as the vocabulary's image token with `features` for them in
order (one forward over a whole prompt), or as image keys (runner.media.prompt) whose feature rows
were bound before the request (`bind_images`): then each chunk of a chunked prefill, and a resume
from the prefix cache, finds its own images' rows by key."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from runner.media.prompt import IMAGE_KEY_BASE
from runner.readback import flags, token_ids


def embed_with_images(inputs: mx.array, embed: Callable[[mx.array], mx.array],
                      image_token: int, features: mx.array | None,
                      bound: dict[int, mx.array]) -> mx.array:
    """`embed(inputs)` with image tokens' rows replaced: by `features` in order, or, when none
    are given, image keys' by their bound rows (ValueError when a key has none)."""
    keyed = inputs >= IMAGE_KEY_BASE
    if features is None and bool(keyed.any()):
        keys = [k for k in token_ids(inputs.reshape(-1)) if k >= IMAGE_KEY_BASE]
        missing = [k for k in keys if k not in bound]
        if missing:
            raise ValueError(f"no image features bound for {len(missing)} image tokens")
        inputs = mx.where(keyed, image_token, inputs)
        features = mx.stack([bound[k] for k in keys])[None]
    h = embed(inputs)
    if features is None:
        return h
    where = (inputs == image_token).reshape(-1)
    positions = mx.array([i for i, hit in enumerate(flags(where)) if hit], mx.int32)
    flat = features.reshape(-1, h.shape[-1]).astype(h.dtype)
    if positions.size != flat.shape[0]:
        raise ValueError(f"{positions.size} image tokens for {flat.shape[0]} image features")
    rows = h.reshape(-1, h.shape[-1])
    rows[positions] = flat
    return rows.reshape(h.shape)
