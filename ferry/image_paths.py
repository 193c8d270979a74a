"""`ferry run MODEL "describe ./cat.png"`: image paths in a prompt become attached images, as
Ollama's CLI does for a vision model. A path must start with `/`, `./`, `../` or `~/` and end in
.png, .jpg, .jpeg or .webp; paths to files that do not exist stay in the text."""

from __future__ import annotations

import base64
import re
from pathlib import Path

IMAGE_PATH = re.compile(r"(?:~/|\.\./|\./|/)[^\s'\"]*?\.(?:png|jpe?g|webp)\b", re.IGNORECASE)


def extract_images(text: str) -> tuple[str, list[str]]:
    """The prompt without the image paths it names, and those images as base64."""
    images: list[str] = []

    def attach(match: re.Match[str]) -> str:
        path = Path(match.group(0)).expanduser()
        if not path.is_file():
            return match.group(0)
        images.append(base64.b64encode(path.read_bytes()).decode())
        return ""

    stripped = IMAGE_PATH.sub(attach, text)
    return (" ".join(stripped.split()) if images else text), images
