"""`ferry serve`: run the model server in the foreground."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ferry.client import CLIError
from ferry.config import Settings


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("serve", help="start the model server (FERRY_HOST, default "
                            "127.0.0.1:11434)")
    parser.add_argument("--tls-cert", metavar="PEM", help="certificate chain: serve https "
                        "(FERRY_TLS_CERT)")
    parser.add_argument("--tls-key", metavar="PEM", help="its private key (FERRY_TLS_KEY)")
    parser.set_defaults(func=run)


def tls_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's ssl arguments for the settings' certificate, or none for plain http."""
    if bool(settings.tls_cert) != bool(settings.tls_key):
        raise CLIError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
    for path in (settings.tls_cert, settings.tls_key):
        if path and not Path(path).is_file():
            raise CLIError(f"TLS file not found: {path}")
    if not settings.tls_cert:
        return {}
    return {"ssl_certfile": settings.tls_cert, "ssl_keyfile": settings.tls_key}


def run(args: argparse.Namespace, settings: Settings) -> int:
    import uvicorn

    from ferry.app import build_model_server
    from registry.service.header_limits import HeaderLimitedProtocol

    changes = {k: v for k, v in (("tls_cert", args.tls_cert), ("tls_key", args.tls_key)) if v}
    settings = settings.with_(**changes) if changes else settings
    tls = tls_options(settings)
    app = build_model_server(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info",
                timeout_graceful_shutdown=5, http=HeaderLimitedProtocol, **tls)
    return 0
