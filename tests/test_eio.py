"""EIO from the backing store, without device-mapper: ckptfs's backing directory lies in a
failing_fs mount (tests/failing_fs.py, a pass-through FUSE file system) that is switched to
fail writes and fsync with EIO. A writer's fsync reports EIO, the daemon stays up and says
so in its status, durable data stays readable; once the store heals, the staged data lands,
new checkpoints succeed, and a remount sees everything (and `ckptfs verify` passes)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import (
    CLI, MiB, as_user, cli, content, fsync_fails, read_all, status_reaches, sync_until_ok,
    verify_and_remount, wait_for, write_file,
)

from ckptfs import api
from ckptfs.bench import drop_caches
from ckptfs.io.buffers import probe_direct

pytestmark = pytest.mark.timeout(90)

@pytest.mark.either_transport
def test_failing_fs_itself(failing):
    """The helper file system: a mirror that fails writes/fsync with EIO while switched on."""
    mnt = failing.mountpoint
    p = os.path.join(mnt, "d", "f")
    os.mkdir(os.path.dirname(p))
    write_file(p, b"x" * 100000, fsync=True)
    with open(os.path.join(failing.source, "d", "f"), "rb") as f:
        assert f.read() == b"x" * 100000
    os.rename(p, p + "2")
    assert os.listdir(os.path.join(mnt, "d")) == ["f2"]
    assert ".fail" not in os.listdir(mnt)
    failing.fail()
    fd = os.open(p + "2", os.O_WRONLY)
    try:
        with pytest.raises(OSError) as ei:
            os.pwrite(fd, b"y", 0)
        assert ei.value.errno == errno.EIO
        with pytest.raises(OSError) as ei:
            os.fsync(fd)
        assert ei.value.errno == errno.EIO
    finally:
        os.close(fd)
    with open(p + "2", "rb") as f:  # reads still work
        assert f.read() == b"x" * 100000
    failing.heal()
    write_file(p + "2", b"z" * 10, fsync=True)
    with open(p + "2", "rb") as f:
        assert f.read() == b"z" * 10
    print("\nprobe_direct on failing_fs:", probe_direct(mnt))


def test_the_flushers_error_is_told_as_it_comes_and_to_a_listener_that_attaches_later():
    """The flusher tells its error notices when it has an error; a listener (the ring's, while
    the queue threads run: they answer FLUSH only while there is none) attached after it came
    is told at once. No mount: a flusher that is not started, failed by a defect."""
    import trio

    from ckptfs.datapath.flusher import ErrorNotices, Flusher
    from ckptfs.datapath.journal import Journal
    from ckptfs.datapath.staging import Staging

    async def main() -> None:
        notices, before, after = ErrorNotices(), [], []
        staging = Staging(64 << 10, 128 << 10, lambda seg: None)
        flusher = Flusher(None, "w0", staging, Journal(), engine="posix", depth=1,
                          direct=False, align=4096, log_bytes=MiB, next_log=1, index=None,
                          io_chunk_bytes=64 << 10, flush_errors=notices)
        notices.attach(before.append)
        flusher.fail(RuntimeError("a defect"), "a test")
        notices.detach()
        notices.attach(after.append)
        assert before == [False, True] and after == [True]
        assert flusher.error is flusher.failed is not None
        staging.close()

    trio.run(main)


def test_eio_then_recovery(failing, mounts):
    backing = os.path.join(failing.mountpoint, "b")
    os.mkdir(backing)
    opts = dict(staging_size="8M", segment_size="1M", idle_flush=0.2)
    sizes = {"a": 3 * MiB, "b": 2 * MiB + 12345, "c": 3 * MiB}
    t0 = time.monotonic()
    m = mounts.mount(backing, **opts)
    mnt = m.mountpoint
    try:
        # 1. a durable checkpoint
        write_file(os.path.join(mnt, "a"), content("a", sizes["a"]), fsync=True)
        # 2. the store fails: a writer's fsync gets EIO, the daemon stays up and says why
        failing.fail()
        fd = os.open(os.path.join(mnt, "b"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        data = content("b", sizes["b"])
        for off in range(0, len(data), MiB):
            os.write(fd, data[off:off + MiB])
        try:
            os.fsync(fd)
        except OSError as exc:
            assert exc.errno == errno.EIO, exc
        else:
            raise AssertionError("fsync succeeded on a failing store; status %s\nfailing_fs: %s"
                                 "\ndaemon: %s" % (m.status(), failing.log_text(),
                                                    mounts.log(m)))
        with pytest.raises(OSError) as ei:  # close learns about the pending error too
            os.close(fd)
        assert ei.value.errno == errno.EIO, ei.value
        assert m.proc.poll() is None, "daemon died on EIO"
        st = m.status()
        assert st["errors"] > 0, st
        err = st["current_error"]
        assert "Input/output error" in err or "EIO" in err or "errno 5" in err.lower() \
            or "[Errno 5]" in err, st
        with pytest.raises(OSError) as ei:  # the sync barrier reports it as well
            m.sync()
        assert ei.value.errno == errno.EIO
        assert read_all(os.path.join(mnt, "a")) == content("a", sizes["a"])
        # 3. the store heals: the flusher's retry lands B; new checkpoints succeed
        failing.heal()
        sync_until_ok(m, errno.EIO, 15, "staged data never landed after healing")
        assert read_all(os.path.join(mnt, "b")) == content("b", sizes["b"])
        write_file(os.path.join(mnt, "c"), content("c", sizes["c"]), fsync=True)
        assert m.status()["current_error"] == ""
    finally:
        failing.heal()  # lets the unmount drain even when an assertion failed above
    # 4. remount: everything is there, and the backing store verifies
    verify_and_remount(mounts, m, backing, opts, sizes).stop()
    print(f"\nEIO scenario: {time.monotonic() - t0:.1f} s")



@pytest.mark.either_transport  # (the kernel's own behaviour, below the daemon)
@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_a_disk_that_fails_writes(failing_disk, mounts, io):
    """The backing directory on ext4 over a block device whose writes fail with EIO (a loop
    device: helpers.FailingDisk), what dm-error does where device-mapper exists. The kernel's
    own behaviour, not a stand-in: O_DIRECT writes fail; buffered pages whose writeback failed
    are dropped and fdatasync reports that once, so a segment is durable only after it is
    written again. fsync reports EIO, durable data stays readable, nothing hangs; healed,
    everything staged lands and a remount (caches dropped) reads every byte back."""
    backing = os.path.join(failing_disk.path, "b")
    os.mkdir(backing)
    opts = dict(staging_size="8M", segment_size="1M", idle_flush=0.2, io=io)
    sizes = {"a": 3 * MiB, "b": 4 * MiB + 4321, "c": 2 * MiB}
    m = mounts.mount(backing, **opts)
    mnt = m.mountpoint
    try:
        write_file(os.path.join(mnt, "a"), content("a", sizes["a"]), fsync=True)
        failing_disk.fail()
        fsync_fails(os.path.join(mnt, "b"), content("b", sizes["b"]))
        with pytest.raises(OSError) as ei:
            m.sync()
        assert ei.value.errno == errno.EIO
        assert m.proc.poll() is None, "daemon died on EIO"
        assert read_all(os.path.join(mnt, "a")) == content("a", sizes["a"])
        failing_disk.heal()
        sync_until_ok(m, errno.EIO, 15, "staged data never landed after healing")
        write_file(os.path.join(mnt, "c"), content("c", sizes["c"]), fsync=True)
    finally:
        failing_disk.heal()
    m.stop()
    drop_caches()  # (the remount reads what the disk holds, not the page cache)
    verify_and_remount(mounts, m, backing, opts, sizes).stop()


def test_umount_timeout_when_the_store_hangs(failing, mounts):
    """A backing store that stops answering (its fsync hangs): `ckptfs umount --timeout` gives
    up after that long with a clear message and leaves the mount in place, nothing lost; once
    the store answers again a plain umount completes and a remount has the data."""
    backing = os.path.join(failing.mountpoint, "b")
    os.mkdir(backing)
    opts = dict(staging_size="8M", segment_size="1M")
    m = mounts.mount(backing, **opts)
    data = content("h", 3 * MiB + 4321)
    with open(os.path.join(m.mountpoint, "h"), "wb") as f:
        f.write(data)
    failing.fail("hang-fsync")
    try:
        t0 = time.monotonic()
        proc = subprocess.Popen(CLI + ["umount", m.mountpoint, "--timeout", "2"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            failing.heal()  # a process waiting in a FUSE request can only exit once answered
            proc.kill()
            proc.communicate()
            raise AssertionError("umount --timeout 2 did not return within 30 s") from None
        took = time.monotonic() - t0
        assert proc.returncode != 0, (out, err)
        assert "did not complete within 2 s" in err and "not unmounted" in err, err
        assert took < 20, took
        assert api.is_mounted(m.mountpoint) and m.proc.poll() is None
        assert "fsync hangs" in failing.log_text()
    finally:
        failing.heal()  # (teardown unmounts through the store)
    res = cli("umount", m.mountpoint, timeout=60)
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert not api.is_mounted(m.mountpoint)
    m2 = mounts.mount(backing, **opts)
    assert read_all(os.path.join(m2.mountpoint, "h")) == data
    m2.stop()


def _blocked_child(code: str) -> subprocess.Popen:
    """A Python child that prints 'ready' and then blocks in a request to the mount."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    _blocked_threads(proc, 1)
    return proc


def _blocked_threads(proc: subprocess.Popen, n: int) -> None:
    """Wait until `n` threads of `proc` wait for an answer of a mount."""
    def blocked() -> bool:
        assert proc.poll() is None, "the child ended instead of blocking"
        waiting = 0
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            try:
                with open(f"/proc/{proc.pid}/task/{tid}/wchan") as f:
                    waiting += f.read().strip() == "request_wait_answer"
            except OSError:
                pass
        return waiting >= n

    wait_for(blocked, f"{n} threads of the child to block in a request", timeout=20)
    time.sleep(0.2)


def test_killing_a_process_blocked_on_a_hung_store(failing, mounts):
    """A process waiting in ckptfs for a backing store that stopped answering can be killed:
    the kernel waits for the daemon's answer once a request reached it (even after SIGKILL),
    so the daemon answers an interrupted fsync / sync barrier with EINTR, and a WRITE waiting
    for staging space with what it recorded (EINTR if nothing). Nothing written is lost: once
    the store answers again everything lands."""
    backing = os.path.join(failing.mountpoint, "b")
    os.mkdir(backing)
    opts = dict(staging_size="4M", segment_size="1M")
    m = mounts.mount(backing, **opts)
    mnt = m.mountpoint
    kids = []
    try:
        failing.fail("hang-fsync hang-write")
        kids.append(("fsync", _blocked_child(
            f"import os; fd = os.open({os.path.join(mnt, 'f')!r}, os.O_WRONLY | os.O_CREAT)\n"
            "os.write(fd, b'f' * 100000); print('ready', flush=True); os.fsync(fd)")))
        kids.append(("sync", _blocked_child(
            f"from ckptfs import api; print('ready', flush=True); api.sync({mnt!r})")))
        # a signal that does not kill changes nothing: the fsync neither fails nor returns
        kids.append(("fsync after another signal", _blocked_child(
            "import os, signal\n"
            "def no(*a): raise SystemExit('fsync was interrupted by SIGUSR1')\n"
            "signal.signal(signal.SIGUSR1, no)\n"
            f"fd = os.open({os.path.join(mnt, 'g')!r}, os.O_WRONLY | os.O_CREAT)\n"
            "os.write(fd, b'g' * 1000); print('ready', flush=True); os.fsync(fd)")))
        kids[-1][1].send_signal(signal.SIGUSR1)
        # (the kernel told the daemon, which looked at the caller and answered nothing)
        status_reaches(m, "interrupt_notices", 1, timeout=20)
        assert m.status()["requests_interrupted"] == 0
        assert kids[-1][1].poll() is None, "a non-fatal signal made the fsync fail"
        # staging (4 MiB) fills: the flusher's writes hang, so this writer waits for space
        kids.append(("write", _blocked_child(
            f"import os; fd = os.open({os.path.join(mnt, 'w')!r}, os.O_WRONLY | os.O_CREAT)\n"
            "print('ready', flush=True)\n"
            "for i in range(64): os.write(fd, bytes([i]) * (1 << 20))")))
        # (its thread seen in a request may be a WRITE on its way: the kill is for one that
        # waits for staging space)
        status_reaches(m, "writers_waiting", 1, timeout=20)
        for what, proc in kids:
            proc.kill()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the process blocked in {what} could not be killed") \
                    from None
        st = m.status()
        assert st["requests_interrupted"] >= 4, st
    finally:
        failing.heal()
        for _, proc in kids:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=60)
            proc.stdout.close()
    m.sync()  # the store answers again: everything recorded lands
    m.stop()
    m2 = mounts.mount(backing, **opts)
    assert read_all(os.path.join(m2.mountpoint, "f")) == b"f" * 100000
    assert read_all(os.path.join(m2.mountpoint, "g")) == b"g" * 1000
    w = read_all(os.path.join(m2.mountpoint, "w"))  # what the killed writer had written
    assert 0 < len(w) < 64 << 20, len(w)
    for at in range(0, len(w), 1 << 20):
        piece = w[at:at + (1 << 20)]
        assert piece == bytes([at >> 20]) * len(piece), at
    m2.stop()


def test_killing_processes_when_every_request_task_is_held(failing, mounts):
    """More fsyncs wait for a hung store than the daemon has request tasks (32): nobody reads
    the kernel's INTERRUPTs then, so the daemon looks at the callers of held requests itself.
    A process with 40 threads in fsync is killed; a process blocked in fsync that gets a signal
    which dumps core (SIGQUIT: the kernel does not turn it into SIGKILL) dies of it. What the
    threads wrote before lands once the store answers again."""
    backing = os.path.join(failing.mountpoint, "b")
    os.mkdir(backing)
    m = mounts.mount(backing)
    mnt = m.mountpoint
    kids = []
    try:
        failing.fail("hang-fsync")
        # SIGQUIT at its default action: a shell without job control starts background jobs
        # with SIGINT and SIGQUIT ignored, which pytest and this child would inherit (then
        # the signal never arrives and the child cannot die of it)
        quit_kid = _blocked_child(
            "import ctypes, os, signal\n"
            "signal.signal(signal.SIGQUIT, signal.SIG_DFL)\n"
            "ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no core file\n"
            f"fd = os.open({os.path.join(mnt, 'q')!r}, os.O_WRONLY | os.O_CREAT)\n"
            "os.write(fd, b'q' * 1000); print('ready', flush=True); os.fsync(fd)")
        kids.append(quit_kid)
        many = subprocess.Popen([sys.executable, "-c", (
            "import os, threading\n"
            "fds = []\n"
            "for i in range(40):\n"
            f"    fd = os.open(os.path.join({mnt!r}, f't{{i}}'), os.O_WRONLY | os.O_CREAT)\n"
            "    os.write(fd, bytes([i]) * 1000)\n"
            "    fds.append(fd)\n"
            "ts = [threading.Thread(target=os.fsync, args=(fd,)) for fd in fds]\n"
            "for t in ts: t.start()\n"
            "print('ready', flush=True)\n"
            "for t in ts: t.join()\n")], stdout=subprocess.PIPE, text=True)
        kids.append(many)
        assert many.stdout.readline().strip() == "ready"
        _blocked_threads(many, 40)
        # Every request task waits for the store, so the mount answers nothing else now (its
        # status xattr would wait too); `ckptfs status` asks the daemon's status socket. Not
        # a user the mount is not open to: it gets no figures that way.
        def figures() -> dict | None:
            res = cli("status", "--json", mnt, timeout=30)
            assert res.returncode == 0, res.stderr
            st = json.loads(res.stdout)
            return st if st["fsyncs"] >= 32 else None

        # (blocked in the kernel before the daemon took each: it takes 32)
        st = wait_for(figures, "32 fsyncs taken by the daemon", timeout=20, step=0.1)
        assert st["bytes_written"] >= 40_000, st
        res = as_user(CLI + ["status", mnt], timeout=30)
        assert res.returncode != 0 and "bytes_written" not in res.stdout, res.stdout
        quit_kid.send_signal(signal.SIGQUIT)
        many.kill()
        for what, proc, sig in (("40 threads in fsync", many, signal.SIGKILL),
                                ("fsync, SIGQUIT", quit_kid, signal.SIGQUIT)):
            try:
                rc = proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the process blocked in {what} could not be killed") \
                    from None
            assert rc == -sig, (what, rc)
    finally:
        failing.heal()
        for proc in kids:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=60)
            proc.stdout.close()
    m.sync()
    assert m.status()["requests_interrupted"] >= 32  # (32 tasks: the rest were never read)
    m.stop()
    m2 = mounts.mount(backing)
    for i in range(40):
        assert read_all(os.path.join(m2.mountpoint, f"t{i}")) == bytes([i]) * 1000, i
    assert read_all(os.path.join(m2.mountpoint, "q")) == b"q" * 1000
    m2.stop()


def test_killing_a_process_blocked_in_a_read(failing, mounts):
    """A read that waits for a disk read from a store that stopped answering can be killed: the
    READ is answered EINTR while the daemon's loader thread goes on waiting for the store;
    once the store answers, the same data reads back whole through the same mount."""
    m2, path, data = _stored_file(failing, mounts)
    kid = None
    try:
        failing.fail("hang-read")
        kid = _blocked_child(
            f"f = open({path!r}, 'rb'); print('ready', flush=True); f.read()")
        kid.kill()
        try:
            kid.wait(timeout=15)
        except subprocess.TimeoutExpired:
            raise AssertionError("the process blocked in a read could not be killed") from None
        assert m2.status()["requests_interrupted"] >= 1
    finally:
        failing.heal()
        if kid is not None:
            if kid.poll() is None:
                kid.kill()
            kid.wait(timeout=60)
            kid.stdout.close()
    assert read_all(path) == data
    m2.stop()


def _stored_file(failing, mounts, **opts):
    """A 3 MiB file saved through one mount over the failing store, then a fresh mount of it
    with nothing cached (neither in ckptfs nor in the store's page cache), reading directly
    (the reader waits in the READ itself, not in the page cache's readahead):
    (mount, path of the file in it, its data)."""
    backing = os.path.join(failing.mountpoint, "b")
    os.mkdir(backing)
    m = mounts.mount(backing, **opts)
    data = os.urandom(3 * MiB)
    with open(os.path.join(m.mountpoint, "r"), "wb") as f:
        f.write(data)
    m.sync()
    m.stop()
    m2 = mounts.mount(backing, direct_reads=True, **opts)
    for d, _, names in os.walk(backing):
        for name in names:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    return m2, os.path.join(m2.mountpoint, "r"), data


@pytest.mark.parametrize("fast_path", [True, pytest.param(  # (no fast path: no rings)
    False, marks=pytest.mark.either_transport)], ids=["fast-path", "no-fast-path"])
def test_a_failing_read_of_the_store_is_eio(failing, mounts, fast_path):
    """A chunk read that the backing store fails (EIO) fails the application's read with EIO,
    with and without the fast path, as an I/O error (not the handlers' guard against bugs,
    which answers EIO too but logs an internal error); the daemon stays up, and once the store
    heals the same file reads back whole through the same mount."""
    m2, path, data = _stored_file(failing, mounts, fast_path=fast_path)
    failing.fail("read")
    try:
        with pytest.raises(OSError) as err:
            read_all(path)
        assert err.value.errno == errno.EIO, err.value
        assert m2.proc.poll() is None, "the daemon died on a failing read:\n" + mounts.log(m2)
        assert "internal error" not in mounts.log(m2), mounts.log(m2)  # an I/O error, not a bug
    finally:
        failing.heal()
    assert read_all(path) == data
    m2.stop()


@pytest.mark.parametrize("fast_path", [True, pytest.param(  # (no fast path: no rings)
    False, marks=pytest.mark.either_transport)], ids=["fast-path", "no-fast-path"])
def test_a_failing_look_at_other_writers_serves_the_view(failing, mounts, fast_path):
    """A backing store that fails the look at the other writers (listing writers/ gives EIO)
    does not fail the requests that look first (lookup, open, listing: --refresh 0 looks at
    every one): they are served from the view as it is, the mount's own files and the other
    writer's seen before, with and without the fast path. The failures are counted
    (refresh_errors) and logged once while they last; once the store heals, the next look
    brings in what the other writer made durable meanwhile."""
    backing = os.path.join(failing.mountpoint, "b")
    os.mkdir(backing)
    opts = dict(staging_size="8M", segment_size="1M", idle_flush=0.2, fast_path=fast_path)
    b = mounts.mount(backing, writer_id="w1", **opts)
    a = mounts.mount(backing, writer_id="w0", refresh=0, **opts)
    with open(os.path.join(b.mountpoint, "theirs"), "wb") as f:
        f.write(b"t" * 5000)
    b.sync()
    with open(os.path.join(a.mountpoint, "mine"), "wb") as f:
        f.write(b"m" * 7000)
    a.sync()
    assert sorted(os.listdir(a.mountpoint)) == ["mine", "theirs"]
    failing.fail("list")
    try:
        with pytest.raises(OSError):
            os.listdir(os.path.join(failing.mountpoint, "b", "writers"))  # (it fails)
        for _ in range(3):
            with pytest.raises(FileNotFoundError):  # a LOOKUP each (nothing cached)
                os.stat(os.path.join(a.mountpoint, "nothere"))
            assert read_all(os.path.join(a.mountpoint, "mine")) == b"m" * 7000  # OPEN
            assert read_all(os.path.join(a.mountpoint, "theirs")) == b"t" * 5000
            assert sorted(os.listdir(a.mountpoint)) == ["mine", "theirs"]  # OPENDIR
        st = a.status()
        assert st["refresh_errors"] >= 3, st
        assert a.proc.poll() is None
    finally:
        failing.heal()
    with open(os.path.join(b.mountpoint, "later"), "wb") as f:
        f.write(b"l" * 3000)
    b.sync()
    assert read_all(os.path.join(a.mountpoint, "later")) == b"l" * 3000
    text = mounts.log(a)
    assert text.count("looking at other writers' changes:") == 1, text
    assert "looking at other writers' changes works again" in text, text
    assert "internal error" not in text, text


@pytest.mark.either_transport  # (the flusher and the store, below the daemon)
def test_a_failed_fdatasync_in_buffered_mode_writes_the_segments_again(failing, mounts):
    """Linux drops the pages whose writeback failed and reports that once: the store here
    loses the bytes written since the last good fsync and fails that fsync (failing_fs
    `fsync-lose`). The fsync reports EIO; the flusher writes those segments again before it
    syncs again, so that what is committed later is the bytes written, never the zeros."""
    backing = os.path.join(failing.mountpoint, "b")
    os.mkdir(backing)
    opts = dict(staging_size="8M", segment_size="1M", idle_flush=0.2, io="buffered")
    sizes = {"a": 2 * MiB + 4321, "b": 3 * MiB + 77}
    m = mounts.mount(backing, **opts)
    write_file(os.path.join(m.mountpoint, "a"), content("a", sizes["a"]), fsync=True)
    failing.fail("fsync-lose")
    fsync_fails(os.path.join(m.mountpoint, "b"), content("b", sizes["b"]))
    assert "writes lost" in failing.log_text()
    failing.heal()
    sync_until_ok(m, errno.EIO, 15, "the segments never landed after the store healed")
    m.stop()
    # (the kernel still caches what was written through failing_fs's mount: what is read
    # next comes from its source files, where the lost bytes are zeros)
    assert drop_caches()
    verify_and_remount(mounts, m, backing, opts, sizes).stop()
