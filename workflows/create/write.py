"""Execute a plan: one safetensors blob per tensor layer, quantized one tensor at a time.

Blob convention (what `runner/load.py` reads; reference 2.2). Every tensor layer's blob is a
standalone safetensors file (u64 LE header length, JSON header padded with spaces to 8 bytes,
data in header order). For a layer named N (the tensor name, e.g.
`model.layers.0.self_attn.q_proj.weight`, or `draft.`-prefixed for a draft model):

- unquantized: one tensor under key N, source dtype (BF16/F16/F32) and shape, bytes copied
  unchanged from the checkpoint; no `__metadata__`.
- quantized: key N = the packed weight, dtype U32, shape [out, in * bits / 32]; key `N.scale`
  = scales, shape [out, in / group_size], dtype = the source dtype for affine (int4, int8) and U8
  for nvfp4 (e4m3), mxfp4 and mxfp8 (e8m0); for affine only, key `N.bias` = biases, same shape
  and dtype as the scales. `__metadata__` = {"quant_type": "<int4|int8|nvfp4|mxfp4|mxfp8>",
  "group_size": "<64|64|16|32|32>"}, exactly what `mx.quantize(w, group_size, bits, mode)`
  returned and `mx.dequantize` takes back (see runner.quant.QUANT_TYPES for bits and mode).
- stacked experts: a blob named `<layer>.mlp.experts` holds `<layer>.mlp.experts.<proj>.weight`
  tensors of shape [experts, out, in] (plus `.scale`/`.bias` when quantized); if the blob's
  quantized tensors disagree, metadata is per tensor: `<key>.quant_type`, `<key>.group_size`.

Memory: an unquantized tensor is streamed in 4 MiB chunks; a quantized one is read, quantized,
serialized and released once written, so the peak is a few tensors, not the model.

Speed: on a CPU device, affine types (int4, int8) are quantized by
`runner.kernels.cpu_quantize.affine` straight from the mapped source bytes: MLX's own CPU
quantize divides weight by weight in scalar code (0.6 GB/s of bf16 per core), the kernel does
the same float arithmetic eight lanes at a time (3.4 GB/s), byte-identical; the fp modes go
through `runner.quant.quantize`, whose per-weight work is the kernel's too (`runner.quant_cpu`:
nvfp4 and mxfp4 0.03 -> 0.65 GB/s, mxfp8 0.37 -> 1.3 GB/s). Either quantizes on one core per
thread, so tensors are
quantized by QUANT_WORKERS threads (shared by every create in the process, each with its own
MLX stream) while the create's thread waits for the next tensor's bytes; at most QUANT_WORKERS
tensors of one create (and QUANT_AHEAD_BYTES of their sources) are in hand at once, and blobs
are still submitted in order.
A tensor of SPLIT_BYTES or more is quantized in two halves at once (see `_quantized_parts`).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Protocol

from registry import media_types as mt
from registry.digests import Digest
from registry.manifests import Descriptor
from registry.store import Store
from runner import quant_cpu
from runner.kernels import cpu_quantize
from runner.quant import QuantType, load_mlx, quantize
from workflows.create.blob_batch import BlobBatch
from workflows.create.errors import CreateCancelled
from workflows.create.inventory import TensorInfo
from workflows.create.plan import BlobPlan, ModelPlan, TensorPlan

CHUNK_BYTES = 4 * 1024 * 1024
QUANT_WORKERS = 2
QUANT_AHEAD_BYTES = 96 * 1024 * 1024
SPLIT_BYTES = 32 * 1024 * 1024
_POOL_LOCK = threading.Lock()
# The process's quantizing threads by name, made once each: MLX keeps a stream per thread for
# good, so a pool per create would leak threads.
_pools: dict[str, ThreadPoolExecutor] = {}
Progress = Callable[[dict[str, Any]], None]


class CancelSignal(Protocol):
    def is_set(self) -> bool: ...


class Arrivals(Protocol):
    """Files still being uploaded (`arrivals.Arrivals`): wait for a byte range, upload order."""

    def wait(self, path: Path, end: int) -> None: ...

    def rank(self, path: Path) -> int: ...


# (key, dtype tag, shape, bytes-like, a tuple of them in order, or chunks)
Part = tuple[str, str, tuple[int, ...], Any]


def check_cancel(cancel: CancelSignal) -> None:
    if cancel.is_set():
        raise CreateCancelled("create cancelled")


def safetensors_header(parts: list[tuple[str, str, tuple[int, ...], int]],
                       metadata: dict[str, str] | None) -> bytes:
    """The length-prefixed header for tensors laid out back to back in `parts` order."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for key, dtype, shape, nbytes in parts:
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset,
                                                                               offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_plan(plan: ModelPlan, store: Store, progress: Progress, cancel: CancelSignal,
               arrivals: Arrivals | None = None) -> list[Descriptor]:
    """Write every tensor blob of `plan`; returns their layers in plan order.

    With `arrivals` (files still being uploaded), blobs are written in the order their bytes
    arrive, each once its sources' byte ranges are on disk; the layers keep plan order.
    """
    order = list(range(len(plan.blobs)))
    if arrivals is not None:
        order.sort(key=lambda i: _arrival_key(plan.blobs[i], arrivals))
    futures: dict[int, Future[tuple[Path, Digest, int]]] = {}
    total, done = plan.total_bytes, 0
    sources = LazySources()
    ahead: deque[tuple[int, int, Future[Iterator[bytes | memoryview]]]] = deque()

    def submit_oldest() -> None:  # in order; its progress once it is handed to the writer
        nonlocal done
        i, nbytes, job = ahead.popleft()
        futures[i] = batch.submit(job.result())
        blob = plan.blobs[i]
        done += nbytes
        verb = "quantizing" if any(t.quant for t in blob.tensors) else "copying"
        progress({"status": f"{verb} {blob.name}", "total": total, "completed": done})

    with BlobBatch(store) as batch:
        try:
            for i in order:
                blob = plan.blobs[i]
                check_cancel(cancel)
                if arrivals is not None:
                    for source in (s for t in blob.tensors for s in t.sources):
                        arrivals.wait(source.file, source.start + source.nbytes)
                nbytes = sum(t.source_bytes for t in blob.tensors)
                while ahead and (len(ahead) >= QUANT_WORKERS
                                 or sum(n for _, n, _ in ahead) + nbytes > QUANT_AHEAD_BYTES):
                    submit_oldest()
                ahead.append((i, nbytes, quant_pool().submit(tensor_blob_chunks, blob, sources)))
            while ahead:
                submit_oldest()
        finally:  # on an error or a cancel: nothing of this create left running
            for _, _, job in ahead:
                job.cancel()
            wait([job for _, _, job in ahead])
        layers = [(blob.name, futures[i].result()) for i, blob in enumerate(plan.blobs)]
    return [Descriptor(mt.TENSOR, digest, size, name=name)
            for name, (_, digest, size) in layers]


def quant_pool() -> ThreadPoolExecutor:
    """The threads that quantize whole tensors (and first halves)."""
    return _pool("ferry-quantize", QUANT_WORKERS)


def split_pool() -> ThreadPoolExecutor:
    """The thread that quantizes second halves."""
    return _pool("ferry-quantize-split", 1)


def _pool(name: str, workers: int) -> ThreadPoolExecutor:
    with _POOL_LOCK:
        if name not in _pools:
            _pools[name] = ThreadPoolExecutor(workers, thread_name_prefix=name)
        return _pools[name]


def _arrival_key(blob: BlobPlan, arrivals: Arrivals) -> tuple[int, int]:
    """When the last byte a blob needs arrives: (file in upload order, end offset)."""
    return max(((arrivals.rank(s.file), s.start + s.nbytes)
                for t in blob.tensors for s in t.sources), default=(-1, 0))


def tensor_blob_chunks(blob: BlobPlan, sources: LazySources) -> Iterator[bytes | memoryview]:
    """Quantize the blob's tensors now; return its bytes as chunks (plain ones read lazily)."""
    parts: list[Part] = []
    for tensor in blob.tensors:
        parts.extend(_quantized_parts(tensor, sources) if tensor.quant
                     else [_plain_part(tensor)])
    header = safetensors_header([(k, d, s, _size(data)) for k, d, s, data in parts],
                                _metadata(blob.tensors))

    def chunks() -> Iterator[bytes | memoryview]:
        yield header
        for _key, _dtype, _shape, data in parts:
            yield from data if isinstance(data, Chunks | tuple) else (data,)

    return chunks()


def _metadata(tensors: tuple[TensorPlan, ...]) -> dict[str, str] | None:
    quants = {t.name: t.quant for t in tensors if t.quant is not None}
    kinds = set(quants.values())
    if not kinds:
        return None
    if len(kinds) == 1 and len(quants) == len(tensors):
        return kinds.pop().metadata()
    out = {}
    for name, quant in quants.items():
        out.update({f"{name}.{k}": v for k, v in quant.metadata().items()})
    return out


class Chunks:
    """A tensor's source bytes, read lazily in CHUNK_BYTES pieces (stacked sources in order)."""

    def __init__(self, sources: tuple[TensorInfo, ...]) -> None:
        self.sources = sources
        self.nbytes = sum(s.nbytes for s in sources)

    def __iter__(self) -> Iterator[bytes]:
        for source in self.sources:
            with open(source.file, "rb") as fh:
                fh.seek(source.start)
                left = source.nbytes
                while left:
                    chunk = fh.read(min(CHUNK_BYTES, left))
                    if not chunk:
                        raise OSError(f"{source.file.name}: unexpected end of file")
                    left -= len(chunk)
                    yield chunk


def _size(data: Any) -> int:
    if isinstance(data, tuple):  # a part quantized in halves
        return sum(memoryview(piece).nbytes for piece in data)
    return data.nbytes if isinstance(data, Chunks) else memoryview(data).nbytes


def _plain_part(tensor: TensorPlan) -> Part:
    return (tensor.name, tensor.dtype, tensor.shape, Chunks(tensor.sources))


class LazySources:
    """`mx.load` of each shard once per quantizing thread, lazily: a tensor's bytes are read
    only when it is used, and popped afterwards, so nothing is held beyond the tensors in hand.
    Per thread, because a lazy array is read on the stream of the thread that loaded it."""

    def __init__(self) -> None:
        self._local = threading.local()

    def take(self, info: TensorInfo) -> Any:
        files: dict[Path, dict[str, Any]] | None = getattr(self._local, "files", None)
        if files is None:
            files = self._local.files = {}
        if info.file not in files:
            files[info.file] = load_mlx().load(str(info.file))
        return files[info.file].pop(info.name)


def load_tensor(tensor: TensorPlan, sources: LazySources) -> Any:
    """The tensor as an MLX array in its source dtype (stacked along a new first axis)."""
    arrays = [sources.take(s) for s in tensor.sources]
    return arrays[0] if len(arrays) == 1 else load_mlx().stack(arrays)


def _quantized_parts(tensor: TensorPlan, sources: LazySources) -> list[Part]:
    """Quantize one tensor and copy its parts to host memory; MLX's buffers are released.

    A tensor of SPLIT_BYTES or more (an embedding, an output head) is quantized in two halves
    at once, the second on a thread of its own: such a tensor often comes last in a
    checkpoint, where one thread quantizing it alone was the create's whole tail. Groups lie
    along the last axis, so halves split along the first quantize exactly as the whole, and
    each part's bytes are the first half's followed by the second's (row-major), as written.
    """
    if native_quantize(tensor):
        return _native_parts(tensor)
    qtype: QuantType = tensor.quant  # type: ignore[assignment]
    weight = load_tensor(tensor, sources)
    keys = _part_keys(tensor)
    halves = _split_rows(weight)
    if halves is None:
        quantized = quantize(weight, qtype)
        parts = [_array_part(keys[part], quantized[part])
                 for part in ("weight", "scale", "bias") if part in quantized]
    else:
        second = split_pool().submit(quantize, halves[1], qtype)
        try:
            first = quantize(halves[0], qtype)
        finally:
            rest = second.result()  # never leave the helper reading a half this frame drops
        parts = [_joined_part(keys[part], first[part], rest[part])
                 for part in ("weight", "scale", "bias") if part in first]
        del first, rest, second
    del weight, halves
    load_mlx().clear_cache()  # else the buffer cache grows toward the model's size
    return parts


def _part_keys(tensor: TensorPlan) -> dict[str, str]:
    return {"weight": tensor.name, "scale": f"{tensor.name}.scale", "bias": f"{tensor.name}.bias"}


def native_quantize(tensor: TensorPlan) -> bool:
    """Whether `runner.kernels.cpu_quantize.affine` (MLX's CPU affine quantize, byte-identical
    and about 5x faster) quantizes this tensor from its source bytes: an affine type on a CPU
    device, where the kernel builds and agrees with MLX (`runner.quant_cpu.fast_path`)."""
    qtype, first = tensor.quant, tensor.sources[0]
    return (qtype is not None and qtype.mode == "affine" and len(first.shape) >= 2
            and first.nbytes > 0 and first.shape[-1] % qtype.group_size == 0
            and all(s.dtype == first.dtype and s.shape == first.shape for s in tensor.sources)
            and quant_cpu.fast_path(qtype.mode, qtype.bits, qtype.group_size, first.dtype))


def _native_parts(tensor: TensorPlan) -> list[Part]:
    """The tensor quantized straight from its mapped source bytes, in blocks of whole rows:
    one per source (stacked experts), or two halves of a tensor of SPLIT_BYTES or more; every
    other block runs on the split thread. Each part's bytes are its blocks' in order."""
    qtype: QuantType = tensor.quant  # type: ignore[assignment]
    shape = tensor.shape
    row_bytes = shape[-1] * tensor.sources[0].nbytes // tensor.sources[0].elements

    def run(block: memoryview) -> tuple[Any, ...]:
        rows = (block.nbytes // row_bytes, shape[-1])
        return cpu_quantize.affine(block, tensor.dtype, rows, qtype.bits, qtype.group_size)

    with contextlib.ExitStack() as stack:
        blocks = [stack.enter_context(_mapped(s)) for s in tensor.sources]
        if len(blocks) == 1 and blocks[0].nbytes >= SPLIT_BYTES and blocks[0].nbytes > row_bytes:
            half = blocks[0].nbytes // row_bytes // 2 * row_bytes
            blocks = [stack.enter_context(blocks[0][:half]),
                      stack.enter_context(blocks[0][half:])]
        helped = [split_pool().submit(run, block) for block in blocks[1::2]]
        try:
            mine = [run(block) for block in blocks[::2]]
        finally:  # the mappings close on leaving; nothing may still read them
            wait(helped)
        results: list[Any] = [None] * len(blocks)
        results[::2], results[1::2] = mine, [job.result() for job in helped]
    rows = shape[:-1]
    out_shapes = {"weight": (*rows, shape[-1] * qtype.bits // 32),
                  "scale": (*rows, shape[-1] // qtype.group_size)}
    out_shapes["bias"] = out_shapes["scale"]
    tags = {"weight": "U32", "scale": tensor.dtype, "bias": tensor.dtype}
    keys = _part_keys(tensor)
    parts: list[Part] = []
    for i, part in enumerate(("weight", "scale", "bias")):
        pieces = tuple(memoryview(result[i]).cast("B") for result in results)
        parts.append((keys[part], tags[part], out_shapes[part],
                      pieces[0] if len(pieces) == 1 else pieces))
    return parts


@contextlib.contextmanager
def _mapped(info: TensorInfo) -> Iterator[memoryview]:
    """The source tensor's bytes, mapped read-only: an upload's file is reserved at its full
    size before it fills and never shrinks (`reserve_temp`), and a blob never changes."""
    offset = info.start - info.start % mmap.ALLOCATIONGRANULARITY
    with open(info.file, "rb") as fh:
        if fh.seek(0, 2) < info.start + info.nbytes:
            raise OSError(f"{info.file.name}: unexpected end of file")
        with (mmap.mmap(fh.fileno(), info.start + info.nbytes - offset, access=mmap.ACCESS_READ,
                        offset=offset) as mapping,
              memoryview(mapping) as whole,
              whole[info.start - offset:] as view):
            yield view


def _split_rows(weight: Any) -> tuple[Any, Any] | None:
    """The tensor's two halves along its first axis, evaluated here (an array is computed on
    the stream of the thread that made it); None when it is small or has a single row."""
    if weight.nbytes < SPLIT_BYTES or weight.ndim < 2 or weight.shape[0] < 2:
        return None
    half = weight.shape[0] // 2
    first, second = weight[:half], weight[half:]
    load_mlx().eval(first, second)  # views of rows, no copy; usable on any thread once evaluated
    return first, second


def _joined_part(key: str, first: Any, second: Any) -> Part:
    """One part from two halves: the bytes of both, in order (never copied into one)."""
    a, b = _array_part(key, first), _array_part(key, second)
    shape = (a[2][0] + b[2][0], *a[2][1:])
    return (key, a[1], shape, (a[3], b[3]))


def _array_part(key: str, array: Any) -> Part:
    mx = load_mlx()
    tags = {mx.uint32: "U32", mx.uint8: "U8", mx.bfloat16: "BF16", mx.float16: "F16",
            mx.float32: "F32"}
    tag = tags[array.dtype]
    flat = array.view(mx.uint16) if tag == "BF16" else array  # buffers have no bf16 format
    mx.eval(flat)
    # No copy: the bytes stay in the MLX array, which the part keeps alive until written.
    return (key, tag, tuple(array.shape), memoryview(flat).cast("B"))


def write_file_layer(store: Store, path: Any, name: str | None, media_type: str) -> Descriptor:
    """A staged file as a layer (JSON files keep their relative path as the name)."""
    with open(path, "rb") as fh:
        digest = store.blob_writer().write_all(iter(lambda: fh.read(CHUNK_BYTES), b""))
    return Descriptor(media_type, digest, store.blob_size(digest), name=name)


def write_bytes_layer(store: Store, data: bytes, media_type: str,
                      name: str | None = None) -> Descriptor:
    digest: Digest = store.blob_writer().write_all(data)
    return Descriptor(media_type, digest, len(data), name=name)
