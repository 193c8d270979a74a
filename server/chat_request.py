"""What a generate or chat request asks of a model, before any runner is involved.

Reads the model's defaults from its manifest layers (PARAMETER -> params, SYSTEM -> system,
MESSAGE -> messages), merges request options over them, parses `keep_alive`, and refuses what
the model cannot do (images for a text-only model) with a clear 400 instead of a runner error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from registry import media_types as mt
from registry.manifests import Manifest, ModelConfig
from registry.model_show import template_capabilities
from registry.names import Name
from registry.store import Store
from server.api_errors import APIError
from server.durations import InvalidDuration, parse_duration
from server.output_parser import ThinkMode

# Options the runner understands (docs/runner-protocol.md); Ollama ignores the rest too.
RUNNER_OPTIONS = frozenset({"temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                            "repeat_last_n", "seed", "stop", "num_predict", "num_ctx",
                            "num_keep"})
FOREVER_YEARS = 290
_LAYER_LIMIT = 1024 * 1024


@dataclass
class ModelDefaults:
    """A stored model's manifest and the request defaults its layers carry."""

    name: Name
    digest: str
    manifest: Manifest
    config: ModelConfig
    params: dict[str, Any] = field(default_factory=dict)
    system: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    template: str = ""

    @property
    def capabilities(self) -> list[str]:
        """As /api/show lists them: the config's, then what the Modelfile TEMPLATE renders."""
        found = [*(self.config.capabilities or []), *template_capabilities(self.template)]
        return list(dict.fromkeys(found)) or ["completion"]

    def details(self) -> dict[str, Any]:
        """Ollama's `details` object, from the config blob."""
        return {"parent_model": "", "format": self.config.model_format,
                "family": self.config.model_family,
                "families": self.config.model_families or None,
                "parameter_size": self.config.model_type,
                "quantization_level": self.config.file_type}


def _layer_text(store: Store, manifest: Manifest, media_type: str) -> str | None:
    layers = manifest.layers_of(media_type)
    if not layers or layers[-1].size > _LAYER_LIMIT:
        return None
    return store.read_blob(layers[-1].digest).decode("utf-8", errors="replace")


def load_model_defaults(store: Store, name: Name) -> ModelDefaults:
    """Read `name`'s manifest, config and default layers (blocking: call off the loop)."""
    entry = store.get_model(name)
    manifest = entry.manifest()
    config = ModelConfig()
    if manifest.config is not None and manifest.config.size <= _LAYER_LIMIT:
        config = ModelConfig.from_json(store.read_blob(manifest.config.digest))
    model = ModelDefaults(name, entry.digest.hex, manifest, config)
    params = _layer_text(store, manifest, mt.PARAMS)
    if params:
        loaded = json.loads(params)
        model.params = loaded if isinstance(loaded, dict) else {}
    model.system = _layer_text(store, manifest, mt.SYSTEM)
    model.template = (_layer_text(store, manifest, mt.TEMPLATE)
                      or _layer_text(store, manifest, mt.PROMPT) or "")
    messages = _layer_text(store, manifest, mt.MESSAGES)
    if messages:
        loaded = json.loads(messages)
        model.messages = [m for m in loaded if isinstance(m, dict)] if isinstance(
            loaded, list) else []
    return model


def parse_name(value: Any) -> Name:
    if not isinstance(value, str) or not value:
        raise APIError(400, "model is required")
    return Name.parse_valid(value)


def parse_keep_alive(value: Any) -> float | None:
    """Seconds from a number or a Go duration ("5m", "1h30m", "-1s", "300"); None if absent.

    Negative keeps the model loaded forever, 0 unloads it as soon as the request ends.
    """
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise APIError(400, "keep_alive must be a duration like \"5m\" or a number of seconds")
    try:
        return parse_duration(str(value))
    except InvalidDuration as exc:
        raise APIError(400, f"invalid keep_alive: {exc}") from exc


def merge_options(model: ModelDefaults, requested: Any) -> dict[str, Any]:
    """The model's PARAMETER defaults overlaid with the request's options (request wins)."""
    if requested is not None and not isinstance(requested, dict):
        raise APIError(400, "options must be an object")
    merged = {**model.params, **(requested or {})}
    options = {k: v for k, v in merged.items() if k in RUNNER_OPTIONS and v is not None}
    if isinstance(options.get("stop"), str):
        options["stop"] = [options["stop"]]
    return options


def refuse_unsupported(model: ModelDefaults, body: dict[str, Any], has_images: bool) -> None:
    """400 for what this model or ferry's runner cannot do, before anything is loaded."""
    shown = model.name.display_shortest()
    caps = model.capabilities
    if "completion" not in caps:
        raise APIError(400, f'"{shown}" does not support generate')
    if has_images and "vision" not in caps:
        raise APIError(400, f'"{shown}" does not support images: it is a text-only model')
    if body.get("tools") and "tools" not in caps:
        raise APIError(400, f'"{shown}" does not support tools')
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                            or not 0 <= top <= 20):
        raise APIError(400, "top_logprobs must be an integer from 0 to 20")


def logprob_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The runner request's `logprobs`/`top_logprobs`, when the client asked for them."""
    if not body.get("logprobs") and not body.get("top_logprobs"):
        return {}
    return {"logprobs": True, "top_logprobs": int(body.get("top_logprobs") or 0)}


THINK_LEVELS = ("low", "medium", "high")


def think_mode(model: ModelDefaults, think: Any) -> ThinkMode:
    """How to treat reasoning: `think` true or a level needs the `thinking` capability.

    Unset, a reasoning model's thinking still goes to `thinking`; false asks the template not
    to reason and drops any reasoning the model writes regardless.
    """
    capable = "thinking" in model.capabilities
    if think is not None and not isinstance(think, bool) and think not in THINK_LEVELS:
        raise APIError(400, f"invalid think value {think!r}: expected true, false, "
                            '"low", "medium" or "high"')
    if think not in (None, False) and not capable:
        raise APIError(400, f'"{model.name.display_shortest()}" does not support thinking')
    if not capable:
        return ThinkMode.OFF
    return ThinkMode.HIDE if think is False else ThinkMode.SHOW


def now_iso() -> str:
    """Ollama's `created_at`: RFC 3339 in UTC with microseconds."""
    return iso_time(datetime.now(UTC))


def iso_time(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def expires_iso(until: float | None) -> str:
    """`expires_at` for /api/ps; None (kept forever) becomes a date centuries away, as Ollama."""
    if until is None:
        return iso_time(datetime.now(UTC) + timedelta(days=365 * FOREVER_YEARS))
    return iso_time(datetime.fromtimestamp(until, UTC))


def fill_in_fields(model: ModelDefaults, body: dict[str, Any]) -> dict[str, Any]:
    """/api/generate's `template` override and `suffix` (fill-in-the-middle) for the runner.

    A suffix needs a template that writes `.Suffix` (the `insert` capability), as in Ollama."""
    out: dict[str, Any] = {}
    template, suffix = body.get("template"), body.get("suffix")
    if template is not None and not isinstance(template, str):
        raise APIError(400, "template must be a string")
    if suffix is not None and not isinstance(suffix, str):
        raise APIError(400, "suffix must be a string")
    if template:
        out["template"] = template
    if suffix:
        caps = template_capabilities(template) if template else model.capabilities
        if "insert" not in caps:
            raise APIError(400, f'"{model.name.display_shortest()}" does not support insert')
        out["suffix"] = suffix
    return out
