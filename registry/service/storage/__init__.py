"""Blob stores for the registry service: the protocol and its implementations."""

from __future__ import annotations

from registry.service.storage.base import BlobStore, KeyNotFound, Stat
from registry.service.storage.filesystem import FilesystemStore

__all__ = ["BlobStore", "FilesystemStore", "KeyNotFound", "Stat"]
