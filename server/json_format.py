"""`format: "json"` and JSON-schema formats, enforced by validation and retry.

The runner samples freely (no grammar), so the model server asks for JSON in the system prompt,
collects the whole answer, extracts the first JSON value in it, validates it (against the schema
when one is given), and retries with a new seed when that fails. A client only ever sees JSON
that passed; after `MAX_ATTEMPTS` misses the request fails with a 500 that says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema

from server.api_errors import APIError

MAX_ATTEMPTS = 3


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
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise APIError(400, f'invalid format: expected "json" or a JSON schema, '
                                    f"got {value!r}") from exc
        if not isinstance(value, dict):
            raise APIError(400, 'invalid format: expected "json" or a JSON schema object')
        try:
            jsonschema.validators.validator_for(value).check_schema(value)
        except jsonschema.SchemaError as exc:
            raise APIError(400, f"invalid JSON schema in format: {exc.message}") from exc
        return cls(schema=value)

    def instruction(self) -> str:
        """The system-prompt text that asks the model for this format."""
        text = "Respond only with valid JSON, no prose and no code fences."
        if self.schema is not None:
            text += " The JSON must match this JSON schema: " + json.dumps(self.schema)
        return text

    def accept(self, text: str) -> str | None:
        """The first JSON value in `text`, re-serialized, if it satisfies the format."""
        for value in _json_values(text):
            if self.schema is None:
                if isinstance(value, dict | list):
                    return json.dumps(value)
                continue
            if jsonschema.validators.validator_for(self.schema)(self.schema).is_valid(value):
                return json.dumps(value)
        return None

    def failure(self) -> APIError:
        what = "JSON matching the requested schema" if self.schema is not None else "valid JSON"
        return APIError(500, f"the model did not produce {what} in {MAX_ATTEMPTS} attempts")


def _json_values(text: str) -> list[Any]:
    """Every JSON object or array that starts at a `{` or `[` in `text` and parses."""
    decoder = json.JSONDecoder()
    found = []
    for index, char in enumerate(text):
        if char in "{[":
            try:
                value, _ = decoder.raw_decode(text, index)
            except json.JSONDecodeError:
                continue
            found.append(value)
            if len(found) >= 8:
                break
    return found


def with_instruction(messages: list[dict[str, Any]], fmt: JSONFormat) -> list[dict[str, Any]]:
    """Messages with the format instruction added to the leading system message (or a new one).

    Many chat templates allow a system message only first, so the instruction joins that one.
    """
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{fmt.instruction()}".strip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": fmt.instruction()}, *messages]
