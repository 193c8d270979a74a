"""The model server (`ferry serve`): Ollama's /api and OpenAI's /v1 over the local store.

One module per route group, routes declared as data; the scheduler spawns and supervises the
runner processes, which it talks to over HTTP (it needs no MLX of its own).
"""
