"""Placeholder expansion: every image marker in a token sequence becomes `start, image * n, end`,
in prompt order, and the image tokens' [start, end) positions come back as spans (the runs a
vision model attends over both ways, and the trie keeps whole)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from runner.media.decode import MediaError


@dataclass(frozen=True)
class ImageTokens:
    marker: int  # what the chat template emits for each image
    start: int
    image: int
    end: int


def expand(ids: Sequence[int], tokens: ImageTokens, counts: Sequence[int]
           ) -> tuple[list[int], list[tuple[int, int]]]:
    """`ids` with the i-th marker replaced by `counts[i]` image tokens between start and end."""
    markers = sum(1 for t in ids if t == tokens.marker)
    if markers != len(counts):
        raise MediaError(f"the prompt has {markers} image placeholders but {len(counts)} "
                         f"images were sent")
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    images = iter(counts)
    for token in ids:
        if token != tokens.marker:
            out.append(token)
            continue
        count = next(images)
        out.append(tokens.start)
        spans.append((len(out), len(out) + count))
        out.extend([tokens.image] * count)
        out.append(tokens.end)
    return out, spans


def token_id(files: dict[str, bytes], content: str) -> int:
    """The id of a special token (`<img>`) from the model's tokenizer.json: an added token, or
    else a vocabulary entry. MediaError when the tokenizer has no such token."""
    raw = files.get("tokenizer.json")
    tokenizer = json.loads(raw) if raw else {}
    for added in tokenizer.get("added_tokens") or []:
        if added.get("content") == content:
            return int(added["id"])
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and content in vocab:
        return int(vocab[content])
    raise MediaError(f"the model's tokenizer has no {content!r} token for images")
