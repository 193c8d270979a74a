"""GGUF models in the runner: fixture checkpoints exported to GGUF (F16, Q8_0, Q4_0, Q4_1) with
the `gguf` package, created as ferry models (wrapped unchanged) and loaded beside the same
checkpoint created from safetensors."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import gguf
import mlx.core as mx
import mlx_lm
import mlx_models
import numpy as np
import pytest
from arch_checkpoints import write_checkpoint
from gguf_export import export_gguf
from kquants import quantize_q4_k, quantize_q6_k
from mlx.utils import tree_flatten
from tokenizers import Tokenizer

from registry import media_types as mt
from registry.names import Name
from runner import generate as generate_module
from runner import gguf_load, gguf_tokenizer, load, server
from runner.generate import Generator
from runner.gguf_embedding import GGUFEmbedding
from runner.gguf_load import GGUFLoadError, convert_tensor, open_gguf
from runner.kv_cache import KVCache, new_caches
from runner.load import LoadError, load_model
from runner.prefix_cache import PrefixCache
from runner.sample import Options
from runner.tokenizer import ModelTokenizer
from workflows.create import CreateError, CreateOptions, GGUFFiles, create

model_store, created_model = mlx_models.model_store, mlx_models.created_model  # fixtures

PROMPT = [0, 2, 379, 480, 203, 76, 698, 346, 351, 73, 3, 2, 1000, 17]
_made: dict[tuple, str] = {}


@pytest.fixture(scope="module")
def gguf_model(model_store, make_checkpoint, tmp_path_factory):
    """`gguf_model(arch, qtype)` -> the name of a model created from the exported GGUF."""

    def build(arch: str, qtype: str = "F16") -> str:
        key = (arch, qtype)
        if key not in _made:
            out = tmp_path_factory.mktemp("gguf") / f"{arch}-{qtype}.gguf"
            path = export_gguf(Path(make_checkpoint(arch)), out, qtype)
            digest = model_store.blob_writer().write_all(path.read_bytes())
            name = f"test/gguf-{arch}-{qtype.lower()}"
            create(Name.parse(name), GGUFFiles({path.name: digest}), CreateOptions(),
                   model_store, lambda event: None, threading.Event())
            _made[key] = name
        return _made[key]

    return build


@dataclass
class RawTensor:
    """A GGUF tensor's bytes held in memory, read the way convert_tensor reads a file's."""

    name: str
    tensor_type: int
    data: np.ndarray

    def available(self) -> int:
        return self.data.size

    def read(self, offset: int, size: int) -> np.ndarray:
        return self.data.reshape(-1)[offset:offset + size]


def _cosine_min(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    cos = mx.sum(a * b, -1) / (mx.linalg.norm(a, axis=-1) * mx.linalg.norm(b, axis=-1))
    return cos.min().item()


def _greedy(loaded, count: int = 32) -> str:
    tokenizer = ModelTokenizer(loaded.files.files, loaded.files.config)
    tokenizer.eos_ids.clear()  # random weights: compare all `count`, never stop early
    generator = Generator(loaded.model, tokenizer, loaded.context_length)
    pieces = list(generator.generate(PROMPT, Options(temperature=0, num_predict=count)))
    assert pieces.pop().eval_count == count
    return "".join(pieces)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_f16_gguf_logits_and_greedy_tokens_match_the_safetensors_checkpoint(
        model_store, created_model, gguf_model, arch):
    reference = load_model(model_store, created_model(arch), "float32")
    loaded = load_model(model_store, gguf_model(arch, "F16"), "float32")
    tokens = mx.array([PROMPT])
    assert mx.abs(loaded.model(tokens) - reference.model(tokens)).max().item() <= 1e-2
    assert _greedy(loaded) == _greedy(reference)


@pytest.mark.parametrize("qtype", ["BF16", "F32"])
def test_bf16_and_f32_gguf_hold_the_checkpoint_exactly(model_store, created_model, gguf_model,
                                                       qtype):
    reference = load_model(model_store, created_model("llama"), "float32")
    loaded = load_model(model_store, gguf_model("llama", qtype), "native")
    want = {"BF16": mx.bfloat16, "F32": mx.float32}[qtype]
    assert loaded.model.model.embed_tokens(mx.array([PROMPT])).dtype == want  # the file's rows
    tokens = mx.array([PROMPT])
    ours = loaded.model(tokens).astype(mx.float32)
    assert _cosine_min(ours, reference.model(tokens)) >= 0.999


@pytest.mark.parametrize("qtype,threshold", [("Q8_0", 0.99), ("Q4_0", 0.95), ("Q4_1", 0.95)])
@pytest.mark.parametrize("compute", ["native", "float32"])
def test_quantized_gguf_logits_close_to_float(model_store, created_model, gguf_model, qtype,
                                              threshold, compute):
    reference = load_model(model_store, created_model("llama"), "float32")
    loaded = load_model(model_store, gguf_model("llama", qtype), compute)
    tokens = mx.array([PROMPT])
    assert _cosine_min(loaded.model(tokens), reference.model(tokens)) >= threshold


@pytest.mark.parametrize("qtype,half", [("Q8_0", mx.float16), ("Q4_0", mx.float16),
                                        ("F16", mx.float16), ("BF16", mx.bfloat16)])
def test_native_path_computes_in_the_files_half_type(model_store, gguf_model, qtype, half,
                                                     monkeypatch):
    """GGUF stores norms as F32; kept so they would promote every activation and the KV cache
    to float32 (twice the memory). An all-F32 file stays float32 (above). On a CPU they are kept
    (half activations are slow there); the GPU's choice is forced here."""
    as_here = load_model(model_store, gguf_model("llama", qtype), "native")
    here = half if gguf_load.half_activations() else mx.float32  # a GPU's choice is half
    assert as_here.model.layers[0].input_layernorm.weight.dtype == here
    monkeypatch.setattr(gguf_load, "half_activations", lambda: True)
    loaded = load_model(model_store, gguf_model("llama", qtype), "native")
    layer = loaded.model.layers[0]
    assert layer.input_layernorm.weight.dtype == half
    assert loaded.model.model.norm.weight.dtype == half
    cache = [KVCache() for _ in loaded.model.layers]
    logits = loaded.model(mx.array([PROMPT]), cache)
    assert logits.dtype == half
    assert cache[0].state[0].dtype == half
    float32 = load_model(model_store, gguf_model("llama", qtype), "float32")
    threshold = 0.99 if qtype != "Q4_0" else 0.98
    assert _cosine_min(logits, float32.model(mx.array([PROMPT]))) >= threshold


@pytest.mark.parametrize("arch,qtype,compute", [
    ("qwen2", "F16", "float32"), ("mistral", "F16", "float32"), ("gemma3", "F16", "float32"),
    ("qwen3_moe", "F16", "float32"),
    ("qwen3_moe", "Q8_0", "native")])
def test_gguf_of_other_architectures_matches_mlx_lm(model_store, make_checkpoint, tmp_path,
                                                    arch, qtype, compute):
    checkpoint = write_checkpoint(tmp_path / arch, arch, Path(make_checkpoint("llama")))
    path = export_gguf(checkpoint, tmp_path / f"{arch}.gguf", qtype)
    name = _create_raw(model_store, path.read_bytes(), f"test/gguf-{arch}-{qtype}")
    loaded = load_model(model_store, name, compute)
    reference, _ = mlx_lm.load(str(checkpoint))
    reference.set_dtype(mx.float32)
    tokens = mx.array([PROMPT])
    ours, theirs = loaded.model(tokens), reference(tokens)
    if qtype == "F16":
        assert mx.abs(ours - theirs).max().item() <= 1e-2
    else:
        assert _cosine_min(ours, theirs) >= 0.99


def test_llama3_rope_scaling_travels_as_rope_freqs(model_store, make_checkpoint, tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    checkpoint = write_checkpoint(tmp_path / "l3", "llama", Path(make_checkpoint("llama")),
                                  rope_scaling=scaling, num_hidden_layers=2)
    path = export_gguf(checkpoint, tmp_path / "l3.gguf", "F16")
    loaded = load_model(model_store, _create_raw(model_store, path.read_bytes(), "test/l3"),
                        "float32")
    assert loaded.files.config["rope_scaling"]["rope_type"] == "freq_factors"
    reference, _ = mlx_lm.load(str(checkpoint))
    reference.set_dtype(mx.float32)
    tokens = mx.array([PROMPT * 6])  # past the original context, where the scaling matters
    assert mx.abs(loaded.model(tokens) - reference(tokens)).max().item() <= 1e-2


def test_q4_0_stays_quantized_at_group_size_32(model_store, gguf_model):
    loaded = load_model(model_store, gguf_model("qwen3", "Q4_0"), "native")
    layer = loaded.model.layers[0].self_attn.q_proj
    assert layer.bits == 4 and layer.group_size == 32 and layer.weight.dtype == mx.uint32
    assert loaded.model.model.embed_tokens.bits == 4  # tied output reads the quantized table


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_0"), ("qwen3", "Q8_0")])
def test_symmetric_types_hold_no_biases_and_compute_the_same_logits(model_store, gguf_model,
                                                                    monkeypatch, arch, qtype):
    """Q4_0 and Q8_0 biases are -8 and -128 times their scales: on the native path the layers
    hold the scales only and derive the biases per call, bitwise the same weights as stored
    biases give (qwen3's head is its tied, quantized embedding: lookups and logits both)."""
    derived = load_model(model_store, gguf_model(arch, qtype), "native")
    flat = dict(tree_flatten(derived.model.parameters()))
    assert not [k for k in flat if k.endswith(".biases")]
    assert derived.model.layers[0].mlp.up_proj.zero_point == {"Q4_0": 8, "Q8_0": 128}[qtype]
    monkeypatch.setattr(gguf_load, "_ZERO_POINTS", {})  # as before: biases stored
    stored = load_model(model_store, gguf_model(arch, qtype), "native")
    biases = sum(v.nbytes for k, v in tree_flatten(stored.model.parameters())
                 if k.endswith(".biases"))
    assert biases > 0 and derived.weights_bytes == stored.weights_bytes - biases
    tokens = mx.array([PROMPT])
    assert mx.array_equal(derived.model(tokens), stored.model(tokens))


def test_asymmetric_types_keep_their_biases(model_store, gguf_model):
    """Q4_1's offsets are its own (w = d q + m), not a multiple of the scale: kept."""
    loaded = load_model(model_store, gguf_model("llama", "Q4_1"), "native")
    layer = loaded.model.layers[0].mlp.up_proj
    assert "biases" in layer and layer.zero_point is None


@pytest.fixture
def on_cpu():
    """What the loader does on a CPU, tested on the CPU also where MLX has a GPU (MLX's default
    device there is the GPU, which takes the other branch)."""
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(previous)


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "F16"])
def test_cpu_native_untied_embedding_is_read_from_the_file(model_store, gguf_model, monkeypatch,
                                                          qtype):
    """An untied token embedding only serves lookups: on a CPU's native path it stays in the
    GGUF file and each lookup reads and converts its rows, bitwise the loaded table's."""
    name = gguf_model("llama", qtype)
    mapped = load_model(model_store, name, "native")
    embedding = mapped.model.model.embed_tokens
    assert isinstance(embedding, GGUFEmbedding) and not tree_flatten(embedding.parameters())
    monkeypatch.setattr(load, "row_embedding", lambda *args: None)
    loaded = load_model(model_store, name, "native")
    table = sum(v.nbytes for _, v in tree_flatten(loaded.model.model.embed_tokens.parameters()))
    assert mapped.weights_bytes == loaded.weights_bytes - table
    tokens = mx.array([PROMPT, PROMPT[::-1]])
    assert mx.array_equal(embedding(tokens), loaded.model.model.embed_tokens(tokens))
    assert mx.array_equal(mapped.model(tokens), loaded.model(tokens))
    with pytest.raises(IndexError, match="out of range"):
        embedding(mx.array([[mapped.files.config["vocab_size"]]]))


def test_embedding_is_loaded_where_it_is_not_only_a_lookup_table(model_store, gguf_model,
                                                                 monkeypatch):
    """A tied embedding is also the output head; on a GPU a host read per token would stall
    the pipeline: both load the table."""
    tied = load_model(model_store, gguf_model("qwen3", "Q4_0"), "native")
    assert not isinstance(tied.model.model.embed_tokens, GGUFEmbedding)
    monkeypatch.setattr(load, "half_activations", lambda: True)
    on_gpu = load_model(model_store, gguf_model("llama", "Q4_0"), "native")
    assert not isinstance(on_gpu.model.model.embed_tokens, GGUFEmbedding)


def _create_raw(store, raw: bytes, name: str) -> str:
    digest = store.blob_writer().write_all(raw)
    create(Name.parse(name), GGUFFiles({"m.gguf": digest}), CreateOptions(), store,
           lambda event: None, threading.Event())
    return name


def test_gguf_with_unknown_architecture_is_a_clear_load_error(model_store, make_checkpoint,
                                                              tmp_path):
    raw = export_gguf(Path(make_checkpoint("llama")), tmp_path / "m.gguf").read_bytes()
    length = len(b"llama").to_bytes(8, "little")
    raw = raw.replace(b"llama.", b"llamo.").replace(length + b"llama", length + b"llamo")
    name = _create_raw(model_store, raw, "test/llamo")
    with pytest.raises(LoadError, match="architecture 'llamo' is not supported"):
        load_model(model_store, name, "native")


def test_truncated_gguf_is_refused_at_create(model_store, make_checkpoint, tmp_path):
    raw = export_gguf(Path(make_checkpoint("llama")), tmp_path / "m.gguf", "Q8_0").read_bytes()
    with pytest.raises(CreateError, match=r"truncated GGUF: tensor \S+ runs past the end"):
        _create_raw(model_store, raw[:-5000], "test/truncated")


def test_truncated_tensor_data_is_a_clear_load_error(make_checkpoint, tmp_path):
    """What the loader checks itself, for a file that got past create some other way."""
    path = export_gguf(Path(make_checkpoint("llama")), tmp_path / "m.gguf", "Q8_0")
    tensor = open_gguf(path).tensors["blk.0.attn_q.weight"]
    short = RawTensor(tensor.name, tensor.tensor_type, tensor.data[:-1])
    with pytest.raises(GGUFLoadError, match=r"blk\.0\.attn_q\.weight is truncated"):
        convert_tensor(short, (128, 128), "native")


def test_gguf_tensor_disagreeing_with_its_metadata_is_named(model_store, make_checkpoint,
                                                           tmp_path):
    path = export_gguf(Path(make_checkpoint("llama")), tmp_path / "m.gguf",
                       metadata={"intermediate_size": 256})
    name = _create_raw(model_store, path.read_bytes(), "test/badshape")
    with pytest.raises(LoadError, match=r"GGUF tensor blk\.\d+\.ffn_\w+\.weight has shape "
                                        r"\[\d+, \d+\] but the metadata implies"):
        load_model(model_store, name, "native")


@pytest.mark.parametrize("kind,quantizer,bits", [("Q4_K", quantize_q4_k, 4),
                                                 ("Q6_K", quantize_q6_k, 6)])
def test_k_quant_tensor_becomes_mlx_affine_no_coarser_than_its_source(kind, quantizer, bits):
    x = np.random.default_rng(1).standard_normal((64, 512)).astype(np.float32) * 0.02
    raw = quantizer(x)
    source = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))
    tensor = RawTensor("blk.0.attn_q.weight", getattr(gguf.GGMLQuantizationType, kind), raw)
    parts, qtype = convert_tensor(tensor, (64, 512), "native")
    assert qtype is not None and qtype.bits == bits and qtype.group_size == 32
    ours = np.array(mx.dequantize(parts["weight"], parts["scales"], parts["biases"],
                                  group_size=32, bits=bits).astype(mx.float32))
    # the conversion moves no value by more than the source's own rounding did
    assert np.abs(ours - source).max() <= np.abs(source - x).max()
    if kind == "Q4_K":  # affine per 32 already: repacked exactly (scales rounded to f16)
        assert np.abs(ours - source).max() <= 1e-4


def test_q6_k_keeps_each_groups_coarser_sub_block_and_rounds_the_finer_to_its_step():
    """MLX has no groups of 16: a group of 32 takes the step of its coarser Q6_K sub-block, so
    that one is kept (to the f16 rounding of its step) and the finer one moves by at most half
    that step; stored at 6 bits, not the 8 a float requantization needed."""
    x = np.random.default_rng(3).standard_normal((8, 1024)).astype(np.float32) * 0.02
    x[:, 16:32] *= 4  # a coarse second sub-block
    x[:, 40:48] *= -6  # a coarse first sub-block of a negative scale
    raw = quantize_q6_k(x)
    source = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K)
    tensor = RawTensor("output.weight", gguf.GGMLQuantizationType.Q6_K, raw)
    parts, qtype = convert_tensor(tensor, (8, 1024), "native")
    assert qtype is not None and (qtype.bits, qtype.group_size) == (6, 32)
    assert parts["weight"].shape == (8, 1024 * 6 // 32)
    wide = [parts[k].astype(mx.float32) for k in ("scales", "biases")]  # no f16 arithmetic
    ours = np.array(mx.dequantize(parts["weight"], *wide, group_size=32, bits=6))
    # each sub-block's step: its values are multiples of it
    blocks = raw.reshape(-1, 210)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    step = np.abs(d * blocks[:, 192:208].view(np.int8)).reshape(8, -1, 2)
    coarse = step.max(-1, keepdims=True)
    move = np.abs(ours - source).reshape(8, -1, 2, 16)
    kept = (step == coarse)[..., None]
    assert (move <= np.where(kept, 2 ** -11 * np.abs(source).reshape(move.shape),
                             coarse[..., None] / 2 * (1 + 2 ** -9))).all()
    assert kept.any() and (~kept).any()


def test_q4_k_m_gguf_logits_close_to_float(model_store, make_checkpoint, tmp_path):
    checkpoint = write_checkpoint(tmp_path / "wide", "llama", Path(make_checkpoint("llama")),
                                  hidden_size=256, intermediate_size=512, head_dim=64,
                                  num_hidden_layers=2)
    path = export_gguf(checkpoint, tmp_path / "q4km.gguf", "Q4_K")
    name = _create_raw(model_store, path.read_bytes(), "test/gguf-q4km")
    loaded = load_model(model_store, name, "native")
    assert loaded.model.layers[0].self_attn.q_proj.bits == 4
    assert loaded.model.layers[0].mlp.down_proj.bits == 6  # Q6_K: repacked at 6 bits
    reference, _ = mlx_lm.load(str(checkpoint))
    reference.set_dtype(mx.float32)
    tokens = mx.array([PROMPT])
    assert _cosine_min(loaded.model(tokens), reference(tokens)) >= 0.95


def test_unsupported_quant_type_is_refused_naming_tensor_and_type():
    kind = gguf.GGMLQuantizationType.IQ2_XXS
    block, size = gguf.GGML_QUANT_SIZES[kind]
    tensor = RawTensor("blk.3.ffn_up.weight", kind, np.zeros((4, 256 // block * size), np.uint8))
    with pytest.raises(GGUFLoadError, match=r"blk\.3\.ffn_up\.weight has type IQ2_XXS"):
        convert_tensor(tensor, (4, 256), "native")


def test_requantized_tensor_is_built_in_place_not_beside_its_slabs(monkeypatch):
    """A K-quant converted a slab at a time holds the result once (plus one slab), never the
    slabs and their concatenation together (which doubled the load's peak for a large head)."""
    monkeypatch.setattr(gguf_load, "REQUANT_SLAB_VALUES", 1 << 15)  # 16 rows of 2048: 32 slabs
    kind = gguf.GGMLQuantizationType.Q6_K
    x = np.random.default_rng(2).standard_normal((512, 2048)).astype(np.float32) * 0.02
    tensor = RawTensor("output.weight", kind, quantize_q6_k(x))
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    parts, _ = convert_tensor(tensor, (512, 2048), "native")
    held = sum(p.nbytes for p in parts.values())
    assert mx.get_peak_memory() - before <= 1.3 * held


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K"])
def test_block_tensor_source_is_read_a_slab_at_a_time(monkeypatch, kind):
    """A block tensor's bytes are read a slab of rows at a time as it is converted (a 32k x 768
    Q8_0 head is 26 MB that would otherwise sit beside the weights), with the same result."""
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    x = np.random.default_rng(4).standard_normal((64, 512)).astype(np.float32) * 0.02
    raw = quantize_q6_k(x) if kind == "Q6_K" else gguf.quants.quantize(x, qtype)
    whole, _ = convert_tensor(RawTensor("output.weight", qtype, raw), (64, 512), "native")
    reads: list[int] = []

    class Counted(RawTensor):
        def read(self, offset: int, size: int) -> np.ndarray:
            reads.append(size)
            return super().read(offset, size)

    monkeypatch.setattr(gguf_load, "REQUANT_SLAB_VALUES", 8 * 512)  # 8 rows a slab
    parts, _ = convert_tensor(Counted("output.weight", qtype, raw), (64, 512), "native")
    assert len(reads) == 8 and max(reads) == raw.nbytes // 8
    for key, value in whole.items():
        assert mx.array_equal(parts[key], value)


def test_native_cpu_path_keeps_the_kv_cache_at_two_bytes(model_store, gguf_model, monkeypatch):
    """On a CPU the file's F32 norms keep activations float32 (fast kernels); the KV cache is
    still float16, the 2 bytes a value llama.cpp stores for the same file, not 4."""
    monkeypatch.setattr(gguf_load, "half_activations", lambda: False)
    monkeypatch.setattr(load, "half_activations", lambda: False)
    loaded = load_model(model_store, gguf_model("llama", "Q4_0"), "native")
    caches = new_caches(loaded.model)
    logits = loaded.model(mx.array([PROMPT]), caches)
    assert logits.dtype == mx.float32
    assert {a.dtype for c in caches for a in c.state} == {mx.float16}
    float32 = load_model(model_store, gguf_model("llama", "Q4_0"), "float32")
    assert _cosine_min(logits, float32.model(mx.array([PROMPT]))) >= 0.98


def test_runner_builds_the_tokenizer_before_the_weights(model_store, gguf_model, monkeypatch):
    """The runner's tokenizer is made before the weights load, so its transient buffers never
    sit on top of them; without the cached files it serves with the object built from the
    GGUF's metadata (not parsed again from its JSON), which encodes as the parsed one does."""
    name = gguf_model("llama", "Q8_0")
    digest = _gguf_digest(model_store, name)
    model_store.derived_path(digest, "tokenizer").unlink()
    events: list[tuple[str, object]] = []
    real_tokenizer, real_load = server.ModelTokenizer, server.load_model

    def tokenizer(*args, **kwargs):
        events.append(("tokenizer", args[3] if len(args) > 3 else None))
        return real_tokenizer(*args, **kwargs)

    def weights(*args, **kwargs):
        events.append(("weights", None))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(server, "ModelTokenizer", tokenizer)
    monkeypatch.setattr(server, "load_model", weights)
    state = server.RunnerState(name, "native", mx.clear_cache)
    server.load_into(state, model_store, pytest.fail)
    assert [kind for kind, _ in events] == ["tokenizer", "weights"]
    assert isinstance(events[0][1], Tokenizer)
    assert state.tokenizer is not None and state.tokenizer.tokenizer is events[0][1]
    assert state.loaded is not None and state.loaded.files.tokenizer is None
    files = state.loaded.files.files
    assert "tokenizer.json" not in files  # a text model's served tokenizer holds it parsed
    parsed = ModelTokenizer({**files, "tokenizer.json": events[0][1].to_str().encode()},
                            state.loaded.files.config)
    text = "Hello, world! The quick brown fox jumps over 1234 lazy dogs."
    assert state.tokenizer.encode(text) == parsed.encode(text)
    assert model_store.derived_path(digest, "tokenizer").is_file()  # cached for the next load


def test_tokenizer_files_are_cached_at_create_and_loaded_without_the_arrays(
        model_store, gguf_model, monkeypatch):
    """Create caches the tokenizer files beside the blob's metadata; a load then reads the
    header without the token arrays and builds nothing (their ~100k Python objects left ~5 MiB
    of the runner's heap resident). A cache of another version is rebuilt."""
    name = gguf_model("llama", "Q4_0")
    digest = _gguf_digest(model_store, name)
    cache = model_store.derived_path(digest, "tokenizer")
    assert cache.is_file()
    fresh = load_model(model_store, name, "native").files.files

    def no_build(file):
        raise AssertionError("built the tokenizer although its files are cached")

    monkeypatch.setattr(gguf_tokenizer, "build_tokenizer", no_build)
    opened: list[bool] = []
    real_open = load.open_gguf
    monkeypatch.setattr(load, "open_gguf", lambda path, keep_arrays=True: (
        opened.append(keep_arrays), real_open(path, keep_arrays))[1])
    files = load.read_model_files(model_store, name)
    assert opened == [False] and files.tokenizer is None
    assert files.gguf is not None and files.gguf.field("tokenizer.ggml.tokens") is None
    assert files.files["tokenizer.json"] == fresh["tokenizer.json"]
    monkeypatch.undo()
    stale = json.loads(cache.read_text())
    stale["version"] = -1
    stale["files"]["tokenizer.json"] = "{}"
    cache.write_text(json.dumps(stale))
    assert load.read_model_files(model_store, name).files["tokenizer.json"] == \
        fresh["tokenizer.json"]
    assert json.loads(cache.read_text())["version"] == gguf_tokenizer.CACHE_VERSION
    other = model_store.blob_writer().write_all(b"a blob with files derived from it")
    model_store.derived_path(other, "tokenizer").write_text("{}")
    model_store.delete_blob(other)
    assert not model_store.derived_path(other, "tokenizer").exists()  # gone with its blob


def _gguf_digest(store, name: str):
    manifest = store.get_model(Name.parse_valid(name)).manifest()
    return next(layer.digest for layer in manifest.layers if layer.media_type == mt.MODEL)


@pytest.mark.usefixtures("on_cpu")
def test_decode_on_a_cpu_grows_no_pool_of_freed_buffers(model_store, gguf_model, monkeypatch):
    """Each decode step frees attention buffers one position larger than the last; MLX's pool
    kept every one of them until the next release (every 256 tokens), 17 MiB after 64 tokens
    on the small fixture. On a CPU the loader turns the pool off."""
    mx.set_cache_limit(1 << 40)  # as a fresh process starts
    loaded = load_model(model_store, gguf_model("llama", "Q4_0"), "native")
    pooled: list[int] = []
    read = generate_module.token_id

    def token_id(y: mx.array) -> int:
        pooled.append(mx.get_cache_memory())
        return read(y)

    monkeypatch.setattr(generate_module, "token_id", token_id)
    tokenizer = ModelTokenizer(loaded.files.files, loaded.files.config)
    tokenizer.eos_ids.clear()
    generator = Generator(loaded.model, tokenizer, loaded.context_length)
    list(generator.generate(PROMPT, Options(temperature=0, num_predict=24)))
    assert len(pooled) == 24 and max(pooled) == 0


def test_cpu_native_head_holds_float32_scales_so_decode_casts_nothing(model_store, gguf_model,
                                                                      monkeypatch):
    """With float32 activations MLX would cast a float16 head's scales and biases at every
    token (the request's peak); the loader widens the scales once, exactly, and the symmetric
    head's biases are derived from them in float32 (no cast, no stored copy)."""
    monkeypatch.setattr(gguf_load, "half_activations", lambda: False)
    loaded = load_model(model_store, gguf_model("llama", "Q4_0"), "native")
    head = loaded.model.lm_head
    assert head.scales.dtype == mx.float32 and "biases" not in head and head.zero_point == 8
    assert mx.array_equal(head.scales.astype(mx.float16).astype(mx.float32), head.scales)
    assert loaded.model.layers[0].mlp.down_proj.scales.dtype == mx.float16  # only the head
    x = mx.ones((1, 1, head.scales.shape[-1] * 32), mx.float32)
    mx.eval(x)
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    logits = head(x)
    mx.eval(logits)
    # the derived biases (a scales' worth) and the logits (a quarter of that here); a widened
    # copy of the scales would be another scales' worth
    assert mx.get_peak_memory() - before < 2 * head.scales.nbytes


def test_prefill_never_materialises_the_prompts_logits(model_store, gguf_model):
    """Prefill evaluates only the KV cache: the [prompt, vocabulary] logits of its chunks are
    never computed (for a 32k vocabulary and a 2048-token chunk they would be 256 MB). Its
    peak is measured against the same forward pass with its logits evaluated."""
    loaded = load_model(model_store, gguf_model("llama", "Q8_0"), "native")
    tokenizer = ModelTokenizer(loaded.files.files, loaded.files.config)
    generator = Generator(loaded.model, tokenizer, loaded.context_length)
    prompt = [(i * 7919) % 2000 + 8 for i in range(65)]
    logits = (len(prompt) - 1) * loaded.files.config["vocab_size"] * 4  # float32 rows

    def transient(run) -> int:
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        caches = run()
        return mx.get_peak_memory() - before - sum(a.nbytes for c in caches for a in c.state)

    def prefill():
        match = generator.prefix_cache.begin(prompt, generator.make_caches, ())
        generator.prefill(match)
        assert match.caches[0].offset == len(prompt) - 1
        return match.caches

    def forward():
        caches = new_caches(loaded.model)
        out = loaded.model(mx.array([prompt[:-1]]), caches)
        mx.eval(out, [c.state for c in caches])
        assert out.shape[1] == len(prompt) - 1
        return caches

    generator.prefix_cache = PrefixCache(0)  # keeps nothing: no copies in the measurement
    assert transient(prefill) <= transient(forward) - logits / 2


def test_cpu_native_runner_prefills_in_short_chunks(model_store, gguf_model):
    """On a CPU the native path's runner prefills 64 tokens at a time (no slower there, and a
    quarter of a 256-token chunk's working memory); the cache it fills is the one-chunk one."""
    name = gguf_model("llama", "Q4_0")
    state = server.RunnerState(name, "native", mx.clear_cache)
    server.load_into(state, model_store, pytest.fail)
    assert state.generator is not None and state.generator.prefill_chunk == 64
    assert generate_module.prefill_chunk("float32") == generate_module.PREFILL_CHUNK
    prompt = [(i * 7919) % 2000 + 8 for i in range(200)]

    def last_logits(generator: Generator) -> mx.array:
        match = generator.prefix_cache.begin(prompt, generator.make_caches, ())
        generator.prefill(match)
        return generator.model(mx.array([prompt[-1:]]), match.caches)

    whole = Generator(state.generator.model, state.generator.tokenizer, 4096,
                      prefill_chunk=generate_module.PREFILL_CHUNK, prefix_cache=PrefixCache(0))
    state.generator.prefix_cache = PrefixCache(0)
    assert _cosine_min(last_logits(state.generator), last_logits(whole)) >= 0.9999
