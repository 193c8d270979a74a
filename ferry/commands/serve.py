"""`ferry serve`: run the model server in the foreground."""

from __future__ import annotations

import argparse

from ferry.config import Settings


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("serve", help="start the model server (FERRY_HOST, default "
                            "127.0.0.1:11434)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    import uvicorn

    from ferry.app import build_model_server
    from registry.service.header_limits import HeaderLimitedProtocol

    app = build_model_server(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info",
                timeout_graceful_shutdown=5, http=HeaderLimitedProtocol)
    return 0
