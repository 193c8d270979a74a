"""`ferry list | show | rm | cp`: the local store, through the model server, as `ollama` does."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from typing import Any

from ferry.client import ServerClient
from ferry.config import Settings

SHOW_FIELDS = ("modelfile", "template", "parameters", "license", "system")


def register(sub: argparse._SubParsersAction) -> None:
    listing = sub.add_parser("list", aliases=["ls"], help="list the models in the local store")
    listing.set_defaults(func=run_list)

    show = sub.add_parser("show", help="show a model's details, Modelfile or layers")
    show.add_argument("model", help="model name, e.g. llama3:8b or host:5000/team/model:tag")
    only = show.add_mutually_exclusive_group()
    for field in SHOW_FIELDS:
        only.add_argument(f"--{field}", action="store_true", help=f"print only the {field}")
    show.add_argument("-v", "--verbose", action="store_true",
                      help="also print every metadata key and the tensors")
    show.set_defaults(func=run_show)

    rm = sub.add_parser("rm", help="remove models (their blobs go when nothing else uses them)")
    rm.add_argument("models", nargs="+", metavar="MODEL")
    rm.set_defaults(func=run_rm)

    cp = sub.add_parser("cp", help="copy a model to a new name (shares its blobs)")
    cp.add_argument("source")
    cp.add_argument("destination")
    cp.set_defaults(func=run_cp)


# -- list ----------------------------------------------------------------------------------------

def human_bytes(size: int) -> str:
    """Ollama's format.HumanBytes: decimal units, `4.7 GB`, `12 MB`, `512 B`."""
    for scale, unit in ((10**12, "TB"), (10**9, "GB"), (10**6, "MB"), (10**3, "KB")):
        if size >= scale:
            value = size / scale
            if value >= 10 or value.is_integer():
                return f"{int(value)} {unit}"
            return f"{value:.1f} {unit}"
    return f"{size} B"


def human_duration(seconds: float) -> str:
    """Go's units.HumanDuration, which `ollama list` uses for MODIFIED."""
    whole = int(seconds)
    minutes, hours = int(seconds // 60), int(seconds / 3600 + 0.5)
    if whole < 1:
        return "Less than a second"
    if whole < 60:
        return "1 second" if whole == 1 else f"{whole} seconds"
    if minutes < 60:
        return "About a minute" if minutes == 1 else f"{minutes} minutes"
    if hours == 1:
        return "About an hour"
    for limit, divisor, unit in ((48, 1, "hours"), (24 * 14, 24, "days"),
                                 (24 * 60, 24 * 7, "weeks"), (24 * 730, 24 * 30, "months")):
        if hours < limit:
            return f"{hours // divisor} {unit}"
    return f"{int(seconds // 3600) // 24 // 365} years"


def human_time(iso: str, now: datetime | None = None) -> str:
    try:
        then = datetime.fromisoformat(iso)
    except ValueError:
        return iso
    now = now or datetime.now(then.tzinfo)
    delta = (now - then).total_seconds()
    return f"{human_duration(-delta)} from now" if delta < 0 else f"{human_duration(delta)} ago"


def table(rows: list[list[str]]) -> str:
    """Left-aligned columns three spaces apart, like Go's tabwriter in the ollama CLI."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["   ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    return "\n".join(lines)


def run_list(args: argparse.Namespace, settings: Settings) -> int:
    with ServerClient(settings) as client:
        models = client.request("GET", "/api/tags").json().get("models", [])
    rows = [["NAME", "ID", "SIZE", "MODIFIED"]]
    for model in models:
        rows.append([model.get("name", ""), str(model.get("digest", ""))[:12],
                     human_bytes(int(model.get("size", 0))),
                     human_time(str(model.get("modified_at", "")))])
    print(table(rows))
    return 0


# -- show ----------------------------------------------------------------------------------------

def _section(title: str, rows: list[list[str]]) -> str:
    if not rows:
        return ""
    body = table(rows) if all(len(r) > 1 for r in rows) else "\n".join(r[0] for r in rows)
    return f"  {title}\n" + "\n".join(f"    {line}" for line in body.splitlines()) + "\n\n"


def _model_rows(info: dict[str, Any]) -> list[list[str]]:
    details = info.get("details") or {}
    model_info = info.get("model_info") or {}
    arch = model_info.get("general.architecture") or details.get("family", "")
    rows = [["architecture", str(arch)],
            ["parameters", str(details.get("parameter_size", ""))]]
    for key, label in (("context_length", "context length"),
                       ("embedding_length", "embedding length")):
        value = model_info.get(f"{arch}.{key}", details.get(key))
        if value:
            rows.append([label, str(value)])
    rows.append(["quantization", str(details.get("quantization_level", ""))])
    if info.get("requires"):
        rows.append(["requires", str(info["requires"])])
    return [row for row in rows if row[1]]


def _first_paragraph(text: str, limit: int = 2) -> list[list[str]]:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    shown = [[line.strip()] for line in lines[:limit]]
    return shown + ([["..."]] if len(lines) > limit else [])


def render_show(info: dict[str, Any], verbose: bool) -> str:
    """The `ollama show` summary: Model, Capabilities, Parameters, System, License sections."""
    out = _section("Model", _model_rows(info))
    out += _section("Capabilities", [[c] for c in info.get("capabilities") or []])
    params = [line.split(None, 1) for line in (info.get("parameters") or "").splitlines()]
    out += _section("Parameters", [p for p in params if len(p) == 2])
    if info.get("system"):
        out += _section("System", _first_paragraph(info["system"]))
    if info.get("license"):
        out += _section("License", _first_paragraph(info["license"]))
    if verbose:
        metadata = info.get("model_info") or {}
        out += _section("Metadata", [[k, _short(v)] for k, v in sorted(metadata.items())])
        tensors = info.get("tensors") or []
        out += _section("Tensors", [[t["name"], t["type"], str(t["shape"])] for t in tensors])
    return "\n" + out.rstrip("\n") + "\n"


def _short(value: Any) -> str:
    text = "[...]" if value is None else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def run_show(args: argparse.Namespace, settings: Settings) -> int:
    body = {"model": args.model, "verbose": bool(args.verbose)}
    with ServerClient(settings) as client:
        info = client.request("POST", "/api/show", body).json()
    for field in SHOW_FIELDS:
        if getattr(args, field):
            text = str(info.get(field) or "")
            sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")
            return 0
    sys.stdout.write(render_show(info, args.verbose))
    return 0


# -- rm, cp --------------------------------------------------------------------------------------

def run_rm(args: argparse.Namespace, settings: Settings) -> int:
    with ServerClient(settings) as client:
        for model in args.models:
            client.request("DELETE", "/api/delete", {"model": model})
            print(f"deleted '{model}'")
    return 0


def run_cp(args: argparse.Namespace, settings: Settings) -> int:
    with ServerClient(settings) as client:
        client.request("POST", "/api/copy",
                       {"source": args.source, "destination": args.destination})
    print(f"copied '{args.source}' to '{args.destination}'")
    return 0
