"""The pull-through cache: `ferry registry serve --proxy URL` mirrors an upstream registry.

    config.py     which repositories mirror which upstream, TTL, size cap (ProxyConfig)
    upstream.py   requests to one upstream, through the transfer client's SafeSession, auth
                  and retry policy (the same redirect rules and address pinning as `ferry pull`)
    keys.py       the proxy's own keys in the BlobStore (when a tag was checked, last use)
    manifests.py  manifests: by tag with a TTL and stale-if-error, by digest verified
    blob_fetch.py one upstream fetch per missing blob, verified while written, fanned out to
                  every request that wants it
    segments.py   that fetch as parallel Range requests, yielded in order
    eviction.py   the size cap: least recently pulled models go first
    routes.py     the /v2 routes in front of oci.py's: cache misses here, hits fall through

Responses say where they came from in `X-Ferry-Cache`: `hit`, `fetched` (upstream, now cached),
`revalidated` (a tag the upstream confirmed) or `stale` (the upstream failed; then also
`Warning: 110`). Tag listings and the catalog show what the cache holds.

The cache is ordinary registry storage: a manifest fetched upstream becomes a revision (and a tag)
of the same repository, its blobs are linked into it, so `ferry registry gc` treats mirrored
models like pushed ones.
"""
