"""Errors of the transfer client (pull, push, login), all domain errors with their fields.

    FerryError
    └── TransferError          a pull or push failed; the message says where and why
        ├── RedirectRefused    a hop broke the redirect policy (scheme, address, hop count)
        ├── AuthFailed         no credentials were accepted, or a token realm looked wrong
        ├── UpstreamError      the upstream registry answered with an error status (code, body)
        │   └── TransientStatus  429 or 5xx: worth retrying (carries Retry-After)
        └── RetriesExhausted   every attempt failed; names the last cause
"""

from __future__ import annotations

from http import HTTPStatus

from registry.errors import FerryError, NotFound


class TransferError(FerryError):
    """A pull, push or login failed."""


class RedirectRefused(TransferError):
    """A hop broke the redirect policy; `rule` is the short reason shown to the user."""

    def __init__(self, url: str, rule: str, hint: str = "", redirected: bool = True) -> None:
        text = f"refusing {'redirect' if redirected else 'request'} to {url}: {rule}"
        super().__init__(f"{text}; {hint}" if hint else text)
        self.url = url
        self.rule = rule


class AuthFailed(TransferError):
    pass


class UpstreamError(TransferError):
    """The registry answered `status`; the message is Ollama's `"<code>: <body>"`."""

    def __init__(self, status: int, body: str, url: str = "") -> None:
        super().__init__(f"{status}: {body.strip()[:500] or _phrase(status)}")
        self.status = status
        self.body = body
        self.url = url


class TransientStatus(UpstreamError):
    """429 or 5xx; `retry_after` is the server's hint in seconds, if it gave one."""

    def __init__(self, status: int, body: str, url: str = "",
                 retry_after: float | None = None) -> None:
        super().__init__(status, body, url)
        self.retry_after = retry_after


class RegistryNotFound(NotFound, TransferError):
    """The registry answered 404 (Ollama's "file does not exist")."""


class RetriesExhausted(TransferError):
    def __init__(self, what: str, attempts: int, last: BaseException) -> None:
        cause = str(last) or type(last).__name__
        super().__init__(f"{what}: giving up after {attempts} attempts: {cause}")
        self.attempts = attempts
        self.last = last


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "error"
