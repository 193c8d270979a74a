"""Registry access control: who may pull, push and delete where, proven by a short-lived token.

- config.py      the TOML file: users, groups, access rules, token settings (`--auth FILE`)
- passwords.py   scrypt password hashes, compared in constant time
- signatures.py  Ollama's Ed25519 request signature (the `<pubkey>:<sig>` Authorization)
- scopes.py      `repository:<name>:<actions>` scopes and the `access` claim they become
- tokens.py      Ed25519 (EdDSA) JWTs: issue, verify (with a cache), key rotation
- token_endpoint.py  `GET /token`, the distribution token spec's endpoint
- gate.py        the per-route check and the 401 challenge
- limits.py      per-client token buckets and concurrent upload sessions (429)
- audit.py       one JSON line per write or denial
- middleware.py  identifies the caller, applies the limits, writes the audit log
- userfile.py    `ferry registry user add`: appends a user to the file
"""
