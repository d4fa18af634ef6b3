"""The I/O engine (ckptfs.io) on a real disk, with the real io_uring."""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import logging
import os
import runpy
import shutil
import sys
import tempfile

import pytest

import ckptfs.io as cio
from ckptfs.io import (
    DirectInfo,
    EngineError,
    alloc_aligned,
    open_engine,
    open_file,
    probe_direct,
    probe_direct_read,
    uring_unavailable_reason,
)
from ckptfs.io.base import _reset_log_once

KiB, MiB = 1 << 10, 1 << 20
HAVE_URING = uring_unavailable_reason() is None
if HAVE_URING:
    try:
        open_engine("io_uring", depth=1).close()
    except OSError:
        HAVE_URING = False

ENGINES = [pytest.param("io_uring", marks=pytest.mark.skipif(not HAVE_URING,
                                                             reason="io_uring unavailable")),
           "posix"]


@pytest.fixture(scope="module")
def disk_dir():
    """A directory on a real disk that takes O_DIRECT (pytest's tmp is tmpfs on some hosts)."""
    for base in (tempfile.gettempdir(), "/var/tmp", os.getcwd()):
        if probe_direct(base).supported:
            d = tempfile.mkdtemp(prefix="ckptfs-io-test-", dir=base)
            yield d
            for name in os.listdir(d):
                os.unlink(os.path.join(d, name))
            os.rmdir(d)
            return
    pytest.skip("no directory that supports O_DIRECT")


@pytest.fixture(scope="module")
def random_src():
    buf = alloc_aligned(64 * MiB)
    buf.write(os.urandom(64 * MiB))
    yield buf
    buf.close()


def _open(path, direct, flags=os.O_RDWR | os.O_CREAT | os.O_TRUNC):
    return open_file(path, flags, 0o600, direct=direct)


# -- probes and buffers ----------------------------------------------------------------------

def test_probe_direct_disk_and_tmpfs(disk_dir):
    info = probe_direct(disk_dir)
    assert isinstance(info, DirectInfo)
    assert info.supported and info.mem_align > 0 and info.offset_align > 0, info
    assert 4096 % info.offset_align == 0
    assert os.listdir(disk_dir) == []  # nothing left behind
    if os.path.isdir("/dev/shm"):
        before = set(os.listdir("/dev/shm"))
        shm = probe_direct("/dev/shm")
        assert shm.supported is False and "tmpfs" in shm.reason
        assert set(os.listdir("/dev/shm")) == before


def test_probe_direct_read_writes_nothing(disk_dir):
    path = os.path.join(disk_dir, "existing.log")
    with open(path, "wb") as f:
        f.write(os.urandom(3 * 4096 + 5))
    before = sorted(os.listdir(disk_dir))
    info = probe_direct_read(path)
    assert info.supported, info.reason
    assert sorted(os.listdir(disk_dir)) == before  # a read-only probe
    missing = probe_direct_read(os.path.join(disk_dir, "missing.log"))
    assert not missing.supported and "missing.log" in missing.reason
    fd, shm = tempfile.mkstemp(dir="/dev/shm")
    os.close(fd)
    try:
        mem = probe_direct_read(shm)
        assert not mem.supported and "tmpfs" in mem.reason
    finally:
        os.unlink(shm)


def test_alloc_aligned():
    b = alloc_aligned(3 * 4096 + 1, populate=False)
    import ctypes
    addr = ctypes.addressof(ctypes.c_char.from_buffer(b))
    assert addr % 4096 == 0 and len(b) == 3 * 4096 + 1
    b.close()
    with pytest.raises(ValueError):
        alloc_aligned(0)


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "never"


def _anon_huge_kb(addr: int, nbytes: int) -> int:
    """AnonHugePages of the mapping(s) covering [addr, addr+nbytes) in /proc/self/smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < addr + nbytes and addr < hi
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


@pytest.mark.parametrize("populate", [True, False])
def test_alloc_aligned_huge(populate, disk_dir):
    import ctypes
    n = 8 * MiB
    b = alloc_aligned(n, populate=populate, huge=True)
    c = ctypes.c_char.from_buffer(b)
    addr = ctypes.addressof(c)
    del c
    assert addr % 4096 == 0 and len(b) == n
    assert b[:4096] == bytes(4096) and b[n - 1] == 0  # zero-filled like any anonymous map
    b[:] = os.urandom(n)  # touches every page
    if _thp_mode() in ("always", "madvise"):
        # at least the 2 MiB-aligned interior is backed by huge pages (not guaranteed under
        # memory fragmentation, but it is on a test machine with free memory)
        assert _anon_huge_kb(addr, n) >= 4 * 1024
    # usable for O_DIRECT like any other aligned buffer
    path = os.path.join(disk_dir, "huge.dat")
    fd = _open(path, True)
    try:
        assert os.pwrite(fd, b, 0) == n
        back = alloc_aligned(n, huge=True)
        assert os.preadv(fd, [back], 0) == n and back[:] == b[:]
        back.close()
    finally:
        os.close(fd)
    b.close()


# -- data integrity --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("depth", [1, 4, 32])
@pytest.mark.parametrize("size,bs", [(4 * KiB, 4 * KiB), (768 * KiB, 64 * KiB),
                                     (64 * MiB, 4 * MiB)])
def test_write_read_roundtrip(kind, direct, depth, size, bs, disk_dir, random_src):
    path = os.path.join(disk_dir, "rt.dat")
    src = memoryview(random_src)
    fd = _open(path, direct)
    try:
        with open_engine(kind, depth=depth) as eng:
            assert eng.name == kind and eng.depth == depth
            # write the blocks in reverse order: offsets, not submission order, decide placement
            reqs = [(fd, src[off:off + bs], off) for off in range(0, size, bs)][::-1]
            eng.write_all(reqs)
            eng.fsync(fd)
            assert eng.inflight == 0
            dst = alloc_aligned(size)
            dv = memoryview(dst)
            got = eng.read_all([(fd, dv[off:off + bs], off) for off in range(0, size, bs)])
            assert got == [bs] * (size // bs)
            assert dst[:size] == src[:size]
            dv.release()
            dst.close()
    finally:
        os.close(fd)
    with open(path, "rb") as f:  # independent check through the page cache
        assert hashlib.sha256(f.read()).digest() == hashlib.sha256(src[:size]).digest()
    os.unlink(path)


@pytest.mark.parametrize("kind", ENGINES)
def test_odd_sizes_and_object_types_buffered(kind, disk_dir):
    path = os.path.join(disk_dir, "odd.dat")
    data = os.urandom(100_003)
    fd = _open(path, False)
    try:
        with open_engine(kind, depth=4) as eng:
            eng.write_all([(fd, data[:10], 0), (fd, bytearray(data[10:5000]), 10),
                           (fd, memoryview(data)[5000:], 5000)])
            out = bytearray(len(data) + 1000)
            mv = memoryview(out)
            n = eng.read_all([(fd, mv[:7], 0), (fd, mv[7:], 7)])
            assert n == [7, len(data) - 7]  # short at EOF
            assert bytes(out[:len(data)]) == data
    finally:
        os.close(fd)
        os.unlink(path)


# -- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ENGINES)
def test_write_to_readonly_fd_is_ebadf(kind, disk_dir):
    path = os.path.join(disk_dir, "ro.dat")
    with open(path, "wb") as f:
        f.write(b"\0" * 8192)
    fd = os.open(path, os.O_RDONLY)
    buf = alloc_aligned(8192)
    try:
        with open_engine(kind, depth=4) as eng:
            with pytest.raises(OSError) as ei:
                eng.write_all([(fd, memoryview(buf)[:4096], 0), (fd, memoryview(buf)[4096:], 4096)])
            assert ei.value.errno == errno.EBADF
            assert eng.inflight == 0
            del ei  # its traceback holds the request slices
            # low level: the failure comes back as a negative errno, not an exception
            eng.submit_write(fd, buf, 0, "w")
            assert eng.reap(1) == [("w", -errno.EBADF)]
        buf.close()  # no buffer export is left behind
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_read_past_eof(kind, direct, disk_dir):
    path = os.path.join(disk_dir, "eof.dat")
    fd = _open(path, direct)
    buf = alloc_aligned(16384)
    try:
        with open_engine(kind, depth=4) as eng:
            eng.write_all([(fd, memoryview(buf)[:8192], 0)])
            mv = memoryview(buf)
            assert eng.read_all([(fd, mv[:4096], 8192), (fd, mv[4096:8192], 1 << 20)]) == [0, 0]
            assert eng.read_all([(fd, mv, 0)]) == [8192]  # short at EOF, not an error
            mv.release()
    finally:
        os.close(fd)
        os.unlink(path)
        buf.close()


@pytest.mark.parametrize("kind", ENGINES)
def test_misaligned_direct_rejected_before_submission(kind, disk_dir):
    path = os.path.join(disk_dir, "mis.dat")
    fd = _open(path, True)
    buf = alloc_aligned(3 * 4096)
    mv = memoryview(buf)
    try:
        with open_engine(kind, depth=4) as eng:
            cases = [((fd, mv[1:4097], 0), "address"), ((fd, mv[:4096], 512), "offset"),
                     ((fd, mv[:4000], 0), "length")]
            for bad, word in cases:
                # a good request first: nothing of the call may be submitted
                with pytest.raises(EngineError) as ei:
                    eng.write_all([(fd, mv[:4096], 8192), bad])
                assert ei.value.errno == errno.EINVAL
                assert word in str(ei.value) and "4096" in str(ei.value)
                assert eng.inflight == 0
                with pytest.raises(EngineError):
                    eng.submit_write(fd, bad[1], bad[2], "x")
                assert eng.inflight == 0
            assert os.fstat(fd).st_size == 0  # nothing was written
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.mark.parametrize("kind", ENGINES)
def test_more_requests_than_ring_entries(kind, disk_dir, random_src):
    path = os.path.join(disk_dir, "many.dat")
    fd = _open(path, True)
    src = memoryview(random_src)
    n, bs = 200, 4096
    try:
        with open_engine(kind, depth=4) as eng:
            eng.write_all([(fd, src[i * bs:(i + 1) * bs], i * bs) for i in range(n)])
            # low level: 200 submissions on a 4-entry ring, nothing lost
            dst = alloc_aligned(n * bs)
            dv = memoryview(dst)
            for i in range(n):
                eng.submit_read(fd, dv[i * bs:(i + 1) * bs], i * bs, ("r", i))
            assert eng.inflight == n
            done = []
            while eng.inflight:
                done += eng.reap(min_complete=7)
            assert sorted(done) == [(("r", i), bs) for i in range(n)]
            assert dst[:] == src[:n * bs]
            eng.submit_fsync(fd, "sync", drain=True)
            assert eng.reap(1) == [("sync", 0)]
            assert eng.reap(0) == []
            dv.release()
            dst.close()
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.mark.skipif(not HAVE_URING, reason="io_uring unavailable")
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_registered_buffers_same_bytes(direct, disk_dir, random_src):
    path = os.path.join(disk_dir, "fixed.dat")
    fd = _open(path, direct)
    pool = [alloc_aligned(1 * MiB) for _ in range(4)]
    for i, b in enumerate(pool):
        b[:] = random_src[i * MiB:(i + 1) * MiB]
    try:
        with open_engine("io_uring", depth=8) as eng:
            assert eng.register_buffers(pool) is True and eng.registered == 4
            from ckptfs.io.uring import ffi
            cb = ffi.from_buffer(pool[1])
            addr = int(ffi.cast("uintptr_t", cb))
            ffi.release(cb)
            assert eng._buf_index(addr + 4096, 4096) >= 0      # inside: READ/WRITE_FIXED
            assert eng._buf_index(addr + MiB - 4096, 8192) == -1  # crosses the end: plain
            reqs = []
            for i, b in enumerate(pool):  # slices inside registered buffers -> WRITE_FIXED
                mv = memoryview(b)
                reqs += [(fd, mv[:512 * KiB], i * MiB), (fd, mv[512 * KiB:], i * MiB + 512 * KiB)]
            reqs.append((fd, memoryview(random_src)[4 * MiB:5 * MiB], 4 * MiB))  # not registered
            eng.write_all(reqs)
            eng.fsync(fd)
            for b in pool:
                b[:] = b"\0" * MiB
            assert eng.read_all([(fd, b, i * MiB) for i, b in enumerate(pool)]) == [MiB] * 4
            for i, b in enumerate(pool):
                assert b[:] == random_src[i * MiB:(i + 1) * MiB]
            with pytest.raises(BufferError):
                pool[0].close()  # still registered
            del mv, reqs
        with open(path, "rb") as f:
            assert f.read() == random_src[:5 * MiB]
    finally:
        os.close(fd)
        os.unlink(path)
        for b in pool:
            b.close()  # released by close()


@pytest.mark.skipif(not HAVE_URING, reason="io_uring unavailable")
def test_register_failure_is_not_fatal(caplog):
    with open_engine("io_uring", depth=2) as eng:
        with caplog.at_level(logging.INFO, logger="ckptfs.io"):
            _reset_log_once()
            assert eng.register_buffers([b"read-only bytes"]) is False
        assert "continuing without" in caplog.text
        assert eng.registered == 0


# -- selection and fallback ------------------------------------------------------------------

def test_posix_engine_explicit():
    with open_engine("posix", depth=3) as eng:
        assert eng.name == "posix" and eng.depth == 3
        assert eng.register_buffers([bytearray(10)]) is False
    with pytest.raises(ValueError):
        open_engine("nope")


@pytest.mark.skipif(not HAVE_URING, reason="io_uring unavailable")
def test_auto_picks_io_uring(caplog):
    _reset_log_once()
    with caplog.at_level(logging.INFO, logger="ckptfs.io"):
        with open_engine("auto") as eng:
            assert eng.name == "io_uring"
    assert "io_uring engine" in caplog.text


def test_auto_falls_back_when_disabled(monkeypatch, caplog, disk_dir):
    monkeypatch.setenv("CKPTFS_DISABLE_IO_URING", "1")
    _reset_log_once()
    with caplog.at_level(logging.INFO, logger="ckptfs.io"):
        eng = open_engine("auto", depth=8)
        eng2 = open_engine("auto", depth=8)
    assert eng.name == "posix" and eng2.name == "posix"
    msgs = [r.getMessage() for r in caplog.records if r.name == "ckptfs.io"]
    assert len([m for m in msgs if "falling back" in m]) == 1  # once per process
    assert "CKPTFS_DISABLE_IO_URING" in msgs[0]
    with pytest.raises(EngineError):
        open_engine("io_uring")
    path = os.path.join(disk_dir, "fb.dat")
    fd = _open(path, False)
    try:
        eng.write_all([(fd, b"hello", 0)])
        eng.fsync(fd)
        out = bytearray(5)
        assert eng.read_all([(fd, out, 0)]) == [5] and out == b"hello"
    finally:
        os.close(fd)
        os.unlink(path)
        eng.close()
        eng2.close()


def test_stub_build_without_liburing(tmp_path, monkeypatch):
    """The build falls back to a stub module (install does not fail) without liburing."""
    monkeypatch.setenv("CKPTFS_BUILD_NO_URING", "1")
    build = os.path.join(os.path.dirname(cio.__file__), "_uring_build.py")
    # The build names its sources relative to the source tree (as setup.py runs it there) and
    # cffi compiles inside `tmpdir`: the C files go there under the same relative names.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(cio.__file__))))
    monkeypatch.chdir(root)
    for sub in ("ckptfs/io", "ckptfs/fuse"):
        os.makedirs(tmp_path / sub)
        for name in os.listdir(os.path.join(root, sub)):
            if name.endswith((".c", ".h")):
                shutil.copy(os.path.join(root, sub, name), tmp_path / sub / name)
    ffibuilder = runpy.run_path(build)["ffibuilder"]
    so = ffibuilder.compile(tmpdir=str(tmp_path))
    spec = importlib.util.spec_from_file_location("_uring_cffi", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.lib.ck_have_uring() == 0
    assert b"CKPTFS_BUILD_NO_URING" in mod.ffi.string(mod.lib.ck_build_info())
    err = mod.ffi.new("int *")
    feat = mod.ffi.new("unsigned int *")
    assert mod.lib.ck_ring_open(8, err, feat) == mod.ffi.NULL and err[0] == errno.ENOSYS
    sys.modules.pop("_uring_cffi", None)
