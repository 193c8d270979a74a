"""`ferry create NAME [-f Modelfile] [--quantize TYPE] [--draft-quantize TYPE]`.

The heavy work runs in the model server. The CLI parses the Modelfile. The model's
safetensors files stream to upload sessions (a ferry extension, `server/uploads_api.py`),
hashed as they are sent, from before anything else is uploaded and while `POST /api/create`
already runs: the server quantizes each tensor as its bytes arrive and publishes only after
every file matched the digest the CLI computed. Meanwhile, for each metadata file of the FROM
(and every file of the DRAFT) source the CLI hashes the file, asks `HEAD /api/blobs/<digest>`
and uploads only what the server lacks (`POST /api/blobs/<digest>`, retried on transient
errors). A local digest cache (`ferry/digest_cache.py`) lets a re-run skip files the server
already has without hashing them; a server without sessions (Ollama) gets the
hash-then-upload flow for every file. The CLI renders the create's progress stream.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn

from ferry.client import CLIError, ServerClient, error_text, server_verify, unreachable
from ferry.config import Settings
from ferry.digest_cache import DigestCache
from registry.digests import Digest, Hasher, sha256_file

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
        except httpx.ConnectError as exc:  # no server there, or one this client does not trust
            raise unreachable(str(http.base_url).rstrip("/"), exc) from exc
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
    cache = DigestCache(settings.home / "cache" / "file-digests.json")
    timeout = httpx.Timeout(30.0, read=600.0, write=600.0)
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  console=console) as bars, \
            httpx.Client(base_url=settings.base_url, timeout=timeout,
                         verify=server_verify(settings)) as http:
        try:
            refs, streams, blobs = _start_streams(http, uploads, cache, bars)
        except httpx.ConnectError as exc:
            raise unreachable(settings.base_url, exc) from exc
        # The weights start streaming now; the small files follow beside them, then the create.
        sender = StreamedUploads(settings.base_url, timeout, streams, cache, bars,
                                 verify=server_verify(settings))
        with sender, ServerClient(settings) as client:
            try:
                for key, path in blobs.items():
                    refs[key] = str(_hash_and_upload(http, path, cache, bars))
            except httpx.ConnectError as exc:
                raise unreachable(settings.base_url, exc) from exc
            for field in ("files", "draft_files"):
                if field in body:
                    prefix = "files/" if field == "files" else "draft/"
                    body[field] = {rel: refs[prefix + rel] for rel in body[field]}
            try:
                _render(client.stream("/api/create", body), bars)
            except CLIError:
                sender.stop()
                sender.raise_error()  # the upload's own failure says more than the create's
                raise
            sender.raise_error()
    return 0


def _start_streams(http: httpx.Client, uploads: dict[str, Path], cache: DigestCache,
                   bars: Progress
                   ) -> tuple[dict[str, str], dict[str, tuple[str, Path]], dict[str, Path]]:
    """What `/api/create` names each file by, as far as known before any byte is sent: a
    digest the server has (the cache knows the file), or `upload:<id>` for a safetensors file
    the server reads as it streams in (sent by `StreamedUploads` while the create runs). The
    rest (metadata, a draft's files; everything, for servers without upload sessions: Ollama,
    older ferry) come back apart, to be hashed and uploaded as blobs while the weights stream."""
    refs: dict[str, str] = {}
    streams: dict[str, tuple[str, Path]] = {}
    blobs: dict[str, Path] = {}
    sessions = True
    for key, path in sorted(uploads.items()):
        if not (_streamable(key) and sessions):
            blobs[key] = path
            continue
        known = cache.get(path)
        if known is not None and _server_has(http, known):
            bars.add_task(f"using existing {path.name}", total=1, completed=1)
            refs[key] = str(known)
            continue
        upload_id = _start_session(http, path.stat().st_size)
        if upload_id is not None:
            refs[key], streams[upload_id] = f"upload:{upload_id}", (key, path)
            continue
        sessions = False
        blobs[key] = path
    return refs, streams, blobs


def _streamable(key: str) -> bool:
    """The model's own weights stream; metadata (and a draft's files) go first, as blobs."""
    return key.startswith("files/") and key.endswith(".safetensors")


def _server_has(http: httpx.Client, digest: Digest) -> bool:
    head = http.head(f"/api/blobs/{digest}")
    if head.status_code not in (200, 404):
        raise CLIError(error_text(head))
    return head.status_code == 200


def _start_session(http: httpx.Client, size: int) -> str | None:
    """An upload session's id; None when the server has no such API (404/405)."""
    response = http.post("/api/uploads", json={"size": size})
    if response.status_code in (404, 405):
        return None
    if response.status_code != 201:
        raise CLIError(f"starting an upload: {error_text(response)}")
    return str(response.json()["id"])


def _hash_and_upload(http: httpx.Client, path: Path, cache: DigestCache,
                     bars: Progress) -> Digest:
    known = cache.get(path)
    digest, size = (known, path.stat().st_size) if known else sha256_file(str(path))
    task = bars.add_task(f"uploading {path.name}", total=size)
    sent = upload_blob(http, digest, path, lambda n, t=task: bars.advance(t, n))
    bars.update(task, completed=size,
                description=f"{'uploaded' if sent else 'using existing'} {path.name}")
    cache.put(path, digest)
    return digest


class StreamedUploads:
    """Sends the upload sessions' files, one after another, in a thread while the create runs:
    each file is hashed as it is read and sent (`PATCH /api/uploads/<id>`), and its digest named
    when the body is through (`PUT ...?digest=`), which the server checks before it publishes.
    Files go in path order, the order the server waits for them in."""

    def __init__(self, base_url: str, timeout: httpx.Timeout,
                 streams: dict[str, tuple[str, Path]], cache: DigestCache,
                 bars: Progress, verify: ssl.SSLContext | bool = True) -> None:
        self.streams = sorted(streams.items(), key=lambda kv: kv[1][0])
        self.cache, self.bars = cache, bars
        self._http = httpx.Client(base_url=base_url, timeout=timeout, verify=verify)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ferry-upload", daemon=True)

    def __enter__(self) -> StreamedUploads:
        if self.streams:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.stop()
        if self._thread.is_alive():
            self._thread.join()
        self._http.close()

    def stop(self) -> None:
        """Abandon what is left: the request in flight is cut, and the server drops it."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def raise_error(self) -> None:
        if self._thread.is_alive():
            self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, CLIError):
                raise error
            raise CLIError(f"uploading failed: {error}") from error

    def _run(self) -> None:
        sent = 0
        try:
            for upload_id, (_key, path) in self.streams:
                if self._stop.is_set():
                    break
                self._send(upload_id, path)
                sent += 1
        except BaseException as exc:  # reported by raise_error in the main thread
            if not self._stop.is_set():
                self._error = exc
        if sent < len(self.streams):
            # Abandon the sessions left (the server drops a cut body by itself, but not a body
            # that failed after it was through, nor files not yet sent), so a create waiting
            # for them fails now, not after its stall timeout, and their temp files go.
            for upload_id, _ in self.streams[sent:]:
                with contextlib.suppress(httpx.HTTPError):
                    self._http.delete(f"/api/uploads/{upload_id}")

    def _send(self, upload_id: str, path: Path) -> None:
        size = path.stat().st_size
        task = self.bars.add_task(f"uploading {path.name}", total=size)
        hasher = Hasher()

        def body() -> Iterator[bytes]:
            for chunk in _chunks(path, lambda n: self.bars.advance(task, n)):
                if self._stop.is_set():
                    raise CLIError("upload stopped")
                hasher.update(chunk)
                yield chunk

        response = self._http.patch(f"/api/uploads/{upload_id}", content=body(),
                                    headers={"Content-Length": str(size)})
        if response.status_code >= 400:
            raise CLIError(f"uploading {path.name}: {error_text(response)}")
        if hasher.size != size:
            raise CLIError(f"{path.name} changed while it was uploaded")
        digest = hasher.digest()
        response = self._http.put(f"/api/uploads/{upload_id}", params={"digest": str(digest)})
        if response.status_code >= 400:
            raise CLIError(f"uploading {path.name}: {error_text(response)}")
        self.cache.put(path, digest)
        self.bars.update(task, completed=size, description=f"uploaded {path.name}")


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
