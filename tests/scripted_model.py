"""Scripted fixture checkpoints: tiny llama checkpoints whose weights emit a chosen token chain.

Random weights cannot be asked to reason or call tools, so a test that needs an exact
`<think>…</think>` or `<tool_call>` answer builds a model that can only say one thing. Each
piece of the script becomes one token (added to the fixture's tokenizer unless it already is
one), every decoder layer is silenced (zero `o_proj` and `down_proj`, so the residual stream is
the embedding itself), and the embedding/output pair is a successor table: a token outside the
script points to the first piece, piece i to piece i+1, the last piece to EOS. Whatever the
prompt, greedy decoding then emits the script; a prompt that already ends inside the script
(a template that writes `<think></think>` itself) continues from there, as a real model would.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file
from tokenizers import AddedToken, Tokenizer

EOS_ID = 1  # <|end_of_text|> in make_checkpoint.py
LOGIT = 20.0  # the successor's logit per unit of normalised hidden state: a decisive margin

# A Qwen3-style template: tools in the system turn, thinking on unless enable_thinking is false,
# previous turns' reasoning and calls written back, tool results as `tool` turns.
THINKING_TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message.get('thinking') %}<think>{{ message['thinking'] }}</think>{% endif %}"
    "{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "<tool_call>{{ call['function'] | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)

# The fixture's own template: no tools, no thinking.
PLAIN_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _script_ids(tokenizer: Tokenizer, script: Sequence[str]) -> list[int]:
    """One token id per piece (adding the pieces that are not single tokens already)."""
    new = [p for p in script if len(tokenizer.encode(p, add_special_tokens=False).ids) != 1]
    tokenizer.add_tokens([AddedToken(p, normalized=False, special=False) for p in new])
    ids = []
    for piece in script:
        encoded = tokenizer.encode(piece, add_special_tokens=False).ids
        if len(encoded) != 1:
            raise ValueError(f"script piece {piece!r} is not one token: {encoded}")
        ids.append(encoded[0])
    if len(set(ids)) != len(ids):
        raise ValueError("a script piece appears twice: its successor would be ambiguous")
    return ids


def _successor_weights(ids: list[int], vocab: int, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """(embed_tokens, lm_head): slot 0 for every other token, slot i+1 for piece i."""
    if len(ids) + 1 > hidden:
        raise ValueError(f"a script of {len(ids)} pieces needs more than {hidden} slots")
    embed = np.zeros((vocab, hidden), np.float32)
    embed[:, 0] = 1.0
    head = np.zeros((vocab, hidden), np.float32)
    head[ids[0], 0] = LOGIT
    for slot, token in enumerate(ids, start=1):
        embed[token] = 0.0
        embed[token, slot] = 1.0
        following = ids[slot] if slot < len(ids) else EOS_ID
        head[following, slot] = LOGIT
    return embed, head


def _silenced(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Layers that add nothing to the residual stream; unit norm gains."""
    out = {}
    for name, value in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            value = np.zeros_like(value)
        elif name.endswith("norm.weight"):
            value = np.ones_like(value)
        out[name] = value.astype(np.float32)
    return out


def write_scripted_checkpoint(base: Path, out: Path, script: Sequence[str],
                              chat_template: str = THINKING_TOOLS_TEMPLATE) -> Path:
    """Copy the float32 llama fixture at `base` to `out`, scripted to say `script`."""
    shutil.copytree(base, out, dirs_exist_ok=True)
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    ids = _script_ids(tokenizer, script)
    tokenizer.save(str(out / "tokenizer.json"))
    config = json.loads((base / "config.json").read_text())
    vocab = max(tokenizer.get_vocab_size(with_added_tokens=True), config["vocab_size"])
    config.update(vocab_size=vocab, torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok_config = json.loads((base / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    weights = _silenced(load_file(str(base / "model.safetensors")))
    weights["model.embed_tokens.weight"], weights["lm_head.weight"] = _successor_weights(
        ids, vocab, config["hidden_size"])
    save_file(weights, str(out / "model.safetensors"))
    return out


def create_scripted_model(store: object, name: str, checkpoint: Path,
                          parameters: dict | None = None, template: str | None = None) -> str:
    """Create `name` from a scripted checkpoint in `store` (greedy by default); its name."""
    from registry.names import Name
    from workflows.create import CreateOptions, create

    options = CreateOptions(parameters=parameters or {"temperature": 0, "seed": 1},
                            template=template)
    create(Name.parse_valid(name), checkpoint, options, store,  # type: ignore[arg-type]
           progress=lambda event: None, cancel=threading.Event())
    return name


@contextlib.contextmanager
def serve_scripted_models(home: Path, make_checkpoint: Callable[..., Path],
                          models: dict[str, tuple]) -> Iterator[str]:
    """A real model server whose store holds `models`:
    {name: (script, chat template) or (script, chat template, Modelfile TEMPLATE)}."""
    from conftest import serve_app

    from ferry.app import build_model_server
    from ferry.config import Settings
    from registry.store import Store

    settings = Settings.from_env({"FERRY_HOME": str(home)})
    store = Store(settings.models_dir)
    store.root.mkdir(parents=True, exist_ok=True)
    base = make_checkpoint("llama", "tiny", "float32")
    for index, (name, (script, template, *modelfile)) in enumerate(models.items()):
        checkpoint = write_scripted_checkpoint(base, home / f"ckpt-{index}", script, template)
        create_scripted_model(store, name, checkpoint, template=next(iter(modelfile), None))
    with serve_app(build_model_server(settings)) as url:
        yield url
