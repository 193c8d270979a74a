"""Create's domain errors: each says which file is wrong and how (the API answers 400)."""

from __future__ import annotations

from registry.errors import FerryError


class CreateError(FerryError):
    """Bad create input: a file, a field or a checkpoint that cannot become a model."""

    def __init__(self, message: str, file: str | None = None) -> None:
        super().__init__(f"{file}: {message}" if file else message)
        self.file = file


class CreateCancelled(Exception):
    """The client went away; the create stopped and published nothing."""
