"""Command groups of the `ferry` CLI, one module each (see ferry/cli.py)."""
