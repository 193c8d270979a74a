"""Embedding models imported with create, loaded by the runner, against numpy references.

Each encoder's random-weight checkpoint goes through the real create workflow into a store, is
loaded with runner.load, and embeds a batch in one padded forward; every vector must match the
numpy reference of the published equations (same files) within cosine 0.9999 in float32.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from registry.names import Name
from registry.store import Store
from runner.embed import Embedder, EmbedError, build_embedder, forward_groups
from runner.load import load_model
from runner.quant import parse_quant_type
from runner.tokenizer import ModelTokenizer
from tests.runner.embedding_checkpoints import reference_embedding, write_checkpoint
from workflows.create import CreateOptions, create

TEXTS = ["the quick brown fox", "hello world", "a cat sat on the mat and the dog ran fast",
         "ferry"]


def imported_embedder(tmp_path, kind: str, pooling: str | None, quantize: str | None = None,
                      compute: str = "float32") -> tuple[Embedder, object]:
    checkpoint = write_checkpoint(tmp_path / "ckpt", kind, pooling)
    store = Store(tmp_path / "models")
    store.root.mkdir(parents=True)
    options = CreateOptions(quantize=parse_quant_type(quantize) if quantize else None)
    create(Name.parse_valid(f"emb/{kind}"), checkpoint, options, store,
           progress=lambda event: None, cancel=threading.Event())
    loaded = load_model(store, f"emb/{kind}", compute)
    files = loaded.files
    tokenizer = ModelTokenizer(files.files, files.config)
    embedder = build_embedder(loaded.model, files.config, files.files, tokenizer)
    assert embedder is not None
    return embedder, checkpoint


@pytest.mark.parametrize(("kind", "pooling", "expected_mode"), [
    ("bert", "mean", "mean"),           # 1_Pooling overrides BERT's CLS default
    ("bert", None, "cls"),
    ("nomic_bert", "mean", "mean"),
    ("xlm_roberta", "cls", "cls"),
    ("qwen3", "last", "last"),          # a Qwen3Model decoder, last-token pooled
])
def test_batched_embeddings_match_the_reference(tmp_path, kind, pooling, expected_mode):
    embedder, checkpoint = imported_embedder(tmp_path, kind, pooling)
    assert embedder.mode == expected_mode
    result = embedder.embed(TEXTS)
    assert len(result.vectors) == len(TEXTS)
    for text, vector in zip(TEXTS, result.vectors, strict=True):
        ours = np.array(vector)
        reference = reference_embedding(checkpoint, kind, text, expected_mode)
        assert abs(np.linalg.norm(ours) - 1.0) < 1e-5
        assert float(ours @ reference) >= 0.9999, text
    assert result.prompt_eval_count == sum(
        len(embedder.tokenizer.tokenizer.encode(t).ids) for t in TEXTS)


def test_a_text_embeds_the_same_alone_and_in_a_padded_batch(tmp_path):
    embedder, _ = imported_embedder(tmp_path, "xlm_roberta", "mean")
    alone = np.array(embedder.embed(["hello world"]).vectors[0])
    batched = np.array(embedder.embed(TEXTS).vectors[1])
    assert np.allclose(alone, batched, atol=1e-5)


def test_dimensions_truncate_and_renormalise(tmp_path):
    embedder, _ = imported_embedder(tmp_path, "bert", "mean")
    full = np.array(embedder.embed(["hello world"]).vectors[0])
    short = np.array(embedder.embed(["hello world"], dimensions=8).vectors[0])
    assert short.shape == (8,)
    assert np.allclose(short, full[:8] / np.linalg.norm(full[:8]), atol=1e-5)
    with pytest.raises(EmbedError, match="exceeds the model's embedding length"):
        embedder.embed(["hello"], dimensions=1000)


def test_overlong_input_is_truncated_keeping_special_tokens_or_refused(tmp_path):
    embedder, _ = imported_embedder(tmp_path, "bert", "cls")
    long_text = " ".join(["fox"] * 100)
    result = embedder.embed([long_text], num_ctx=10)
    assert result.prompt_eval_count == 10
    ids = embedder.tokens(long_text, 10, truncate=True)
    assert ids[0] == 2 and ids[-1] == 3  # [CLS] ... [SEP] survive the cut
    with pytest.raises(EmbedError, match="exceeds maximum context length"):
        embedder.embed([long_text], truncate=False)


@pytest.mark.parametrize("kind", ["qwen3", "bert"])
def test_int8_imports_load_and_stay_close(tmp_path, kind):
    """Quantized layers of a bare Qwen3Model are found under their `model.` names too."""
    embedder, checkpoint = imported_embedder(tmp_path, kind, "mean", "int8", "native")
    vector = np.array(embedder.embed(["hello world the fox"]).vectors[0])
    reference = reference_embedding(checkpoint, kind, "hello world the fox", "mean")
    assert float(vector @ reference) >= 0.999


def test_forward_groups_sort_by_length_within_the_token_budget():
    assert forward_groups([5, 2, 9, 3], budget=100) == [[1, 3, 0, 2]]
    assert forward_groups([5, 2, 9, 3], budget=10) == [[1, 3], [0], [2]]
    assert forward_groups([], budget=10) == []


def test_a_batch_split_across_forwards_keeps_order_and_values(tmp_path):
    embedder, _ = imported_embedder(tmp_path, "bert", "mean")
    whole = embedder.embed(TEXTS)
    embedder.forward_tokens = 12  # every text in a forward of its own, or two short ones
    split = embedder.embed(TEXTS)
    assert np.allclose(whole.vectors, split.vectors, atol=1e-5)
    assert split.prompt_eval_count == whole.prompt_eval_count
