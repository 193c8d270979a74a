"""The proxy's own keys, beside the registry's tree (paths.py), under `_proxy/`:

    _proxy/checked/<repo>/_tags/<tag>             a tag's digest as last confirmed upstream;
                                                  its mtime is when (the TTL counts from it)
    _proxy/used/<repo>/_manifests/<hex>           empty; its mtime is when a client last
                                                  pulled that manifest (the size cap's LRU)

Repository components never start with `_`, so `_tags` and `_manifests` cannot clash with them.
"""

from __future__ import annotations

from registry.digests import Digest

ROOT = "_proxy"


def checked(repo: str, tag: str) -> str:
    return f"{ROOT}/checked/{repo}/_tags/{tag}"


def used(repo: str, digest: Digest) -> str:
    return f"{ROOT}/used/{repo}/_manifests/{digest.hex}"
