"""The CLI's client of the model server, as the `ollama` CLI talks to `ollama serve`."""

from __future__ import annotations

import functools
import json
import ssl
from collections.abc import Iterator
from typing import Any

import httpx

from ferry.config import Settings
from registry.transfer.session import build_ssl_context


class CLIError(Exception):
    """A one-line error the CLI prints before exiting with status 1."""


def server_verify(settings: Settings) -> ssl.SSLContext:
    """How every CLI connection to the model server checks its certificate: a `ferry serve
    --tls-cert` signed by a private CA is trusted through SSL_CERT_FILE, else system trust."""
    return _server_trust(settings.ssl_cert_file or "")


@functools.cache
def _server_trust(ca_file: str) -> ssl.SSLContext:
    """Built once per process and shared by its clients: loading a CA bundle costs 20-40 ms,
    and `ferry create` opens three clients before its first byte goes out (httpx builds a
    context per client unless it is handed one)."""
    return build_ssl_context(ca_file) if ca_file else httpx.create_ssl_context()


def unreachable(base_url: str, exc: Exception) -> CLIError:
    """The one-line error for a server this client cannot reach or does not trust."""
    if "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return CLIError(f"the ferry server at {base_url} has a certificate this client "
                        "does not trust; point SSL_CERT_FILE at its CA bundle")
    return CLIError(
        f"could not connect to the ferry server at {base_url} ({exc.__class__.__name__});"
        " start it with `ferry serve`"
    )


class ServerClient:
    def __init__(self, settings: Settings, timeout: float | None = 30.0) -> None:
        self.settings = settings
        self.base_url = settings.base_url
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout,
                                  verify=server_verify(settings))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unreachable(self, exc: Exception) -> CLIError:
        return unreachable(self.base_url, exc)

    def request(self, method: str, path: str, body: Any = None,
                timeout: float | None = None) -> httpx.Response:
        """Send a request; a connection failure or an error status becomes a CLIError."""
        try:
            kwargs: dict[str, Any] = {"json": body} if body is not None else {}
            if timeout is not None:
                kwargs["timeout"] = timeout
            response = self._http.request(method, path, **kwargs)
        except httpx.ConnectError as exc:
            raise self._unreachable(exc) from exc
        except httpx.HTTPError as exc:
            raise CLIError(f"{method} {path} failed: {exc}") from exc
        if response.status_code >= 400:
            raise CLIError(error_text(response))
        return response

    def has_model(self, model: str) -> bool:
        """True if the server's store holds `model` (POST /api/show: 200, not 404)."""
        try:
            response = self._http.post("/api/show", json={"model": model})
        except httpx.ConnectError as exc:
            raise self._unreachable(exc) from exc
        except httpx.HTTPError as exc:
            raise CLIError(f"POST /api/show failed: {exc}") from exc
        if response.status_code == 404:
            return False
        if response.status_code >= 400:
            raise CLIError(error_text(response))
        return True

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST and yield each NDJSON line; an `{"error"}` line raises CLIError."""
        try:
            with self._http.stream("POST", path, json=body, timeout=None) as response:
                if response.status_code >= 400:
                    response.read()
                    raise CLIError(error_text(response))
                for line in response.iter_lines():
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if "error" in event:
                        raise CLIError(str(event["error"]))
                    yield event
        except httpx.ConnectError as exc:
            raise self._unreachable(exc) from exc
        except httpx.HTTPError as exc:
            raise CLIError(f"POST {path} failed: {exc}") from exc


def error_text(response: httpx.Response) -> str:
    """The server's error message, from `{"error"}` or an OCI `{"errors"}` body."""
    try:
        data = response.json()
    except ValueError:
        return f"{response.status_code}: {response.text.strip() or response.reason_phrase}"
    if isinstance(data, dict) and isinstance(data.get("error"), str):
        return data["error"]
    if isinstance(data, dict) and isinstance(data.get("errors"), list) and data["errors"]:
        first = data["errors"][0]
        return f"{first.get('code', response.status_code)}: {first.get('message', '')}"
    return f"{response.status_code}: {response.text.strip()}"
