"""`format: "json"` and JSON-schema formats: checked here, enforced by the runner's grammar.

The model server refuses a malformed format or schema with a 400 before any runner is involved;
the runner then masks the logits at every step (runner/constrain.py), so the answer streams
token by token and is valid JSON (for the schema) in one pass, as Ollama's is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jsonschema

from registry import bounded_json
from server.api_errors import APIError


@dataclass(frozen=True)
class JSONFormat:
    """A parsed `format` field: any JSON object/array, or one that matches `schema`."""

    schema: dict[str, Any] | None = None

    @classmethod
    def parse(cls, value: Any) -> JSONFormat | None:
        """None for no format; 400 for a format that is neither "json" nor a valid schema."""
        if value is None or value == "":
            return None
        if value == "json":
            return cls()
        if isinstance(value, str):
            try:
                value = bounded_json.loads(value)
            except (ValueError, RecursionError) as exc:  # JSONDecodeError, JSONLimitError
                raise APIError(400, f'invalid format: expected "json" or a JSON schema, '
                                    f"got {value!r}") from exc
        if not isinstance(value, dict):
            raise APIError(400, 'invalid format: expected "json" or a JSON schema object')
        try:
            jsonschema.validators.validator_for(value).check_schema(value)
        except jsonschema.SchemaError as exc:
            raise APIError(400, f"invalid JSON schema in format: {exc.message}") from exc
        return cls(schema=value)

    def runner_value(self) -> Any:
        """What the runner's grammar takes: "json" or the schema."""
        return self.schema if self.schema is not None else "json"
