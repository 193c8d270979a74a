"""A completion request's images, from base64 in the body to token ids with image runs.

The chat template never sees image bytes: each image becomes a one-off sentinel in its message
(before the text, as Ollama places it), the rendered prompt is split on the sentinel, and each
cut becomes an image's run of tokens. The run's ids are image keys, not the vocabulary's image
token: `IMAGE_KEY_BASE` + the image's slot (one per distinct image, `ImageSlots`) + the position in
the run, so the prefix cache (keyed by ids) reuses an image's KV only for the same image, and the
model maps each key back to its feature row.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import uuid
from collections.abc import Callable
from typing import Any

from runner.media.decode import MediaError

IMAGE_KEY_BASE = 1 << 30
_SLOT_BITS, _RUN_BITS = 18, 12  # keys stay below 2**31 (int32 token arrays); a run of
# up to 4096 tokens holds a 13-tile Nemotron image (3328); 262,144 distinct images per reset
MARKER = -1  # where an image goes, before expansion


def image_bytes(value: Any) -> bytes:
    """One `images` entry: base64 (Ollama's API), optionally a data URL."""
    if not isinstance(value, str) or not value:
        raise MediaError("each image must be a non-empty base64 string")
    if value.startswith("data:"):
        value = value.partition(",")[2]
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError("an image is not valid base64") from exc


def mark_images(body: dict[str, Any], sentinel: str) -> tuple[dict[str, Any], list[bytes]]:
    """The body with a sentinel per image at the start of its message; the images in order."""
    found: list[bytes] = []
    if isinstance(body.get("messages"), list):
        messages = []
        for message in body["messages"]:
            images = message.get("images") if isinstance(message, dict) else None
            if images:
                found += [image_bytes(v) for v in _as_list(images)]
                content = message.get("content") or ""
                message = {k: v for k, v in message.items() if k != "images"}
                message["content"] = sentinel * len(images) + str(content)
            messages.append(message)
        return {**body, "messages": messages}, found
    if body.get("images") and isinstance(body.get("prompt"), str):
        found = [image_bytes(v) for v in _as_list(body["images"])]
        return {**body, "prompt": sentinel * len(found) + body["prompt"]}, _capped(found)
    return body, _capped(found)


# Each image is decoded, preprocessed (several MB of float32) and encoded before the prompt is
# fitted to the context: the count is capped before any of that.
MAX_IMAGES = 16


def _capped(found: list[bytes]) -> list[bytes]:
    if len(found) > MAX_IMAGES:
        raise MediaError(f"at most {MAX_IMAGES} images per request (got {len(found)}); send "
                         "fewer or split the conversation")
    return found


def _as_list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise MediaError("images must be a list of base64 strings")
    return value


def new_sentinel() -> str:
    return f"<ferry-image-{uuid.uuid4().hex}>"


def encode_marked(text: str, sentinel: str, encode: Callable[[str], list[int]],
                  encode_more: Callable[[str], list[int]],
                  around: tuple[str, str] = ("", "")) -> list[int]:
    """Token ids of `text` with MARKER where each sentinel was (`encode` for the first piece,
    which may add BOS; `encode_more` for the rest). `around`: the text a model's processor puts
    before and after each image (Gemma 3: a blank line each side)."""
    pieces = text.replace(sentinel, around[0] + sentinel + around[1]).split(sentinel)
    ids = encode(pieces[0])
    for piece in pieces[1:]:
        ids.append(MARKER)
        ids += encode_more(piece) if piece else []
    return ids


class ImageSlots:
    """Collision-free image keys for one runner process: each distinct image (by the whole
    sha256 of its bytes) gets a slot of its own, and a key is `IMAGE_KEY_BASE` + slot and
    position. Keys are assigned on the generation worker, under the runner's lock, so a reset
    when the slots run out (the table and every cached prefix that could hold an old slot's
    keys are dropped together) never races a generation."""

    def __init__(self, capacity: int = 1 << _SLOT_BITS) -> None:
        self.capacity = capacity
        self._slots: dict[bytes, int] = {}

    def keys(self, digests: list[bytes], counts: list[int],
             on_reset: Callable[[], None]) -> list[list[int]]:
        """Each image's run of keys; `on_reset` runs first when the new images don't fit."""
        for count in counts:
            if count > 1 << _RUN_BITS:
                raise MediaError(f"an image run of {count} tokens is longer than supported")
        new = {d for d in digests if d not in self._slots}
        if len(self._slots) + len(new) > self.capacity:
            self._slots.clear()
            on_reset()
        runs = []
        for digest, count in zip(digests, counts, strict=True):
            slot = self._slots.setdefault(digest, len(self._slots))
            runs.append([IMAGE_KEY_BASE + (slot << _RUN_BITS) + i for i in range(count)])
        return runs


def image_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()
