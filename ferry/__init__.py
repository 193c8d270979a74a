"""ferry: a self-hostable model registry and model toolchain."""

__version__ = "0.1.0"
