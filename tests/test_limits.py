"""What is written can be read back: sizes, offsets and times at and past what the index can
record, on a real mount and again after a remount; a defect in a thread or task of the daemon
(the flusher, a loader, the cleaner, the hand-over of the queue threads' requests) fails every
barrier with EIO instead of hanging it; one in a request handler fails that request alone."""

from __future__ import annotations

import errno
import os
import subprocess
import time

import pyfuse3
import pytest
from helpers import cli, fsync_fails, read_all, wait_for, write_file

from ckptfs import api
from ckptfs.format import records
from ckptfs.fuse.ops import CkptOperations

pytestmark = pytest.mark.timeout(180)

MAX = records.MAX_FILE_BYTES
Y2300_NS = 10_413_792_000 * 10**9  # 2300-01-01
Y1600_NS = -11_676_096_000 * 10**9  # 1600-01-01


def _remount(mounts, m: api.Mount, backing: str) -> api.Mount:
    m.stop()
    return mounts.mount(backing, m.mountpoint, writer_id="w")


def test_sizes_and_offsets_past_the_largest_file_fail_with_efbig(mounts):
    backing = mounts.backing()
    m = mounts.mount(backing, writer_id="w")
    big = os.path.join(m.mountpoint, "big")
    with open(big, "wb"):
        pass
    os.truncate(big, MAX)  # the largest size there is: recorded and read back
    for size in (MAX + 1, 2 << 50, (1 << 63) - 1):
        with pytest.raises(OSError) as e:
            os.truncate(big, size)
        assert e.value.errno == errno.EFBIG, size
    res = subprocess.run(["truncate", "-s", "2P", big], capture_output=True, text=True)
    assert res.returncode != 0 and "too large" in res.stderr.lower()
    # a WRITE starting at or past the largest file (write-only opens bypass the page cache:
    # the WRITE is the write(2) itself)
    fd = os.open(os.path.join(m.mountpoint, "dd"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for off in (MAX, MAX + 1, 1 << 60, (1 << 63) - 8192):
            with pytest.raises(OSError) as e:
                os.pwrite(fd, b"x" * 4096, off)
            assert e.value.errno == errno.EFBIG, off
        with pytest.raises(OSError) as e:  # (past the largest loff_t: the kernel refuses)
            os.pwrite(fd, b"x" * 4096, (1 << 63) - 4096)
        assert e.value.errno in (errno.EFBIG, errno.EINVAL)
        assert os.pwrite(fd, b"tail", MAX - 4) == 4  # ends at the largest file exactly
    finally:
        os.close(fd)
    with open(os.path.join(m.mountpoint, "b.pt"), "wb") as f:
        f.write(b"world\n")
    assert cli("sync", m.mountpoint).returncode == 0
    m = _remount(mounts, m, backing)
    assert os.path.getsize(big) == MAX
    assert os.path.getsize(os.path.join(m.mountpoint, "dd")) == MAX
    with open(os.path.join(m.mountpoint, "dd"), "rb") as f:
        f.seek(MAX - 4)
        assert f.read() == b"tail"
    with open(os.path.join(m.mountpoint, "b.pt"), "rb") as f:
        assert f.read() == b"world\n"
    assert "out of range" not in mounts.log(m)


READERS = {  # who reads the WRITE: each has its own path to Handles.write_target
    "queue threads": {},  # (FUSE's io_uring queues with CKPTFS_TEST_FUSE_URING=1)
    "request loop": {"fuse_uring": False, "queue_threads": False},
    "pyfuse3": {"fast_path": False},
}


@pytest.mark.parametrize("reader", list(READERS))
def test_a_write_across_the_largest_file_writes_what_fits(mounts, reader):
    """A WRITE from below the largest file to past it writes the bytes that fit and returns
    their count, as POSIX and ext4 have it; one starting at the largest file fails with
    EFBIG. Write-only opens (direct I/O: the WRITE is the write(2)) and read-write ones
    (through the page cache); sizes and bytes again after a remount."""
    backing = mounts.backing()
    m = mounts.mount(backing, writer_id="w", **READERS[reader])
    data = bytes(range(100))
    for how in (os.O_WRONLY, os.O_RDWR):
        fd = os.open(os.path.join(m.mountpoint, f"f{how}"), how | os.O_CREAT, 0o644)
        try:
            assert os.pwrite(fd, data, MAX - 10) == 10
            assert os.fstat(fd).st_size == MAX
            for off in (MAX, MAX + 5):
                with pytest.raises(OSError) as e:
                    os.pwrite(fd, data, off)
                assert e.value.errno == errno.EFBIG, off
            assert os.pwrite(fd, data[:40], 0) == 40  # (the file takes writes as before)
            assert os.pwrite(fd, data, MAX - 1) == 1
        finally:
            os.close(fd)
    assert cli("sync", m.mountpoint).returncode == 0
    m = _remount(mounts, m, backing)
    for how in (os.O_WRONLY, os.O_RDWR):
        with open(os.path.join(m.mountpoint, f"f{how}"), "rb") as f:
            assert os.fstat(f.fileno()).st_size == MAX
            assert f.read(40) == data[:40]
            f.seek(MAX - 10)
            assert f.read() == data[:9] + data[:1]
    assert "out of range" not in mounts.log(m)


def test_times_outside_the_index_range_are_clamped_and_survive_a_remount(mounts):
    backing = mounts.backing()
    m = mounts.mount(backing, writer_id="w")
    late, early = os.path.join(m.mountpoint, "late.pt"), os.path.join(m.mountpoint, "early")
    for p in (late, early):
        with open(p, "wb") as f:
            f.write(b"x")
    os.utime(late, ns=(Y2300_NS, Y2300_NS))
    os.utime(early, ns=(Y1600_NS, Y1600_NS))
    res = subprocess.run(["touch", "-d", "2300-01-01", late], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert os.stat(late).st_mtime_ns == records.TIME_MAX_NS
    assert os.stat(early).st_mtime_ns == records.TIME_MIN_NS
    assert cli("sync", m.mountpoint, timeout=30).returncode == 0  # (a flusher gone: a hang)
    m = _remount(mounts, m, backing)
    st = os.stat(late)
    assert (st.st_atime_ns, st.st_mtime_ns) == (records.TIME_MAX_NS, records.TIME_MAX_NS)
    st = os.stat(early)
    assert (st.st_atime_ns, st.st_mtime_ns) == (records.TIME_MIN_NS, records.TIME_MIN_NS)
    with open(late, "rb") as f:
        assert f.read() == b"x"


def test_a_failed_flusher_fails_every_barrier_with_eio_and_says_why(mounts):
    """An unexpected exception in the flusher thread (injected at its first commit): fsync,
    `ckptfs sync` and `ckptfs umount` fail with EIO within their time, status says so."""
    backing = mounts.backing()
    m = mounts.mount(backing, writer_id="w", env={"CKPTFS_FAILPOINT": "flusher-commit:1"})
    t0 = time.monotonic()
    fsync_fails(os.path.join(m.mountpoint, "a.pt"), b"a" * 100_000)
    assert time.monotonic() - t0 < 30
    st = api.status(m.mountpoint)
    assert st["failed"] == 1 and "flusher thread failed" in st["last_error"], st
    res = cli("sync", m.mountpoint, timeout=30)
    assert res.returncode != 0 and "Input/output error" in res.stderr, res.stderr
    # new writes find the mount failed too: a write that needs a free segment is refused
    # once staging has none; the unmount says what was lost
    res = cli("umount", m.mountpoint, timeout=60)
    assert res.returncode != 0, res.stdout
    assert "flusher thread failed" in mounts.log(m)
    if api.is_mounted(m.mountpoint):
        assert cli("umount", "--force", m.mountpoint, timeout=60).returncode in (0, 1)
    assert not api.is_mounted(m.mountpoint)
    m.proc.wait(timeout=30)


def test_a_defect_in_the_hand_over_of_a_queue_threads_request_fails_the_mount(mounts):
    """The trio thread ends a request the queue threads handed over on an unexpected exception
    (injected at the first hand-over: the first LOOKUP, no answer is left with the queue
    threads yet): that request fails with EIO, the mount is failed as with the flusher (fsync,
    sync, umount: EIO and the cause) and serves on, so the unmount returns."""
    m = mounts.mount(writer_id="w", env={"CKPTFS_FAILPOINT": "handover:1"})
    assert m.status()["transport"] != "/dev/fuse"  # (the queue threads, on either transport)
    p = os.path.join(m.mountpoint, "a.pt")
    with pytest.raises(OSError) as e:
        os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
    assert e.value.errno == errno.EIO
    st = api.status(m.mountpoint)
    assert st["failed"] == 1 and "hand-over" in st["last_error"], st
    fsync_fails(p, b"a" * 100_000)  # (the mount serves on, failed)
    res = cli("sync", m.mountpoint, timeout=30)
    assert res.returncode != 0 and "Input/output error" in res.stderr, res.stderr
    res = cli("umount", m.mountpoint, timeout=60)  # (returns, and says what was lost)
    assert res.returncode != 0 and "Input/output error" in res.stderr, res.stderr
    assert "failpoint handover reached" in mounts.log(m)
    if api.is_mounted(m.mountpoint):
        assert cli("umount", "--force", m.mountpoint, timeout=60).returncode in (0, 1)
    assert not api.is_mounted(m.mountpoint)
    m.proc.wait(timeout=30)


@pytest.mark.parametrize("where", ["loader", "cleaner"])
def test_a_defect_in_a_loader_or_the_cleaner_fails_the_mount_and_says_why(mounts, where):
    """A loader thread of the read path, or the maintenance task, ends on an unexpected
    exception (injected): reads waiting for it end with EIO instead of waiting for ever, and
    the mount is failed as with the flusher (fsync, sync, umount: EIO and the cause)."""
    backing = mounts.backing()
    m = mounts.mount(backing, writer_id="w")
    with open(os.path.join(m.mountpoint, "a.pt"), "wb") as f:
        f.write(os.urandom(3 << 20))
    m.stop()
    m = mounts.mount(backing, writer_id="w", env={"CKPTFS_FAILPOINT": f"{where}:1"},
                     clean_idle=0)
    if where == "loader":  # (the first disk read of the file: EIO, not a hang)
        with pytest.raises(OSError) as e:
            with open(os.path.join(m.mountpoint, "a.pt"), "rb") as f:
                f.read()
        assert e.value.errno == errno.EIO
    # (the maintenance looks every second)
    st = wait_for(lambda: (s := api.status(m.mountpoint))["failed"] and s, "the mount to fail",
                  timeout=30)
    assert st["failed"] == 1 and "failed" in st["last_error"], st
    res = cli("sync", m.mountpoint, timeout=30)
    assert res.returncode != 0 and "Input/output error" in res.stderr, res.stderr
    assert cli("umount", m.mountpoint, timeout=60).returncode != 0
    assert "failpoint" in mounts.log(m)
    if api.is_mounted(m.mountpoint):
        cli("umount", "--force", m.mountpoint, timeout=60)
    m.proc.wait(timeout=30)


def test_a_defect_in_a_request_handler_fails_that_request_and_nothing_else(mounts):
    """An unexpected exception in a handler pyfuse3 calls (injected into the first STATFS)
    would end pyfuse3's loop and the mount with it: the request fails with EIO instead, the
    daemon's log has the traceback, and the mount serves on, not failed (a defect of one
    request is no error of the store's)."""
    m = mounts.mount(writer_id="w", env={"CKPTFS_FAILPOINT": "statfs:1"})
    with pytest.raises(OSError) as e:
        os.statvfs(m.mountpoint)
    assert e.value.errno == errno.EIO
    assert os.statvfs(m.mountpoint).f_namemax == records.NAME_MAX  # (the next is answered)
    data = os.urandom(100_000)
    write_file(os.path.join(m.mountpoint, "a.pt"), data, fsync=True)
    assert read_all(os.path.join(m.mountpoint, "a.pt")) == data
    assert m.status()["failed"] == 0
    log = mounts.log(m)
    assert "internal error in statfs" in log and "failpoint statfs reached" in log, log
    assert m.stop() == 0


def test_every_request_handler_is_guarded():
    """Each handler pyfuse3 calls carries ops.guarded (the test above shows what it does):
    a handler added without it would let a defect end the mount."""
    handlers = [name for name, fn in vars(CkptOperations).items()
                if name in dir(pyfuse3.Operations) and not name.startswith("_") and callable(fn)]
    assert len(handlers) >= 28, handlers
    assert [n for n in handlers if not hasattr(getattr(CkptOperations, n), "__wrapped__")] == []
