"""/api/create's `files` paths are bounded before staging, and every error names the user's
path, never the server's staging directory (issue 19, item 3)."""

from __future__ import annotations

import hashlib
import threading

import httpx
import pytest

from workflows.create.stage import MAX_PATH_COMPONENT_BYTES, MAX_PATH_DEPTH


@pytest.mark.parametrize("paths, message", [
    (["a" * 300 + ".json"], f"longer than {MAX_PATH_COMPONENT_BYTES} bytes"),
    (["é" * 150], f"longer than {MAX_PATH_COMPONENT_BYTES} bytes"),
    (["d/" * 2000 + "config.json"], f"deeper than {MAX_PATH_DEPTH} directories"),
    (["a", "a/b"], "'a' is a file, so 'a/b' cannot be inside it"),
    (["x/y/config.json", "x/y"], "'x/y' is a file"),
])
def test_unstageable_paths_are_400_naming_the_input(model_server: str, settings, paths,
                                                     message) -> None:
    data = b'{"model_type": "llama"}'
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with httpx.Client(base_url=model_server, timeout=60) as http:
        assert http.post(f"/api/blobs/{digest}", content=data).status_code == 201
        r = http.post("/api/create", json={"model": "me/bad",
                                           "files": {p: digest for p in paths}})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]
    assert str(settings.home) not in r.text and str(settings.models_dir) not in r.text
    assert len(r.text) < 1000  # a 4,000-character path is shortened in the message


def test_staging_errors_name_the_users_path(tmp_path, store) -> None:
    from registry.digests import Digest
    from workflows.create.errors import CreateError
    from workflows.create.stage import staged_dir

    blob = b"x"
    digest = Digest.of(blob)
    store.blob_path(digest).parent.mkdir(parents=True, exist_ok=True)
    store.blob_path(digest).write_bytes(blob)
    with pytest.raises(CreateError) as caught, staged_dir(
            store, {"ok/f": digest, "ok/f/g": digest}, threading.Event()):
        pass
    assert "'ok/f/g'" in str(caught.value) and str(store.root) not in str(caught.value)
