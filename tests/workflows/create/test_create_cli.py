"""`ferry create` end to end: Modelfile, hashing, HEAD, upload, create, then list/show."""

from __future__ import annotations

import httpx
import pytest

from ferry.cli import main
from registry import media_types as mt
from workflows.create.errors import CreateError
from workflows.create.modelfile import parse_modelfile

from .helpers import read_model

MODELFILE = '''# a tiny model
FROM {source}
PARAMETER temperature 0.25
PARAMETER stop "<|im_end|>"
PARAMETER stop "<|end_of_text|>"
PARAMETER num_ctx 1024
SYSTEM """You are terse.
Very terse."""
LICENSE MIT
MESSAGE user Hi
MESSAGE assistant Hello!
'''


@pytest.fixture
def cli_env(model_server, settings, monkeypatch):
    monkeypatch.setenv("FERRY_HOST", model_server.removeprefix("http://"))
    monkeypatch.setenv("FERRY_HOME", str(settings.home))  # the CLI's digest cache goes there
    return model_server


def test_ferry_create_with_modelfile_quantizes_and_lists(cli_env, store, make_checkpoint,
                                                         tmp_path, capsys):
    ckpt = make_checkpoint("llama")
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(MODELFILE.format(source=ckpt))
    assert main(["create", "me/tiny", "-f", str(modelfile), "--quantize", "int4"]) == 0
    manifest, config = read_model(store, "me/tiny")
    assert config.file_type == "int4"
    kinds = [x["mediaType"] for x in manifest["layers"]]
    assert kinds[-4:] == [mt.SYSTEM, mt.PARAMS, mt.LICENSE, mt.MESSAGES]
    tags = httpx.get(f"{cli_env}/api/tags").json()["models"]
    assert tags[0]["name"] == "me/tiny:latest"
    assert tags[0]["details"]["quantization_level"] == "int4"
    assert tags[0]["details"]["family"] == "llama"
    show = httpx.post(f"{cli_env}/api/show", json={"model": "me/tiny"}).json()
    assert show["system"] == "You are terse.\nVery terse."
    assert show["messages"] == [{"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "Hello!"}]
    capsys.readouterr()
    # Second run: every blob is already on the server, so nothing is uploaded again.
    assert main(["create", "me/tiny2", "-f", str(modelfile), "--quantize", "int4"]) == 0
    err = capsys.readouterr().err
    assert "uploaded" not in err and err.count("using existing") == 5
    assert read_model(store, "me/tiny2")[0]["layers"] == manifest["layers"]


def test_ferry_create_without_modelfile_uses_the_current_dir(cli_env, store, make_checkpoint,
                                                             monkeypatch):
    monkeypatch.chdir(make_checkpoint("qwen3", shard_mb=1.0))
    assert main(["create", "me/q3"]) == 0
    _, config = read_model(store, "me/q3")
    assert config.model_family == "qwen3" and config.file_type == "BF16"


def test_ferry_create_from_an_existing_model_adds_a_draft(cli_env, store, make_checkpoint,
                                                          tmp_path):
    (tmp_path / "base").write_text(f"FROM {make_checkpoint('llama')}\n")
    assert main(["create", "me/base", "-f", str(tmp_path / "base"), "-q", "int8"]) == 0
    draft = make_checkpoint("llama", seed=1)
    (tmp_path / "mf").write_text(f"FROM me/base\nDRAFT {draft}\nSYSTEM s\n")
    assert main(["create", "me/spec", "-f", str(tmp_path / "mf"),
                 "--draft-quantize", "int4"]) == 0
    base, _ = read_model(store, "me/base")
    spec, config = read_model(store, "me/spec")
    assert spec["layers"][:len(base["layers"])] == base["layers"]
    assert config.draft and config.draft["tensor_prefix"] == "draft."
    assert config.file_type == "int8"
    assert any(x.get("name") == "draft/config.json" for x in spec["layers"])


def test_ferry_create_reports_server_errors(cli_env, make_checkpoint, tmp_path, capsys):
    (tmp_path / "Modelfile").write_text(f"FROM {make_checkpoint('llama')}\n")
    assert main(["create", "me/x", "-f", str(tmp_path / "Modelfile"), "-q", "int3"]) == 1
    assert "unsupported quantize type 'int3'" in capsys.readouterr().err


def test_modelfile_parser_handles_quotes_comments_and_case():
    parsed = parse_modelfile('from ./m\n# note\nTEMPLATE """{{ .Prompt }}\n"""\n'
                             'parameter Stop "a \\"b\\""\nREQUIRES 0.20.0\n')
    assert parsed.from_ == "./m" and parsed.template == "{{ .Prompt }}\n"
    assert parsed.typed_parameters() == {"stop": ['a "b"']}
    assert parsed.requires == "0.20.0"
    for bad in ("PARAMETER x 1\n", "FROM a\nBOGUS x\n", 'FROM a\nSYSTEM """open\n',
                "FROM a\nPARAMETER num_ctx lots\n"):
        with pytest.raises(CreateError):
            parse_modelfile(bad).typed_parameters()


def test_ferry_create_from_a_gguf_keeps_its_digest(cli_env, store, tmp_path):
    from registry.digests import sha256_file

    from .gguf_files import write_gguf

    path = write_gguf(tmp_path / "weights.gguf")
    (tmp_path / "Modelfile").write_text("FROM ./weights.gguf\nSYSTEM hello\n")
    assert main(["create", "me/g", "-f", str(tmp_path / "Modelfile")]) == 0
    manifest, config = read_model(store, "me/g")
    assert manifest["layers"][0]["digest"] == str(sha256_file(str(path))[0])
    assert config.model_format == "gguf"
    assert main(["create", "me/g2", "-f", str(tmp_path / "Modelfile"), "-q", "int4"]) == 1
