"""The local models dir: atomic blobs and manifests, refcounted delete, prune, Ollama layout."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures_ollama import OllamaModelsDir

from registry.digests import Digest
from registry.errors import DigestMismatch, InvalidManifest, NotFound, SizeMismatch
from registry.manifests import Descriptor, build_manifest
from registry.model_show import list_tags, show_model
from registry.names import Name
from registry.store import Store

REPO = Path(__file__).resolve().parents[2]
HOUR = 3600.0


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _model(store: Store, name: str, *layers: bytes, config: bytes = b"{}") -> bytes:
    """Write blobs and a manifest through the store; return the manifest bytes."""
    config_desc = Descriptor("application/vnd.docker.container.image.v1+json",
                             store.blob_writer().write_all(config), len(config))
    descs = [Descriptor("application/vnd.ollama.image.tensor", store.blob_writer().write_all(data),
                        len(data)) for data in layers]
    raw = build_manifest(config_desc, descs)
    store.write_manifest(Name.parse_valid(name), raw)
    return raw


# -- blobs ---------------------------------------------------------------------------------------

def test_write_blob_publishes_under_the_digest_with_mode_0644(store):
    digest = store.blob_writer(Digest.of(b"hello")).write_all(b"hello")
    path = store.blob_path(digest)
    assert path.name == f"sha256-{hashlib.sha256(b'hello').hexdigest()}"
    assert path.read_bytes() == b"hello" and oct(path.stat().st_mode & 0o777) == "0o644"
    assert _files(store.blobs_dir) == [path.name]


def test_digest_mismatch_leaves_nothing(store):
    with pytest.raises(DigestMismatch) as info:
        store.blob_writer(Digest.of(b"expected")).write_all(b"actual")
    assert info.value.actual == str(Digest.of(b"actual"))
    assert _files(store.blobs_dir) == []


def test_size_mismatch_leaves_nothing(store):
    with pytest.raises(SizeMismatch):
        store.blob_writer(Digest.of(b"abc"), expected_size=4).write_all([b"abc"])
    assert _files(store.blobs_dir) == []


async def test_async_write_blob_removes_its_temp_file_when_the_stream_fails(store):
    async def broken():
        yield b"x" * (2 * 1024 * 1024)
        raise ConnectionResetError("client went away")

    with pytest.raises(ConnectionResetError):
        await store.blob_writer(Digest.of(b"whatever")).write_stream(broken())
    assert _files(store.blobs_dir) == []

    async def chunks():
        for part in (b"a" * 700_000, b"b" * 700_000):
            await asyncio.sleep(0)
            yield part

    expected = Digest.of(b"a" * 700_000 + b"b" * 700_000)
    digest = await store.blob_writer(expected).write_stream(chunks())
    assert store.blob_size(digest) == 1_400_000


def test_adopt_blob_publishes_a_verified_temp_file_under_its_digest(store):
    from registry.blob_writer import temp_path

    store.blobs_dir.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(store.blobs_dir)
    tmp.write_bytes(b"verified elsewhere")
    digest = Digest.of(b"verified elsewhere")
    path = store.adopt_blob(tmp, digest)
    assert path == store.blob_path(digest) and not tmp.exists()
    assert store.read_blob(digest) == b"verified elsewhere"
    assert oct(path.stat().st_mode & 0o777) == "0o644"


def test_a_committed_writer_is_done_and_a_second_one_can_replace_the_same_blob(store):
    first = store.blob_writer()
    first.write_all(b"same")
    assert first.done
    assert store.blob_writer().write_all(b"same") == Digest.of(b"same")
    assert _files(store.blobs_dir) == [Digest.of(b"same").filename]


def test_a_large_blob_is_flushed_while_it_is_written_not_only_at_commit(store, monkeypatch):
    import registry.blob_writer as blob_writer

    monkeypatch.setattr(blob_writer, "_SYNC_EVERY", 1024 * 1024)
    synced: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real(fd))[1])
    writer = store.blob_writer()
    for _ in range(6):
        writer.write(os.urandom(1024 * 1024))
    assert synced  # before commit: durability overlaps the transfer
    digest = writer.commit()
    assert store.blob_size(digest) == 6 * 1024 * 1024 and _files(store.blobs_dir) == [
        digest.filename]


def test_a_killed_writer_leaves_only_a_temp_name_that_prune_sweeps(store):
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from registry.store import Store\n"
        "from registry.digests import Digest\n"
        "w = Store(Path(sys.argv[1])).blob_writer(Digest.of(b'x' * 300000))\n"
        "w.write(b'x' * 100000); w._fh.flush()\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(store.root)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    finally:
        proc.kill()
        proc.wait(timeout=30)
    left = list(store.blobs_dir.iterdir())
    assert len(left) == 1 and not Digest.is_valid(left[0].name)
    assert store.prune() == []  # young: may belong to a write still in progress
    assert store.prune(now=time.time() + HOUR + 1) == left
    assert _files(store.blobs_dir) == []


def test_missing_blobs_raise_not_found(store):
    digest = Digest.of(b"absent")
    with pytest.raises(NotFound, match=str(digest)):
        store.read_blob(digest)
    with pytest.raises(NotFound):
        store.blob_size(digest)


# -- manifests -----------------------------------------------------------------------------------

def test_a_manifest_referencing_a_missing_blob_is_refused_and_nothing_is_written(store):
    config = Descriptor("application/vnd.docker.container.image.v1+json",
                        store.blob_writer().write_all(b"{}"), 2)
    missing = Descriptor("application/vnd.ollama.image.tensor", Digest.of(b"nope"), 4)
    with pytest.raises(InvalidManifest, match=str(missing.digest)):
        store.write_manifest(Name.parse_valid("m"), build_manifest(config, [missing]))
    assert not store.manifests_dir.exists() or _files(store.manifests_dir) == []


def test_write_manifest_rejects_invalid_json_and_keeps_the_old_one(store):
    raw = _model(store, "m:1", b"w")
    name = Name.parse_valid("m:1")
    with pytest.raises(InvalidManifest):
        store.write_manifest(name, b'{"schemaVersion": 1}')
    assert store.read_manifest(name) == raw
    assert [p for p in store.manifests_dir.rglob("*") if p.name.startswith(".")] == []


def test_manifest_names_match_existing_files_case_insensitively(store):
    raw = _model(store, "Me/Model:Tag", b"w")
    assert store.read_manifest(Name.parse_valid("me/model:tag")) == raw
    store.copy_model(Name.parse_valid("me/model:tag"), Name.parse_valid("ME/MODEL:TAG"))
    assert [e.name.model for e in store.list_models()] == ["Model"]


# -- delete and prune ----------------------------------------------------------------------------

def test_delete_keeps_blobs_other_manifests_use_as_config_or_layer(store):
    shared_config = b'{"model_format":"safetensors"}'
    _model(store, "a", b"only-a", b"shared-layer", config=shared_config)
    _model(store, "b", b"shared-layer", config=shared_config)
    # c uses a's config bytes as a *layer*: refcounting must look at both roles.
    config_desc = Descriptor("application/vnd.docker.container.image.v1+json",
                             store.blob_writer().write_all(b"{}"), 2)
    as_layer = Descriptor("application/vnd.ollama.image.json", Digest.of(shared_config),
                          len(shared_config))
    store.write_manifest(Name.parse_valid("c"), build_manifest(config_desc, [as_layer]))

    removed = store.delete_model(Name.parse_valid("a"))
    assert removed == [Digest.of(b"only-a")]
    store.delete_model(Name.parse_valid("b"))
    assert store.has_blob(Digest.of(shared_config))  # still c's layer
    assert not store.has_blob(Digest.of(b"shared-layer"))
    store.delete_model(Name.parse_valid("c"))
    assert _files(store.blobs_dir) == []
    assert list(store.manifests_dir.iterdir()) == []  # empty host/ns/model dirs pruned


def test_delete_of_an_unknown_model_is_not_found_and_changes_nothing(store):
    _model(store, "keep", b"w")
    before = _files(store.root)
    with pytest.raises(NotFound, match="model 'gone:latest' not found"):
        store.delete_model(Name.parse_valid("gone"))
    assert _files(store.root) == before


def test_delete_removes_the_metadata_file_with_its_blob(store):
    _model(store, "m", b"GGUF weights")
    store.write_metadata(Digest.of(b"GGUF weights"), {"kv": {}})
    store.delete_model(Name.parse_valid("m"))
    assert _files(store.root) == []


def test_prune_removes_old_leftovers_and_unreferenced_blobs_but_not_young_ones(store):
    _model(store, "m", b"used")
    orphan = store.blob_writer().write_all(b"orphan")
    young_orphan = store.blob_writer().write_all(b"young orphan")
    hexdigest = "f" * 64
    partial = store.blobs_dir / f"sha256-{hexdigest}-partial"
    part_state = store.blobs_dir / f"sha256-{hexdigest}-partial-0"
    tmp = store.blobs_dir / ".tmp-deadbeef"
    ollama_tmp = store.blobs_dir / "sha256-123456789"
    manifest_tmp = store.manifests_dir / "registry.ollama.ai" / ".tmp-m-abc"
    for path in (partial, part_state, tmp, ollama_tmp, manifest_tmp):
        path.write_bytes(b"left over")
    old = time.time() - 2 * HOUR
    for path in (store.blob_path(orphan), partial, part_state, tmp, ollama_tmp, manifest_tmp):
        os.utime(path, (old, old))
    for path in (store.blob_path(Digest.of(b"used")), store.blob_path(Digest.of(b"{}"))):
        os.utime(path, (old, old))

    removed = {p.name for p in store.prune()}
    assert removed == {store.blob_path(orphan).name, partial.name, part_state.name, tmp.name,
                       ollama_tmp.name, manifest_tmp.name}
    assert store.has_blob(young_orphan)
    assert store.has_blob(Digest.of(b"used")) and store.has_blob(Digest.of(b"{}"))


# -- a models dir written by Ollama --------------------------------------------------------------

def test_an_ollama_written_models_dir_lists_shows_and_deletes(settings):
    ollama = OllamaModelsDir(settings.models_dir)
    raw_a = ollama.gguf_model("llama3:8b", weights=b"GGUF llama", params={"stop": ["<|eot|>"]})
    ollama.gguf_model("llama3:latest", weights=b"GGUF llama")
    ollama.gguf_model("phi:latest", weights=b"GGUF phi", host="my.registry:5000", namespace="t")
    # Corrupt manifests and stray files are ignored when listing (and reference nothing).
    stray = settings.models_dir / "manifests/registry.ollama.ai/library/bad/latest"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"not json")
    shallow = settings.models_dir / "manifests/registry.ollama.ai/too/shallow"
    shallow.parent.mkdir(parents=True)
    shallow.write_bytes(b"{}")
    store = Store(settings.models_dir)

    assert {m["name"] for m in list_tags(store)} == {"llama3:8b", "llama3:latest",
                                                    "my.registry:5000/t/phi:latest"}
    shown = show_model(store, Name.parse_valid("llama3:8b"))
    assert shown["parameters"] == f"{'stop':<30} \"<|eot|>\""
    assert shown["template"].startswith("{{ if .System }}")
    assert store.get_model(Name.parse_valid("llama3:8b")).digest == Digest.of(raw_a)

    store.delete_model(Name.parse_valid("llama3:8b"))
    weights = Digest.of(b"GGUF llama")
    assert store.has_blob(weights)  # llama3:latest still uses it
    assert not store.has_blob(Digest.of(json.dumps({"stop": ["<|eot|>"]}).encode()))
    store.delete_model(Name.parse_valid("llama3:latest"))
    assert not store.has_blob(weights)
    store.delete_model(Name.parse_valid("my.registry:5000/t/phi"))
    assert not (settings.models_dir / "manifests/my.registry:5000").exists()
    assert list_tags(store) == []  # only the corrupt manifest is left, and it is skipped


def test_prune_removes_old_create_staging_dirs_and_metadata_temp_files(store):
    from workflows.create.stage import STAGE_PREFIX  # the name create really stages under

    blob = store.blob_writer().write_all(b"weights")
    crashed = store.root / f"{STAGE_PREFIX}0123456789abcdef"
    (crashed / "sub").mkdir(parents=True)
    os.link(store.blob_path(blob), crashed / "sub" / "model.safetensors")
    running = store.root / f"{STAGE_PREFIX}fedcba9876543210"
    running.mkdir()
    store.metadata_dir.mkdir(parents=True, exist_ok=True)
    stale_tmp = store.metadata_dir / ".tmp-sha256-abc.json-123456"
    young_tmp = store.metadata_dir / ".tmp-sha256-def.json-654321"
    for path in (stale_tmp, young_tmp):
        path.write_bytes(b"{")
    old = time.time() - 2 * HOUR
    for path in (crashed, stale_tmp):
        os.utime(path, (old, old))

    removed = set(store.prune())
    assert {crashed, stale_tmp} <= removed
    assert not crashed.exists() and not stale_tmp.exists()
    assert running.is_dir() and young_tmp.exists()  # young: a create or write in progress
