"""Where a pull may fetch a model from: its host's mirrors first, then the host itself.

A mirror's URL carries its scheme, and `http://` there is the operator's consent to plain http
for that mirror alone (its hops then follow `--insecure` rules); a mirror given without a scheme
was made https when the configuration was read. The registry host keeps its own rule: the user's
`--insecure`, and an https registry never falls back to http. The model's name never changes,
so a model pulled through a mirror is stored exactly as if pulled directly.
"""

from __future__ import annotations

from dataclasses import replace

import httpx

from registry.names import Name
from registry.transfer.client import TransferOptions
from registry.transfer.errors import TransferError


def pull_sources(name: Name, base: httpx.URL,
                 options: TransferOptions) -> list[tuple[httpx.URL, TransferOptions]]:
    """(registry base URL, options for it) in the order to try them."""
    host = name.host.lower()
    sources = []
    for mirror_host, url in options.mirrors:
        if mirror_host == host:
            mirror = httpx.URL(url)
            sources.append((mirror, replace(options, insecure=mirror.scheme == "http")))
    if not options.mirrors_only:
        sources.append((base, options))
    elif not sources:
        raise TransferError(f"no mirror is configured for {name.host}, and FERRY_MIRRORS_ONLY "
                            "forbids pulling from it directly")
    return sources
