"""The `ferry` command: a thin client of the model server, plus the servers themselves.

Each command group lives in `ferry/commands/<group>.py` and exports `register(subparsers)`;
this module discovers them, so adding a command never edits a shared list. A module may set
`HIDDEN = {"name", ...}` for commands that work but stay out of `ferry --help` (the runner).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from ferry import __version__, commands
from ferry.client import CLIError
from ferry.commands.run import attach_flag_defaults
from ferry.config import ConfigError, Settings
from ferry.home import make_home


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="ferry",
        description="A self-hostable model registry and model toolchain.",
    )
    parser.add_argument("--version", action="version", version=f"ferry {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    hidden: set[str] = set()
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(sub)
        hidden |= set(getattr(module, "HIDDEN", ()))
    help_parser = sub.add_parser("help", help="show help for a command")
    help_parser.add_argument("topic", nargs="?", help="the command to explain")
    # argparse lists every subparser in --help; drop the hidden ones from that listing.
    sub._choices_actions = [a for a in sub._choices_actions if a.dest not in hidden]
    return parser, dict(sub.choices)


def main(argv: Sequence[str] | None = None) -> int:
    parser, by_name = build_parser()
    args, extra = parser.parse_known_args(
        attach_flag_defaults(sys.argv[1:] if argv is None else argv))
    # Words after a flag (`ferry run m --verbose why?`) continue a command's trailing positional,
    # as cobra allows; anything else unrecognised is still an error.
    spill = getattr(args, "words_continue", None)
    if extra and (spill is None or any(word.startswith("-") for word in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        getattr(args, str(spill)).extend(extra)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "help":
        target = by_name.get(args.topic) if args.topic else parser
        if target is None:
            print(f"ferry: unknown command {args.topic!r}; see `ferry --help`", file=sys.stderr)
            return 1
        target.print_help()
        return 0
    try:
        settings = Settings.from_env()
        make_home(settings.home)
        return int(args.func(args, settings) or 0)
    except (CLIError, ConfigError) as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
