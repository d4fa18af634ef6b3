"""The read path (datapath/reader.py: readahead, read plans' loads, READs; datapath/readcache.py:
the chunk cache; datapath/loaders.py: its loader threads). What must hold: a restore reads each
chunk from disk once and the cache's memory stays about the readahead window (consumed chunks
are reused first); READs that span pieces, chunks and holes read the right bytes; readahead
grows with the bytes read in a row, asks only for chunks it has not asked for while a reader
moves on, and again for a reader that starts over; damage found ahead of the reader is EIO for
that file only; checksum blocks bound what a jump loads; chunk loads land as the READs that
wait for them need, and a load that fails leaves nothing behind."""

from __future__ import annotations

import errno
import os
import random

import pytest

torch = pytest.importorskip("torch")

from ckptfs.bench import models  # noqa: E402
from ckptfs.datapath.readcache import CHUNK_BYTES as CHUNK  # noqa: E402
from ckptfs.datapath.readcache import ReadCache  # noqa: E402
from ckptfs.datapath.reader import Reader  # noqa: E402
from ckptfs.format.logs import RunReader  # noqa: E402
from helpers import check_all, save_all, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


@pytest.mark.parametrize("direct_reads", [True, False], ids=["direct", "pagecache"])
def test_streaming_restore_recycles_consumed_chunks(mounts, direct_reads):
    """Reading files once, front to back (a restore), frees each cache chunk as soon as all of
    its bytes were served: fresh memory stays ~the readahead window, not the whole cache, and
    nothing is read from disk twice."""
    backing = mounts.backing()
    w = mounts.mount(backing)
    rng = random.Random(5)
    files = {f"t{i}.bin": rng.randbytes(rng.randrange(5 * MiB, 23 * MiB)) for i in range(8)}
    files.update({f"s{i}.bin": rng.randbytes(rng.randrange(1, 9000)) for i in range(50)})
    for name, data in files.items():
        with open(os.path.join(w.mountpoint, name), "wb") as f:
            f.write(data)
    w.stop()
    payload = sum(len(d) for d in files.values())
    m = mounts.mount(backing, direct_reads=direct_reads, read_cache="128M", prefetch="16M")
    for name, data in files.items():  # the save order = log order
        with open(os.path.join(m.mountpoint, name), "rb") as f:
            assert f.read(4096) == data[:4096]  # a header read, then everything again
            f.seek(0)
            assert f.read() == data
    st = m.status()
    assert st["read_chunks_recycled"] > 0
    assert st["read_cache_allocated_bytes"] <= 64 * MiB < payload
    assert st["read_disk_bytes"] <= payload + 12 * MiB  # ~no chunk read twice
    assert st["read_runs_verified_ahead"] > 0  # checksums checked by readahead, off the loop
    # a second restore through the same mount: chunks count as consumed per stay in the
    # cache, so a chunk being read is not recycled under the reader (no re-reads)
    for name, data in files.items():
        with open(os.path.join(m.mountpoint, name), "rb") as f:
            assert f.read() == data
    assert m.status()["read_disk_bytes"] <= 2 * payload + 24 * MiB


@pytest.mark.parametrize("direct_reads", [True, False], ids=["direct", "pagecache"])
def test_torch_load_restore_keeps_the_cache_to_the_readahead_window(mounts, direct_reads):
    """torch.load seeks to a file's end, then reads the file's head several times: with direct
    reads each of those is a READ, so a chunk of small files is consumed by the first read of
    its last file and read again after. Such re-reads must not keep consumed chunks from reuse:
    the cache's memory stays ~the readahead window, not the configured size."""
    backing = mounts.backing()
    w = mounts.mount(backing)
    sd = models.state_dict(models.tensor_specs("gpt2", 450 * MiB), seed=11)  # tiny and big
    save_all(w.mountpoint, sd)
    w.stop()
    payload = sum(t.numel() * t.element_size() for t in sd.values())
    m = mounts.mount(backing, direct_reads=direct_reads, read_cache="256M", prefetch="8M")
    check_all(m.mountpoint, sd, uncached=False)  # (direct reads, or the first read)
    st = m.status()
    assert payload > 256 * MiB
    assert st["read_cache_allocated_bytes"] <= 8 * MiB + 6 * CHUNK, st
    assert st["read_disk_bytes"] <= payload + 16 * MiB, st  # nothing read from disk twice
    assert st["bytes_read"] >= payload, st


@pytest.mark.parametrize("direct_reads", [True, False], ids=["direct", "pagecache"])
def test_reads_across_pieces_and_holes(mounts, direct_reads):
    """A READ that spans several runs, chunks and holes is assembled in a reused buffer: holes
    must read as zeros every time, whatever an earlier READ left in that buffer."""
    backing = mounts.backing()
    w = mounts.mount(backing)
    rng = random.Random(8)
    p = os.path.join(w.mountpoint, "sparse")
    model = bytearray(12 * MiB)
    with open(p, "wb") as f:
        for _ in range(40):  # many small runs with gaps between them
            off = rng.randrange(0, 12 * MiB - 70000)
            data = rng.randbytes(rng.randrange(1, 70000))
            f.seek(off)
            f.write(data)
            model[off:off + len(data)] = data
        f.truncate(len(model))
    w.stop()
    m = mounts.mount(backing, direct_reads=direct_reads)
    with open(os.path.join(m.mountpoint, "sparse"), "rb", buffering=0) as f:
        for _ in range(3):
            f.seek(0)
            assert f.read() == bytes(model)
        for _ in range(100):
            off = rng.randrange(len(model))
            n = rng.choice([5000, 300000, MiB, 2 * MiB + 3])
            f.seek(off)
            assert f.read(n) == bytes(model[off:off + n])


def _saved_big(mounts, size: int, seed: int) -> tuple[str, bytes]:
    """A backing directory holding one file "big" of `size` random bytes (mount unmounted)."""
    backing = mounts.backing()
    w = mounts.mount(backing)
    data = random.Random(seed).randbytes(size)
    with open(os.path.join(w.mountpoint, "big"), "wb") as f:
        f.write(data)
    w.stop()
    return backing, data


def _loads_done(m, key: str = "read_disk_bytes") -> int:
    """Status figure `key` once the read cache has no chunk load in flight. The status takes
    in the READs the queue threads answered before it counts (their readahead is asked for
    then), so every READ answered so far has had its readahead, and all of that is read: a
    bound from above holds from here on, and a figure that must grow has grown."""
    st = wait_for(lambda: (s := m.status())["read_loads_in_flight"] == 0 and s,
                  "the read cache's chunk loads", timeout=30)
    return st[key]


def test_readahead_grows_with_the_streak(mounts):
    """A reader that jumps to an item and reads a few MiB of it (DCP loading items of one big
    file in its own order) gets no full --prefetch window behind every item: readahead grows
    with the bytes read in a row. A file read from its start still gets the full window."""
    backing, data = _saved_big(mounts, 160 * MiB, seed=9)
    m = mounts.mount(backing, direct_reads=True, prefetch="64M")
    fd = os.open(os.path.join(m.mountpoint, "big"), os.O_RDONLY)
    try:
        assert os.pread(fd, 512, 100 * MiB) == data[100 * MiB:100 * MiB + 512]  # a jump
        for i in range(3):  # an item: 3 MiB in a row, after another jump
            lo = 50 * MiB + i * MiB
            assert os.pread(fd, MiB, lo) == data[lo:lo + MiB]
        item = _loads_done(m)  # readahead runs in the background
        assert item <= 40 * MiB, item  # the runs touched (checked whole), not 64 MiB more
        assert os.pread(fd, MiB, 0) == data[:MiB]  # a file's start: the full window
        assert _loads_done(m) >= item + 60 * MiB
    finally:
        os.close(fd)


def test_readahead_asks_only_for_new_chunks_until_the_reader_starts_over(tmp_path):
    """The window bookkeeping of Reader._readahead, without a mount: the chunks it asks the
    cache for are those in flight right after it asks; their log is missing, so each load
    fails and goes before the next ask (a chunk asked for and not cached, as one evicted
    before use)."""
    import trio

    cache = ReadCache(RunReader({0: str(tmp_path)}), 8 * CHUNK, background=True)
    r = Reader(cache, prefetch_bytes=16 * MiB)
    cache.log_end[(0, 1)] = 100 * CHUNK

    async def ahead_of(idx: int, ahead: int = 4) -> list[int]:
        r._readahead({(0, 1, idx): None}, ahead)
        asked = sorted(k[2] for k in cache.loading)
        with trio.fail_after(10):
            while cache.loading:
                await trio.sleep(0.01)
        return asked

    async def main() -> None:
        assert await ahead_of(0) == [1, 2, 3, 4]
        assert await ahead_of(1) == [5]  # only the chunk not asked for yet
        assert await ahead_of(1) == []
        assert await ahead_of(3) == [6, 7]
        assert await ahead_of(2) == [3, 4, 5, 6]  # behind the last READ: the reader started over
        assert await ahead_of(98) == [99]  # a jump ahead: from there, up to the log's end
        assert await ahead_of(40, ahead=2) == [41, 42]
        assert await ahead_of(41) == [43, 44, 45]
        cache.log_end[(0, 1)] = 46 * CHUNK - 5  # the log ends inside chunk 45
        assert await ahead_of(42) == []
        cache.log_end[(0, 1)] = 50 * CHUNK  # it grew: the chunks past the old end are asked for
        assert await ahead_of(42) == [46]
        cache.invalidate(0, 1, 44 * CHUNK, 100)  # a write into the log: loads in flight are
        assert await ahead_of(43) == [44, 45, 46, 47]  # discarded, so they are asked for again

    try:
        trio.run(main)
    finally:
        cache.close()


@pytest.mark.parametrize("pick", ["lru", "consumed"])
def test_readahead_takes_no_buffer_of_the_chunk_being_served(tmp_path, pick):
    """A load's buffer is taken when readahead asks for it (the reader's loader threads), and
    may be a cached chunk's: the least recently used, or a consumed one. The chunk the READ
    is about to serve is neither while readahead asks (it is pinned): here it is both, in a
    cache with no free buffer, and the READ still gets its bytes."""
    import trio

    from ckptfs.datapath.readcache import Chunk
    from ckptfs.datapath.staging import ExtentMap, Run

    cache = ReadCache(RunReader({0: str(tmp_path)}), 8 * CHUNK, background=True)
    r = Reader(cache, prefetch_bytes=4 * CHUNK)
    for idx in (0, 10, 11, 12, 13, 14, 15, 16):  # (chunk 0 first: the least recently used)
        cache.chunks[(0, 1, idx)] = Chunk(bytearray(b"x" * CHUNK), 0, CHUNK, False)
    cache.allocated = 8
    if pick == "consumed":
        cache.consumed[(0, 1, 0)] = None
    cache.log_end[(0, 1)] = 20 * CHUNK  # (readahead asks for chunks 1..4: the log is missing)
    emap = ExtentMap()
    emap.insert(0, 4096, Run(None, 0, 4096, log=1, loff=0, crc=0, verified=True), 0)

    async def main() -> bytes:
        out = bytes(await r.read(emap, 0, 4096, 4096, ahead=None))
        with trio.fail_after(10):  # (the loads fail: no log; their buffers go back)
            while cache.loading or cache.pins:
                await trio.sleep(0.01)
        return out

    try:
        assert trio.run(main) == b"x" * 4096
        assert (0, 1, 0) in cache.chunks and not cache.loading and not cache.pins
    finally:
        cache.close()


def test_a_load_that_gets_no_buffer_is_not_left_listed(tmp_path):
    """A chunk load whose buffer cannot be had (no memory) fails the READ that asked for it and
    is not listed as loading: the next READ of the chunk loads it again, not waits for ever."""
    import trio

    from ckptfs.datapath.staging import ExtentMap, Run

    cache = ReadCache(RunReader({0: str(tmp_path)}), 8 * CHUNK)
    r = Reader(cache, prefetch_bytes=0)
    emap = ExtentMap()
    emap.insert(0, 4096, Run(None, 0, 4096, log=1, loff=0, crc=0, verified=True), 0)
    buffer, calls = cache._buffer, []

    def no_memory_once():
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return buffer()

    cache._buffer = no_memory_once

    async def main() -> list[int]:
        errs = []
        for _ in range(2):
            with trio.fail_after(10):
                try:
                    await r.read(emap, 0, 4096, 4096, ahead=0)
                except OSError as exc:
                    errs.append(exc.errno)
        return errs

    try:  # (the second load runs, and finds no log)
        assert trio.run(main) == [errno.ENOMEM, errno.EIO]
        assert not cache.loading
    finally:
        cache.close()


def test_a_second_pass_gets_readahead_again(mounts):
    """Readahead asks only for chunks past what it asked for before while a reader moves on;
    a reader that starts over (a second restore through the same mount) gets the window
    again: its first READ loads the file's first chunk and the window after it. Which of the
    file's chunks a pass leaves cached depends on timing (when the READs the queue threads
    answered are accounted for, against when readahead takes a buffer): a chunk let go while
    partly read and loaded again is never counted consumed (its first bytes were served in
    its earlier stay), and consumed chunks are reused first, so it can stay through a whole
    pass. Before the second pass another file larger than the cache is therefore read
    through two handles at once (a file open twice is not counted consumed): each buffer it
    takes past the free and consumed ones is the least recently used chunk's, and none of
    the first file's stays. Each figure is read once no chunk load is in flight
    (_loads_done), not after a pause: every READ answered by then has had its readahead."""
    backing = mounts.backing()
    w = mounts.mount(backing)
    data = random.Random(4).randbytes(96 * MiB)
    other = random.Random(5).randbytes(40 * MiB)  # (more than the read cache below)
    for name, blob in (("big", data), ("other", other)):
        with open(os.path.join(w.mountpoint, name), "wb") as f:
            f.write(blob)
    w.stop()
    m = mounts.mount(backing, direct_reads=True, read_cache="32M", prefetch="16M")
    p = os.path.join(m.mountpoint, "big")
    with open(p, "rb", buffering=0) as f:
        assert f.read() == data
    first = _loads_done(m)
    # (each chunk once: the file's, the one it ends in, the window past it: the other file)
    assert first <= len(data) + CHUNK + 16 * MiB
    q = os.path.join(m.mountpoint, "other")
    with open(q, "rb", buffering=0) as f, open(q, "rb", buffering=0):
        assert f.read() == other
    before = _loads_done(m)
    with open(p, "rb", buffering=0) as f:
        assert f.read(MiB) == data[:MiB]  # the start again: loaded, and the window after it
        assert _loads_done(m) >= before + CHUNK + 16 * MiB
        assert f.read() == data[MiB:]


@pytest.mark.parametrize("direct_reads", [True, False], ids=["direct", "pagecache"])
def test_damage_found_by_readahead_is_eio_for_that_file_only(mounts, direct_reads):
    """Checksums checked ahead of the reader (in its loader threads) must report damage exactly
    like the READ path does: EIO for the damaged file, every other file intact."""
    backing = mounts.backing()
    w = mounts.mount(backing)
    rng = random.Random(9)
    files = {f"f{i}.bin": rng.randbytes(6 * MiB) for i in range(6)}
    for name, data in files.items():
        with open(os.path.join(w.mountpoint, name), "wb") as f:
            f.write(data)
    w.stop()
    marker = files["f4.bin"][3 * MiB:3 * MiB + 64]
    logs = [os.path.join(d, n) for d, _, ns in os.walk(backing) for n in ns
            if n.startswith("data-") and n.endswith(".log")]
    hits = []
    for path in logs:
        with open(path, "rb") as f:
            blob = f.read()
        if marker in blob:
            hits.append((path, blob.index(marker)))
    assert len(hits) == 1
    path, pos = hits[0]
    with open(path, "r+b") as f:
        f.seek(pos + 10)
        b = f.read(1)
        f.seek(pos + 10)
        f.write(bytes([b[0] ^ 0x40]))
    m = mounts.mount(backing, direct_reads=direct_reads)
    for name, data in files.items():
        p = os.path.join(m.mountpoint, name)
        if name == "f4.bin":
            with pytest.raises(OSError) as exc:
                with open(p, "rb") as f:
                    f.read()
            assert exc.value.errno == errno.EIO
        else:
            with open(p, "rb") as f:
                assert f.read() == data, name
    assert m.status()["read_runs_verified_ahead"] > 0


def test_checksum_blocks_bound_what_a_jump_loads(mounts):
    """--checksum-block caps a run (the bytes one CRC32C covers, one index record): with
    8 MiB segments and 1 MiB blocks no run of a file is longer than 1 MiB, whatever the
    writes' sizes and alignment, and a reader that jumps into the file (DCP's first read of
    an item) loads and checks the 4 MiB read chunks of one block, not of a segment's run."""
    from ckptfs.tools.snapshot import Snapshot

    data = random.Random(5).randbytes(40 * MiB + 12345)
    lengths, loaded = {}, {}
    for block in ("1M", "8M"):
        backing = mounts.backing(f"b{block}")
        w = mounts.mount(backing, segment_size="8M", checksum_block=block)
        with open(os.path.join(w.mountpoint, "big"), "wb", buffering=0) as f:
            f.write(data[:1000])  # the rest lands unaligned in the segments
            for pos in range(1000, len(data), 3 * MiB + 7):
                f.write(data[pos:pos + 3 * MiB + 7])
        w.stop()
        runs = Snapshot(backing).lookup("/big").emap.runs()
        lengths[block] = [r.length for r in runs]
        assert sum(lengths[block]) == len(data)
        m = mounts.mount(backing, direct_reads=True)
        fd = os.open(os.path.join(m.mountpoint, "big"), os.O_RDONLY)
        try:
            lo = 21 * MiB + 333
            assert os.pread(fd, 4096, lo) == data[lo:lo + 4096]
            loaded[block] = _loads_done(m)
            assert os.pread(fd, 8 * MiB, 30 * MiB) == data[30 * MiB:38 * MiB]
        finally:
            os.close(fd)
        m.stop()
    assert max(lengths["1M"]) == MiB, lengths["1M"]
    assert max(lengths["8M"]) > 4 * MiB, lengths["8M"]  # whole segments without the cap
    assert loaded["1M"] <= 2 * CHUNK, loaded
    assert loaded["1M"] < loaded["8M"], loaded


@pytest.mark.parametrize("case", ["nobody waits", "waits before it lands", "waits after",
                                  "lazy turned off"])
def test_lazy_landing_hands_over_only_the_loads_a_read_waits_for(tmp_path, case):
    """With `lazy` (set by the fast path with its queue threads), a chunk load no READ waits
    for is not handed to the trio thread by a call of its own (each a wake-up of it): it
    lands at the next land() (the fast path's settle). A READ that waits for a load still gets
    it at once, whether the load finished before it began to wait or after; turning `lazy`
    off lands what is left. The disk read is held back on an Event, the calls counted."""
    import threading

    import trio

    from ckptfs.datapath.staging import ExtentMap, Run

    gate = threading.Event()

    class HeldLogs(RunReader):
        """A log whose reads wait for `gate`, then give 4 KiB of b"y"."""

        def read_into(self, layer: int, number: int, buf, offset: int) -> int:
            assert gate.wait(10)
            buf[:4096] = b"y" * 4096
            return 4096

    cache = ReadCache(HeldLogs({0: str(tmp_path)}), 8 * CHUNK)
    r = Reader(cache, prefetch_bytes=0)
    loaders = cache.loaders
    landed, land = [], loaders._landed
    loaders._landed = lambda: (landed.append(1), land())[1]
    key = (0, 1, 0)
    emap = ExtentMap()
    emap.insert(0, 4096, Run(None, 0, 4096, log=1, loff=0, crc=0, verified=True), 0)

    async def finished() -> None:
        """Until the load is done: a loader thread decides whether to call the trio thread
        while it holds `cond`, as it lists the result, so no call is on its way then unless
        `posted` says so."""
        with trio.fail_after(10):
            while not landed:
                with loaders.cond:
                    if loaders.done:
                        assert not loaders.posted
                        return
                await trio.sleep(0.01)
        raise AssertionError("the trio thread was called for a load no READ waits for")

    async def main() -> bytes | None:
        cache.land_lazily(True)
        if case == "waits before it lands":
            async with trio.open_nursery() as n:
                got = []

                async def reader() -> None:
                    got.append(bytes(await r.read(emap, 0, 4096, 4096, ahead=0)))

                n.start_soon(reader)
                with trio.fail_after(10):
                    while key not in cache.loading or not cache.loading[key].waited:
                        await trio.sleep(0.01)
                gate.set()  # (finished now, waited for: handed over by a call of its own)
            assert landed == [1]
            return got[0]
        cache.start_load(key)  # (readahead's way: nobody waits)
        gate.set()
        await finished()
        assert landed == [] and key not in cache.chunks  # (no call: it waits for land())
        if case == "nobody waits":
            cache.land()
        elif case == "lazy turned off":
            cache.land_lazily(False)
        else:  # (the READ lands it itself)
            with trio.fail_after(10):
                return bytes(await r.read(emap, 0, 4096, 4096, ahead=0))
        assert landed == [1] and key in cache.chunks and not cache.loading
        return None

    try:
        got = trio.run(main)
        if case.startswith("waits"):
            assert got == b"y" * 4096 and key in cache.chunks
    finally:
        cache.close()


def test_parts_of_a_chunk_load_and_widen_in_place(tmp_path):
    """A read plan's loads of parts of a chunk (ReadCache.start_load with a part), from a real
    log without a mount: a part alone, then widened in the chunk's own buffer before and
    after it (the bytes between loaded too); at the log's end a part is short, holds what
    lies past the end, and still widens before it. The bytes are the log's throughout."""
    import trio

    from ckptfs.format import backingdir

    data = random.Random(5).randbytes(CHUNK + CHUNK // 2)  # chunk 1 ends half way
    with open(os.path.join(tmp_path, backingdir.data_log_name(1)), "wb") as f:
        f.write(data)
    cache = ReadCache(RunReader({0: str(tmp_path)}), 8 * CHUNK)

    async def load(idx: int, a: int, b: int):
        ld = cache.start_load((0, 1, idx), (a, b))
        with trio.fail_after(10):
            await ld.done.wait()
        assert ld.error is None, ld.error
        ch = cache.chunks[(0, 1, idx)]
        base = idx * CHUNK
        assert bytes(ch.view[ch.lo:ch.length]) == data[base + ch.lo:base + ch.length]
        return ch.lo, ch.length, ch.short

    half = CHUNK // 2

    async def main() -> None:
        assert await load(0, 40_000, 90_000) == (36_864, 90_112, False)  # (to 4 KiB)
        buf = cache.chunks[(0, 1, 0)].buf
        assert await load(0, 5_000, 6_000) == (4_096, 90_112, False)  # before: in place
        assert await load(0, 200_000, 300_000) == (4_096, 303_104, False)  # after
        assert cache.chunks[(0, 1, 0)].buf is buf and not cache.pins
        assert cache.holds((0, 1, 0), 4_096, 303_104) and not cache.holds((0, 1, 0), 0, 10)
        assert await load(1, half - 8192, half + 100) == (half - 8192, half, True)
        assert cache.holds((0, 1, 1), half - 100, CHUNK)  # (nothing lies past the log's end)
        assert await load(1, 0, 10) == (0, half, True)  # before a short part: in place

    try:
        trio.run(main)
        # (each byte read once: chunk 0's three parts, chunk 1's last 8 KiB and what is before)
        assert cache.disk_bytes == 303_104 - 4_096 + CHUNK // 2
    finally:
        cache.close()
