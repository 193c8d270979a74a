"""`ferry run` with a reasoning model: --think, --hidethinking, /set think and /set nothink.

The scripted model reasons "The user wants weather" and then answers "Let me check."; its
template skips the reasoning when thinking is switched off.
"""

from __future__ import annotations

import subprocess

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


def _env(served) -> dict[str, str]:
    import os

    home, url = served
    return {**os.environ, "FERRY_HOME": str(home), "FERRY_HOST": url.split("//")[1],
            "FERRY_AUTOSTART": "0", "TERM": "dumb"}


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
