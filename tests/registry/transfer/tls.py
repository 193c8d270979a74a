"""An https server on loopback with a `trustme` CA, as a private registry would have."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import trustme
from conftest import serve_app

_CA: trustme.CA | None = None


def test_ca() -> trustme.CA:
    global _CA
    if _CA is None:
        _CA = trustme.CA()
    return _CA


@contextlib.contextmanager
def tls_server(app, host: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """Serve `app` over https on `host`; yield (base URL, CA bundle path for SSL_CERT_FILE)."""
    ca = test_ca()
    cert = ca.issue_cert("127.0.0.1", "127.0.0.2", "localhost", "cdn.test", "registry.test")
    key_file, cert_file = tmp_path / f"key-{host}.pem", tmp_path / f"cert-{host}.pem"
    ca_file = tmp_path / "ca.pem"
    cert.private_key_pem.write_to_path(str(key_file))
    cert.cert_chain_pems[0].write_to_path(str(cert_file))
    ca.cert_pem.write_to_path(str(ca_file))
    with serve_app(app, host=host, ssl_keyfile=str(key_file), ssl_certfile=str(cert_file)) as url:
        yield url.replace("http://", "https://"), str(ca_file)
