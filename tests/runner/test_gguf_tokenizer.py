"""The tokenizer built from GGUF metadata encodes exactly as the checkpoint's tokenizer.json,
for the pre-tokenizers llama.cpp names (`gpt-2`, `llama-bpe`, `qwen2`)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from gguf_export import export_gguf
from tokenizers import Tokenizer, models, normalizers, trainers

from runner.gguf_load import GGUFLoadError, open_gguf
from runner.gguf_tokenizer import PRE_TOKENIZERS, eos_ids, tokenizer_files
from runner.tokenizer import ModelTokenizer

TEXT = ("Hello world! It's 2026, and we're testing 12345 tokens.\n\n  Indented line\t tab. "
        "Grüße aus München, ça va? Привет, мир! 你好，世界。こんにちは 🤖🚢 "
        "<|im_start|>user\nhi<|im_end|>")


def _with_pre_tokenizer(checkpoint: Path, pre: str) -> str:
    """The checkpoint's tokenizer.json with the HF pre-tokenizer that `pre` stands for."""
    data = json.loads((checkpoint / "tokenizer.json").read_text())
    pattern = PRE_TOKENIZERS[pre][0]
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": False}]}
    return json.dumps(data)


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_gguf_tokenizer_ids_match_tokenizer_json(make_checkpoint, tmp_path, pre):
    checkpoint = Path(make_checkpoint("llama"))
    source = None if pre == "gpt-2" else _with_pre_tokenizer(checkpoint, pre)
    path = export_gguf(checkpoint, tmp_path / "m.gguf", pre=pre, tokenizer_json=source)
    files = tokenizer_files(open_gguf(path))
    ours = Tokenizer.from_str(files["tokenizer.json"].decode())
    reference = Tokenizer.from_str(source or (checkpoint / "tokenizer.json").read_text())
    want = reference.encode(TEXT, add_special_tokens=False).ids
    assert ours.encode(TEXT, add_special_tokens=False).ids == want
    assert ours.decode(want, skip_special_tokens=False) == TEXT


def test_gguf_tokenizer_config_carries_specials_eos_and_chat_template(make_checkpoint,
                                                                      tmp_path):
    checkpoint = Path(make_checkpoint("llama"))
    gguf = open_gguf(export_gguf(checkpoint, tmp_path / "m.gguf"))
    files = tokenizer_files(gguf)
    config = json.loads(files["tokenizer_config.json"])
    assert config["bos_token"] == "<|begin_of_text|>"
    assert config["eos_token"] == "<|end_of_text|>"
    assert "<|im_start|>" in config["chat_template"]
    assert eos_ids(gguf) == [1, 3]
    tokenizer = ModelTokenizer(files, {"eos_token_id": eos_ids(gguf)})
    prompt = tokenizer.render([{"role": "user", "content": "hi"}])
    assert prompt.startswith("<|begin_of_text|><|im_start|>user\nhi<|im_end|>")
    assert tokenizer.encode("<|im_start|>")[0] == 2


def test_unknown_pre_tokenizer_is_refused_by_name(make_checkpoint, tmp_path):
    path = export_gguf(Path(make_checkpoint("llama")), tmp_path / "m.gguf", pre="mystery")
    with pytest.raises(GGUFLoadError, match="pre-tokenizer 'mystery'"):
        tokenizer_files(open_gguf(path))


def _spm_style_tokenizer() -> Tokenizer:
    """A SentencePiece-style BPE (▁ for spaces, byte fallback), as Llama 2, Mistral and Gemma
    GGUFs describe with `tokenizer.ggml.model = llama`; trained here on a little text."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=specials,
                                  show_progress=False)
    tok.train_from_iterator([TEXT.replace("<|im_start|>", "").replace("<|im_end|>", ""),
                             "the quick brown fox jumps over the lazy dog"] * 20, trainer)
    return tok


def test_sentencepiece_gguf_tokenizer_ids_match(tmp_path):
    reference = _spm_style_tokenizer()
    vocab = reference.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    writer = gguf.GGUFWriter(tmp_path / "spm.gguf", "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])  # SPM BPE: -rank
    writer.add_token_types([3 if t in ("<unk>", "<s>", "</s>") else 6 if t.startswith("<0x")
                            else 1 for t in tokens])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    files = tokenizer_files(open_gguf(tmp_path / "spm.gguf"))
    ours = Tokenizer.from_str(files["tokenizer.json"].decode())
    text = "Hello world, the lazy fox! Grüße aus München 你好 🤖"  # CJK/emoji: byte fallback
    want = reference.encode(text, add_special_tokens=False).ids
    assert ours.encode(text, add_special_tokens=False).ids == want
    assert ours.decode(want) == text
    assert json.loads(files["tokenizer_config.json"])["add_bos_token"] is True


def test_gguf_without_tokenizer_is_refused_by_the_loader(make_checkpoint, tmp_path):
    path = export_gguf(Path(make_checkpoint("llama")), tmp_path / "m.gguf", tokenizer=False)
    with pytest.raises(GGUFLoadError, match="GGUF has no tokenizer"):
        tokenizer_files(open_gguf(path))
