"""registry/gguf.py: the pure-Python GGUF reader and the per-blob metadata cache."""

from __future__ import annotations

import math
import struct

import gguf
import pytest

from registry.gguf import GGUFError, ensure_metadata, read_header
from tests.workflows.create.gguf_files import write_gguf


def test_reader_matches_the_reference_reader_and_omits_big_and_non_finite(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    header = read_header(path)
    reference = gguf.GGUFReader(path)
    assert header.version == 3
    assert set(header.kv) | set(header.omitted) == {
        k for k in reference.fields if not k.startswith("GGUF.")}
    assert sorted(header.omitted) == ["llama.test.inf_array", "llama.test.nan",
                                      "tokenizer.ggml.tokens"]
    assert header.kv["llama.test.big"] == 2**63 + 5  # integers stay exact
    assert header.kv["llama.rope.freqs"] == [1.0, 2.0, 3.0]
    assert header.kv["general.architecture"] == "llama"
    assert header.file_type == "Q4_K_M"
    assert header.arch_value("context_length") == 4096
    assert [t.name for t in header.tensors] == [t.name for t in reference.tensors]
    assert header.parameter_count == sum(math.prod(t.shape) for t in reference.tensors)
    assert header.data_offset == reference.data_offset


def test_metadata_is_written_once_per_blob_and_removed_with_it(store, tmp_path):
    data = write_gguf(tmp_path / "m.gguf").read_bytes()
    digest = store.blob_writer().write_all(data)
    document = ensure_metadata(store, digest)
    path = store.metadata_path(digest)
    assert path.is_file() and set(document) == {"kv", "omitted"}
    assert "tokenizer.ggml.tokens" in document["omitted"]
    assert "tokenizer.ggml.tokens" not in document["kv"]
    before = path.stat().st_mtime_ns
    assert ensure_metadata(store, digest) == document
    assert path.stat().st_mtime_ns == before  # cached: not rewritten
    store.delete_blob(digest)
    assert not path.exists()


@pytest.mark.parametrize("damage", [
    lambda raw: b"GGML" + raw[4:],
    lambda raw: raw[:4] + struct.pack("<I", 9) + raw[8:],
    lambda raw: raw[:40],
])
def test_malformed_files_raise_gguf_errors(tmp_path, damage):
    path = write_gguf(tmp_path / "m.gguf")
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(GGUFError):
        read_header(path)
