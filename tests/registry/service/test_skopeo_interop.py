"""Interop with a real client: Debian's skopeo copies an OCI image into the registry and back.

skopeo is a test dependency (`make test` installs it with apt-get). Where it is missing the
test fails with the reason, except on machines without apt-get, where it skips loudly.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from registry import media_types as mt

POLICY = {"default": [{"type": "insecureAcceptAnything"}]}


@pytest.fixture(scope="module")
def skopeo() -> str:
    found = shutil.which("skopeo")
    if found:
        return found
    if shutil.which("apt-get") is None:
        pytest.skip("SKOPEO MISSING: no skopeo and no apt-get to install it; interop not tested")
    pytest.fail("skopeo is not installed: run `make system-deps` (apt-get install skopeo)")


def _write_blob(layout: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def _layer(files: dict[str, bytes]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            info.mtime = 0
            tar.addfile(info, io.BytesIO(content))
    return gzip.compress(raw.getvalue(), mtime=0)


def build_oci_layout(layout: Path, tag: str, layers: int = 3) -> str:
    """A multi-layer OCI image layout; returns the manifest digest."""
    (layout / "blobs" / "sha256").mkdir(parents=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    tars = [_layer({f"file{i}.txt": f"layer {i}\n".encode() * (1000 * (i + 1))})
            for i in range(layers)]
    diff_ids = [f"sha256:{hashlib.sha256(gzip.decompress(t)).hexdigest()}" for t in tars]
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "rootfs": {"type": "layers", "diff_ids": diff_ids},
                         "config": {}}).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": mt.OCI_MANIFEST,
        "config": {"mediaType": mt.OCI_CONFIG, **_write_blob(layout, config)},
        "layers": [{"mediaType": mt.OCI_LAYER_TAR_GZIP, **_write_blob(layout, t)}
                   for t in tars],
    }).encode()
    desc = {"mediaType": mt.OCI_MANIFEST, **_write_blob(layout, manifest),
            "annotations": {"org.opencontainers.image.ref.name": tag}}
    (layout / "index.json").write_text(json.dumps(
        {"schemaVersion": 2, "mediaType": mt.OCI_INDEX, "manifests": [desc]}))
    return str(desc["digest"])


def run_skopeo(skopeo: str, policy: Path, *args: str) -> str:
    cmd = [skopeo, "--policy", str(policy), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stderr}"
    return done.stdout


def test_skopeo_round_trip_inspect_list_tags_and_delete(
    skopeo: str, registry_url: str, tmp_path: Path,
) -> None:
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps(POLICY))
    source = tmp_path / "src"
    digest = build_oci_layout(source, "v1")
    host = registry_url.removeprefix("http://")
    ref = f"docker://{host}/ferry/interop/image"

    run_skopeo(skopeo, policy, "copy", "--dest-tls-verify=false", "--preserve-digests",
               f"oci:{source}:v1", f"{ref}:v1")
    run_skopeo(skopeo, policy, "copy", "--dest-tls-verify=false", "--preserve-digests",
               f"oci:{source}:v1", f"{ref}:v2")

    inspected = json.loads(run_skopeo(skopeo, policy, "inspect", "--tls-verify=false",
                                      f"{ref}:v1"))
    assert inspected["Digest"] == digest
    assert len(inspected["Layers"]) == 3
    raw = run_skopeo(skopeo, policy, "inspect", "--raw", "--tls-verify=false", f"{ref}:v1")
    assert f"sha256:{hashlib.sha256(raw.encode()).hexdigest()}" == digest
    tags = json.loads(run_skopeo(skopeo, policy, "list-tags", "--tls-verify=false", ref))
    assert sorted(tags["Tags"]) == ["v1", "v2"]

    out = tmp_path / "out"
    run_skopeo(skopeo, policy, "copy", "--src-tls-verify=false", "--preserve-digests",
               f"{ref}:v1", f"oci:{out}:v1")
    index = json.loads((out / "index.json").read_text())
    assert [m["digest"] for m in index["manifests"]] == [digest]
    original = sorted(p.name for p in (source / "blobs" / "sha256").iterdir())
    assert sorted(p.name for p in (out / "blobs" / "sha256").iterdir()) == original
    for name in original:
        assert (out / "blobs" / "sha256" / name).read_bytes() == (
            source / "blobs" / "sha256" / name).read_bytes()

    run_skopeo(skopeo, policy, "delete", "--tls-verify=false", f"{ref}:v1")
    gone = subprocess.run([skopeo, "--policy", str(policy), "inspect", "--tls-verify=false",
                           f"{ref}:v1"], capture_output=True, text=True, timeout=120)
    assert gone.returncode != 0
    tags = json.loads(run_skopeo(skopeo, policy, "list-tags", "--tls-verify=false", ref))
    assert tags["Tags"] == []  # deleting by digest removed every tag pointing at it
