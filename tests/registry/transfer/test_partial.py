"""The partial file a pull writes into: gathered writes land in order at their offset, and the
in-order hasher (flushing on its own thread) yields the digest of the whole file."""

from __future__ import annotations

import threading

from registry.digests import Digest
from registry.manifests import Descriptor
from registry.transfer.partial import OrderedHasher, PartialBlob, plan_parts


def test_gathered_chunks_are_written_back_to_back_at_their_offset(tmp_path):
    data = bytes(range(256)) * 4096 * 5  # 5 MiB
    desc = Descriptor("application/octet-stream", Digest.of(data), len(data))
    partial = PartialBlob(tmp_path, desc)
    parts = plan_parts(len(data), 2 * 1024 * 1024)
    partial.open(parts)
    hasher = OrderedHasher(partial.path, parts, len(data))
    result: list[tuple[Digest, int] | None] = []
    thread = threading.Thread(target=lambda: result.append(hasher.run()))
    thread.start()
    for part in reversed(parts):  # the hasher must wait for the front, then catch up
        chunks = [data[o:o + 70_000] for o in range(part.offset, part.offset + part.size, 70_000)]
        chunks[-1] = data[part.offset + 70_000 * (len(chunks) - 1):part.offset + part.size]
        partial.write([b"", *chunks], part.offset)
        part.completed = part.size
        hasher.wake()
    thread.join(timeout=30)
    partial.close()
    assert result == [(desc.digest, len(data))]
    assert partial.path.read_bytes() == data
