"""`ferry pull`, `ferry push` (through the model server); `ferry login` and `ferry logout` (local
credentials, checked by the registry's token endpoint before they are saved)."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import sys

import httpx

from ferry.client import CLIError, ServerClient
from ferry.config import Settings
from ferry.progress import show_progress
from registry.errors import FerryError


def register(sub: argparse._SubParsersAction) -> None:
    for command, verb in (("pull", "pull a model from a registry"),
                          ("push", "push a model to a registry")):
        parser = sub.add_parser(command, help=verb)
        parser.add_argument("model", metavar="NAME", help="[host/][namespace/]model[:tag]")
        parser.add_argument("--insecure", action="store_true",
                            help="allow plain http and private addresses (a private registry)")
        parser.set_defaults(func=run_transfer, path=f"/api/{command}")
    login = sub.add_parser("login", help="save credentials for a registry")
    login.add_argument("registry", metavar="REGISTRY", help="host[:port] of the registry")
    login.add_argument("-u", "--username", help="user name (prompted when omitted)")
    login.add_argument("--password-stdin", action="store_true",
                       help="read the password from standard input")
    login.add_argument("--insecure", action="store_true",
                       help="the registry is private and may speak plain http")
    login.set_defaults(func=run_login)
    logout = sub.add_parser("logout", help="forget the credentials saved for a registry")
    logout.add_argument("registry", metavar="REGISTRY", help="host[:port] of the registry")
    logout.set_defaults(func=run_logout)


def run_transfer(args: argparse.Namespace, settings: Settings) -> int:
    body = {"model": args.model, "insecure": args.insecure, "stream": True}
    with ServerClient(settings) as client:
        last = show_progress(client.stream(args.path, body))
    if last.get("status") != "success":
        raise CLIError(f"{args.command} ended without success: {last}")
    return 0


def run_login(args: argparse.Namespace, settings: Settings) -> int:
    from registry.transfer.login import login

    username = args.username or input("Username: ")
    if args.password_stdin:
        password = sys.stdin.readline().rstrip("\n")
    else:
        password = getpass.getpass("Password: ")
    if not username or not password:
        raise CLIError("a username and a password are required")
    try:
        asyncio.run(login(args.registry, username, password, home=settings.home,
                          insecure=args.insecure, ca_file=settings.ssl_cert_file))
    except (FerryError, httpx.HTTPError) as exc:
        raise CLIError(f"login to {args.registry} failed: {exc}") from exc
    print("Login Succeeded")
    return 0


def run_logout(args: argparse.Namespace, settings: Settings) -> int:
    from registry.transfer.auth import remove_credentials

    host = args.registry.strip().rstrip("/").split("://", 1)[-1].split("/", 1)[0]
    if remove_credentials(settings.home / "credentials.json", host):
        print(f"Removing login credentials for {host}")
    else:
        print(f"Not logged in to {host}")
    return 0
