"""`--direct-reads`: read-only opens of files >= 1 MiB bypass the kernel page cache
(FOPEN_DIRECT_IO). What must hold: every byte reads back as written (torch.load, DCP, plain
reads at odd offsets, files still in staging, files rewritten while mounted), torch.load(mmap=True)
and MAP_PRIVATE mmap work; MAP_SHARED mmap works too where the fast path could ask the kernel for
it (the default turns direct reads on only then), and fails with ENODEV without it (the price
of forcing --direct-reads there); --no-direct-reads keeps the page cache."""

from __future__ import annotations

import errno
import mmap
import os
import random
import time

import pytest

torch = pytest.importorskip("torch")

from ckptfs.bench import models  # noqa: E402
from ckptfs.datapath.reader import CHUNK_BYTES as CHUNK  # noqa: E402
from ckptfs.fuse.replies import IO_BLOCK_BYTES  # noqa: E402
from helpers import status_reaches  # noqa: E402

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def _state():
    specs = models.tensor_specs("gpt2", 24 * MiB) + models.small_tensor_specs(40, seed=3)
    return models.state_dict(specs, seed=5)


def _save(root: str, sd: dict) -> None:
    for name, t in sd.items():
        p = os.path.join(root, "step_1", models.file_name(name))
        os.makedirs(os.path.dirname(p), exist_ok=True)
        torch.save(t, p)


def _check(root: str, sd: dict, **load_kw) -> None:
    for name, t in sd.items():
        got = torch.load(os.path.join(root, "step_1", models.file_name(name)),
                         weights_only=True, **load_kw)
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name


def test_restore_through_direct_reads(mounts):
    backing = mounts.backing()
    sd = _state()
    w = mounts.mount(backing)
    _save(w.mountpoint, sd)
    w.stop()
    for opts in ({"direct_reads": True}, {"direct_reads": True, "ro": True}):
        m = mounts.mount(backing, **opts)
        before = m.status()["read_requests"]
        _check(m.mountpoint, sd)
        _check(m.mountpoint, sd, mmap=True)  # torch maps MAP_PRIVATE: allowed
        assert m.status()["read_requests"] > before
        m.stop()


def _blob(m, size: int = 3 * MiB + 17) -> tuple[str, bytes]:
    p = os.path.join(m.mountpoint, "blob")
    data = os.urandom(size)
    with open(p, "wb") as f:
        f.write(data)
    m.sync()
    return p, data


def _reads_bypass_the_page_cache(m, p: str, data: bytes) -> bool:
    """Read the file twice: through the page cache the second read sends no READ."""
    for _ in range(2):
        before = m.status()["read_requests"]
        with open(p, "rb") as f:
            assert f.read() == data
    return m.status()["read_requests"] > before


def test_mmap_shared_is_refused_without_the_fast_path_private_works(mounts):
    m = mounts.mount(direct_reads=True, fast_path=False)
    p, data = _blob(m)
    assert m.status()["shared_mmap_of_direct_files"] is False
    assert _reads_bypass_the_page_cache(m, p, data)
    with open(p, "rb") as f:
        with mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ) as mm:
            assert mm[:] == data
        with pytest.raises(OSError) as exc:
            mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        assert exc.value.errno == errno.ENODEV
    # read-write opens keep the page cache: MAP_SHARED works there
    with open(p, "r+b") as f:
        with mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mm:
            assert mm[:] == data


def test_default_mount_reads_direct_and_maps_shared(mounts):
    """The default (fast path on a kernel with FUSE_DIRECT_IO_ALLOW_MMAP, Linux 6.6+): reads
    of big files bypass the page cache, and MAP_SHARED mmap of them (safetensors, numpy.memmap)
    still works. Without the fast path the default keeps the page cache."""
    import numpy as np

    m = mounts.mount()
    st = m.status()
    if not st["shared_mmap_of_direct_files"]:
        assert st["direct_reads"] is False  # an older kernel: the page cache stays the default
        pytest.skip("kernel without FUSE_DIRECT_IO_ALLOW_MMAP")
    assert st["direct_reads"] is True
    p, data = _blob(m)
    assert _reads_bypass_the_page_cache(m, p, data)
    with open(p, "rb") as f:
        with mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mm:
            assert mm[:] == data
    arr = np.memmap(p, dtype=np.uint8, mode="r")
    assert arr[-17:].tobytes() == data[-17:]
    del arr
    m2 = mounts.mount(mounts.backing("other"), fast_path=False)
    st2 = m2.status()
    assert st2["direct_reads"] is False and st2["shared_mmap_of_direct_files"] is False
    p2, data2 = _blob(m2)
    assert not _reads_bypass_the_page_cache(m2, p2, data2)


@pytest.mark.parametrize("direct_reads,size", [(True, MiB - 1), (False, MiB + 3)],
                         ids=["direct-small-file", "no-direct-reads"])
def test_mmap_shared_works_where_the_page_cache_is_kept(mounts, direct_reads, size):
    """--no-direct-reads keeps the page cache for every file; with --direct-reads, files under
    one READ request (1 MiB) keep it too (a round trip per header read is not worth it). Either
    way MAP_SHARED works on them."""
    m = mounts.mount(direct_reads=direct_reads)
    p = os.path.join(m.mountpoint, "f")
    data = os.urandom(size)
    with open(p, "wb") as f:
        f.write(data)
    with open(p, "rb") as f:
        with mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as mm:
            assert mm[:] == data


def test_odd_reads_staged_and_rewritten_files(mounts):
    m = mounts.mount(direct_reads=True)
    rng = random.Random(11)
    p = os.path.join(m.mountpoint, "f")
    data = bytearray(rng.randbytes(9 * MiB + 4095))
    with open(p, "wb") as f:
        f.write(data)
    # not synced: parts still in staging; reads at odd offsets and sizes, forward and back
    with open(p, "rb", buffering=0) as f:
        for _ in range(200):
            off = rng.randrange(len(data))
            n = rng.choice([1, 7, 4096, 65537, MiB + 1, 3 * MiB])
            f.seek(off)
            assert f.read(n) == bytes(data[off:off + n])
        f.seek(0)
        assert f.read() == bytes(data)
    m.sync()
    # rewrite a range while mounted: the next read-only open sees it (no stale cache)
    new = rng.randbytes(2 * MiB)
    with open(p, "r+b") as f:
        f.seek(5 * MiB)
        f.write(new)
    data[5 * MiB:7 * MiB] = new
    with open(p, "rb") as f:
        assert f.read() == bytes(data)
    m.sync()
    with open(p, "rb") as f:
        assert f.read() == bytes(data)


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
    _save(w.mountpoint, sd)
    w.stop()
    payload = sum(t.numel() * t.element_size() for t in sd.values())
    m = mounts.mount(backing, direct_reads=direct_reads, read_cache="256M", prefetch="8M")
    _check(m.mountpoint, sd)
    st = m.status()
    assert payload > 256 * MiB
    assert st["read_cache_allocated_bytes"] <= 8 * MiB + 6 * CHUNK, st
    assert st["read_disk_bytes"] <= payload + 16 * MiB, st  # nothing read from disk twice
    assert st["bytes_read"] >= payload, st


def test_buffered_reader_fills_take_one_request_each(mounts):
    """Python's buffered reader reads st_blksize at a time into a malloc'd buffer that need not
    start on a page: a direct read of a full 1 MiB there spans 257 pages, which the kernel
    sends as two READs (its cap is 256 pages). st_blksize is 512 KiB, as reported (the kernel
    rounds it down to a power of two): one READ per refill."""
    m = mounts.mount(mounts.backing(), direct_reads=True)
    p, data = _blob(m, 16 * MiB + 5)
    assert os.stat(p).st_blksize == IO_BLOCK_BYTES == 512 << 10
    before = m.status()["read_requests"]
    with open(p, "rb") as f:  # buffered: 4 KiB at a time from the buffer
        got = b"".join(iter(lambda: f.read(4096), b""))
    assert got == data
    fills = -(-len(data) // os.stat(p).st_blksize)
    assert m.status()["read_requests"] - before <= fills + 2


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


def _settled(m, key: str) -> int:
    """A status figure once it stopped moving for 0.5 s (for a bound from above: a figure
    that must grow is waited for with status_reaches)."""
    last, since = m.status()[key], time.monotonic()
    while time.monotonic() - since < 0.5:
        time.sleep(0.05)
        now = m.status()[key]
        if now != last:
            last, since = now, time.monotonic()
    return last


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
        item = _settled(m, "read_disk_bytes")  # readahead runs in the background
        assert item <= 40 * MiB, item  # the runs touched (checked whole), not 64 MiB more
        assert os.pread(fd, MiB, 0) == data[:MiB]  # a file's start: the full window
        status_reaches(m, "read_disk_bytes", item + 60 * MiB)
    finally:
        os.close(fd)


def test_readahead_asks_only_for_new_chunks_until_the_reader_starts_over(tmp_path):
    """The window bookkeeping of Reader._readahead, without a mount: its loads replaced by a
    recorder of the chunks it asks for (the loads themselves are what the mount tests do)."""
    from ckptfs.datapath.reader import Reader

    r = Reader({0: str(tmp_path)}, cache_bytes=64 * MiB, prefetch_bytes=16 * MiB)
    started: list[int] = []
    r.background = True
    r._start_load = lambda key, part=None: started.append(key[2])
    r.log_end[(0, 1)] = 100 * CHUNK

    def ahead_of(idx: int, ahead: int = 4) -> list[int]:
        started.clear()
        r._readahead({(0, 1, idx): None}, ahead)
        return list(started)

    assert ahead_of(0) == [1, 2, 3, 4]
    assert ahead_of(1) == [5]  # only the chunk not asked for yet
    assert ahead_of(1) == []
    assert ahead_of(3) == [6, 7]
    assert ahead_of(2) == [3, 4, 5, 6]  # behind the last READ: the reader started over
    assert ahead_of(98) == [99]  # a jump ahead: from there, up to the log's end
    assert ahead_of(40, ahead=2) == [41, 42]
    assert ahead_of(41) == [43, 44, 45]
    r.log_end[(0, 1)] = 46 * CHUNK - 5  # the log ends inside chunk 45
    assert ahead_of(42) == []
    r.log_end[(0, 1)] = 50 * CHUNK  # it grew: the chunks past the old end are asked for now
    assert ahead_of(42) == [46]
    r.invalidate(0, 1, 44 * CHUNK, 100)  # a write into the log: loads in flight are discarded
    assert ahead_of(43) == [44, 45, 46, 47]  # so they are asked for again


@pytest.mark.parametrize("pick", ["lru", "consumed"])
def test_readahead_takes_no_buffer_of_the_chunk_being_served(tmp_path, pick):
    """A load's buffer is taken when readahead asks for it (the reader's loader threads), and
    may be a cached chunk's: the least recently used, or a consumed one. The chunk the READ
    is about to serve is neither while readahead asks (it is pinned): here it is both, in a
    cache with no free buffer, and the READ still gets its bytes."""
    import trio

    from ckptfs.datapath.reader import Reader, _Chunk
    from ckptfs.datapath.staging import ExtentMap, Run

    r = Reader({0: str(tmp_path)}, cache_bytes=8 * CHUNK, prefetch_bytes=4 * CHUNK)
    r.background = True
    for idx in (0, 10, 11, 12, 13, 14, 15, 16):  # (chunk 0 first: the least recently used)
        r.chunks[(0, 1, idx)] = _Chunk(bytearray(b"x" * CHUNK), 0, CHUNK, False)
    r.allocated = 8
    if pick == "consumed":
        r.consumed[(0, 1, 0)] = None
    r.log_end[(0, 1)] = 20 * CHUNK  # (readahead asks for chunks 1..4: the log is missing)
    emap = ExtentMap()
    emap.insert(0, 4096, Run(None, 0, 4096, log=1, loff=0, crc=0, verified=True), 0)

    async def main() -> bytes:
        out = bytes(await r.read(emap, 0, 4096, 4096, ahead=None))
        with trio.fail_after(10):  # (the loads fail: no log; their buffers go back)
            while r.loading or r.pins:
                await trio.sleep(0.01)
        return out

    try:
        assert trio.run(main) == b"x" * 4096
        assert (0, 1, 0) in r.chunks and not r.loading and not r.pins
    finally:
        r.close()


def test_a_load_that_gets_no_buffer_is_not_left_listed(tmp_path):
    """A chunk load whose buffer cannot be had (no memory) fails the READ that asked for it and
    is not listed as loading: the next READ of the chunk loads it again, not waits for ever."""
    import trio

    from ckptfs.datapath.reader import Reader
    from ckptfs.datapath.staging import ExtentMap, Run

    r = Reader({0: str(tmp_path)}, cache_bytes=8 * CHUNK, prefetch_bytes=0)
    emap = ExtentMap()
    emap.insert(0, 4096, Run(None, 0, 4096, log=1, loff=0, crc=0, verified=True), 0)
    buffer, calls = r._buffer, []

    def no_memory_once():
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return buffer()

    r._buffer = no_memory_once

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
        assert not r.loading
    finally:
        r.close()


def test_a_second_pass_gets_readahead_again(mounts):
    """Readahead asks only for chunks past what it asked for before while a reader moves on;
    a reader that starts over (a second restore through the same mount) gets the window
    again. In between, another file is read through two handles at once: the bytes of a
    file open twice are not counted consumed, so the cache lets its least recently used
    chunks go, and none of the first file's chunks is left cached. (The first pass alone may
    leave some of the file's first chunks cached, consumed chunks being reused first and one
    whose consumption was not counted staying, and a cached chunk is not loaded again: under
    load, a second pass right after the first once read 12 MiB, less than the window.)"""
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
    first = _settled(m, "read_disk_bytes")
    # (each chunk once: the file's, the one it ends in, the window past it: the other file)
    assert first <= len(data) + CHUNK + 16 * MiB
    q = os.path.join(m.mountpoint, "other")
    with open(q, "rb", buffering=0) as f, open(q, "rb", buffering=0):
        assert f.read() == other
    before = _settled(m, "read_disk_bytes")
    with open(p, "rb", buffering=0) as f:
        assert f.read(MiB) == data[:MiB]  # the start again: loaded, and the window after it
        status_reaches(m, "read_disk_bytes", before + CHUNK + 16 * MiB)
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
            loaded[block] = _settled(m, "read_disk_bytes")
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

    from ckptfs.datapath.reader import Reader
    from ckptfs.datapath.staging import ExtentMap, Run

    r = Reader({0: str(tmp_path)}, cache_bytes=8 * CHUNK, prefetch_bytes=0)
    gate = threading.Event()

    def pread(key: tuple[int, int, int], buf, lo: int, hi: int) -> int:
        assert gate.wait(10)
        buf[lo:lo + 4096] = b"y" * 4096
        return 4096

    r._pread = pread
    landed, land = [], r._landed
    r._landed = lambda: (landed.append(1), land())[1]
    key = (0, 1, 0)
    emap = ExtentMap()
    emap.insert(0, 4096, Run(None, 0, 4096, log=1, loff=0, crc=0, verified=True), 0)

    async def finished() -> None:
        with trio.fail_after(10):
            while not r.done:
                await trio.sleep(0.01)
        await trio.sleep(0.2)  # (a call on its way would have run by now)

    async def main() -> bytes | None:
        r.land_lazily(True)
        if case == "waits before it lands":
            async with trio.open_nursery() as n:
                got = []

                async def reader() -> None:
                    got.append(bytes(await r.read(emap, 0, 4096, 4096, ahead=0)))

                n.start_soon(reader)
                with trio.fail_after(10):
                    while key not in r.loading or not r.loading[key].waited:
                        await trio.sleep(0.01)
                gate.set()  # (finished now, waited for: handed over by a call of its own)
            assert landed == [1]
            return got[0]
        r._start_load(key)  # (readahead's way: nobody waits)
        gate.set()
        await finished()
        assert landed == [] and key not in r.chunks  # (no call: it waits for land())
        if case == "nobody waits":
            r.land()
        elif case == "lazy turned off":
            r.land_lazily(False)
        else:  # (the READ lands it itself)
            with trio.fail_after(10):
                return bytes(await r.read(emap, 0, 4096, 4096, ahead=0))
        assert landed == [1] and key in r.chunks and not r.loading
        return None

    try:
        got = trio.run(main)
        if case.startswith("waits"):
            assert got == b"y" * 4096 and key in r.chunks
    finally:
        r.close()


def test_reads_answered_in_c_are_accounted_for_as_their_union():
    """The READs of a handle the queue threads answered go to the reader as the union of
    their bytes, range by range (Handles.read_served): torch.load's READs of one file (its
    start twice, its zip directory at the end backwards in small steps, then its tensors)
    make one range, with a READ from 0's whole-window readahead; ranges apart stay apart,
    each with the most readahead its READs asked for; every READ and byte is counted."""
    from types import SimpleNamespace

    from ckptfs.fuse.handles import Handle, Handles
    from ckptfs.fuse.ops import Settings

    calls = []
    reader = SimpleNamespace(  # (read_served tells the reader only this)
        window_served=lambda emap, lo, hi, ahead, seen: calls.append((lo, hi, ahead)))
    handles = Handles(None, None, None, reader, None, None, Settings(backing="/", info={}))
    x = SimpleNamespace(ino=5, emap=object(), opens=1, size=2361077)
    handles.by_fh[7] = Handle(x, os.O_RDONLY)
    torch_load = [(0, 524288, 524288), (0, 524288, 524288), (2356981, 524288, 4096),
                  (2361055, 524288, 22), (2361035, 524288, 42), (2360979, 524288, 98),
                  (2360376, 524288, 701), (304, 524288, 524288), (0, 524288, 524288),
                  (524288, 1046144, 1046144), (1570432, 789632, 789632)]
    handles.read_served(7, torch_load)
    assert calls == [(0, 2361077, None)]
    assert handles.read_requests == 11
    assert handles.bytes_read == sum(n for _, _, n in torch_load)

    calls.clear()
    handles.by_fh[8] = Handle(x, os.O_RDONLY)
    handles.read_served(8, [(50 * MiB, 512, 512), (10 * MiB, MiB, MiB), (11 * MiB, MiB, MiB),
                            (60 * MiB, 4096, 0)])
    assert calls == [(10 * MiB, 12 * MiB, MiB), (50 * MiB, 50 * MiB + 512, 0)]
    assert handles.read_requests == 15


def test_parts_of_a_chunk_load_and_widen_in_place(tmp_path):
    """A read plan's loads of parts of a chunk (Reader._start_load with a part), from a real
    log without a mount: a part alone, then widened in the chunk's own buffer before and
    after it (the bytes between loaded too); at the log's end a part is short, holds what
    lies past the end, and still widens before it. The bytes are the log's throughout."""
    import random

    import trio

    from ckptfs.datapath.reader import Reader
    from ckptfs.format import backingdir

    data = random.Random(5).randbytes(CHUNK + CHUNK // 2)  # chunk 1 ends half way
    with open(os.path.join(tmp_path, backingdir.data_log_name(1)), "wb") as f:
        f.write(data)
    r = Reader({0: str(tmp_path)}, cache_bytes=8 * CHUNK, prefetch_bytes=0)

    async def load(idx: int, a: int, b: int):
        ld = r._start_load((0, 1, idx), (a, b))
        with trio.fail_after(10):
            await ld.done.wait()
        assert ld.error is None, ld.error
        ch = r.chunks[(0, 1, idx)]
        base = idx * CHUNK
        assert bytes(ch.view[ch.lo:ch.length]) == data[base + ch.lo:base + ch.length]
        return ch.lo, ch.length, ch.short

    half = CHUNK // 2

    async def main() -> None:
        assert await load(0, 40_000, 90_000) == (36_864, 90_112, False)  # (to 4 KiB)
        buf = r.chunks[(0, 1, 0)].buf
        assert await load(0, 5_000, 6_000) == (4_096, 90_112, False)  # before: in place
        assert await load(0, 200_000, 300_000) == (4_096, 303_104, False)  # after
        assert r.chunks[(0, 1, 0)].buf is buf and not r.pins
        assert r._holds((0, 1, 0), 4_096, 303_104) and not r._holds((0, 1, 0), 0, 10)
        assert await load(1, half - 8192, half + 100) == (half - 8192, half, True)
        assert r._holds((0, 1, 1), half - 100, CHUNK)  # (nothing lies past the log's end)
        assert await load(1, 0, 10) == (0, half, True)  # before a short part: in place

    try:
        trio.run(main)
        # (each byte read once: chunk 0's three parts, chunk 1's last 8 KiB and what is before)
        assert r.disk_bytes == 303_104 - 4_096 + CHUNK // 2
    finally:
        r.close()
