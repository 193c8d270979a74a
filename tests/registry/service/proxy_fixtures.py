"""Two registries on loopback for the pull-through cache tests: an upstream and a proxy."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from conftest import serve_app

from registry.service.app import build_registry_app
from registry.service.proxy.config import ProxyConfig, parse_upstreams
from registry.store import Store
from registry.transfer.push import push
from registry.transfer.retry import RetryPolicy
from tests.registry.transfer.fakes import RequestLog
from tests.registry.transfer.helpers import fast_options, make_model

FAST_RETRY = RetryPolicy(attempts=3, initial=0.01, cap=0.05)


@dataclass
class Upstream:
    host: str  # 127.0.0.1:<port>
    log: RequestLog
    stop: contextlib.ExitStack

    def blob_gets(self, digest: object) -> int:
        return self.log.count("GET", f"/blobs/{digest}")


@contextlib.contextmanager
def upstream_registry(root: Path) -> Iterator[Upstream]:
    """ferry's registry service, every request logged; `stop.close()` takes it down early."""
    stack = contextlib.ExitStack()
    log = RequestLog(build_registry_app(root))
    url = stack.enter_context(serve_app(log))
    with stack:
        yield Upstream(url.removeprefix("http://"), log, stack)


def proxy_config(upstream_url: str, home: Path, **changes: object) -> ProxyConfig:
    values: dict[str, object] = {"upstreams": parse_upstreams([upstream_url]), "home": home,
                                 "retry": FAST_RETRY}
    values.update(changes)
    return ProxyConfig(**values)  # type: ignore[arg-type]


@contextlib.contextmanager
def proxy_registry(root: Path, config: ProxyConfig) -> Iterator[tuple[str, object]]:
    """The pull-through cache; yields (host:port, its Starlette app)."""
    app = build_registry_app(root, proxy=config)
    with serve_app(app) as url:
        yield url.removeprefix("http://"), app


async def publish(source: Store, name: str, sizes: list[int], home: Path,
                  seed: int = 0) -> bytes:
    """Make a model in `source` and push it to the registry its name names."""
    raw = make_model(source, name, sizes, seed)
    await push(name, source, fast_options(home, insecure=True), lambda e: None)
    return raw
