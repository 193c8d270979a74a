"""The runner process's HTTP API.

The wire contract is docs/runner-protocol.md (GET /v1/status, POST /v1/completions NDJSON,
POST /v1/tokenize): build this module to exactly that document; the scheduler is its only client.
"""
