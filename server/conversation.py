"""Chat messages in the one shape every chat template can render.

Clients send tool loops in several dialects: the official `ollama` client drops empty fields,
so an assistant turn that only called tools has no `content`; OpenAI clients send `arguments`
as a JSON string and answer calls by `tool_call_id`; templates read `content`, `arguments` as
objects and `tool_name` (Ollama) or `name` (Hugging Face). Every message is normalised here
before it reaches a template, whichever route it came through.
"""

from __future__ import annotations

from typing import Any

from registry import bounded_json
from server.api_errors import APIError

MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_name", "tool_call_id", "thinking",
                "images")


def normalise_messages(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Known keys only; content always a string; calls with object arguments; named results."""
    names_by_id: dict[str, str] = {}
    out = []
    for message in raw:
        if not isinstance(message.get("role"), str):
            raise APIError(400, "every message needs a role")
        clean = {k: message[k] for k in MESSAGE_KEYS if message.get(k) is not None}
        clean["content"] = _text(clean.get("content"))
        if "images" in clean:
            clean["images"] = image_list(clean["images"])
        if "tool_calls" in clean:
            clean["tool_calls"] = [_call(c, i) for i, c in enumerate(_list(clean["tool_calls"]))]
            names_by_id.update({c["id"]: c["function"]["name"] for c in clean["tool_calls"]
                                if c.get("id")})
        if clean["role"] == "tool":
            name = clean.get("tool_name") or message.get("name") or names_by_id.get(
                str(clean.get("tool_call_id")))
            if name:
                clean["tool_name"] = clean["name"] = str(name)
        if clean.get("thinking"):
            clean["reasoning_content"] = clean["thinking"]  # the Hugging Face templates' name
        out.append(clean)
    return out


def image_list(images: Any) -> list[str]:
    """`images`: base64 strings (decoded, and refused if not images, by the runner)."""
    if not isinstance(images, list) or not all(isinstance(i, str) and i for i in images):
        raise APIError(400, "images must be a list of base64-encoded strings")
    return images


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    raise APIError(400, "message content must be a string")


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise APIError(400, "tool_calls must be a list")
    return value


def _call(call: Any, index: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, "every tool call needs a function with a name")
    arguments = function.get("arguments")
    if arguments is None or arguments == "":
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = bounded_json.loads(arguments)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, JSONLimitError
            raise APIError(400, f"tool call arguments are not JSON: {exc}") from exc
    if not isinstance(arguments, dict):
        raise APIError(400, "tool call arguments must be an object")
    out: dict[str, Any] = {"type": "function", "function": {
        "index": function.get("index", index), "name": function["name"],
        "arguments": arguments}}
    if call.get("id"):
        out["id"] = str(call["id"])
    return out
