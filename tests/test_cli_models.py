"""`ferry list | show | rm | cp` against a real model server, and without one."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
from conftest import free_port
from fixtures_ollama import TOOLS_TEMPLATE, OllamaModelsDir

from ferry.cli import main
from ferry.commands.models import human_bytes, human_duration, human_time


@pytest.fixture
def cli(model_server, monkeypatch, capsys):
    """Run `ferry ARGS` in-process with FERRY_HOST at the test server; return (rc, out, err)."""
    monkeypatch.setenv("FERRY_HOST", model_server)

    def run(*args: str) -> tuple[int, str, str]:
        rc = main(list(args))
        captured = capsys.readouterr()
        return rc, captured.out, captured.err

    return run


@pytest.fixture
def models(settings) -> OllamaModelsDir:
    return OllamaModelsDir(settings.models_dir)


def test_list_prints_a_model_placed_in_the_store(cli, models):
    raw = models.gguf_model("tiny:latest")
    rc, out, _ = cli("list")
    assert rc == 0
    header, row = out.splitlines()
    assert header.split() == ["NAME", "ID", "SIZE", "MODIFIED"]
    name, model_id, *rest = row.split()
    assert (name, model_id) == ("tiny:latest", hashlib.sha256(raw).hexdigest()[:12])
    assert " ".join(rest).endswith("ago")
    assert header.index("ID") == row.index(model_id)  # columns line up


def test_the_ferry_command_lists_a_model_from_a_separate_process(model_server, models,
                                                                tmp_path):
    models.gguf_model("proc:latest")
    env = {**os.environ, "FERRY_HOST": model_server, "FERRY_HOME": str(tmp_path / "other")}
    result = subprocess.run([sys.executable, "-m", "ferry.cli", "list"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1].split()[0] == "proc:latest"


def test_list_of_an_empty_store_prints_only_the_header(cli):
    rc, out, _ = cli("list")
    assert (rc, out.split()) == (0, ["NAME", "ID", "SIZE", "MODIFIED"])


def test_show_prints_the_summary_and_single_fields(cli, models):
    models.gguf_model("chat:v1", template=TOOLS_TEMPLATE, params={"num_ctx": 2048},
                      license_text="Apache License\nVersion 2.0", system="Be kind.")
    rc, out, _ = cli("show", "chat:v1")
    assert rc == 0
    assert "  Model\n" in out and "architecture" in out and "Q4_0" in out
    assert "  Capabilities\n    completion\n    tools\n" in out
    assert "num_ctx" in out and "2048" in out
    assert "  License\n    Apache License\n    Version 2.0\n" in out
    assert cli("show", "chat:v1", "--template")[1] == TOOLS_TEMPLATE + "\n"
    assert cli("show", "chat:v1", "--license")[1] == "Apache License\nVersion 2.0\n"
    assert cli("show", "chat:v1", "--system")[1] == "Be kind.\n"
    assert cli("show", "chat:v1", "--parameters")[1] == f"{'num_ctx':<30} 2048\n"
    modelfile = cli("show", "chat:v1", "--modelfile")[1]
    assert "# FROM chat:v1\n" in modelfile and "PARAMETER num_ctx 2048\n" in modelfile


def test_show_verbose_prints_metadata_and_tensors(cli, models):
    models.tensor_model("tiny:int4", namespace="me")
    rc, out, _ = cli("show", "me/tiny:int4", "--verbose")
    assert rc == 0
    assert out.startswith("\n  Model\n    architecture       llama\n    parameters         3K\n")
    assert "    requires           0.19.0\n" in out
    assert "  Metadata\n" in out and "llama.block_count" in out
    assert "  Tensors\n" in out
    assert "model.layers.0.mlp.up_proj.weight   INT4   [32, 64]" in out
    assert "Tensors" not in cli("show", "me/tiny:int4")[1]


def test_cp_then_rm_through_the_cli(cli, models, settings):
    models.gguf_model("src:latest")
    assert cli("cp", "src", "dst:v2") == (0, "copied 'src' to 'dst:v2'\n", "")
    rc, out, _ = cli("rm", "src", "dst:v2")
    assert (rc, out) == (0, "deleted 'src'\ndeleted 'dst:v2'\n")
    assert cli("list")[1].split() == ["NAME", "ID", "SIZE", "MODIFIED"]
    assert list((settings.models_dir / "blobs").iterdir()) == []


def test_server_errors_become_one_line_and_exit_1(cli):
    rc, out, err = cli("show", "missing")
    assert (rc, out, err) == (1, "", "Error: model 'missing' not found\n")
    rc, _, err = cli("cp", "../x", "y")
    assert rc == 1 and err.startswith('Error: source "../x" is invalid')


def test_cli_without_a_server_says_to_start_ferry_serve(tmp_path):
    env = {**os.environ, "FERRY_HOST": f"127.0.0.1:{free_port()}",
           "FERRY_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "ferry.cli", "list"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "`ferry serve`" in lines[0]


@pytest.mark.parametrize("size, text", [
    (0, "0 B"), (999, "999 B"), (1000, "1 KB"), (1500, "1.5 KB"), (12_345_678, "12 MB"),
    (4_661_211_424, "4.7 GB"), (2 * 10**12, "2 TB"),
])
def test_human_bytes_matches_ollama(size, text):
    assert human_bytes(size) == text


@pytest.mark.parametrize("seconds, text", [
    (0.5, "Less than a second"), (1, "1 second"), (42, "42 seconds"), (61, "About a minute"),
    (600, "10 minutes"), (3600, "About an hour"), (5 * 3600, "5 hours"),
    (3 * 86400, "3 days"), (20 * 86400, "2 weeks"), (90 * 86400, "3 months"),
    (800 * 86400, "2 years"),
])
def test_human_duration_matches_go_units(seconds, text):
    assert human_duration(seconds) == text


def test_human_time_says_ago_and_from_now():
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert human_time((now - timedelta(minutes=5)).isoformat(), now) == "5 minutes ago"
    assert human_time((now + timedelta(hours=5)).isoformat(), now) == "5 hours from now"
