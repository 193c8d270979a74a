"""`ferry create NAME [-f Modelfile] [--quantize TYPE] [--draft-quantize TYPE]`.

The heavy work runs in the model server. The CLI parses the Modelfile, hashes each file of the
FROM (and DRAFT) source, asks `HEAD /api/blobs/<digest>`, uploads only what the server lacks
(`POST /api/blobs/<digest>`, retried on transient errors), then sends `POST /api/create` with
the `files`/`draft_files` maps and renders the progress stream.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn

from ferry.client import CLIError, ServerClient, error_text
from ferry.config import Settings
from registry.digests import Digest, sha256_file

if TYPE_CHECKING:
    from workflows.create.modelfile import Modelfile

UPLOAD_ATTEMPTS = 6
CHUNK = 1024 * 1024
_MODULE_DIR_RE = re.compile(r"^\d+_[A-Za-z]\w*$")
SOURCE_SUFFIXES = (".safetensors", ".json", ".jinja", ".model", ".tiktoken", ".txt")
_SPLIT_RE = re.compile(r"^(?P<prefix>.+)-\d{5}-of-(?P<count>\d{5})\.gguf$")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("create", help="create a model from a Modelfile or a checkpoint dir")
    parser.add_argument("model", help="name of the model to create, e.g. me/tiny:int4")
    parser.add_argument("-f", "--file", help="the Modelfile (default: ./Modelfile, else FROM .)")
    parser.add_argument("-q", "--quantize", help="int4 (q4), int8 (q8), nvfp4, mxfp4 or mxfp8")
    parser.add_argument("--draft-quantize", help="quantize type for the DRAFT model")
    parser.set_defaults(func=run)


def load_modelfile(path: str | None) -> tuple[Modelfile, Path]:
    """The Modelfile and the dir its relative paths resolve against."""
    # Imported here: `ferry` imports every command module, and this one pulls in numpy.
    from workflows.create.errors import CreateError
    from workflows.create.modelfile import Modelfile, parse_modelfile

    file = Path(path) if path else Path("Modelfile")
    if path is None and not file.is_file():
        return Modelfile(from_="."), Path.cwd()
    try:
        text = file.read_text()
    except OSError as exc:
        raise CLIError(f"cannot read {file}: {exc.strerror}") from exc
    try:
        return parse_modelfile(text), file.resolve().parent
    except CreateError as exc:
        raise CLIError(exc.message) from exc


def sentence_transformers_files(source: Path) -> dict[str, Path]:
    """The JSON configs of a sentence-transformers checkpoint's module folders (`1_Pooling/`,
    `2_Normalize/`, named in modules.json): the runner reads its pooling from them."""
    return {f"{p.parent.name}/{p.name}": p for p in sorted(source.glob("*/*.json"))
            if _MODULE_DIR_RE.match(p.parent.name) and p.is_file()}


def source_files(source: Path) -> dict[str, Path]:
    """The files of a FROM/DRAFT source: a checkpoint dir's top-level files, or GGUF file(s)."""
    if source.is_dir():
        files = {p.name: p for p in sorted(source.iterdir())
                 if p.is_file() and not p.name.startswith(".") and p.suffix in SOURCE_SUFFIXES}
        files.update(sentence_transformers_files(source))
        if not files:
            raise CLIError(f"{source} holds no model files (*.safetensors, *.json)")
        return files
    match = _SPLIT_RE.match(source.name)
    if match:  # every part of a split GGUF travels together
        parts = sorted(source.parent.glob(f"{match['prefix']}-*-of-{match['count']}.gguf"))
        return {p.name: p for p in parts}
    return {source.name: source}


def _resolve(value: str, base: Path) -> Path | None:
    path = Path(value).expanduser()
    path = path if path.is_absolute() else base / path
    return path if path.exists() else None


def build_request(args: argparse.Namespace, modelfile: Modelfile, base: Path
                  ) -> tuple[dict[str, Any], dict[str, Path]]:
    """The /api/create body (without digests filled in) and every local file to upload."""
    body: dict[str, Any] = {"model": args.model, "stream": True}
    uploads: dict[str, Path] = {}
    source = _resolve(modelfile.from_, base)
    if source is None:
        body["from"] = modelfile.from_
    else:
        body["files"] = source_files(source)
        uploads.update({f"files/{k}": v for k, v in body["files"].items()})
    if modelfile.draft:
        draft = _resolve(modelfile.draft, base)
        if draft is None or not draft.is_dir():
            raise CLIError(f"DRAFT {modelfile.draft}: not a checkpoint directory")
        body["draft_files"] = source_files(draft)
        uploads.update({f"draft/{k}": v for k, v in body["draft_files"].items()})
    for key, value in (("quantize", args.quantize), ("draft_quantize", args.draft_quantize),
                       ("template", modelfile.template), ("system", modelfile.system),
                       ("requires", modelfile.requires)):
        if value:
            body[key] = value
    if modelfile.parameters:
        body["parameters"] = modelfile.typed_parameters()
    if modelfile.licenses:
        body["license"] = modelfile.licenses
    if modelfile.messages:
        body["messages"] = modelfile.messages
    return body, uploads


def upload_blob(http: httpx.Client, digest: Digest, path: Path,
                on_chunk: Any = None) -> bool:
    """Upload `path` unless the server has it; True when bytes were sent. Retries transients."""
    for attempt in range(UPLOAD_ATTEMPTS):
        try:
            head = http.head(f"/api/blobs/{digest}")
            if head.status_code == 200:
                return False
            if head.status_code != 404:
                raise CLIError(error_text(head))
            response = http.post(f"/api/blobs/{digest}", content=_chunks(path, on_chunk))
        except httpx.TransportError as exc:
            if attempt + 1 == UPLOAD_ATTEMPTS:
                raise CLIError(f"uploading {path.name} failed: {exc}") from exc
        else:
            if response.status_code < 400:
                return True
            transient = response.status_code == 429 or response.status_code >= 500
            if not transient or attempt + 1 == UPLOAD_ATTEMPTS:
                raise CLIError(f"uploading {path.name}: {error_text(response)}")
        time.sleep(2 ** attempt)
    return True  # unreachable: the last attempt either returns or raises


def _chunks(path: Path, on_chunk: Any) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            if on_chunk:
                on_chunk(len(chunk))
            yield chunk


def run(args: argparse.Namespace, settings: Settings) -> int:
    modelfile, base = load_modelfile(args.file)
    body, uploads = build_request(args, modelfile, base)
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  console=console) as bars:
        digests = _hash_and_upload(settings, uploads, bars)
        for field in ("files", "draft_files"):
            if field in body:
                prefix = "files/" if field == "files" else "draft/"
                body[field] = {rel: str(digests[prefix + rel]) for rel in body[field]}
        with ServerClient(settings) as client:
            _render(client.stream("/api/create", body), bars)
    return 0


def _hash_and_upload(settings: Settings, uploads: dict[str, Path],
                     bars: Progress) -> dict[str, Digest]:
    digests: dict[str, Digest] = {}
    timeout = httpx.Timeout(30.0, read=600.0, write=600.0)
    with httpx.Client(base_url=settings.base_url, timeout=timeout) as http:
        for key, path in uploads.items():
            digest, size = sha256_file(str(path))
            digests[key] = digest
            task = bars.add_task(f"uploading {path.name}", total=size)
            try:
                sent = upload_blob(http, digest, path, lambda n, t=task: bars.advance(t, n))
            except httpx.ConnectError as exc:
                raise CLIError(f"could not connect to the ferry server at {settings.base_url};"
                               " start it with `ferry serve`") from exc
            bars.update(task, completed=size,
                        description=f"{'uploaded' if sent else 'using existing'} {path.name}")
    return digests


def _render(events: Iterator[dict[str, Any]], bars: Progress) -> None:
    tensors: TaskID | None = None
    for event in events:
        status, total = event.get("status", ""), event.get("total")
        if total and not event.get("digest"):
            if tensors is None:
                tensors = bars.add_task(status, total=total)
            bars.update(tensors, completed=event.get("completed", 0), description=status)
        elif status:
            bars.console.print(status)
