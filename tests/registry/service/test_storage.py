"""The BlobStore conformance suite: every implementation must pass all of it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from registry.service.storage import BlobStore, FilesystemStore, KeyNotFound

from .conftest import open_fds, s3_store, wait_open_fds_at_most


@pytest.fixture(params=["filesystem", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "filesystem":
        impl = FilesystemStore(tmp_path / "store")
    else:
        endpoint = request.getfixturevalue("s3_server")
        impl = s3_store(endpoint)
    yield impl
    impl.close()


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        await asyncio.sleep(0)
        yield part


async def read_all(store: BlobStore, key: str, offset: int = 0, length: int | None = None):
    return b"".join([p async for p in store.read(key, offset, length)])


async def test_put_then_get_stat_and_overwrite(store: BlobStore) -> None:
    assert await store.stat("a/b/c") is None
    await store.put("a/b/c", b"hello")
    assert await store.get("a/b/c") == b"hello"
    stat = await store.stat("a/b/c")
    assert stat is not None and stat.size == 5 and stat.mtime > 0
    await store.put("a/b/c", b"bye")
    assert await store.get("a/b/c") == b"bye"


async def test_get_and_read_of_missing_key_raise_key_not_found(store: BlobStore) -> None:
    with pytest.raises(KeyNotFound):
        await store.get("missing")
    with pytest.raises(KeyNotFound):
        await read_all(store, "missing")


async def test_read_ranges_of_a_large_object(store: BlobStore) -> None:
    data = bytes(range(256)) * 12_000  # 3 MiB: crosses the 1 MiB piece size
    await store.append("big", chunks(data[:1000], data[1000:]))
    assert await read_all(store, "big") == data
    assert await read_all(store, "big", 1_500_000, 1_000_000) == data[1_500_000:2_500_000]
    assert await read_all(store, "big", 10, 5) == data[10:15]


async def test_append_accumulates_and_reports_bytes_written(store: BlobStore) -> None:
    assert await store.append("s/data", chunks(b"ab", b"cd")) == 4
    assert await store.append("s/data", chunks(b"ef")) == 2
    assert await store.get("s/data") == b"abcdef"


async def test_append_keeps_bytes_received_before_a_failure(store: BlobStore) -> None:
    async def broken() -> AsyncIterator[bytes]:
        yield b"kept"
        raise ConnectionResetError("client went away")

    with pytest.raises(ConnectionResetError):
        await store.append("s/data", broken())
    assert await store.get("s/data") == b"kept"


async def test_concurrent_small_appends_keep_every_line_whole(store: BlobStore) -> None:
    lines = [f"{i:04d} sha256:{'ab' * 32}\n".encode() for i in range(16)]
    await asyncio.gather(*(store.append("log", chunks(line)) for line in lines))
    got = (await store.get("log")).splitlines(keepends=True)
    assert sorted(got) == lines


async def test_commit_publishes_staged_bytes_and_removes_the_staging_key(store: BlobStore) -> None:
    await store.append("staging/x", chunks(b"payload"))
    await store.commit("published/deep/x", "staging/x")
    assert await store.get("published/deep/x") == b"payload"
    assert await store.stat("staging/x") is None


async def test_commit_of_many_appends_concatenates_them(store: BlobStore) -> None:
    big = bytes(range(256)) * 40_000  # ~10 MiB: more than one multipart part on S3
    await store.append("staging/y", chunks(b"first,"))
    await store.append("staging/y", chunks(big))
    await store.append("staging/y", chunks(b",last"))
    stat = await store.stat("staging/y")
    assert stat is not None and stat.size == len(big) + 11
    assert await read_all(store, "staging/y", 3, 10) == (b"first," + big)[3:13]
    await store.commit("out/y", "staging/y")
    assert await store.get("out/y") == b"first," + big + b",last"
    assert await store.stat("staging/y") is None
    assert await store.list("staging") == []


async def test_commit_replaces_an_existing_object(store: BlobStore) -> None:
    await store.put("target", b"old")
    await store.append("staging", chunks(b"new"))
    await store.commit("target", "staging")
    assert await store.get("target") == b"new"


async def test_list_returns_sorted_direct_children(store: BlobStore) -> None:
    for key in ("p/b/1", "p/a", "p/c/2/3"):
        await store.put(key, b"x")
    assert await store.list("p") == ["a", "b", "c"]
    assert await store.list("p/c") == ["2"]
    assert await store.list("nothing/here") == []


async def test_delete_removes_a_key_or_a_whole_prefix(store: BlobStore) -> None:
    for key in ("d/1", "d/sub/2", "keep"):
        await store.put(key, b"x")
    await store.delete("d/1")
    assert await store.stat("d/1") is None
    await store.delete("d")
    assert await store.list("d") == []
    await store.delete("never-existed")
    assert await store.get("keep") == b"x"


async def test_concurrent_puts_leave_one_whole_value(store: BlobStore) -> None:
    values = [bytes([i]) * 100_000 for i in range(16)]
    await asyncio.gather(*(store.put("race", v) for v in values))
    assert await store.get("race") in values
    assert await store.list("") == ["race"]  # no temp files left visible


async def test_keys_that_escape_the_store_are_refused(store: BlobStore) -> None:
    for key in ("../outside", "/abs", "a/../../b"):
        with pytest.raises(ValueError):
            await store.put(key, b"x")


async def test_redirect_url_is_none_when_the_store_serves_bytes_itself(store: BlobStore) -> None:
    await store.put("k", b"x")
    assert store.redirect_url("k") is None


async def test_put_if_swaps_only_from_the_expected_version(store: BlobStore) -> None:
    assert await store.get_versioned("cas") == (b"", None)
    assert await store.put_if("cas", b"one", None)
    assert not await store.put_if("cas", b"again", None)  # absent no longer
    data, version = await store.get_versioned("cas")
    assert data == b"one" and version is not None
    assert await store.put_if("cas", b"two", version)
    assert not await store.put_if("cas", b"stale", version)  # the version moved on
    assert await store.get("cas") == b"two"
    assert await store.list("") == ["cas"]


async def _increment(store: BlobStore, key: str) -> int:
    """One compare-and-swap increment of a counter; returns how many swaps it lost."""
    lost = 0
    while True:
        data, version = await store.get_versioned(key)
        if await store.put_if(key, str(int(data or b"0") + 1).encode(), version):
            return lost
        lost += 1


async def test_concurrent_compare_and_swap_increments_lose_no_update(store: BlobStore) -> None:
    await asyncio.gather(*(_increment(store, "counter") for _ in range(24)))
    assert await store.get("counter") == b"24"


def _increment_in_a_process(root: str, times: int) -> None:
    store = FilesystemStore(Path(root))
    for _ in range(times):
        asyncio.run(_increment(store, "counter"))


def test_filesystem_put_if_is_serialized_across_processes(tmp_path: Path) -> None:
    import multiprocessing

    context = multiprocessing.get_context("fork")
    procs = [context.Process(target=_increment_in_a_process, args=(str(tmp_path), 50))
             for _ in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    assert asyncio.run(FilesystemStore(tmp_path).get("counter")) == b"200"


async def test_staged_lists_tmp_keys_that_list_hides(store: BlobStore) -> None:
    await store.put("a/published", b"x")
    await store.append("a/blob~tmp-one", chunks(b"abc"))
    await store.append("a/blob~tmp-one", chunks(b"de"))  # two segments on S3: one entry
    await store.append("deep/er/key~tmp-two", chunks(b"z"))
    staged = dict(await store.staged())
    assert sorted(staged) == ["a/blob~tmp-one", "deep/er/key~tmp-two"]
    assert staged["a/blob~tmp-one"].size == 5 and staged["a/blob~tmp-one"].mtime > 0
    assert await store.list("a") == ["published"]
    await store.delete("a/blob~tmp-one")
    assert [key for key, _ in await store.staged()] == ["deep/er/key~tmp-two"]


async def test_legal_names_that_look_like_staging_are_listed_and_never_staged(
    store: BlobStore,
) -> None:
    """`model.tmp-1` is a legal repository component and `v1.tmp-2` a legal tag: hiding them
    made gc's mark phase miss them and delete live manifests."""
    await store.put("repositories/team/model.tmp-1/_manifests/tags/v1.tmp-2/current", b"d")
    await store.put("repositories/team/model.tmp-1/_layers/sha256/a.tmp-3", b"")
    assert await store.list("repositories/team") == ["model.tmp-1"]
    assert await store.list("repositories/team/model.tmp-1/_manifests/tags") == ["v1.tmp-2"]
    assert await store.list("repositories/team/model.tmp-1/_layers/sha256") == ["a.tmp-3"]
    assert list(await store.staged()) == []


async def test_staged_also_finds_leftovers_of_the_old_tmp_marker(store: BlobStore) -> None:
    """Keys staged before the marker became `~tmp-` are still swept; only leaves the layout
    itself writes can match, so `.tmp-` inside a repository or tag name never does."""
    old = ["blobs/sha256/ab/" + "a" * 64 + ".tmp-0123456789ab",
           "repositories/r/_manifests/tags/v1/current.tmp-" + "f" * 32]
    for key in old:
        await store.put(key, b"x")
    await store.put("repositories/r.tmp-0123456789ab/_manifests/tags/t.tmp-1/current", b"d")
    assert sorted(key for key, _ in await store.staged()) == sorted(old)


async def test_filesystem_append_flushes_as_it_goes_and_closes_its_file_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long append pushes its bytes to disk while it runs (so commit's fsync, and anyone
    else's, finds little left); a flush still running when the append ends keeps the file
    open until it is done, then closes it."""
    import os
    import threading

    from registry.service.storage import filesystem

    monkeypatch.setattr(filesystem, "FLUSH_EVERY", 2 * filesystem.PIECE)
    flushed: list[int] = []
    release = threading.Event()
    real = os.fdatasync

    def slow_fdatasync(fd: int) -> None:
        flushed.append(os.fstat(fd).st_size)
        release.wait(10)  # the append ends meanwhile
        real(fd)

    monkeypatch.setattr(os, "fdatasync", slow_fdatasync)
    fs = FilesystemStore(tmp_path / "store")
    piece = os.urandom(filesystem.PIECE)
    open_before = open_fds()
    try:
        # more than PENDING_MAX: batches are handed on at least that often, whatever the timing
        count = 2 * filesystem.PENDING_MAX // filesystem.PIECE + 4
        assert await fs.append("s/data", chunks(*[piece] * count)) == count * len(piece)
        assert flushed and flushed[0] >= 2 * len(piece)
        assert open_fds() > open_before  # the flush still holds it
        release.set()
        await wait_open_fds_at_most(open_before)
        assert await read_all(fs, "s/data") == piece * count
    finally:
        release.set()
        fs.close()
