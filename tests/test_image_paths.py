"""Image paths in a `ferry run` prompt (ferry/image_paths.py)."""

from __future__ import annotations

import base64

from ferry.image_paths import extract_images


def test_existing_image_paths_are_attached_and_removed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cat.PNG").write_bytes(b"png bytes")
    (tmp_path / "b.jpeg").write_bytes(b"jpeg bytes")
    text, images = extract_images(f"compare ./cat.PNG and {tmp_path}/b.jpeg please")
    assert text == "compare and please"
    assert [base64.b64decode(i) for i in images] == [b"png bytes", b"jpeg bytes"]


def test_missing_files_and_other_text_stay(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    prompt = "see ./missing.png, ./notes.txt and cat.png"
    assert extract_images(prompt) == (prompt, [])
