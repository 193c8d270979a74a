"""Settings: the one place that reads the environment.

Everything else receives a frozen `Settings` (or the few fields it needs) from its caller, so a
test can build one with `Settings.from_env({...})` and nothing depends on process globals.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

from registry.manifests import MAX_MANIFEST_BYTES
from server.durations import InvalidDuration, parse_duration

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 11434
DEFAULT_REGISTRY_PORT = 5000
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024  # JSON bodies of the model API (413 above)


class ConfigError(ValueError):
    """An environment variable holds a value ferry cannot use; the message names it."""


def parse_host(value: str, default_port: int = DEFAULT_PORT) -> tuple[str, str, int]:
    """Parse `host`, `host:port`, `:port` or `scheme://host:port` into (scheme, host, port)."""
    text = value.strip() or DEFAULT_HOST
    scheme = "http"
    if "://" in text:
        scheme, _, text = text.partition("://")
        if scheme not in ("http", "https"):
            raise ConfigError(f"unsupported scheme {scheme!r} in host {value!r}")
    parts = urlsplit(f"//{text}")
    try:
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"invalid port in host {value!r}") from exc
    host = parts.hostname or DEFAULT_HOST
    return scheme, host, port if port is not None else default_port


def _flag(env: Mapping[str, str], key: str) -> bool:
    return env.get(key, "").strip().lower() in ("1", "true", "yes", "on")


def _list(env: Mapping[str, str], key: str) -> tuple[str, ...]:
    """A comma-separated list; blanks dropped."""
    return tuple(item.strip() for item in env.get(key, "").split(",") if item.strip())


def _int(env: Mapping[str, str], key: str, default: int, minimum: int = 0) -> int:
    raw = env.get(key, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise ConfigError(f"{key} must be an integer, got {raw!r}") from exc
    if value < minimum:
        raise ConfigError(f"{key} must be at least {minimum}, got {value}")
    return value


def _duration(env: Mapping[str, str], key: str, default: float) -> float:
    """Seconds from a Go duration (`30s`, `1h30m`) or a number of seconds, read the way a
    request's keep_alive is; a negative value means forever."""
    raw = env.get(key, "").strip()
    if not raw:
        return default
    try:
        return parse_duration(raw)
    except InvalidDuration as exc:
        raise ConfigError(f"{key} must be a duration like 30s or 1h30m, got {raw!r}") from exc


def _rate(env: Mapping[str, str], key: str) -> float:
    """Requests per second; unset is -1 (the default applies), 0 turns the limit off."""
    raw = env.get(key, "").strip()
    if not raw:
        return -1.0
    try:
        value = float(raw)
    except ValueError as exc:
        raise ConfigError(f"{key} must be a number of requests per second, got {raw!r}") from exc
    if value < 0:
        raise ConfigError(f"{key} must be 0 (off) or more, got {raw!r}")
    return value


@dataclass(frozen=True)
class Settings:
    """Everything ferry reads from the environment, read once."""

    home: Path
    models_dir: Path
    scheme: str = "http"
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    noprune: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # registry service
    registry_root: Path = field(default_factory=lambda: Path.home() / ".ferry" / "registry")
    registry_host: str = DEFAULT_HOST
    registry_port: int = DEFAULT_REGISTRY_PORT
    max_manifest_bytes: int = MAX_MANIFEST_BYTES
    registry_max_blob_bytes: int = 0  # > 0: larger blob uploads are refused (413); 0: no limit
    upload_session_ttl: float = 24 * 3600.0
    registry_s3_bucket: str = ""  # set: store in this S3 bucket instead of registry_root
    registry_s3_prefix: str = ""
    registry_s3_redirect_ttl: int = 0  # > 0: blob GETs redirect to presigned S3 URLs
    # transfers
    max_transfer_streams: int = 8
    # create
    max_create_files: int = 1024
    max_metadata_file_bytes: int = 64 * 1024 * 1024
    # a create fails when a file it reads as it is uploaded gets no bytes for this long
    upload_stall_timeout: float = 60.0
    # runners
    keep_alive: float = 300.0
    load_timeout: float = 300.0
    max_loaded_models: int = 3
    compute: str = "auto"
    autostart: bool = False
    # release (`ferry release publish`)
    github_token: str | None = field(default=None, repr=False)  # never in logs
    aws_endpoint_url: str | None = None
    # transfers: a private CA bundle for registries (SSL_CERT_FILE), as OpenSSL reads it
    ssl_cert_file: str = ""
    # registry access control (issue 12): the auth file, limits, audit log, and TLS for both
    registry_auth: str = ""  # TOML file of users, groups, rules and token keys; "" = open
    registry_allow_anonymous_writes: bool = False  # an open registry on a non-loopback address
    registry_rate_limit: float = -1.0  # requests/s per client; -1: 100 with auth, else off
    registry_rate_burst: int = 0  # 0: ten seconds' worth of the rate
    registry_max_uploads: int = -1  # open upload sessions per client; -1: 32 with auth, else off
    registry_audit_log: str = ""  # a file, or "-" for stderr; "": stderr with auth, else none
    tls_cert: str = ""  # PEM certificate chain: both servers speak https when set
    tls_key: str = ""
    # runners: bytes of cache snapshots the prefix-cache trie keeps between requests
    prefix_cache_bytes: int = 1 << 30
    # model server: browser origins (globs) allowed besides the loopback and app ones
    origins: tuple[str, ...] = ()
    # model server on a non-loopback address: the Host names it answers (globs); empty: any
    allowed_hosts: tuple[str, ...] = ()
    # registry service as a pull-through cache: `URL` or `prefix=URL` entries
    registry_proxy: tuple[str, ...] = ()
    registry_proxy_ttl: float = 300.0
    registry_proxy_max_bytes: int = 0  # > 0: evict least recently pulled mirrored models above
    registry_proxy_local: tuple[str, ...] = ()  # namespaces that stay local (pushes allowed)
    # transfers: (registry host, mirror URL) pairs tried before the host; only those if set
    mirrors: tuple[tuple[str, str], ...] = ()
    mirrors_only: bool = False

    @property
    def base_url(self) -> str:
        """URL of the model server, as the CLI reaches it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        home = Path(env.get("FERRY_HOME") or Path.home() / ".ferry").expanduser()
        models = Path(env.get("FERRY_MODELS") or home / "models").expanduser()
        scheme, host, port = parse_host(env.get("FERRY_HOST", ""))
        reg_root = Path(env.get("FERRY_REGISTRY_ROOT") or home / "registry").expanduser()
        _, reg_host, reg_port = parse_host(
            env.get("FERRY_REGISTRY_HOST", ""), DEFAULT_REGISTRY_PORT
        )
        compute = env.get("FERRY_COMPUTE", "auto").strip().lower() or "auto"
        if compute not in ("auto", "native", "float32", "fused"):
            raise ConfigError("FERRY_COMPUTE must be auto, native, float32 or fused, "
                              f"got {compute!r}")
        return cls(
            home=home,
            models_dir=models,
            scheme=scheme,
            host=host,
            port=port,
            noprune=_flag(env, "FERRY_NOPRUNE"),
            max_request_body_bytes=_int(env, "FERRY_MAX_REQUEST_BYTES",
                                        DEFAULT_MAX_REQUEST_BODY_BYTES, minimum=1024),
            registry_root=reg_root,
            registry_host=reg_host,
            registry_port=reg_port,
            max_manifest_bytes=_int(env, "FERRY_REGISTRY_MAX_MANIFEST_BYTES", MAX_MANIFEST_BYTES,
                                    minimum=1024),
            registry_max_blob_bytes=_int(env, "FERRY_REGISTRY_MAX_BLOB_BYTES", 0),
            upload_session_ttl=_duration(env, "FERRY_REGISTRY_UPLOAD_TTL", 24 * 3600.0),
            registry_s3_bucket=env.get("FERRY_REGISTRY_S3_BUCKET", "").strip(),
            registry_s3_prefix=env.get("FERRY_REGISTRY_S3_PREFIX", "").strip(),
            registry_s3_redirect_ttl=_int(env, "FERRY_REGISTRY_S3_REDIRECT_TTL", 0),
            max_transfer_streams=_int(env, "FERRY_MAX_TRANSFER_STREAMS", 8, minimum=1),
            upload_stall_timeout=_duration(env, "FERRY_UPLOAD_STALL_TIMEOUT", 60.0),
            keep_alive=_duration(env, "FERRY_KEEP_ALIVE", 300.0),
            load_timeout=_duration(env, "FERRY_LOAD_TIMEOUT", 300.0),
            max_loaded_models=_int(env, "FERRY_MAX_LOADED_MODELS", 3, minimum=1),
            compute=compute,
            autostart=_flag(env, "FERRY_AUTOSTART"),
            github_token=env.get("GITHUB_TOKEN") or None,
            aws_endpoint_url=env.get("AWS_ENDPOINT_URL") or None,
            ssl_cert_file=env.get("SSL_CERT_FILE", ""),
            registry_auth=env.get("FERRY_REGISTRY_AUTH", "").strip(),
            registry_allow_anonymous_writes=_flag(env, "FERRY_REGISTRY_ALLOW_ANONYMOUS_WRITES"),
            registry_rate_limit=_rate(env, "FERRY_REGISTRY_RATE_LIMIT"),
            registry_rate_burst=_int(env, "FERRY_REGISTRY_RATE_BURST", 0),
            registry_max_uploads=_int(env, "FERRY_REGISTRY_MAX_UPLOADS", -1, minimum=-1),
            registry_audit_log=env.get("FERRY_REGISTRY_AUDIT_LOG", "").strip(),
            tls_cert=env.get("FERRY_TLS_CERT", "").strip(),
            tls_key=env.get("FERRY_TLS_KEY", "").strip(),
            prefix_cache_bytes=_int(env, "FERRY_PREFIX_CACHE_BYTES", 1 << 30),
            origins=_list(env, "FERRY_ORIGINS"),
            allowed_hosts=_list(env, "FERRY_ALLOWED_HOSTS"),
            registry_proxy=_proxy_entries(env.get("FERRY_REGISTRY_PROXY", "")),
            registry_proxy_ttl=_duration(env, "FERRY_REGISTRY_PROXY_TTL", 300.0),
            registry_proxy_max_bytes=_int(env, "FERRY_REGISTRY_PROXY_MAX_BYTES", 0),
            registry_proxy_local=_names(env.get("FERRY_REGISTRY_PROXY_LOCAL", "")),
            mirrors=parse_mirrors(env.get("FERRY_MIRRORS", "")),
            mirrors_only=_flag(env, "FERRY_MIRRORS_ONLY"),
        )

    def with_(self, **changes: object) -> Settings:
        """A copy with some fields changed (tests and CLI flags)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def child_env(self) -> dict[str, str]:
        """The environment for a ferry child process (a runner, an autostarted server): this
        process's, plus the settings that locate the store, so the child sees the same one."""
        env = dict(os.environ)
        env.update(FERRY_HOME=str(self.home), FERRY_MODELS=str(self.models_dir),
                   FERRY_COMPUTE=self.compute)
        return env


def _names(raw: str) -> tuple[str, ...]:
    return tuple(n.strip().strip("/") for n in raw.split(",") if n.strip().strip("/"))


def _proxy_entries(raw: str) -> tuple[str, ...]:
    """FERRY_REGISTRY_PROXY: `URL` or `prefix=URL,prefix=URL`, checked now, parsed by the app."""
    from registry.errors import FerryError
    from registry.service.proxy.config import parse_upstreams

    entries = tuple(e.strip() for e in raw.split(",") if e.strip())
    try:
        parse_upstreams(entries)
    except FerryError as exc:
        raise ConfigError(f"FERRY_REGISTRY_PROXY: {exc}") from exc
    return entries


def parse_mirrors(raw: str) -> tuple[tuple[str, str], ...]:
    """FERRY_MIRRORS: `host=URL,...`; a URL without a scheme means https. The same host may be
    named twice (mirrors are tried in order)."""
    found = []
    for entry in (e.strip() for e in raw.split(",") if e.strip()):
        host, sep, url = entry.partition("=")
        host, url = host.strip().lower(), url.strip().rstrip("/")
        if not sep or not host or not url or "/" in host:
            raise ConfigError(f"FERRY_MIRRORS entries are host=URL, got {entry!r}")
        if "://" not in url:
            url = f"https://{url}"
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"FERRY_MIRRORS: {url!r} is not an http or https URL")
        if parts.username or parts.password or parts.query or parts.path not in ("", "/"):
            raise ConfigError(f"FERRY_MIRRORS: give a mirror as scheme://host[:port], got {url!r}")
        found.append((host, url))
    return tuple(found)
