"""`ferry registry serve|gc`: run the registry service, or collect its garbage."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from ferry.client import CLIError
from ferry.config import Settings


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

    gc = commands.add_parser("gc", help="delete blobs no manifest references")
    gc.add_argument("--root", type=Path, help="storage directory")
    gc.add_argument("--dry-run", action="store_true", help="report what would go, delete nothing")
    gc.add_argument("--grace", type=float, default=3600.0,
                    help="keep unreferenced blobs written or linked this many seconds ago "
                    "(uploads in flight) (default 3600)")
    gc.set_defaults(func=run_gc)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 0


def _with_flags(args: argparse.Namespace, settings: Settings) -> Settings:
    changes: dict[str, object] = {}
    if getattr(args, "host", None):
        changes["registry_host"] = args.host
    if getattr(args, "port", None):
        changes["registry_port"] = args.port
    if args.root:
        changes["registry_root"] = args.root.expanduser()
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
    from registry.service.proxy.config import parse_upstreams

    settings = _with_flags(args, settings)
    app = build_registry_app(settings)
    where = (f"s3://{settings.registry_s3_bucket}/{settings.registry_s3_prefix}"
             if settings.registry_s3_bucket else str(settings.registry_root))
    print(f"registry on http://{settings.registry_host}:{settings.registry_port}, "
          f"storing in {where}", flush=True)
    for upstream in parse_upstreams(settings.registry_proxy):
        where = f"{upstream.prefix}/..." if upstream.prefix else "every repository"
        print(f"mirroring {upstream.shown} for {where}", flush=True)
    uvicorn.run(app, host=settings.registry_host, port=settings.registry_port,
                log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                http=BulkHttpProtocol, loop="uvloop")
    return 0


def run_gc(args: argparse.Namespace, settings: Settings) -> int:
    from ferry.app import registry_store
    from registry.service.gc import collect_garbage

    settings = _with_flags(args, settings)
    store = registry_store(settings)
    try:
        report = asyncio.run(collect_garbage(store, grace=args.grace, dry_run=args.dry_run))
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
