"""oras-py (the ORAS Python client) pushes and pulls an artifact through the token flow with
Basic credentials, and is refused without them."""

from __future__ import annotations

from pathlib import Path

import pytest

from .auth_fixtures import serve_auth_registry, write_auth_file

oras_client = pytest.importorskip("oras.client", reason="oras-py is a dev dependency")


def test_oras_pushes_and_pulls_with_credentials_and_is_refused_without(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # oras-py pushes files named relative to the working directory
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))  # never the user's config
    Path("artifact.txt").write_text("hello from oras\n")
    with serve_auth_registry(tmp_path, write_auth_file(tmp_path)) as url:
        target = f"{url.removeprefix('http://')}/team/artifact:v1"
        client = oras_client.OrasClient(hostname=url.removeprefix("http://"), insecure=True)
        client.auth.set_basic_auth("alice", "alice-pw")
        assert client.push(files=["artifact.txt"], target=target).status_code == 201
        reader = oras_client.OrasClient(hostname=url.removeprefix("http://"), insecure=True)
        reader.auth.set_basic_auth("bob", "bob-pw")
        pulled = reader.pull(target=target, outdir=str(tmp_path / "out"))
        assert [Path(p).read_text() for p in pulled] == ["hello from oras\n"]
        anonymous = oras_client.OrasClient(hostname=url.removeprefix("http://"), insecure=True)
        with pytest.raises(ValueError, match="Unauthorized"):
            anonymous.pull(target=target, outdir=str(tmp_path / "anon"))
    assert not (tmp_path / "anon").exists() or not any((tmp_path / "anon").iterdir())
