"""A GGUF file's tokenizer metadata -> the `tokenizer.json` and `tokenizer_config.json` layers a
safetensors model would carry, so ModelTokenizer serves both kinds of model the same way.

`tokenizer.ggml.model` "gpt2" is byte-level BPE (`tokens`, `merges`), pre-tokenized with the
regex llama.cpp uses for the file's `tokenizer.ggml.pre`; "llama" is SentencePiece-style BPE over
`tokens` ranked by `scores`, with byte fallback. Control tokens (`token_type` 3) and user-defined
ones (4) become added tokens, so they are matched whole, as llama.cpp does.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from registry.digests import Digest
from registry.store import Store, atomic_write
from runner.gguf_load import GGUFFile, GGUFLoadError, open_gguf

_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# tokenizer.ggml.pre -> (split regex, ignore_merges), after llama.cpp's llama-vocab.cpp.
PRE_TOKENIZERS = {
    "llama-bpe": (_LLAMA3, True), "llama3": (_LLAMA3, True), "smaug-bpe": (_LLAMA3, False),
    "qwen2": (_QWEN2, False), "deepseek-r1-qwen": (_QWEN2, False),
    "gpt-2": (_GPT2, False), "gpt2": (_GPT2, False), "default": (_GPT2, False),
}
CONTROL, USER_DEFINED = 3, 4
CACHE_VERSION = 1  # raise when the files built from the same metadata change


def tokenizer_files(file: GGUFFile) -> dict[str, bytes]:
    """`tokenizer.json` and `tokenizer_config.json` built from the file's metadata."""
    return build_tokenizer(file)[1]


def cached_files(store: Store, digest: Digest) -> dict[str, bytes] | None:
    """The tokenizer files built for this GGUF blob before (at create, or by an earlier load),
    or None: missing, unreadable, or built by another version of this module."""
    try:
        cached = json.loads(store.derived_path(digest, "tokenizer").read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(cached, dict) or cached.get("version") != CACHE_VERSION:
        return None
    files = cached.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        return None
    return {name: text.encode() for name, text in files.items()}


def cache_files(store: Store, digest: Digest, files: dict[str, bytes]) -> None:
    """Keep the built files beside the blob's metadata: a load then parses one JSON string
    instead of building from the metadata's token arrays, whose ~100k Python objects leave
    ~5 MiB of the runner's heap resident after they are freed."""
    document = {"version": CACHE_VERSION,
                "files": {name: data.decode() for name, data in files.items()}}
    atomic_write(store.derived_path(digest, "tokenizer"), json.dumps(document).encode())


def ensure_cached(store: Store, digest: Digest) -> None:
    """Build and cache the blob's tokenizer files unless cached (create calls this for every
    GGUF model it wraps); a tokenizer this module cannot build is left to the load to report."""
    if cached_files(store, digest) is not None:
        return
    try:
        files = tokenizer_files(open_gguf(store.blob_path(digest)))
    except Exception:
        return
    cache_files(store, digest, files)


def build_tokenizer(file: GGUFFile) -> tuple[Tokenizer, dict[str, bytes]]:
    """The tokenizer built from the file's metadata, and its files (`tokenizer_files`): the
    runner serves with this object rather than parsing its JSON a second time (a 32k
    vocabulary's parse peaks ~15 MB above what the tokenizer then holds)."""
    kind = file.field("tokenizer.ggml.model")
    tokens = file.field("tokenizer.ggml.tokens")
    if not kind or not tokens:
        raise GGUFLoadError("GGUF has no tokenizer (tokenizer.ggml.model and .tokens)")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(file, tokens)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(file, tokens)
    else:
        raise GGUFLoadError(f"GGUF tokenizer model {kind!r} is not supported (gpt2, llama)")
    _add_special(tokenizer, tokens, file.field("tokenizer.ggml.token_type") or [])
    config = _tokenizer_config(file, tokens, kind)
    return tokenizer, {"tokenizer.json": tokenizer.to_str().encode(),
                       "tokenizer_config.json": json.dumps(config).encode()}


def eos_ids(file: GGUFFile) -> list[int]:
    """Every id that ends generation: EOS, end-of-turn and end-of-message."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [file.field(f"tokenizer.ggml.{key}") for key in keys]
    return [i for i in ids if isinstance(i, int)]


def _byte_level_bpe(file: GGUFFile, tokens: list[str]) -> Tokenizer:
    pre = str(file.field("tokenizer.ggml.pre") or "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFLoadError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
                            f"{', '.join(sorted(PRE_TOKENIZERS))}")
    pattern, ignore_merges = PRE_TOKENIZERS[pre]
    merges = [tuple(m.split(" ", 1)) for m in file.field("tokenizer.ggml.merges") or []]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(file: GGUFFile, tokens: list[str]) -> Tokenizer:
    """SentencePiece BPE as transformers converts it: merges rebuilt from the scores."""
    scores = file.field("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = []
    for piece in sorted(vocab, key=lambda t: -scores[vocab[t]]):
        merges += [(piece[:i], piece[i:], vocab[piece]) for i in range(1, len(piece))
                   if piece[:i] in vocab and piece[i:] in vocab]
    merges.sort(key=lambda m: (-scores[m[2]], vocab[m[0]], vocab[m[1]]))
    unk = file.field("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(models.BPE(vocab, [(a, b) for a, b, _ in merges],
                                     unk_token=tokens[unk] if isinstance(unk, int) else None,
                                     fuse_unk=True, byte_fallback=True))
    prefix = file.field("tokenizer.ggml.add_space_prefix")
    steps = [normalizers.Prepend("▁")] if prefix is not False else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if prefix is not False else []),
    ])
    return tokenizer


def _add_special(tokenizer: Tokenizer, tokens: list[str], types: list[int]) -> None:
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i, t in enumerate(types) if t == CONTROL])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                          for i, t in enumerate(types) if t == USER_DEFINED])


def _tokenizer_config(file: GGUFFile, tokens: list[str], kind: str) -> dict[str, Any]:
    def token(key: str) -> str | None:
        index = file.field(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    add_bos = file.field("tokenizer.ggml.add_bos_token")
    config: dict[str, Any] = {
        "bos_token": token("bos"), "eos_token": token("eos"), "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "add_bos_token": bool(add_bos) if add_bos is not None else kind == "llama",
    }
    template = file.field("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return config
