"""`--direct-reads`: read-only opens of files >= 1 MiB bypass the kernel page cache
(FOPEN_DIRECT_IO). What must hold: every byte reads back as written (torch.load, DCP, plain
reads at odd offsets, files still in staging, files rewritten while mounted), torch.load(mmap=True)
and MAP_PRIVATE mmap work; MAP_SHARED mmap works too where the fast path could ask the kernel for
it (the default turns direct reads on only then), and fails with ENODEV without it (the price
of forcing --direct-reads there); --no-direct-reads keeps the page cache. The READs the queue
threads answer are accounted for as the union of their bytes. The read path behind the READs
(the chunk cache, readahead) is tested in test_reader.py."""

from __future__ import annotations

import errno
import mmap
import os
import random

import pytest
from helpers import check_all, save_all

torch = pytest.importorskip("torch")

from ckptfs.bench import models  # noqa: E402
from ckptfs.fuse.replies import IO_BLOCK_BYTES  # noqa: E402

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def _state():
    specs = models.tensor_specs("gpt2", 24 * MiB) + models.small_tensor_specs(40, seed=3)
    return models.state_dict(specs, seed=5)


def test_restore_through_direct_reads(mounts):
    backing = mounts.backing()
    sd = _state()
    w = mounts.mount(backing)
    save_all(w.mountpoint, sd)
    w.stop()
    for opts in ({"direct_reads": True}, {"direct_reads": True, "ro": True}):
        m = mounts.mount(backing, **opts)
        before = m.status()["read_requests"]
        check_all(m.mountpoint, sd)
        check_all(m.mountpoint, sd, mmap=True)  # torch maps MAP_PRIVATE: allowed
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


