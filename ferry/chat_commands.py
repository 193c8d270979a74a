"""The slash commands of an interactive `ferry run` session, as the `ollama` CLI has them.

`/set` changes how the next request is made (system, options, format, thinking, verbosity,
word wrap); `/show` reads /api/show; `/load` switches models and `/save` writes the session
(messages, system, parameters) as a new model through /api/create.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ferry.client import CLIError
from ferry.commands.models import render_show

if TYPE_CHECKING:
    from ferry.commands.run import Chat

HELP = """Available Commands:
  /set system <text>             Set the system message
  /set parameter <name> <value>  Set an option, e.g. /set parameter temperature 0.2
  /set verbose | quiet           Show or hide timings after each answer
  /set think [low|medium|high]   Let the model reason before it answers
  /set nothink                   Ask the model not to reason
  /set format json | noformat    Ask for JSON answers, or stop asking
  /set wordwrap | nowordwrap     Wrap words at the terminal width, or not
  /show info|license|modelfile|parameters|system|template
  /load <model>                  Switch to another model (the history is cleared)
  /save <model>                  Save this session as a new model
  /clear                         Clear session context
  /bye                           Exit
  /?, /help                      Help for a command

Use \"\"\" to begin a multi-line message.
"""
LEVELS = ("low", "medium", "high")
SHOW_USAGE = "Usage: /show info|license|modelfile|parameters|system|template"


def handle_command(chat: Chat, command: str) -> bool:
    """Run a slash command; True means leave the session."""
    word, _, rest = command.partition(" ")
    rest = rest.strip()
    if word in ("/bye", "/exit"):
        return True
    try:
        _run(chat, word, rest)
    except CLIError as exc:
        print(f"error: {exc}")
    return False


def _run(chat: Chat, word: str, rest: str) -> None:
    if word == "/clear":
        chat.messages = []
        print("Cleared session context")
    elif word == "/set":
        set_command(chat, rest.split(None, 1))
    elif word == "/show":
        show_command(chat, rest)
    elif word == "/load" and rest:
        print(f"Loading model '{rest}'")
        chat.model, chat.messages = rest, []
        chat.load(timeout=600)
    elif word == "/save" and rest:
        save_command(chat, rest)
    elif word in ("/?", "/help"):
        print(HELP)
    else:
        print(f"Unknown command '{word}'. Type /? for help")


def set_command(chat: Chat, words: list[str]) -> None:
    what, rest = [*words, "", ""][:2]
    if what == "system" and rest:
        chat.system = rest
        print("Set system message.")
    elif what == "parameter" and len(rest.split()) == 2:
        name, raw = rest.split()
        if name == "stop":
            chat.options.setdefault("stop", []).append(raw)
        else:
            chat.options[name] = _parameter_value(raw)
        print(f"Set parameter '{name}' to '{raw}'")
    elif what in ("verbose", "quiet"):
        chat.verbose = what == "verbose"
        print(f"Set '{what}' mode.")
    elif what == "think" and rest in ("", *LEVELS):
        chat.think = rest or True
        print(f"Set 'think' mode{' to ' + rest if rest else ''}.")
    elif what == "nothink":
        chat.think = False
        print("Set 'nothink' mode.")
    elif (what, rest) == ("format", "json"):
        chat.extra["format"] = "json"
        print("Set format to 'json' mode.")
    elif what == "noformat":
        chat.extra.pop("format", None)
        print("Disabled format.")
    elif what in ("wordwrap", "nowordwrap"):
        chat.wordwrap = what == "wordwrap"
        print("Set 'wordwrap' mode." if chat.wordwrap else "Set 'nowordwrap' mode.")
    else:
        print("Usage: /set system <text> | parameter <name> <value> | verbose | quiet | "
              "think [level] | nothink | format json | noformat | wordwrap | nowordwrap")


def show_command(chat: Chat, what: str) -> None:
    """Print one part of /api/show for the session's model (the session's system wins)."""
    if what not in ("info", "license", "modelfile", "parameters", "system", "template"):
        print(SHOW_USAGE)
        return
    if what == "system" and chat.system:
        print(chat.system)
        return
    info = chat.client.request("POST", "/api/show", {"model": chat.model}).json()
    if what == "info":
        print(render_show(info, verbose=False))
        return
    text = info.get(what) or ""
    print(text if text else f"No {what} was specified for this model.")


def save_command(chat: Chat, name: str) -> None:
    """A new model from this one with the session's messages, system and parameters."""
    body: dict[str, Any] = {"model": name, "from": chat.model, "stream": False}
    if chat.messages:
        body["messages"] = [{"role": m["role"], "content": m["content"]}
                            for m in chat.messages]
    if chat.system:
        body["system"] = chat.system
    if chat.options:
        body["parameters"] = chat.options
    chat.client.request("POST", "/api/create", body, timeout=600)
    print(f"Created new model '{name}'")


def _parameter_value(raw: str) -> Any:
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            continue
    return raw
