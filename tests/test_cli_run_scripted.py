"""`ferry run` on a scripted reasoning model: thinking flags, word wrap, --verbose, and the
interactive commands (/set, /show, /save, /load).

The scripted model reasons "The user wants weather" and then answers "Let me check."; its
template skips the reasoning when thinking is switched off.
"""

from __future__ import annotations

import subprocess

import httpx
import pytest
from scripted_model import THINKING_TOOLS_TEMPLATE, serve_scripted_models
from test_cli_run import Terminal, ferry

SCRIPT = ["<think>", "The user", " wants weather", "</think>", "Let me", " check", "."]


@pytest.fixture(scope="module")
def served(tmp_path_factory, make_checkpoint):
    home = tmp_path_factory.mktemp("home")
    with serve_scripted_models(home, make_checkpoint,
                               {"me/reasoner": (SCRIPT, THINKING_TOOLS_TEMPLATE)}) as url:
        yield home, url


def _env(served, **extra: str) -> dict[str, str]:
    import os

    home, url = served
    return {**os.environ, "FERRY_HOME": str(home), "FERRY_HOST": url.split("//")[1],
            "FERRY_AUTOSTART": "0", "TERM": "dumb", **extra}


def _run(served, *args: str) -> str:
    done = subprocess.run(ferry("run", "me/reasoner", *args), env=_env(served),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_think_prints_the_reasoning_apart_from_the_answer(served):
    out = _run(served, "weather?", "--think")
    assert out == ("Thinking...\nThe user wants weather\n...done thinking.\n\n"
                   "Let me check.\n")


def test_hidethinking_prints_only_the_answer(served):
    assert _run(served, "weather?", "--think=high", "--hidethinking") == "Let me check.\n"


def test_think_false_asks_the_template_not_to_reason(served):
    assert _run(served, "weather?", "--think=false") == "Let me check.\n"


def test_set_think_and_nothink_in_a_session(served):
    term = Terminal(ferry("run", "me/reasoner"), _env(served))
    term.expect(">>> ")
    term.send("/set nothink")
    assert "Set 'nothink' mode." in term.expect(">>> ")
    term.send("weather?")
    assert "Thinking" not in term.expect(">>> ")
    term.send("/set think")
    assert "Set 'think' mode." in term.expect(">>> ")
    term.send("weather again?")
    assert "The user wants weather\n...done thinking." in term.expect(">>> ")
    term.send("/bye")
    assert term.wait() == 0


def test_verbose_statistics_start_on_their_own_line(served):
    done = subprocess.run(ferry("run", "me/reasoner", "weather?", "--verbose", "--think=false"),
                          env=_env(served), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert lines[0] == "Let me check." and lines[1].startswith("total duration:")
    assert any(line.startswith("eval rate:") for line in lines)


def test_words_wrap_at_the_terminal_width_unless_switched_off(served):
    term = Terminal(ferry("run", "me/reasoner", "--think"), _env(served, COLUMNS="20"))
    term.expect(">>> ")
    term.send("weather?")
    wrapped = "The user wants\nweather\n...done thinking.\n\nLet me check."
    assert wrapped in term.expect(">>> ")
    term.send("/set nowordwrap")
    assert "Set 'nowordwrap' mode." in term.expect(">>> ")
    term.send("again?")
    assert "The user wants weather" in term.expect(">>> ")
    term.send("/bye")
    assert term.wait() == 0


def test_show_save_load_and_format_in_a_session(served):
    _, url = served
    term = Terminal(ferry("run", "me/reasoner", "--think=false"), _env(served))
    term.expect(">>> ")
    term.send("/show info")
    assert "thinking" in term.expect(">>> ")
    term.send("/show parameters")
    assert "temperature" in term.expect(">>> ")
    term.send("/show template")
    assert "No template was specified" in term.expect(">>> ")
    term.send("/set system Be brief.")
    term.expect(">>> ")
    term.send("/show system")
    assert "Be brief." in term.expect(">>> ")
    term.send("weather?")
    assert "Let me check." in term.expect(">>> ")
    term.send("/save me/saved")
    assert "Created new model 'me/saved'" in term.expect(">>> ")
    saved = httpx.post(f"{url}/api/show", json={"model": "me/saved"}, timeout=60).json()
    assert saved["system"] == "Be brief."
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
    term.send("/load me/saved")
    assert "Loading model 'me/saved'" in term.expect(">>> ")
    term.send("/set format json")
    assert "Set format to 'json' mode." in term.expect(">>> ")
    term.send("/set parameter num_predict 3")
    term.expect(">>> ")
    term.send("json?")
    answer = term.expect(">>> ").split("json?")[-1].strip()
    assert answer.startswith(("{", "[")), answer
    term.send("/bye")
    assert term.wait() == 0


def test_a_prompt_after_a_bare_think_is_the_prompt_not_the_level(served):
    # Ollama's CLI: only --think=LEVEL carries a level; a bare --think is --think=true.
    out = _run(served, "--think", "weather?")
    assert out == ("Thinking...\nThe user wants weather\n...done thinking.\n\n"
                   "Let me check.\n")


def test_think_level_and_bare_think_parse_as_ollama_does():
    from ferry.commands.run import attach_flag_defaults

    assert attach_flag_defaults(["run", "m", "--think", "hi"]) == ["run", "m", "--think=true", "hi"]
    assert attach_flag_defaults(["run", "m", "--think=low"]) == ["run", "m", "--think=low"]
    assert attach_flag_defaults(["run", "m", "--", "--think"]) == ["run", "m", "--", "--think"]


def test_prompt_words_may_follow_flags(served):
    assert _run(served, "--think=false", "weather?") == "Let me check.\n"
