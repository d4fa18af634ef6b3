"""FUSE over io_uring (--fuse-uring, fuse/ring.py): requests on the kernel's per-CPU queues,
served by the fast path's handlers, answered through the queue threads' ring entries; the same
bytes as through /dev/fuse; a clear fallback where the kernel does not offer it; a clear error
for an option it cannot work with. What the queue threads answer themselves (directory
attributes, absent names, creates) is tested on both their transports, the rings and
/dev/fuse (test_queue_threads.py: the rest of the /dev/fuse one). (The data-path tests run
on the rings as a whole with CKPTFS_TEST_FUSE_URING=1: `make test` does.)"""

from __future__ import annotations

import contextlib
import itertools
import os
import time

import pytest
from helpers import check_files, cli, status_reaches, uring_switch, wait_for, write_tree

from ckptfs.bench import drop_caches
from ckptfs.fuse import answers, ring

pytestmark = pytest.mark.timeout(240)

MiB = 1 << 20


def test_requests_are_served_on_the_rings_bit_exact(mounts):
    torch = pytest.importorskip("torch")
    with uring_switch("Y"):
        m = mounts.mount(fuse_uring=True)
        st = m.status()
        assert st["transport"] == "io_uring", mounts.log(m)
        assert st["ring_queues"] == ring.queues()
        files = write_tree(m.mountpoint)
        state = {f"layer{i}.weight": torch.randn(257, 129 + i) for i in range(20)}
        state["big"] = torch.arange(3 * MiB, dtype=torch.int32)
        path = os.path.join(m.mountpoint, "sub", "model.pt")
        torch.save(state, path)
        # namespace changes go to pyfuse3 and come back through the ring entries
        os.rename(os.path.join(m.mountpoint, "sub"), os.path.join(m.mountpoint, "moved"))
        files = {p.replace("/sub/", "/moved/"): d for p, d in files.items()}
        path = path.replace("/sub/", "/moved/")
        os.mkdir(os.path.join(m.mountpoint, "d"))
        assert os.listdir(os.path.join(m.mountpoint, "d")) == []
        # (a barrier: the sync xattr answers once everything written is durable)
        os.getxattr(m.mountpoint, "user.ckptfs.sync")
        with open(os.path.join(m.mountpoint, "moved", "s3"), "r+b") as f:
            os.fsync(f.fileno())
        check_files(files, m.mountpoint)
        back = torch.load(path)
        assert back.keys() == state.keys()
        assert all(torch.equal(back[k], state[k]) for k in state)
        st = m.status()
        # (a save's and a load's requests: nearly all of them on the rings)
        assert st["ring_requests"] > 300, st
        assert st["ring_queues_pinned"] >= 1
        assert st["writes_in_place"] > 0
        # WRITEs that landed whole on a handle open for writing, FLUSH and IOCTL: answered by
        # the queue threads
        assert st["ring_answered_in_c"] > 0
        m.stop()
    # (through /dev/fuse, every request read by the daemon's loop: the same bytes)
    m2 = mounts.mount(m.backing, fuse_uring=False, queue_threads=False)
    assert m2.status()["transport"] == "/dev/fuse"
    check_files(files, m.mountpoint, m2.mountpoint)
    back = torch.load(path.replace(m.mountpoint, m2.mountpoint))
    assert all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize("queue_threads", [True, False])
def test_without_the_kernels_switch_requests_stay_on_dev_fuse(mounts, queue_threads):
    """Without the switch a --fuse-uring mount serves /dev/fuse and says why: with the queue
    threads reading it (the default), or the daemon's loop (--no-queue-threads)."""
    with uring_switch("N"):
        m = mounts.mount(fuse_uring=True, queue_threads=queue_threads)
        with open(os.path.join(m.mountpoint, "f"), "wb") as f:
            f.write(b"x" * 5000)
        with open(os.path.join(m.mountpoint, "f"), "rb") as f:
            assert f.read() == b"x" * 5000
        st = m.status()
        if queue_threads:
            assert st["transport"] == "/dev/fuse, queue threads"
            assert st["ring_requests"] > 0
        else:
            assert st["transport"] == "/dev/fuse"
            assert "ring_requests" not in st
        log = mounts.log(m)
        assert "--fuse-uring: requests stay on /dev/fuse" in log
        assert "enable_uring is N" in log
        m.stop()


@pytest.mark.parametrize("flag", ["--fuse-uring", "--queue-threads"])
def test_queue_threads_without_the_fast_path_are_refused(tmp_path, flag):
    os.makedirs(tmp_path / "b")
    os.makedirs(tmp_path / "m")
    proc = cli("mount", flag, "--no-fast-path", "--foreground", tmp_path / "b", tmp_path / "m",
               timeout=60)
    assert proc.returncode != 0
    assert f"{flag} needs the fast path" in proc.stderr
    assert not os.listdir(tmp_path / "b")  # (nothing written)


def drop_dentries() -> None:
    """The kernel forgets the names it cached (and so asks with a LOOKUP for each again)."""
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("2")
    except PermissionError:
        pytest.skip("dropping the kernel's dentries needs root")


def on(transport: str):
    """The queue threads' transport for a test: FUSE over io_uring (the kernel's switch on for
    it) or /dev/fuse (the default)."""
    if transport == "uring":
        return uring_switch("Y"), {"fuse_uring": True}
    return contextlib.nullcontext(), {"fuse_uring": False}


@pytest.mark.parametrize("transport", ["uring", "dev"])
def test_absent_names_answered_on_the_rings_follow_every_new_name(mounts, transport):
    """LOOKUP of a name that is not there is answered by the queue threads from the names of
    the directory the trio thread left with them (a new file's open asks for its name first);
    every way a name comes into the directory reaches them before it is answered, so a name
    that exists is never answered absent."""
    switch, opts = on(transport)
    with switch:
        m = mounts.mount(refresh=30, **opts)  # (no look at other writers falls due)
        root = m.mountpoint
        d = os.path.join(root, "d")
        os.mkdir(d)
        for i in range(600):  # (past the first filter's room: it is built again, larger)
            with open(os.path.join(d, f"f{i}"), "wb") as f:
                f.write(b"x")
        assert m.status()["ring_absent_answered_in_c"] >= 500
        os.mkdir(os.path.join(root, "e"))
        open(os.path.join(root, "e", "moved"), "wb").close()
        ways = {
            "created": lambda p: open(p, "xb").close(),
            "dir": os.mkdir,
            "symlink": lambda p: os.symlink("f0", p),
            "fifo": os.mkfifo,
            "link": lambda p: os.link(os.path.join(d, "f1"), p),
            "renamed in": lambda p: os.rename(os.path.join(root, "e", "moved"), p),
            "renamed here": lambda p: os.rename(os.path.join(d, "f2"), p),
        }
        for name, make in ways.items():
            p = os.path.join(d, name)
            assert not os.path.lexists(p)
            make(p)
        drop_dentries()
        assert [n for n in ways if not os.path.lexists(os.path.join(d, n))] == []
        assert [i for i in range(3, 600) if not os.path.exists(os.path.join(d, f"f{i}"))] == []
        assert not os.path.lexists(os.path.join(d, "f2"))
        # the root's names include the control directory's
        assert not os.path.lexists(os.path.join(root, "nothing"))
        assert not os.path.lexists(os.path.join(root, "nothing else"))
        drop_dentries()
        assert os.path.isdir(os.path.join(root, ".ckptfs"))
        st = m.status()
        assert st["ring_absent_answered_in_c"] >= 510, st
        assert st["ring_creates_answered_in_c"] >= 500, st
        m.stop()


@pytest.mark.parametrize("transport", ["uring", "dev"])
def test_files_created_on_the_rings_are_the_files_the_python_side_makes(mounts, transport):
    """CREATE answered by the queue threads: the file has the mode (umask applied), owner and
    group (a set-group-ID directory's) a CREATE served by the trio thread gives, its directory
    takes the change at once, and the files, their numbers and times are in the tree (the
    trio thread made them) as the kernel was told at the create: after a remount through
    /dev/fuse too."""
    key = ("st_ino", "st_mode", "st_uid", "st_gid", "st_nlink", "st_ctime_ns")

    def told(fd: int) -> list:  # (right after the create: its answer's attributes)
        st = os.fstat(fd)
        return [getattr(st, k) for k in key]

    switch, opts = on(transport)
    with switch:
        m = mounts.mount(refresh=30, **opts)
        d = os.path.join(m.mountpoint, "d")
        os.mkdir(d)
        os.chown(d, -1, 1234)
        os.chmod(d, 0o2775)
        seen = {}
        old = os.umask(0o027)
        try:
            for i in range(60):
                with open(os.path.join(d, f"f{i}"), "wb") as f:
                    seen[f"f{i}"] = told(f.fileno())
                    f.write(bytes([i]) * (100 + i))
            fd = os.open(os.path.join(d, "ro"), os.O_CREAT | os.O_RDONLY, 0o604)
            seen["ro"] = told(fd)
            assert os.read(fd, 10) == b""
            os.close(fd)
            fd = os.open(os.path.join(d, "rw"), os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o666)
            seen["rw"] = told(fd)
            os.write(fd, b"read back")
            assert os.pread(fd, 9, 0) == b"read back"
            os.close(fd)
            with pytest.raises(FileExistsError):
                os.open(os.path.join(d, "rw"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            for i in range(5):  # (no writes: the file's times are its create's)
                with open(os.path.join(d, f"e{i}"), "wb") as f:
                    seen[f"e{i}"] = told(f.fileno())
                e = os.stat(os.path.join(d, f"e{i}"))
                assert e.st_mtime_ns == e.st_ctime_ns == e.st_atime_ns
                assert os.stat(d).st_mtime_ns == e.st_mtime_ns
        finally:
            os.umask(old)
        st = m.status()
        assert st["ring_creates_answered_in_c"] >= 50, st
        assert len({v[0] for v in seen.values()}) == 67
        for n, v in seen.items():
            want = 0o604 & ~0o027 if n == "ro" else 0o640
            assert v[1:5] == [0o100000 | want, 0, 1234, 1], n
        assert sorted(os.listdir(d)) == sorted(seen)
        dst = os.stat(d)
        m.sync()
        m.stop()
    m2 = mounts.mount(m.backing, fuse_uring=False, queue_threads=False)
    d2 = os.path.join(m2.mountpoint, "d")
    again = {n: [getattr(os.stat(os.path.join(d2, n)), k) for k in key] for n in seen}
    # (the ctime of a file written to is its last write's)
    assert {n: v[:5] for n, v in again.items()} == {n: v[:5] for n, v in seen.items()}
    unwritten = [n for n in seen if n[0] == "e" or n == "ro"]
    assert [again[n][5] for n in unwritten] == [seen[n][5] for n in unwritten]
    assert os.stat(d2).st_mtime_ns == dst.st_mtime_ns
    for i in range(60):
        with open(os.path.join(d2, f"f{i}"), "rb") as f:
            assert f.read() == bytes([i]) * (100 + i)


@pytest.mark.parametrize("transport", ["uring", "dev"])
def test_many_files_created_on_the_rings_leave_nothing_open(mounts, transport):
    """More files created, written and closed on the rings than the queue threads' writable
    set holds: every one is made, written (its WRITEs answered by the queue threads to the
    end) and let go (no handle left open, none left writable), and reads back the same."""
    n = 2500  # (the writable set holds 2048 handles)
    switch, opts = on(transport)
    with switch:
        m = mounts.mount(refresh=30, **opts)
        d = os.path.join(m.mountpoint, "d")
        os.mkdir(d)
        for i in range(n):
            with open(os.path.join(d, f"f{i}"), "wb") as f:
                f.write(i.to_bytes(4, "little") * 100)
        # (the kernel sends the last RELEASE after close() returned)
        st = wait_for(lambda: not ((s := m.status())["open_handles"]
                                   or s["ring_writable_handles"]) and s,
                      "every handle released", timeout=5)
        assert st["ring_creates_answered_in_c"] >= n - 10, st
        assert st["ring_creates_not_made"] == 0
        last = st["ring_answered_in_c"]
        for i in range(100):  # (still answered by the queue threads: none of them leaked)
            with open(os.path.join(d, f"g{i}"), "wb") as f:
                f.write(b"x" * 1000)
        assert m.status()["ring_answered_in_c"] - last >= 100 * 6
        m.stop()
    m2 = mounts.mount(m.backing, fuse_uring=False, queue_threads=False)
    d2 = os.path.join(m2.mountpoint, "d")
    assert len(os.listdir(d2)) == n + 100
    for i in range(0, n, 7):
        with open(os.path.join(d2, f"f{i}"), "rb") as f:
            assert f.read() == i.to_bytes(4, "little") * 100


@pytest.mark.parametrize("transport", ["uring", "dev"])
def test_absent_names_on_the_rings_keep_the_refresh_contract(mounts, transport):
    """A name another writer made durable is found within --refresh, also when the queue
    threads answered the lookups of it absent before: they answer only while no look at the
    other writers is due. (In the root, whose entry the kernel never asks for again, while the
    mount is idle: no other request makes a look.)"""
    switch, opts = on(transport)
    with switch:
        backing = mounts.backing()
        a = mounts.mount(backing, writer_id="w0", refresh=1.0, **opts)
        for i in range(50):
            open(os.path.join(a.mountpoint, f"f{i}"), "wb").close()
        assert a.status()["ring_absent_answered_in_c"] >= 40
        a.sync()
        pauses = a.status()["refresh_idle_pauses"]  # (a's background look stops: nothing
        status_reaches(a, "refresh_idle_pauses", pauses + 1)  # open, nobody asked)
        b = mounts.mount(backing, writer_id="w1", fuse_uring=False, queue_threads=False)
        with open(os.path.join(b.mountpoint, "x"), "wb") as f:
            f.write(b"from b")
        b.sync()
        wait_for(lambda: os.path.exists(os.path.join(a.mountpoint, "x")),
                 "another writer's file", timeout=1.0 + 4.0, step=0.01)
        with open(os.path.join(a.mountpoint, "x"), "rb") as f:
            assert f.read() == b"from b"
        # (the names the queue threads held before the look went with it)
        assert not os.path.exists(os.path.join(a.mountpoint, "y"))
        drop_dentries()
        assert os.path.exists(os.path.join(a.mountpoint, "x"))


@pytest.mark.parametrize("transport", ["uring", "dev"])
def test_name_filters_on_the_rings_outlive_other_writers_changes_where_they_can(mounts,
                                                                                 transport):
    """A look that brings other writers' changes drops the names the queue threads hold only
    of directories another writer's directory is merged into (the others' names change only
    by this writer's records): they are built again there, not in this writer's own ones.
    A directory that a look merges into loses them, so a name another writer made there is
    found, also right after a lookup answered from the names of the other directories."""
    switch, opts = on(transport)
    with switch:
        backing = mounts.backing()
        a = mounts.mount(backing, writer_id="w0", refresh=0.3, **opts)
        # (b looks at a's changes at most every 30 s: it never sees a's "own", in which it
        # makes its own "own" below)
        b = mounts.mount(backing, writer_id="w1", fuse_uring=False, queue_threads=False,
                         refresh=30)
        am, bm = a.mountpoint, b.mountpoint
        # "shared": a's own directory, into which b's merges (a look brings it below)
        os.mkdir(os.path.join(am, "shared"))
        os.mkdir(os.path.join(bm, "shared"))
        b.sync()
        # (a listing looks, once refresh is due)
        wait_for(lambda: os.listdir(os.path.join(am, "shared")) is not None
                 and a.status()["writers_joined"], "another writer's changes",
                 timeout=0.3 + 4.0, step=0.02)
        os.mkdir(os.path.join(am, "own"))

        def make(d: str, n: int, tag: str) -> None:
            for i in range(n):
                open(os.path.join(am, d, f"{tag}{i}"), "wb").close()

        make("own", 20, "a")
        make("shared", 20, "a")  # (merged: w1 has it too)
        s0 = a.status()
        assert s0["ring_creates_answered_in_c"] >= 30, s0
        with open(os.path.join(bm, "shared", "from_b"), "wb") as f:
            f.write(b"b")
        os.mkdir(os.path.join(bm, "elsewhere"))
        b.sync()
        wait_for(lambda: os.path.exists(os.path.join(am, "shared", "from_b")),
                 "another writer's file", timeout=0.3 + 4.0, step=0.02)
        built = a.status()["ring_name_filters_built"]
        make("own", 20, "b")  # (own's names outlived the look)
        s1 = a.status()
        assert s1["ring_name_filters_built"] == built, (built, s1)
        assert s1["ring_creates_answered_in_c"] - s0["ring_creates_answered_in_c"] >= 15, s1
        make("shared", 20, "b")  # (shared's went with it: built once more)
        assert a.status()["ring_name_filters_built"] == built + 1
        # another writer's directory merges into own: its names go with the look that
        # brings it, though a lookup answered from the other directories' names comes first
        intruder = os.path.join(am, "own", "intruder")
        assert not os.path.exists(intruder)
        try:
            os.mkdir(os.path.join(bm, "own"))
        except FileExistsError:
            # (b's sync above also looked at a, and a's idle commit of "own" may have come
            # before it: b then shows a's "own", and the file below makes b's own copy of it)
            pass
        with open(os.path.join(bm, "own", "intruder"), "wb") as f:
            f.write(b"b")
        b.sync()
        probes = itertools.count(1)

        def shown() -> bool:
            assert not os.path.exists(os.path.join(am, "shared", f"probe{next(probes)}"))
            return os.path.exists(intruder)

        wait_for(shown, "another writer's file", timeout=0.3 + 4.0, step=0.02)
        with open(intruder, "rb") as f:
            assert f.read() == b"b"
        drop_dentries()
        names = {f"{t}{i}" for t in "ab" for i in range(20)}
        assert set(os.listdir(os.path.join(am, "own"))) == names | {"intruder"}
        assert set(os.listdir(os.path.join(am, "shared"))) == names | {"from_b"}
        assert all(os.path.exists(os.path.join(am, d, n)) for d in ("own", "shared")
                   for n in names)
        assert a.status()["ring_creates_not_made"] == 0


@pytest.mark.parametrize("transport", ["uring", "dev"])
def test_directory_attributes_answered_on_the_rings_follow_every_change(mounts, transport):
    """GETATTR of a directory is answered by the queue threads from what the trio thread left
    with them (after a CREATE in it, after a GETATTR it answered); every change of a directory
    takes them back, so stat() of a directory shows each change, as through /dev/fuse."""
    switch, opts = on(transport)
    with switch:
        m = mounts.mount(**opts)
        d = os.path.join(m.mountpoint, "d")
        os.mkdir(d)
        times = []
        for i in range(20):  # a small file's save: the kernel asks for d's attributes each time
            with open(os.path.join(d, f"f{i}"), "wb") as f:
                f.write(b"x" * 100)
            times.append(os.stat(d).st_mtime_ns)
        assert times == sorted(times) and len(set(times)) == len(times)
        assert m.status()["ring_attrs_answered_in_c"] >= 20

        def changed(what, *args) -> os.stat_result:
            before = os.stat(d)
            what(*args)
            after = os.stat(d)
            assert after.st_mtime_ns > before.st_mtime_ns, what
            return after

        assert changed(os.mkdir, os.path.join(d, "sub")).st_nlink == 3
        changed(os.unlink, os.path.join(d, "f0"))
        sub0 = os.stat(os.path.join(d, "sub")).st_mtime_ns
        changed(os.rename, os.path.join(d, "f1"), os.path.join(d, "sub", "f1"))
        assert os.stat(os.path.join(d, "sub")).st_mtime_ns > sub0
        os.link(os.path.join(d, "f2"), os.path.join(d, "sub", "f2"))
        os.chmod(d, 0o700)
        assert os.stat(d).st_mode & 0o7777 == 0o700
        os.utime(d, ns=(10**9, 2 * 10**9))
        assert os.stat(d).st_mtime_ns == 2 * 10**9
        with open(os.path.join(d, "g"), "wb"):
            pass
        assert os.stat(d).st_mtime_ns > 2 * 10**9
        os.unlink(os.path.join(d, "sub", "f1"))
        os.unlink(os.path.join(d, "sub", "f2"))
        assert changed(os.rmdir, os.path.join(d, "sub")).st_nlink == 2
        # (the same through /dev/fuse after a remount: what the rings answered was the tree's)
        want = {n: os.stat(os.path.join(d, n)).st_size for n in os.listdir(d)}
        dst = os.stat(d)
        m.stop()
    m2 = mounts.mount(m.backing, fuse_uring=False, queue_threads=False)
    d2 = os.path.join(m2.mountpoint, "d")
    assert {n: os.stat(os.path.join(d2, n)).st_size for n in os.listdir(d2)} == want
    assert (os.stat(d2).st_mtime_ns, os.stat(d2).st_nlink) == (dst.st_mtime_ns, dst.st_nlink)


@pytest.mark.parametrize("transport", ["uring", "dev"])
def test_reads_answered_from_read_windows_follow_every_change_of_the_file(mounts, transport):
    """A handle that reads a file alone gets its READs answered by the queue threads from the
    read cache (its read window); a handle that can write, a write, a truncate take the window
    back before anything changes, so no READ sees bytes the file no longer has."""
    torch = pytest.importorskip("torch")
    switch, opts = on(transport)
    with switch:
        m = mounts.mount(**opts)
        p = os.path.join(m.mountpoint, "big")
        data = bytearray(os.urandom(24 * MiB))  # (more than one window: opened again on)
        with open(p, "wb") as f:
            f.write(data)
        state = {f"t{i}": torch.rand(1 + 997 * i) for i in range(50)}
        for k, v in state.items():
            torch.save(v, os.path.join(m.mountpoint, f"{k}.pt"))
        m.sync()
        m.stop()
        m = mounts.mount(m.backing, **opts)  # (an empty read cache: read from the logs)
        p = os.path.join(m.mountpoint, "big")

        def in_c() -> int:
            return m.status()["ring_reads_answered_in_c"]

        for k, v in state.items():
            assert torch.equal(torch.load(os.path.join(m.mountpoint, f"{k}.pt")), v)
        assert in_c() >= 40
        st0 = m.status()
        with open(p, "rb") as f:
            assert f.read() == data
        st = m.status()
        assert in_c() >= 50
        # (each READ counted, its bytes once: those answered from windows are accounted for a
        # window's worth at a time)
        assert st["bytes_read"] - st0["bytes_read"] == len(data), (st0, st)
        assert (st["read_requests"] - st0["read_requests"]
                == st["reads_direct"] - st0["reads_direct"] >= len(data) // MiB), (st0, st)
        with open(p, "rb", buffering=0) as fa:
            assert fa.read(MiB) == data[:MiB]
            n = in_c()
            assert fa.read(MiB) == data[MiB:2 * MiB]
            assert in_c() > n  # (from the window)
            with open(p, "r+b") as fb:  # (a handle that can write: the window is taken back)
                fb.seek(4 * MiB)
                fb.write(b"N" * 4096)
            data[4 * MiB:4 * MiB + 4096] = b"N" * 4096
            fa.seek(4 * MiB)
            assert fa.read(8192) == data[4 * MiB:4 * MiB + 8192]
            fa.seek(0)
            assert fa.read(MiB) == data[:MiB]
            n = in_c()
            assert fa.read(MiB) == data[MiB:2 * MiB]
            assert in_c() > n  # (a window again)
            os.truncate(p, 3 * MiB)  # (down and up again: zeros from 3 MiB on)
            os.truncate(p, 24 * MiB)
            data[3 * MiB:] = bytes(21 * MiB)
            fa.seek(2 * MiB)
            assert fa.read(4 * MiB) == data[2 * MiB:6 * MiB]
            fa.seek(0)
            assert fa.read() == data
        st = m.status()
        assert st["ring_error"] == "", st
        m.stop()
    m2 = mounts.mount(m.backing, fuse_uring=False, queue_threads=False)
    check_files({p: bytes(data)}, m.mountpoint, m2.mountpoint)


def _remounted(mounts, opts: dict, sizes: dict[str, int]):
    """Files of these sizes (random bytes) written through a mount, then a fresh mount of
    them (an empty read cache: read from the logs): (the mount, name -> bytes). No look at
    other writers falls due on it (answers prepared for the queue threads are not used once
    one is due: the tests count the ones used)."""
    m = mounts.mount(**opts)
    data = {n: os.urandom(k) for n, k in sizes.items()}
    for n, d in data.items():
        with open(os.path.join(m.mountpoint, n), "wb") as f:
            f.write(d)
    m.stop()
    return mounts.mount(m.backing, refresh=30, **opts), data


@pytest.mark.parametrize("transport", ["uring", "dev"])
def test_opens_answered_from_prepared_windows_follow_every_change_of_the_file(mounts, transport):
    """A LOOKUP that finds a file whose bytes are in the read cache prepares its next
    read-only OPEN, which the queue threads then answer with a window over those bytes; a
    handle that can write, a truncate, an O_TRUNC open between the LOOKUP and the OPEN take
    the prepared window back, so no OPEN is answered with bytes the file no longer has; a
    LOOKUP followed by no open (stat) leaves at most PREPARED_MAX of them."""
    switch, opts = on(transport)
    with switch:
        names = [f"f{i}" for i in range(40)]
        m, data = _remounted(mounts, opts, {n: 1 + 997 * i for i, n in enumerate(names)})

        def read(n: str) -> bytes:
            with open(os.path.join(m.mountpoint, n), "rb") as f:
                return f.read()

        def opens() -> int:
            return m.status()["ring_opens_answered_in_c"]

        def forget() -> None:  # (the kernel's dentries go: every open asks LOOKUP again)
            assert drop_caches(2)

        for n in names:  # (every chunk in the read cache, every run checked)
            assert read(n) == data[n]
        forget()
        for n in names:
            assert read(n) == data[n]
        assert opens() >= len(names) // 2
        forget()
        a, b, c, e = names[1:5]
        n0 = opens()
        os.stat(os.path.join(m.mountpoint, a))  # (LOOKUP: prepared)
        assert read(a) == data[a]
        assert opens() == n0 + 1
        os.stat(os.path.join(m.mountpoint, b))
        with open(os.path.join(m.mountpoint, b), "r+b") as f:  # (a handle that can write)
            f.write(b"X" * 10)
        data[b] = b"X" * 10 + data[b][10:]
        assert read(b) == data[b]
        os.stat(os.path.join(m.mountpoint, c))
        os.truncate(os.path.join(m.mountpoint, c), 5)
        data[c] = data[c][:5]
        assert read(c) == data[c]
        os.stat(os.path.join(m.mountpoint, e))
        with open(os.path.join(m.mountpoint, e), "wb") as f:  # (O_WRONLY | O_TRUNC)
            f.write(b"new")
        data[e] = b"new"
        assert read(e) == data[e]
        assert opens() == n0 + 1  # (none of those from the window prepared before)
        forget()
        for n in names:  # (ls -l: LOOKUPs and no open)
            os.stat(os.path.join(m.mountpoint, n))
        st = m.status()
        assert 0 < st["ring_windows_prepared"] <= answers.PREPARED_MAX, st
        assert st["ring_read_windows"] <= answers.PREPARED_MAX, st
        time.sleep(answers.PREPARED_TTL_S + 0.1)  # (no OPEN came: they go, chunks let go)
        st = m.status()
        assert st["ring_windows_prepared"] == st["ring_read_windows"] == 0, st
        forget()
        for n in names:
            assert read(n) == data[n]
        st = m.status()
        assert st["ring_opens_not_made"] == 0 and st["ring_error"] == "", st
        m.stop()
    m2 = mounts.mount(m.backing, fuse_uring=False, queue_threads=False)
    check_files(data, m.mountpoint, m2.mountpoint)


@pytest.mark.parametrize("transport", ["uring", "dev"])
def test_a_lookup_served_by_the_python_side_takes_back_its_prepared_answer(mounts, transport):
    """A LOOKUP that comes to the trio thread while an answer prepared for its name stands
    (a reader quicker than the preparation, or, as here, a look at other writers due, when
    the queue threads answer none) takes that answer back: left standing, it would answer
    the name's next LOOKUP in C without the OPEN prepared with it, whose window went with
    the file's OPEN, so that OPEN would come to the trio thread."""
    switch, opts = on(transport)
    with switch:
        names = [f"f{i}" for i in range(8)]
        m = mounts.mount(**opts)
        data = {n: os.urandom(1000 + 77 * i) for i, n in enumerate(names)}
        for n, d in data.items():
            with open(os.path.join(m.mountpoint, n), "wb") as f:
                f.write(d)
        m.stop()
        m = mounts.mount(m.backing, **opts)  # (--refresh 1)

        def read(n: str) -> bytes:
            with open(os.path.join(m.mountpoint, n), "rb") as f:
                return f.read()

        def counts() -> tuple[int, int]:
            st = m.status()
            return st["ring_opens_answered_in_c"], st["ring_lookups_answered_in_c"]

        for n in names:  # (every chunk in the read cache)
            assert read(n) == data[n]
        assert drop_caches(2)
        assert read("f0") == data["f0"]  # (its LOOKUP here: the answers for f1.. prepared)
        assert m.status()["ring_lookups_prepared"] >= 1
        # (the background look f0's LOOKUP asked for came within a second, none since: a
        # look is due, which the next LOOKUP makes first; the queue threads answer none till
        # then, and after it no deadline falls within the next second)
        time.sleep(2.5)
        o0, l0 = counts()
        os.stat(os.path.join(m.mountpoint, "f1"))  # (here: a look, f1's OPEN prepared)
        assert read("f1") == data["f1"]
        o1, l1 = counts()
        assert (o1, l1) == (o0 + 1, l0)
        assert drop_caches(2)  # (the kernel lets f1's entry go: its next open asks again)
        # (a look due again, which the LOOKUP makes first: the OPEN after it then falls
        # within the second that follows, however long drop_caches took under load)
        time.sleep(1.5)
        os.stat(os.path.join(m.mountpoint, "f1"))
        assert read("f1") == data["f1"]
        # (its LOOKUP came here again, which prepared its OPEN: the answer standing from
        # before would have answered it in C, and the OPEN would have come here)
        assert counts() == (o1 + 1, l1)
        st = m.status()
        assert st["ring_opens_not_made"] == 0 and st["ring_error"] == "", st
        m.stop()


@pytest.mark.parametrize("transport", ["uring", "dev"])
def test_lookups_answered_from_prepared_answers_follow_every_change(mounts, transport):
    """A LOOKUP that finds a file prepares the answers to LOOKUPs of the names after it (in
    the directory's creation order), which the queue threads then answer; a change to one of
    those files through a name the kernel already holds (a chmod, truncate, write, rename,
    utime) takes them back, so no later LOOKUP is answered with what the file no longer is."""
    switch, opts = on(transport)
    with switch:
        names = [f"f{i:02d}" for i in range(30)]
        m, data = _remounted(mounts, opts, {n: 100 + 37 * i for i, n in enumerate(names)})

        def p(n: str) -> str:
            return os.path.join(m.mountpoint, n)

        def read(n: str) -> bytes:
            with open(p(n), "rb") as f:
                return f.read()

        def forget() -> None:  # (the kernel's dentries go: every name is asked for again)
            assert drop_caches(2)

        def append(q: str) -> None:
            with open(q, "r+b") as f:
                f.seek(0, os.SEEK_END)
                f.write(b"more")

        for n in names:
            assert read(n) == data[n]
        forget()
        for n in names:
            assert read(n) == data[n]
        assert m.status()["ring_lookups_answered_in_c"] >= len(names) // 2
        changes = {
            "f11": (lambda q: os.chmod(q, 0o600),
                    lambda: os.stat(p("f11")).st_mode & 0o777 == 0o600),
            "f12": (lambda q: os.truncate(q, 7), lambda: os.stat(p("f12")).st_size == 7),
            "f13": (append, lambda: os.stat(p("f13")).st_size == len(data["f13"]) + 4),
            "f14": (lambda q: os.rename(q, p("g14")), lambda: not os.path.exists(p("f14"))),
            "f16": (lambda q: os.utime(q, ns=(1_000_000_000, 2_000_000_000)),
                    lambda: os.stat(p("f16")).st_mtime_ns == 2_000_000_000)}
        for name, (change, changed) in changes.items():
            forget()
            os.stat(p(name))  # (the kernel holds this name: the change does not ask for it)
            os.stat(p(names[names.index(name) - 1]))  # (this name's answer prepared)
            change(p(name))
            forget()
            assert changed(), name  # (asked for again: not from an answer prepared before)
        assert os.stat(p("g14")).st_size == len(data["f14"])
        st = m.status()
        assert st["ring_error"] == "", st
        m.stop()


def test_lookups_prepared_in_several_directories_read_in_turn(mounts):
    """A checkpoint is often loaded one file from each of several directories in turn (a
    model's tensors, then each optimizer state's): the names prepared ahead in each stand
    while the others are read, so the queue threads answer most of the LOOKUPs and OPENs."""
    dirs, per = [f"d{k}" for k in range(6)], 16
    m = mounts.mount()
    data = {}
    for d in dirs:
        os.mkdir(os.path.join(m.mountpoint, d))
    for i in range(per):
        for d in dirs:
            n = f"{d}/f{i:02d}"
            data[n] = os.urandom(100 + 53 * i)
            with open(os.path.join(m.mountpoint, n), "wb") as f:
                f.write(data[n])
    m.stop()
    m = mounts.mount(m.backing, refresh=30)  # (no look at other writers falls due)

    def read_all() -> None:
        for n, d in data.items():  # (in turn: one file of each directory)
            with open(os.path.join(m.mountpoint, n), "rb") as f:
                assert f.read() == d

    read_all()  # (every chunk in the read cache)
    assert drop_caches(2)
    st0 = m.status()
    read_all()
    st = m.status()
    files = len(data)
    assert st["ring_lookups_answered_in_c"] - st0["ring_lookups_answered_in_c"] >= files // 2, st
    assert st["ring_opens_answered_in_c"] - st0["ring_opens_answered_in_c"] >= files // 2, st
    assert st["ring_error"] == "" and st["ring_opens_not_made"] == 0, st


@pytest.mark.parametrize("transport", ["uring", "dev"])
def test_read_windows_follow_a_copy_up_of_another_writers_file(mounts, transport):
    """Another writer's file that this writer truncates is copied up first (a new extent map);
    a read window over the old one is taken back, so the zeros past the cut are read, not the
    bytes that were there."""
    switch, opts = on(transport)
    with switch:
        backing = mounts.backing()
        b = mounts.mount(backing, writer_id="w1", fuse_uring=False, queue_threads=False)
        data = bytearray(os.urandom(6 * MiB))
        with open(os.path.join(b.mountpoint, "theirs"), "wb") as f:
            f.write(data)
        b.stop()
        a = mounts.mount(backing, writer_id="w0", **opts)
        p = os.path.join(a.mountpoint, "theirs")
        with open(p, "rb") as f:  # (every chunk in the read cache: the window spans them)
            assert f.read() == data
        with open(p, "rb", buffering=0) as fa:
            assert fa.read(MiB) == data[:MiB]
            n = a.status()["ring_reads_answered_in_c"]
            assert fa.read(MiB) == data[MiB:2 * MiB]
            assert a.status()["ring_reads_answered_in_c"] > n  # (from the window)
            os.truncate(p, 3 * MiB)  # (a copy-up, then down and up again)
            os.truncate(p, 6 * MiB)
            data[3 * MiB:] = bytes(3 * MiB)
            fa.seek(2 * MiB)
            assert fa.read(4 * MiB) == data[2 * MiB:]
        a.stop()
