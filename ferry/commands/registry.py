"""`ferry registry serve|gc|user`: run the registry service, collect its garbage, add users."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import sys
from pathlib import Path

from ferry.client import CLIError
from ferry.commands.serve import tls_options
from ferry.config import Settings
from server.browser_guard import is_loopback_host


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("registry", help="run a private OCI registry (the /v2 API)")
    commands = parser.add_subparsers(dest="registry_command", metavar="COMMAND")
    parser.set_defaults(func=lambda args, settings: _usage(parser))

    serve = commands.add_parser("serve", help="serve the registry in the foreground "
                                "(default 127.0.0.1:5000, FERRY_REGISTRY_HOST)")
    serve.add_argument("--host", help="address to listen on")
    serve.add_argument("--port", type=int, help="port to listen on")
    serve.add_argument("--root", type=Path, help="storage directory (default "
                       "$FERRY_HOME/registry, FERRY_REGISTRY_ROOT)")
    _serve_options(serve)
    serve.add_argument("--proxy", action="append", metavar="[PREFIX=]URL",
                       help="be a pull-through cache of this upstream registry, for every "
                       "repository or those under PREFIX (repeatable; FERRY_REGISTRY_PROXY)")
    serve.add_argument("--proxy-ttl", type=float, metavar="SECONDS",
                       help="serve a cached tag this long before asking upstream again "
                       "(default 300, FERRY_REGISTRY_PROXY_TTL)")
    serve.add_argument("--proxy-max-bytes", type=int, metavar="BYTES",
                       help="evict least recently pulled mirrored models above this size "
                       "(default 0: no cap, FERRY_REGISTRY_PROXY_MAX_BYTES)")
    serve.add_argument("--proxy-local", action="append", metavar="NAMESPACE",
                       help="keep this namespace local: pushes allowed, never fetched upstream "
                       "(repeatable; FERRY_REGISTRY_PROXY_LOCAL)")
    serve.set_defaults(func=run_serve)
    _user_commands(commands)

    gc = commands.add_parser("gc", help="delete blobs no manifest references")
    gc.add_argument("--root", type=Path, help="storage directory")
    gc.add_argument("--dry-run", action="store_true", help="report what would go, delete nothing")
    gc.add_argument("--grace", type=float, default=3600.0,
                    help="keep unreferenced blobs written or linked this many seconds ago "
                    "(uploads in flight) (default 3600, at least 1200)")
    gc.set_defaults(func=run_gc)


def _serve_options(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--s3-bucket", help="store in this S3 bucket instead of --root "
                       "(FERRY_REGISTRY_S3_BUCKET; credentials, region and AWS_ENDPOINT_URL "
                       "as the AWS CLI reads them)")
    serve.add_argument("--s3-prefix", help="key prefix inside the bucket "
                       "(FERRY_REGISTRY_S3_PREFIX)")
    serve.add_argument("--s3-redirect-ttl", type=int, help="answer blob GETs with presigned S3 "
                       "URLs valid this many seconds (FERRY_REGISTRY_S3_REDIRECT_TTL; 0 = off)")
    serve.add_argument("--auth", metavar="FILE", help="TOML file of users, groups, access "
                       "rules and the token key (FERRY_REGISTRY_AUTH); without it the registry "
                       "is open and listens on loopback only")
    serve.add_argument("--allow-anonymous-writes", action="store_true", default=None,
                       help="serve an open registry (no --auth) on a non-loopback address "
                       "(FERRY_REGISTRY_ALLOW_ANONYMOUS_WRITES)")
    serve.add_argument("--tls-cert", metavar="PEM", help="certificate chain: serve https "
                       "(FERRY_TLS_CERT)")
    serve.add_argument("--tls-key", metavar="PEM", help="its private key (FERRY_TLS_KEY)")
    serve.add_argument("--max-blob-bytes", type=int, help="largest blob an upload may store "
                       "(FERRY_REGISTRY_MAX_BLOB_BYTES; default 64 GiB with --auth, else no "
                       "limit)")
    serve.add_argument("--max-manifest-bytes", type=int, help="largest manifest accepted "
                       "(FERRY_REGISTRY_MAX_MANIFEST_BYTES; default 4 MiB)")
    serve.add_argument("--upload-ttl", type=float, metavar="SECONDS", help="drop upload "
                       "sessions untouched this long (FERRY_REGISTRY_UPLOAD_TTL; default 24h)")
    serve.add_argument("--rate-limit", type=float, help="requests per second per client "
                       "(FERRY_REGISTRY_RATE_LIMIT; default 100 with --auth, else off; 0 = off)")
    serve.add_argument("--rate-burst", type=int, help="requests a client may make at once "
                       "(FERRY_REGISTRY_RATE_BURST; default ten seconds' worth)")
    serve.add_argument("--max-uploads", type=int, help="open upload sessions per client "
                       "(FERRY_REGISTRY_MAX_UPLOADS; default 32 with --auth, else off)")
    serve.add_argument("--audit-log", metavar="FILE", help="append a JSON line per write or "
                       "denial here, '-' for stderr (FERRY_REGISTRY_AUDIT_LOG; default stderr "
                       "with --auth)")


def _user_commands(commands: argparse._SubParsersAction) -> None:
    user = commands.add_parser("user", help="manage the accounts of an --auth file")
    users = user.add_subparsers(dest="user_command", metavar="COMMAND")
    user.set_defaults(func=lambda args, settings: _usage(user))
    add = users.add_parser("add", help="add a user (password asked on a TTY, else read from "
                           "stdin); creates the file and its token key when missing")
    add.add_argument("name", metavar="NAME")
    add.add_argument("--auth", metavar="FILE", help="the auth file (FERRY_REGISTRY_AUTH)")
    add.add_argument("--key", action="append", default=[], metavar="PUBKEY",
                     help="an `ssh-ed25519 AAAA…` public key (Ollama's, or ferry's "
                     "~/.ferry/id_ed25519.pub) the user signs token requests with; repeatable")
    add.add_argument("--group", action="append", default=[], metavar="G",
                     help="a group the user belongs to; repeatable")
    add.add_argument("--no-password", action="store_true",
                     help="key-only user: ask for no password")
    add.set_defaults(func=run_user_add)


def run_user_add(args: argparse.Namespace, settings: Settings) -> int:
    from registry.service.auth.userfile import add_user

    target = args.auth or settings.registry_auth
    if not target:
        raise CLIError("which auth file? pass --auth FILE or set FERRY_REGISTRY_AUTH")
    password = None if args.no_password else _read_password()
    try:
        add_user(Path(target).expanduser(), args.name, password, args.key, args.group)
    except (ValueError, OSError) as exc:
        raise CLIError(str(exc)) from exc
    print(f"added user {args.name} to {target}")
    return 0


def _read_password() -> str:
    if sys.stdin.isatty():
        password = getpass.getpass("Password: ")
        if password != getpass.getpass("Again: "):
            raise CLIError("the passwords differ")
    else:
        password = sys.stdin.readline().rstrip("\n")
    if not password:
        raise CLIError("an empty password; pass --no-password for a key-only user")
    return password


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 0


_SERVE_FLAGS = {  # flag -> the Settings field it overrides
    "s3_bucket": "registry_s3_bucket", "s3_prefix": "registry_s3_prefix",
    "s3_redirect_ttl": "registry_s3_redirect_ttl", "auth": "registry_auth",
    "allow_anonymous_writes": "registry_allow_anonymous_writes", "tls_cert": "tls_cert",
    "tls_key": "tls_key", "max_blob_bytes": "registry_max_blob_bytes",
    "rate_limit": "registry_rate_limit", "rate_burst": "registry_rate_burst",
    "max_uploads": "registry_max_uploads", "audit_log": "registry_audit_log",
    "max_manifest_bytes": "max_manifest_bytes", "upload_ttl": "upload_session_ttl",
}


def _with_flags(args: argparse.Namespace, settings: Settings) -> Settings:
    changes: dict[str, object] = {}
    if getattr(args, "host", None):
        changes["registry_host"] = args.host
    if getattr(args, "port", None):
        changes["registry_port"] = args.port
    if args.root:
        changes["registry_root"] = args.root.expanduser()
    for flag, field in _SERVE_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            changes[field] = value
    changes.update(_proxy_flags(args))
    return settings.with_(**changes) if changes else settings


def _proxy_flags(args: argparse.Namespace) -> dict[str, object]:
    from registry.errors import FerryError
    from registry.service.proxy.config import parse_upstreams

    changes: dict[str, object] = {}
    if getattr(args, "proxy", None):
        try:
            parse_upstreams(args.proxy)
        except FerryError as exc:
            raise CLIError(str(exc)) from exc
        changes["registry_proxy"] = tuple(args.proxy)
    if getattr(args, "proxy_ttl", None) is not None:
        changes["registry_proxy_ttl"] = args.proxy_ttl
    if getattr(args, "proxy_max_bytes", None) is not None:
        changes["registry_proxy_max_bytes"] = args.proxy_max_bytes
    if getattr(args, "proxy_local", None):
        changes["registry_proxy_local"] = tuple(n.strip("/") for n in args.proxy_local)
    return changes


def run_serve(args: argparse.Namespace, settings: Settings) -> int:
    import uvicorn

    from ferry.app import build_registry_app
    from registry.service.app import BulkHttpProtocol
    from registry.service.auth.config import AuthConfigError
    from registry.service.proxy.config import parse_upstreams

    settings = _with_flags(args, settings)
    _refuse_open_exposure(settings)
    tls = tls_options(settings)
    try:
        app = build_registry_app(settings)
    except AuthConfigError as exc:
        raise CLIError(f"bad auth file: {exc}") from None
    where = (f"s3://{settings.registry_s3_bucket}/{settings.registry_s3_prefix}"
             if settings.registry_s3_bucket else str(settings.registry_root))
    scheme = "https" if tls else "http"
    if settings.registry_auth and not tls and not is_loopback_host(settings.registry_host):
        print("warning: passwords and tokens cross the network in clear text; serve TLS "
              "(--tls-cert/--tls-key) or put a TLS proxy in front", file=sys.stderr)
    access = f"auth from {settings.registry_auth}" if settings.registry_auth else "OPEN: no auth"
    print(f"registry on {scheme}://{settings.registry_host}:{settings.registry_port}, "
          f"storing in {where}, {access}", flush=True)
    for upstream in parse_upstreams(settings.registry_proxy):
        where = f"{upstream.prefix}/..." if upstream.prefix else "every repository"
        print(f"mirroring {upstream.shown} for {where}", flush=True)
    uvicorn.run(app, host=settings.registry_host, port=settings.registry_port,
                log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                http=BulkHttpProtocol, loop="uvloop", **tls)
    return 0


def _refuse_open_exposure(settings: Settings) -> None:
    """An open registry lets anyone push and delete: only on loopback unless asked for."""
    if settings.registry_auth or settings.registry_allow_anonymous_writes:
        return
    if not is_loopback_host(settings.registry_host):
        raise CLIError(f"refusing to serve an open registry on {settings.registry_host}: "
                       "anyone who can reach it could push, overwrite and delete. Pass --auth "
                       "FILE (see `ferry registry user add`), or --allow-anonymous-writes if "
                       "that is really what you want")


def run_gc(args: argparse.Namespace, settings: Settings) -> int:
    from ferry.app import registry_store
    from ferry.client import CLIError
    from registry.service.gc import GraceTooShort, collect_garbage

    settings = _with_flags(args, settings)
    store = registry_store(settings)
    try:
        report = asyncio.run(collect_garbage(store, grace=args.grace, dry_run=args.dry_run))
    except GraceTooShort as exc:
        raise CLIError(str(exc)) from exc
    finally:
        store.close()
    verb = "would delete" if args.dry_run else "deleted"
    for digest in report.swept:
        print(f"{verb} {digest}")
    for key in report.staging_swept:
        print(f"{verb} staging leftover {key}")
    print(f"{len(report.marked)} referenced, {verb} {len(report.swept)} blobs and "
          f"{len(report.staging_swept)} staging leftovers ({report.freed_bytes} bytes), "
          f"kept {len(report.kept_young)} recent unreferenced")
    return 0
