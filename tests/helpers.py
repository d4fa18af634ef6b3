"""The helpers every test module shares (test modules import this, never each other): the CLI,
deterministic file contents, waits on the daemon's figures, tree snapshots and checks, other
users, daemon memory figures; the view of many writers without a mount; the crash writer and
its journal (test_crash, test_lifecycle and the GlusterFS tests); the many-writer and torch
checkpoint layouts and the live-writer scenarios run over a local disk and over GlusterFS;
the mount scripts' environment."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import warnings
from typing import TYPE_CHECKING

import pytest

from ckptfs import api
from ckptfs.fuse import ring

# (torch and the benchmark's modules are imported by the functions that use them: processes
# a test spawns import this module, and torch would take seconds of their start)
if TYPE_CHECKING:
    from ckptfs.bench.scaling import Writer

KiB, MiB = 1 << 10, 1 << 20
CLI = [sys.executable, "-m", "ckptfs"]
NOBODY = 65534
# every mount of the tests on FUSE over io_uring (conftest.py)
FUSE_URING = os.environ.get("CKPTFS_TEST_FUSE_URING") == "1"


def cli(*args, timeout: float = 120, check: bool = False, **kw) -> subprocess.CompletedProcess:
    """Run `ckptfs ARGS...`; text output captured. `check`: fail unless it exits 0."""
    r = subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True,
                       timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"ckptfs {args} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def flip_byte(path: str, at: int, mask: int = 0xFF) -> None:
    """Byte `at` of file `path` changed in place (XOR `mask`): a bad sector, bit rot."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))


def content(name: str, size: int) -> bytes:
    """Deterministic bytes of a file called `name`: pseudo-random (seeded by the name, never
    periodic, so misplaced, stale or foreign bytes are detected), with the name and offset
    stamped every 64 KiB for readable failure messages."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    out = bytearray(random.Random(seed).randbytes(size))
    for off in range(0, size, 64 * KiB):
        head = f"{name}@{off}|".encode()[:size - off]
        out[off:off + len(head)] = head
    return bytes(out)


def first_mismatch(got: bytes, want: bytes) -> int:
    """Offset of the first differing byte (or -1 when equal)."""
    n = min(len(got), len(want))
    if got[:n] == want[:n]:
        return -1 if len(got) == len(want) else n
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if got[lo:mid] != want[lo:mid]:
            hi = mid
        else:
            lo = mid
    return lo


def tree_snapshot(root: str) -> dict:
    """{relative path: (type, mode, size, mtime_ns)} of everything under `root` (and root)."""
    out = {}
    if not os.path.lexists(root):
        return out
    st = os.lstat(root)
    out["."] = ("d" if os.path.isdir(root) else "f", st.st_mode, st.st_size, st.st_mtime_ns)
    if not os.path.isdir(root):
        return out
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = ("d" if os.path.isdir(p) else "f", st.st_mode,
                                             st.st_size, st.st_mtime_ns)
    return out


def walk_fds(root: str, reads: dict[bytes, list[tuple[int, int]]]) -> tuple[dict, dict]:
    """Every entry under `root`, without recursion and through directory descriptors (paths
    may be longer than PATH_MAX): {relative path: its lstat fields}, and the bytes of
    `reads` (path -> [(offset, length)]) read where the walk passes."""
    snap, got = {}, {}
    queue = [(b"", os.open(root, os.O_RDONLY | os.O_DIRECTORY))]
    while queue:
        rel, dfd = queue.pop()
        try:
            for name in os.listdir(dfd):
                name = os.fsencode(name)
                path = rel + b"/" + name if rel else name
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                snap[path] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_nlink,
                              st.st_rdev, st.st_ino, st.st_atime_ns, st.st_mtime_ns,
                              st.st_ctime_ns,
                              os.readlink(name, dir_fd=dfd) if stat.S_ISLNK(st.st_mode) else b"")
                if stat.S_ISDIR(st.st_mode):
                    queue.append((path, os.open(name, os.O_RDONLY | os.O_DIRECTORY |
                                                os.O_NOFOLLOW, dir_fd=dfd)))
                elif path in reads:
                    fd = os.open(name, os.O_RDONLY, dir_fd=dfd)
                    try:
                        got[path] = [os.pread(fd, n, off) for off, n in reads[path]]
                    finally:
                        os.close(fd)
        finally:
            os.close(dfd)
    return snap, got


def as_user(argv: list[str], uid: int = NOBODY, gid: int = NOBODY, timeout: float = 60,
            **kw) -> subprocess.CompletedProcess:
    """Run argv as another user (no supplementary groups)."""
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
                          + argv, capture_output=True, text=True, timeout=timeout, **kw)


def py_as_user(code: str, uid: int = NOBODY, gid: int = NOBODY, umask: int = 0o022):
    """Run a snippet of Python (system interpreter, no ckptfs import) as another user; the
    snippet sets `R` (a JSON-able object), or fills it in (a dict at first), which is
    returned."""
    prog = (f"import os, json, errno, stat\nos.umask({umask})\nR = {{}}\n{code}\n"
            "print(json.dumps(R))\n")
    py = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    res = as_user([py, "-c", prog], uid, gid)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def loopback_only(script: str, *unshare: str) -> list[str]:
    """The command that runs the shell `script` (under `set -e`) in a network namespace of its
    own whose only interface is the loopback, up: it reaches nothing off the machine, and none
    of the machine's sockets (a glusterd listening on 127.0.0.1:24007 is not there). `unshare`:
    more options of unshare(1), e.g. a mount namespace too. Skips the test where root, unshare
    or ip is missing."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        pytest.skip("needs root, unshare and ip (a network namespace with loopback only)")
    return ["unshare", "--net", *unshare, "sh", "-c", f"set -e; ip link set lo up; {script}"]


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM ... of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k.startswith("Vm") or k.startswith("Rss"):
                parts = v.split()
                if parts and parts[0].isdigit():
                    out[k] = int(parts[0]) * 1024
    return out


def wait_unmounted(path: str, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not api.is_mounted(path):
            return True
        time.sleep(0.05)
    return False


def wait_for(cond, what: str = "the condition", timeout: float = 20.0, step: float = 0.05):
    """cond()'s value once it is true (polled every `step` seconds); fails after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out ({timeout:.1f} s) waiting for {what}"
        time.sleep(step)


def status_reaches(m, key: str, least: int, timeout: float = 30.0) -> int:
    """Mount m's status figure `key` once it is at least `least` (the daemon's background
    work moves it); fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (now := m.status()[key]) < least:
        assert time.monotonic() < deadline, f"{key} stayed at {now}, below {least}"
        time.sleep(0.05)
    return now


def read_all(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def read_uncached(path: str) -> bytes:
    """The whole file, after dropping its page-cache pages (the read reaches the daemon)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        chunks = []
        while True:
            b = os.read(fd, MiB)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    finally:
        os.close(fd)


def check_files(files: dict[str, bytes], root: str, new_root: str | None = None,
                absent: tuple[str, ...] = ()) -> None:
    """Every file of `files` reads back the same under new_root (under root itself when None),
    and nothing named in `absent` is there. The keys and the names in `absent` are paths under
    root or names relative to it: a file saved through one mount is looked for at the same
    place under another."""
    new_root = root if new_root is None else new_root

    def there(key: str) -> str:
        return os.path.join(new_root, os.path.relpath(os.path.join(root, key), root))

    for key, data in files.items():
        got = read_all(there(key))
        assert got == data, (f"{key}: {len(got)} bytes read back, {len(data)} written, first "
                             f"difference at {first_mismatch(got, data)}")
    for key in absent:
        assert not os.path.lexists(there(key)), f"{key} should not be there"


def set_uring_switch(value: str) -> tuple[str | None, str | None]:
    """Sets the kernel's FUSE over io_uring switch to `value`: (the value it had, None), or
    (None, why it cannot be set or used) where the kernel has none, io_uring is off or /sys
    cannot be written."""
    try:
        with open(ring.ENABLE_URING) as f:
            was = f.read().strip()
    except OSError:
        return None, "this kernel has no FUSE over io_uring"
    if value == "Y":  # (io_uring itself may be off here: a sysctl, seccomp, a stub build)
        from ckptfs.io.uring import ffi, lib
        if lib is None or not lib.ck_have_uring():
            return None, "ckptfs was built without io_uring"
        err, features = ffi.new("int *"), ffi.new("unsigned int *")
        r = lib.ck_ring_open(1, err, features)
        if r == ffi.NULL:
            return None, f"io_uring is not usable here: {os.strerror(err[0])}"
        lib.ck_ring_close(r)
    try:
        with open(ring.ENABLE_URING, "w") as f:
            f.write(value)
    except OSError as exc:
        return None, f"cannot set {ring.ENABLE_URING}: {exc}"
    return was, None


@contextlib.contextmanager
def uring_switch(value: str = "Y"):
    """The kernel's FUSE over io_uring switch set to `value` for the block, then put back.
    Skips the test where the kernel has none or it cannot be written."""
    was, why = set_uring_switch(value)
    if why:
        pytest.skip(why)
    try:
        yield
    finally:
        set_uring_switch(was)


def write_file(path: str, data: bytes, fsync: bool = False, chunk: int | None = MiB) -> None:
    """`data` into `path` (created or truncated), in write calls of `chunk` bytes (None:
    all of it in one)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    chunk = chunk or max(1, len(data))
    try:
        off = 0
        while off < len(data):
            off += os.write(fd, data[off:off + chunk])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_fails(path: str, data: bytes, err: int = errno.EIO) -> None:
    """`data` written into `path` (created), whose fsync must fail with `err` (a failing
    store, a failed mount); the close may report it again (as NFS's does), nothing else."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        with pytest.raises(OSError) as e:
            os.fsync(fd)
        assert e.value.errno == err
    finally:
        try:
            os.close(fd)
        except OSError as exc:
            assert exc.errno == err


def dump_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)


def sync_until_ok(m, err: int, seconds: float, why: str) -> None:
    """`m.sync()` until it succeeds; meanwhile it may only fail with errno `err` (the store's
    error the flusher is retrying past), for at most `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            m.sync()
            return
        except OSError as exc:
            assert exc.errno == err, exc
            assert time.monotonic() < deadline, why
            time.sleep(0.3)


def verify_and_remount(mounts, m, backing: str, opts: dict, files: dict[str, int]):
    """Unmount `m`, check every checksum offline (`ckptfs verify`), remount and compare each
    file with its `content()`. Returns the new (still mounted) Mount."""
    m.stop()
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr
    m = mounts.mount(backing, **opts)
    for name, size in files.items():
        assert read_all(os.path.join(m.mountpoint, name)) == content(name, size), name
    return m


def committed_bytes(backing: str, path: str) -> int:
    """The bytes of file `path` from its start that the index in `backing` commits (read
    from the backing directory, not through a mount, which would be a request; a mount may be
    appending to the index): what a daemon killed now would keep. -1: no such file yet."""
    from ckptfs.format.records import FormatError
    from ckptfs.tools.snapshot import Snapshot

    try:
        x = Snapshot(backing).lookup(path)
    except (OSError, FormatError):
        return -1
    n = 0
    for s, k, _, _ in (x.emap.find(0, x.size) if x.emap is not None else ()):
        if s != n:
            break
        n += k
    return n


def damage_run(backing: str, path: str, which: int) -> object:
    """Flip a bit in the middle of the `which`-th run of virtual file `path` in its data log
    (an unmounted backing directory); the run."""
    from ckptfs.format import backingdir
    from ckptfs.tools.snapshot import Snapshot

    snap = Snapshot(backing)
    run = snap.lookup(path).emap.runs()[which]
    with open(os.path.join(snap.writer_dir, backingdir.data_log_name(run.log)), "r+b") as f:
        f.seek(run.loff + run.length // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    return run


# ---------------------------------------------------------------- trees of files
def seeded_bytes(n: int, seed: int) -> bytes:

    return random.Random(seed).randbytes(n)


def write_tree(root: str) -> dict[str, bytes]:
    """Big files in 1 MiB writes and odd-sized pieces, small files, a subdirectory."""
    files = {}
    os.makedirs(os.path.join(root, "sub"), exist_ok=True)
    for i in range(3):
        p = os.path.join(root, f"big{i}")
        data = seeded_bytes(9 * MiB + 4097 * i, i)
        with open(p, "wb", buffering=0) as f:
            pos = 0
            for k in (MiB, 123_457, 5, 2 * MiB, 777):
                while pos < len(data):
                    pos += f.write(data[pos:pos + k])
                    break
            while pos < len(data):
                pos += f.write(data[pos:pos + MiB])
        files[p] = data
    for i in range(50):
        p = os.path.join(root, "sub", f"s{i}")
        data = seeded_bytes(10 + 997 * i, 100 + i)
        with open(p, "wb") as f:
            f.write(data)
        files[p] = data
    return files


def md5_tree(root):

    out = {}
    for dp, _, fns in os.walk(root):
        for fn in fns:
            p = os.path.join(dp, fn)
            if os.path.islink(p):
                out[os.path.relpath(p, root)] = "->" + os.readlink(p)
            else:
                with open(p, "rb") as f:
                    out[os.path.relpath(p, root)] = hashlib.md5(f.read()).hexdigest()
    return out


# ---------------------------------------------------------------- the view, without a mount
def view_shape(view) -> dict:
    """A view (view.View) as nested dicts: a file is (its writer, its number there), a
    directory the dict of what is in it."""
    from ckptfs.namespace import ROOT_INO
    from ckptfs.view import MASK

    ns = view.ns

    def walk(d) -> dict:
        out = {}
        for name, ino in d.children.items():
            x = ns.inodes[ino]
            out[name] = walk(x) if x.is_dir else (view.union.writer_of(x.layer), x.ino & MASK)
        return out
    return walk(ns.inodes[ROOT_INO])


def two_writers(tmp_path):
    """Two empty writers w1, w2 of a fresh backing directory, read by a mount of neither:
    (peers.Peers, layer of w1, layer of w2)."""
    from ckptfs.format import backingdir, records
    from ckptfs.namespace import Namespace
    from ckptfs.peers import Peers
    from ckptfs.view import Union

    backing = str(tmp_path / "backing")
    dirs = {w: os.path.join(backing, backingdir.WRITERS_DIR, w) for w in ("w1", "w2")}
    for d in dirs.values():
        os.makedirs(d)
    peers = Peers(Namespace(now_ns=0), Union(), backing, None)
    l1, l2 = (peers.add_tree(dirs[w], records.IndexScan(), (0, 0)) for w in ("w1", "w2"))
    return peers, l1, l2


# ---------------------------------------------------------------- the crash writer
# the mount writer_main writes into (tests/test_crash.py; over GlusterFS too)
CRASH_WRITER_OPTS = dict(staging_size="8M", segment_size="1M", idle_flush=0.1, writer_id="w")


def _size(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.1:
        return 0
    if r < 0.4:
        return rng.randint(1, 8 * KiB)
    if r < 0.85:
        return rng.randint(8 * KiB, 512 * KiB)
    return rng.randint(512 * KiB, 3 * MiB)


def writer_main(mnt: str, it: int, seed: int, journal_path: str) -> None:
    """Write files i<it>/f<j> front to back until the file system goes away. Journal lines
    (appended, on the real disk): 'P name size' before the file is created (the planned final
    size), 'D name' once its data is durable (its fsync, or a sync after its close returned)."""
    rng = random.Random(seed)
    jfd = os.open(journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(line: str) -> None:
        os.write(jfd, (line + "\n").encode())

    closed: list[str] = []
    try:
        os.mkdir(os.path.join(mnt, f"i{it}"))
        for j in range(100000):
            name = f"i{it}/f{j:04d}"
            size = _size(rng)
            data = content(name, size)
            note(f"P {name} {size}")
            fd = os.open(os.path.join(mnt, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            pos = 0
            while pos < size:
                k = min(size - pos, rng.choice([4 * KiB, 100 * KiB, 1 * MiB, 1500 * KiB]))
                os.write(fd, data[pos:pos + k])
                pos += k
            if rng.random() < 0.15:
                os.fsync(fd)
                note(f"D {name}")
            os.close(fd)
            closed.append(name)
            if rng.random() < 0.03:
                api.sync(mnt)
                for n in closed:
                    note(f"D {n}")
                closed.clear()
    except OSError:
        pass  # the daemon is gone (ENOTCONN) -- that is the point
    finally:
        os.close(jfd)


def kill_mid_write(m, w, mnt: str) -> None:
    """kill -9 of mount m's daemon while writer process w writes into it: the writer ends
    (its writes fail), `ckptfs umount` detaches the stale mount and says the daemon is gone,
    and the daemon is reaped."""
    os.kill(m.pid, signal.SIGKILL)
    w.join(30)
    assert not w.is_alive(), "writer hung on the dead mount"
    res = cli("umount", mnt)
    assert res.returncode != 0 and "daemon is gone" in res.stderr, res.stderr
    m._reap(kill=False)


def read_journal(path: str) -> tuple[dict[str, int], set[str]]:
    planned, durable, _ = read_journal_with_deletes(path)
    return planned, durable


def read_journal_with_deletes(path: str) -> tuple[dict[str, int], set[str], set[str]]:
    """(planned sizes, durable names, names deleted) of a writer's journal: lines 'P name
    size', 'D name', 'U name'; a torn last line is ignored."""
    planned: dict[str, int] = {}
    durable: set[str] = set()
    deleted: set[str] = set()
    if not os.path.exists(path):
        return planned, durable, deleted
    with open(path) as f:
        for line in f:
            parts = line.split()
            if not line.endswith("\n") or not parts:
                continue
            if parts[0] == "P":
                planned[parts[1]] = int(parts[2])
            elif parts[0] == "D":
                durable.add(parts[1])
            elif parts[0] == "U":
                deleted.add(parts[1])
    return planned, durable, deleted


def list_files(mnt: str) -> dict[str, str]:
    """{relative path: 'f' | 'd'} of the whole mount."""
    out = {}
    for d, dirs, files in os.walk(mnt):
        for n in dirs:
            out[os.path.relpath(os.path.join(d, n), mnt)] = "d"
        for n in files:
            p = os.path.join(d, n)
            assert stat.S_ISREG(os.lstat(p).st_mode), p
            out[os.path.relpath(p, mnt)] = "f"
    return out


def check_tree(mnt: str, planned: dict[str, int], durable: set[str],
               seen: dict[str, tuple | None], full: bool) -> tuple[int, int, int]:
    """Check the remounted tree against what the writers did. `seen` keeps the state found
    at an earlier remount of files that are finished (their state must never change): their
    contents are read again only when `full`, else their size is compared. Returns (exact,
    partial, absent) counts."""
    found = list_files(mnt)
    dirs = {p for p, t in found.items() if t == "d"}
    files = {p for p, t in found.items() if t == "f"}
    unknown = files - set(planned)
    assert not unknown, f"files nobody wrote: {sorted(unknown)[:5]}"
    assert all(d.startswith("i") and "/" not in d for d in dirs), dirs
    exact = partial = absent = 0
    for name, size in planned.items():
        want = content(name, size)
        if name not in files:
            assert name not in durable, f"{name}: fsync/sync returned before the kill, " \
                f"but the file is gone after the remount"
            state = None
            absent += 1
        elif name in seen and not full:
            state = seen[name]
            assert state is not None and os.path.getsize(os.path.join(mnt, name)) == state[0], \
                f"{name}: changed between remounts without being written"
            continue
        else:
            got = read_all(os.path.join(mnt, name))
            if name in durable:
                assert got == want, f"{name}: durable, but reads back {len(got)} bytes of " \
                    f"{size}, first difference at {first_mismatch(got, want)}"
            assert len(got) <= size, f"{name}: {len(got)} bytes, more than the {size} written"
            bad = first_mismatch(got, want[:len(got)])
            assert bad < 0, f"{name}: {len(got)} bytes of {size}; byte {bad} differs from " \
                "what was written there (not a state the file ever had)"
            if len(got) == size:
                exact += 1
            else:
                partial += 1
            state = (len(got), hash(got))
        if name in seen:
            old = seen[name]
            assert state == old, f"{name}: changed between remounts without being written " \
                f"({old} -> {state})"
        else:
            seen[name] = state
    return exact, partial, absent


# ---------------------------------------------------------------- a full backing store
def fill(path: str, nbytes: int) -> None:
    with open(path, "wb") as f:
        f.write(b"\xff" * nbytes)
        os.fsync(f.fileno())


def write_ckpt(path: str, data: bytes) -> str:
    """Write, fsync, close; returns the first step that failed with ENOSPC ('' when none)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    failed = ""
    try:
        step = "write"
        for off in range(0, len(data), MiB):
            os.write(fd, data[off:off + MiB])
        step = "fsync"
        os.fsync(fd)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, f"{step}: {exc}"
        failed = step
    try:
        os.close(fd)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, f"close: {exc}"
        failed = failed or "close"
    return failed


def read_fd(path: str) -> tuple[bytes, int]:
    """(contents, errno of close() or 0)."""
    fd = os.open(path, os.O_RDONLY)
    parts = []
    while chunk := os.read(fd, MiB):
        parts.append(chunk)
    try:
        os.close(fd)
    except OSError as exc:
        return b"".join(parts), exc.errno
    return b"".join(parts), 0


# ---------------------------------------------------------------- torch checkpoints
def gpt_state_dict() -> dict:
    """A GPT-2-shaped training state (bf16 weights, fp32 Adam state, int64 step) plus hundreds
    of small tensors, float16/int64 extras, a 0-d, an empty and a 24 MiB tensor."""
    import torch
    from ckptfs.bench import models

    specs = models.tensor_specs("gpt2", 48 << 20) + models.small_tensor_specs(300, seed=7)
    sd = models.state_dict(specs, seed=1)
    g = torch.Generator().manual_seed(2)
    sd["extra.half.scale"] = torch.randn(1000, generator=g).to(torch.float16)
    sd["extra.half.big"] = torch.randn(3 * MiB // 2 + 3, generator=g).to(torch.float16)
    sd["extra.ids"] = torch.randint(-(1 << 62), 1 << 62, (4097,), generator=g, dtype=torch.int64)
    sd["extra.scalar"] = torch.tensor(3.25, dtype=torch.float32)
    sd["extra.empty"] = torch.empty(0, 7, dtype=torch.bfloat16)
    sd["extra.byte"] = torch.tensor([7], dtype=torch.uint8)
    sd["extra.huge"] = torch.randn(6 * MiB + 5, generator=g)  # ~24 MiB of float32
    sd["extra.strided"] = torch.randn(64, 48, generator=g).t()  # non-contiguous
    return sd


def path_of(root: str, name: str) -> str:
    from ckptfs.bench import models

    return os.path.join(root, "step_100", models.file_name(name))


def save_all(root: str, sd: dict) -> None:
    """One torch.save per tensor of `sd`, each in a file of its own under `root` (path_of)."""
    import torch

    for name, t in sd.items():
        p = path_of(root, name)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        torch.save(t, p)


def drop_cache(path: str) -> None:
    """Evict the file's clean pages from the kernel page cache, so the next read is served by
    the daemon (staging memory or data logs), not by the kernel."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def check_all(root: str, sd: dict, uncached: bool = True, mmap: bool = False) -> None:
    """Every tensor of `sd` that save_all saved under `root` loads bit-exact (`mmap`: by
    torch.load(mmap=True), which maps the file MAP_PRIVATE)."""
    import torch

    for name, want in sd.items():
        p = path_of(root, name)
        if uncached:
            drop_cache(p)
        got = torch.load(p, weights_only=True, mmap=mmap)
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        assert torch.equal(got, want), name
        assert got.stride() == want.stride(), name
        # bit-exact (torch.equal compares values; compare the bytes too)
        assert bits(got) == bits(want), name


def backing_files(backing: str) -> list[str]:
    out = []
    for dp, _, fns in os.walk(backing):
        out += [os.path.relpath(os.path.join(dp, f), backing) for f in fns]
    return sorted(out)


def dcp_save_load(mounts, backing: str) -> None:
    """DCP save into a mount over `backing`, load back; unmount, remount, load again."""
    import torch

    dcp = pytest.importorskip("torch.distributed.checkpoint")
    m = mounts.mount(backing=backing)
    g = torch.Generator().manual_seed(9)
    sd = {
        "model": {f"layer{i}.weight": torch.randn(256, 64 * (i + 1), generator=g).to(
            torch.bfloat16) for i in range(8)},
        "optim": {"state": {f"p{i}": {"exp_avg": torch.randn(3000 + i, generator=g),
                                      "step": torch.tensor(i, dtype=torch.int64)}
                            for i in range(10)}},
        "big": torch.randn(3 * MiB, generator=g),
        "half": torch.randn(777, generator=g).to(torch.float16),
        "epoch": 12,
    }
    ckpt = os.path.join(m.mountpoint, "dcp", "step_7")
    os.makedirs(ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=ckpt)
    assert ".metadata" in os.listdir(ckpt)

    def blank(x):
        if isinstance(x, dict):
            return {k: blank(v) for k, v in x.items()}
        if isinstance(x, torch.Tensor):
            return torch.zeros_like(x)
        return 0

    def same(a, b, where="sd"):
        if isinstance(a, dict):
            assert a.keys() == b.keys(), where
            for k in a:
                same(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, where
            assert torch.equal(a, b), where
        else:
            assert a == b, where

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = blank(sd)
        dcp.load(out, checkpoint_id=ckpt)
    same(sd, out)
    assert m.stop() == 0
    m2 = mounts.mount(backing=m.backing)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = blank(sd)
        dcp.load(out, checkpoint_id=os.path.join(m2.mountpoint, "dcp", "step_7"))
    same(sd, out)


# ---------------------------------------------------------------- many writers, eight ranks
# a few MB per rank, with a 0-dim tensor, bf16 and nested directories like a real state dict
RANK_SPECS = [
    ("model.embed.weight", (512, 256), "bfloat16"),
    ("model.layers.0.attn.c_attn.weight", (256, 768), "float32"),
    ("model.layers.0.mlp.c_fc.bias", (1024,), "float32"),
    ("optim.exp_avg.layers.0.attn.c_attn.weight", (256, 768), "float32"),
    ("optim.exp_avg_sq.layers.0.attn.c_attn.weight", (256, 768), "float32"),
    ("model.norm.weight", (256,), "bfloat16"),
    ("optim.step", (), "int64"),
]
RANKS = 8
DAEMONS = 4


def seed(step: int, rank: int) -> int:
    return 1000 * step + rank


def rank_dir(root: str, step: int, rank: int) -> str:
    return os.path.join(root, f"step_{step}", f"rank_{rank}")


def start_rank(m: api.Mount, step: int, rank: int, **kw) -> Writer:
    from ckptfs.bench.scaling import Writer

    return Writer(rank_dir(m.mountpoint, step, rank), RANK_SPECS, seed(step, rank), **kw)


def finish(writers: list[Writer], timeout: float = 60.0) -> None:
    for w in writers:
        w.wait(timeout)
    errors = [w.error for w in writers if w.error]
    assert not errors, errors
    assert all(w.saved == len(RANK_SPECS) for w in writers)


def bits(t) -> bytes:
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


_EXPECTED: dict[tuple[int, int], dict] = {}


def expected(step: int, rank: int) -> dict:
    from ckptfs.bench import models

    key = (step, rank)
    if key not in _EXPECTED:
        _EXPECTED[key] = models.state_dict(RANK_SPECS, seed(step, rank))
    return _EXPECTED[key]


def check_rank(root: str, step: int, rank: int) -> None:
    """Every tensor of (step, rank) under `root` loads bit-exact."""
    import torch
    from ckptfs.bench import models

    for name, t in expected(step, rank).items():
        path = os.path.join(rank_dir(root, step, rank), models.file_name(name))
        got = torch.load(path, weights_only=True)
        assert got.dtype == t.dtype and got.shape == t.shape, path
        assert bits(got) == bits(t), f"{path}: content differs"


def read_tree(root: str) -> int:
    """Read every file below `root` (no EIO, no short read); returns the bytes read."""
    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                data = fh.read()
            assert len(data) == os.path.getsize(p), p
            total += len(data)
    return total


def verify_ok(backing: str) -> None:
    r = cli("verify", backing)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1].startswith("OK:"), r.stdout


def listed(backing: str) -> set[str]:
    r = cli("ls", "-R", backing)
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split("\n"))


def rank_paths(step: int, rank: int) -> set[str]:
    from ckptfs.bench import models

    return {f"/step_{step}/rank_{rank}/{models.file_name(n)}" for n, _, _ in RANK_SPECS}


def writer_files_digest(backing: str, writer: str) -> dict[str, str]:
    """sha256 of everything a writer owns except its lock file (rewritten by each mount)."""
    wdir = os.path.join(backing, "writers", writer)
    out = {}
    for name in sorted(os.listdir(wdir)):
        if name == "writer.lock":
            continue
        with open(os.path.join(wdir, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def four_writers(mounts, backing: str) -> list[api.Mount]:
    """Four daemons started at once (as on a cluster; also faster on 2 cores)."""
    from ckptfs.bench.scaling import parallel

    ms = []
    for i in range(DAEMONS):
        mounts.n += 1
        mp = os.path.join(mounts.tmp, f"mnt{mounts.n}")
        os.makedirs(mp)
        m = api.Mount(backing, mp, log_file=os.path.join(mounts.tmp, f"daemon{mounts.n}.log"),
                      writer_id=f"w{i}", staging_size="64M", segment_size="4M",
                      read_cache="64M", no_populate=True)
        mounts.live.append(m)  # the fixture unmounts it in teardown
        ms.append(m)
    parallel([m.start for m in ms])
    return ms


def daemon_of(rank: int) -> int:
    return rank // (RANKS // DAEMONS)


def save_ranks(ms: list[api.Mount], step: int) -> None:
    """Step `step` of all ranks saved through their daemons, then synced on every mount."""
    finish([start_rank(ms[daemon_of(r)], step, r) for r in range(RANKS)])
    for m in ms:
        m.sync()


# ---------------------------------------------------------------- live writers
def backing_calls(pid: int, backing: str, seconds: float) -> list[str] | None:
    """The system calls of every thread of process `pid` on `backing` (a path under it, or
    a descriptor of one) during `seconds`, traced by strace; None where strace is missing or
    cannot attach (not root, ptrace refused)."""
    import tempfile

    if shutil.which("strace") is None:
        return None
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
        p = subprocess.Popen(["strace", "-f", "-qq", "-y", "-p", str(pid), "-o", out.name],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(seconds)
        if p.poll() is not None:  # (it could not attach)
            return None
        p.send_signal(signal.SIGINT)
        p.wait(10)
        real = os.path.realpath(backing)
        return [line for line in out.read().splitlines() if real in line]


LOOK_COUNTS = ("refresh_polls", "refresh_listdirs", "refresh_stats", "refresh_reads")


def tree_of(root: str) -> dict:
    """path -> (mode, bytes) for files, (mode, None) for directories, below root."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root) + "/"] = (os.stat(p).st_mode, None)
        for n in files:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = (os.stat(p).st_mode, f.read())
    return out


def shards(m, step: int, rank: int) -> None:
    import torch

    for i in range(3):
        save(m, f"step_{step}/rank_{rank}/t{i}.pt", torch.full((500 + i,), float(step * 10 + rank)))


def run_dcp_job(a, b, out: str, steps: int = 5, kill_at: int = 3, timeout: float = 240):
    """tests/dcp_rotation_job.py under torchrun: 4 ranks (gloo), two per mount, in a network
    namespace of its own that has only the loopback interface (the rendezvous and gloo can
    reach nothing else), restarted once (--max-restarts 1) after one rank is killed."""
    import socket
    with socket.socket() as s:  # (a free port number; the namespace has its own ports anyway)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    job = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dcp_rotation_job.py")
    cmd = (f"exec {torchrun} --nnodes 1 --nproc-per-node 4 "
           f"--max-restarts 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} "
           "--local-addr 127.0.0.1 "
           f"{job} {a.mountpoint} {b.mountpoint} {steps} {kill_at} {out}")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    r = subprocess.run(loopback_only(cmd), capture_output=True, text=True, timeout=timeout,
                       env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-6000:]
    return r


SLACK_S = 4.0  # a loaded 2-CPU machine: the look itself, the daemon's scheduling


def save(m, rel: str, t) -> str:
    import torch

    p = os.path.join(m.mountpoint, rel)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    torch.save(t, p)
    return p


def load(m, rel: str):
    import torch

    return torch.load(os.path.join(m.mountpoint, rel), weights_only=True)


def loads_as(m, rel: str, t) -> bool:
    """Whether `rel` loads on mount m as `t`. A load whose open came before the overwrite
    reached m may read old and new bytes mixed (docs/scaling.md: a file already open may or
    may not show later changes) and fail to load: not yet."""
    import pickle
    try:
        return bits(load(m, rel)) == bits(t)
    except (RuntimeError, EOFError, pickle.UnpicklingError):
        return False


def exists(m, rel: str) -> bool:
    return os.path.exists(os.path.join(m.mountpoint, rel))


def visibility(mounts, backing: str, other: str) -> float:
    """Mount b writes (over `other`: the same backing directory, maybe through another
    client of a network file system), mounts a (--refresh 1) and `now` (--refresh 0) over
    `backing` see it. Returns how long a took to see the first file."""
    import torch

    a = mounts.mount(backing, writer_id="w0", refresh=1.0)
    now = mounts.mount(backing, writer_id="w2", refresh=0)  # looks at every open and lookup
    b = mounts.mount(other, writer_id="w1")  # joins after both: a new writer directory
    v1, v2 = torch.arange(5000, dtype=torch.float32), torch.full((3000,), 7.0)
    assert not exists(a, "step_1/x.pt")  # (a negative lookup, nothing cached)
    save(b, "step_1/x.pt", v1)
    b.sync()  # durable on b
    assert bits(load(now, "step_1/x.pt")) == bits(v1)  # at once with --refresh 0
    t0 = time.monotonic()
    wait_for(lambda: exists(a, "step_1/x.pt"), timeout=1.0 + SLACK_S, step=0.02)
    dt = time.monotonic() - t0
    assert bits(load(a, "step_1/x.pt")) == bits(v1)
    # an overwrite (same name, same inode on b): the new bytes on the next open, although a
    # has the file's attributes and pages cached
    save(b, "step_1/x.pt", v2)
    b.sync()
    wait_for(lambda: loads_as(a, "step_1/x.pt", v2), timeout=1.0 + SLACK_S, step=0.02)
    assert bits(load(a, "step_1/x.pt")) == bits(v2)
    assert bits(load(now, "step_1/x.pt")) == bits(v2)
    # a listing shows new entries; a name b removes or renames goes from a's cached entries
    save(b, "step_1/y.pt", v1)
    os.rename(os.path.join(b.mountpoint, "step_1/x.pt"), os.path.join(b.mountpoint,
                                                                     "step_1/z.pt"))
    b.sync()
    # (the kernel is told to forget the old name by a worker thread after the view changed:
    # a listing may show the change a few ms before the name's cached entry goes)
    wait_for(lambda: sorted(os.listdir(os.path.join(a.mountpoint, "step_1"))) ==
             ["y.pt", "z.pt"] and not exists(a, "step_1/x.pt"), timeout=1.0 + SLACK_S, step=0.02)
    assert bits(load(a, "step_1/z.pt")) == bits(v2)
    os.unlink(os.path.join(b.mountpoint, "step_1/y.pt"))
    b.sync()
    assert not exists(now, "step_1/y.pt")
    wait_for(lambda: not exists(a, "step_1/y.pt"), timeout=1.0 + SLACK_S, step=0.02)
    st = a.status()
    assert st["writers"] == 3 and st["refresh_polls"] > 0 and st["writers_joined"] == 2
    print(f"visible on the 1 s mount after {dt:.2f} s")
    return dt


def idle_and_quiet(mounts, backing: str, other: str) -> None:
    """Mount a (--refresh 0.2) over `backing` and b over `other` (the same directory, maybe
    through another client of a network file system): idle, a makes no calls to the backing
    store, and its first lookup after that sees what b did meanwhile."""
    import torch

    a = mounts.mount(backing, writer_id="w0", refresh=0.2)
    b = mounts.mount(other, writer_id="w1")
    v1, v2 = torch.zeros(10), torch.arange(77, dtype=torch.float32)
    save(b, "f.pt", v1)
    b.sync()
    wait_for(lambda: exists(a, "f.pt"), timeout=0.2 + SLACK_S, step=0.02)
    pauses = a.status()["refresh_idle_pauses"]
    assert bits(load(a, "f.pt")) == bits(v1)  # (f.pt cached by a's kernel now)
    wait_for(lambda: a.status()["refresh_idle_pauses"] > pauses, timeout=0.4 + SLACK_S, step=0.02)
    # (a pause before the load, on a stalled test, is followed by a look the load asked for
    # and another pause: quiet means nothing moved over more than a --refresh period)
    s0 = a.status()
    t0 = time.monotonic()
    keys = LOOK_COUNTS + ("refresh_idle_pauses",)
    while True:
        time.sleep(0.3)
        s = a.status()
        if {k: s[k] for k in keys} == {k: s0[k] for k in keys}:
            break
        assert time.monotonic() - t0 < 0.8 + SLACK_S, "the idle mount went on looking"
        s0 = s
    calls = backing_calls(s0["pid"], backing, 3.0)
    s1 = a.status()
    assert {k: s1[k] for k in LOOK_COUNTS} == {k: s0[k] for k in LOOK_COUNTS}
    assert calls is None or calls == [], calls[:20]
    print("calls on the backing store by the idle mount in 3 s:",
          "(strace cannot attach)" if calls is None else len(calls))
    os.unlink(os.path.join(b.mountpoint, "f.pt"))
    save(b, "g.pt", v2)
    b.sync()
    time.sleep(0.3)  # (longer than a's --refresh: its kernel asks again for f.pt)
    assert not exists(a, "f.pt")  # at once: the lookup looked first
    assert bits(load(a, "g.pt")) == bits(v2)
    # (one look, the lookup's; a second once a --refresh period passed since, the load of
    # g.pt having asked, when this test stalled that long)
    assert 1 <= a.status()["refresh_polls"] - s1["refresh_polls"] <= 2


def cross_writer_changes(mounts, backing: str, other: str, tmp: str) -> None:
    """The changes of test_changes_to_other_writers_entries_hold_everywhere; mount b is over
    `other` (the same backing directory, maybe through another client)."""
    import torch

    a = mounts.mount(backing, writer_id="w0", refresh=0)
    b = mounts.mount(other, writer_id="w1", refresh=0)
    c = mounts.mount(backing, writer_id="w2", refresh=0)
    for step in (1, 2, 3):
        shards(a, step, 0)
        shards(b, step, 1)
    for name in ("latest", "cfg", "tmp", "keep"):
        save(b, f"shared/{name}", torch.tensor([len(name)]))
    os.makedirs(os.path.join(b.mountpoint, "shared/empty"))
    a.sync()
    b.sync()
    am = a.mountpoint
    assert sorted(os.listdir(f"{am}/step_1")) == ["rank_0", "rank_1"]
    shutil.rmtree(f"{am}/step_1")  # the rotation: rank 0 deletes every node's shards
    new_latest = torch.arange(100)
    save(a, "shared/latest", new_latest)  # torch.save over b's file (O_TRUNC)
    os.truncate(f"{am}/shared/cfg", 10)
    os.chmod(f"{am}/shared/cfg", 0o600)
    os.utime(f"{am}/shared/keep", ns=(10**18, 10**18))
    save(a, "shared/tmp.new", torch.ones(7))
    os.rename(f"{am}/shared/tmp.new", f"{am}/shared/tmp")  # over b's file
    os.rename(f"{am}/shared/keep", f"{am}/shared/kept")  # b's file moves
    os.rmdir(f"{am}/shared/empty")
    os.rename(f"{am}/step_2", f"{am}/step_2.old")  # both writers' shards move
    with pytest.raises(OSError) as ei:
        os.rmdir(f"{am}/step_3")
    assert ei.value.errno == errno.ENOTEMPTY
    a.sync()
    want = tree_of(am)
    assert "step_1/" not in want and "shared/empty/" not in want and "shared/keep" not in want
    assert want["shared/cfg"][0] & 0o777 == 0o600 and len(want["shared/cfg"][1]) == 10
    assert os.stat(f"{am}/shared/kept").st_mtime_ns == 10**18
    assert sorted(os.listdir(f"{am}/step_2.old")) == ["rank_0", "rank_1"]
    assert bits(load(a, "step_2.old/rank_1/t0.pt")) == bits(torch.full((500,), 21.0))
    for m in (b, c):
        assert tree_of(m.mountpoint) == want, m.mountpoint
    assert os.stat(f"{b.mountpoint}/shared/kept").st_mtime_ns == 10**18
    b.sync()  # b's own UNLINKs of what a deleted of its tree (it carried them out)
    for m in (a, b, c):
        m.stop()
    a2 = mounts.mount(backing, writer_id="w0")
    b2 = mounts.mount(other, writer_id="w1")
    ro = mounts.mount(other, ro=True)
    for m in (a2, b2, ro):
        assert tree_of(m.mountpoint) == want, m.mountpoint
    assert bits(load(ro, "shared/latest")) == bits(new_latest)
    verify_ok(backing)
    r = cli("verify", backing)
    assert "0 index warnings" in r.stdout, r.stdout + r.stderr
    names = {p for p in listed(backing) if p}
    assert names == {"/" + k.rstrip("/") for k in want} | {"/"}
    out = os.path.join(tmp, "export")
    r = cli("export", backing, out)
    assert r.returncode == 0, r.stderr
    assert {k: v[1] for k, v in tree_of(out).items()} == {k: v[1] for k, v in want.items()}
    # a's index holds the whiteouts of b's entries (XUNLINK) under the new index version;
    # b's own index the UNLINKs it made of them
    from ckptfs.format import records
    sa = records.read_index(os.path.join(backing, "writers", "w0", "index.log"))
    sb = records.read_index(os.path.join(backing, "writers", "w1", "index.log"))
    assert sa.version == records.CROSS_INDEX_VERSION
    assert any(type(r) is records.XUnlinkRec and r.writer == "w1" for g in sa.groups for r in g)
    assert any(type(r) is records.XExtentRec for g in sa.groups for r in g)  # cfg, kept
    assert sum(type(r) is records.UnlinkRec for g in sb.groups for r in g) >= 6


def dcp_job(mounts, backing: str, other: str | None, tmp_path) -> float:
    """The job of test_torchrun_dcp_rotation_and_a_restarted_rank; the second mount over
    `other` (another client's path of the backing directory) when given."""
    a = mounts.mount(backing, writer_id="node0")
    b = mounts.mount(other or backing, writer_id="node1")
    out = tmp_path / "out"
    out.mkdir()
    t0 = time.monotonic()
    run_dcp_job(a, b, str(out))
    took = time.monotonic() - t0
    reports = {p.name: json.loads(p.read_text()) for p in out.iterdir()}
    assert sorted(reports) == [f"rank{r}-1.json" for r in range(4)], sorted(reports)
    for rep in reports.values():
        assert rep["loopback"] and rep["master"] == "127.0.0.1", rep
        assert rep["loaded"] == 3 and rep["exact"] is True, rep
        assert rep["steps_seen"] == [4, 5], rep
    for m in (a, b):
        root = os.path.join(m.mountpoint, "ckpt")
        assert sorted(os.listdir(root)) == ["step_4", "step_5"], (m.mountpoint,
                                                                  os.listdir(root))
        for s in ("step_4", "step_5"):
            names = sorted(os.listdir(os.path.join(root, s)))
            assert ".metadata" in names and len([n for n in names if n.endswith(".distcp")]) == 4
    a.stop()
    b.stop()
    ro = mounts.mount(backing, ro=True)
    assert sorted(os.listdir(os.path.join(ro.mountpoint, "ckpt"))) == ["step_4", "step_5"]
    verify_ok(backing)
    assert {p for p in listed(backing) if p.count("/") == 2} == {"/ckpt/step_4", "/ckpt/step_5"}
    print(f"job with one restart: {took:.1f} s")
    return took


# ---------------------------------------------------------------- mount_scripts/
HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(os.path.dirname(HERE), "mount_scripts")
CKPTFS = os.path.join(os.path.dirname(sys.executable), "ckptfs")
if not os.access(CKPTFS, os.X_OK):
    CKPTFS = shutil.which("ckptfs") or CKPTFS
SMALL = "staging_size=32M,segment_size=1M,no_populate"
SMALL_FLAGS = "--staging-size 32M --segment-size 1M --no-populate"
needs_fuse = pytest.mark.skipif(not os.path.exists("/dev/fuse") or
                                shutil.which("fusermount3") is None,
                                reason="needs /dev/fuse and fusermount3")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")


def sh(*args, env=None, timeout=60, check=False, cwd=None):
    """A mount_scripts/ script (or any command), output captured, with the environment the
    scripts get in the tests: this ckptfs, a log tag of its own, no Slurm configuration."""
    full_env = dict(os.environ, CKPTFS=CKPTFS, CKPTFS_LOG_TAG="ckptfs-test",
                    CKPTFS_SLURM_CONF="/nonexistent")
    full_env.update(env or {})
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=full_env,
                       timeout=timeout, cwd=cwd)
    if check and r.returncode != 0:
        raise AssertionError(f"{args} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


class Tracker:
    """Mount points a test created; teardown leaves none behind."""
    def __init__(self) -> None:
        self.mountpoints: list[str] = []
        self.pids: set[int] = set()

    def add(self, mnt) -> None:
        mnt = str(mnt)
        self.mountpoints.append(mnt)
        try:
            self.pids.add(api.status(mnt)["pid"])
        except OSError:
            pass

    def cleanup(self) -> None:
        for mnt in self.mountpoints:
            if api.is_mounted(mnt):
                subprocess.run([CKPTFS, "umount", mnt, "--timeout", "20"], capture_output=True,
                               timeout=60)
            if api.is_mounted(mnt):
                api.fusermount(mnt, lazy=True)
        for pid in self.pids:
            if not api.wait_pid_exit(pid, 10):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


# ---------------------------------------------------------------- a GlusterFS volume
GLUSTER_SCRIPT = os.path.join(SCRIPTS, "glusterfs.sh")
UP_TIMEOUT = 1200   # the first `up` on a fresh machine installs the packages
DOWN_TIMEOUT = 300


class Volume:
    """One volume of the script: its environment, mount point, and whether this run started it."""
    def __init__(self, **env: str) -> None:
        self.env = dict(os.environ, GLUSTER_TIMEOUT="60", **env)
        self.dir = self.env.get("GLUSTER_DIR", "/var/tmp/ckptfs-gluster")
        self.name = self.env.get("GLUSTER_VOLUME", "ckptfs")
        self.mount = self.env.get("GLUSTER_MOUNT", os.path.join(self.dir, "mnt"))
        self.started = False

    def script(self, cmd: str, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", GLUSTER_SCRIPT, cmd], env=self.env, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def up(self) -> None:
        if os.geteuid() != 0:
            pytest.skip("GlusterFS needs root (glusterd, mount -t glusterfs, apt-get)")
        if self.script("status", 60).returncode == 0:
            return  # already up: used as it is, left up
        self.started = True
        res = self.script("up", UP_TIMEOUT)
        if res.returncode == 3:
            self.down()
            pytest.skip(f"GlusterFS packages cannot be installed: {res.stderr.strip()}")
        if res.returncode != 0:
            self.down()
            pytest.fail(f"glusterfs.sh up failed ({res.returncode}):\n{res.stdout}{res.stderr}")
        assert os.path.ismount(self.mount), res.stdout

    def down(self) -> None:
        try:
            res = self.script("down", DOWN_TIMEOUT)
            if res.returncode == 0:
                return
            print(f"glusterfs.sh down failed:\n{res.stdout}{res.stderr}")
        except subprocess.TimeoutExpired:
            print(f"glusterfs.sh down did not finish in {DOWN_TIMEOUT} s")
        # last resort: detach the mounts (volume, small bricks), kill what the script recorded
        bricks = os.path.join(self.dir, "bricks")
        paths = [self.mount] + ([os.path.join(bricks, b) for b in os.listdir(bricks)
                                 if b.endswith(".fs")] if os.path.isdir(bricks) else [])
        for d in paths:
            if listed_mount(d):
                subprocess.run(["umount", "-l", d], capture_output=True, timeout=30)
        for f in ("client.pid", "bricks.pids"):
            for pid in pids_in(os.path.join(self.dir, "state", f)):
                kill_quietly(pid)

    def subdir(self, name: str) -> str:
        path = os.path.join(self.mount, f"tests-{os.getpid()}", name)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        return path


def listed_mount(path: str) -> bool:
    """In the mount table. Unlike os.path.ismount, true for a mount whose client died too
    (its stat fails with ENOTCONN, yet it is mounted and must be detached)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            target = line.split()[4]
            if re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), target) == path:
                return True
    return False


def pids_in(path: str) -> list[int]:
    try:
        with open(path) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------- a failing backing store
FAILING_FS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "failing_fs.py")


class FailingMount:
    """A running failing_fs: `source` mirrored at `mountpoint`; fail()/heal() switch EIO."""

    def __init__(self, source: str, mountpoint: str, log: str) -> None:
        self.source, self.mountpoint, self.log = source, mountpoint, log
        self.control = os.path.join(source, ".fail")
        with open(log, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, FAILING_FS, source, mountpoint],
                                         stdout=subprocess.PIPE, stderr=err,
                                         start_new_session=True)
        deadline = time.monotonic() + 20
        while not api.is_mounted(mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("failing_fs did not mount: " + self.log_text())
            time.sleep(0.05)

    def fail(self, ops: str = "write fsync") -> None:
        # Written beside the source and renamed into place: failing_fs reads the control file
        # on every operation, and an empty one (open's truncation, before the write) means
        # "write fsync", which would fail a flush that was meant to hang.
        tmp = os.path.join(os.path.dirname(self.source), ".fail.tmp")
        with open(tmp, "w") as f:
            f.write(ops)
        os.replace(tmp, self.control)

    def heal(self) -> None:
        try:
            os.unlink(self.control)
        except FileNotFoundError:
            pass

    def log_text(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        self.heal()
        if api.is_mounted(self.mountpoint):
            api.fusermount(self.mountpoint)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        if api.is_mounted(self.mountpoint):
            api.fusermount(self.mountpoint, lazy=True)
        if self.proc.stdout:
            self.proc.stdout.close()


class FailingDisk:
    """A real block device that fails its writes with EIO on command, where device-mapper
    (dm-error, dm-flakey) is missing: ext4 on a loop device whose image lies in a failing_fs
    mount. fail() makes the image's writes fail, so the loop device completes every write
    with an I/O error and ext4 sees what it sees from a dying disk (O_DIRECT writes fail,
    buffered pages whose writeback fails are dropped and reported once by fdatasync);
    heal() lets them through again. `path`: the ext4 file system's root."""

    def __init__(self, failing: FailingMount, path: str, size: int = 512 * MiB) -> None:
        self.failing, self.path, self.loop = failing, path, None
        image = os.path.join(failing.mountpoint, "disk.img")
        with open(image, "wb") as f:
            f.truncate(size)
        try:
            self.loop = subprocess.run(["losetup", "-f", "--show", image], check=True,
                                       capture_output=True, text=True,
                                       timeout=30).stdout.strip()
            subprocess.run(["mkfs.ext4", "-q", "-F", "-E", "nodiscard", self.loop], check=True,
                           capture_output=True, timeout=60)
            os.makedirs(path, exist_ok=True)
            subprocess.run(["mount", "-o", "errors=continue", self.loop, path], check=True,
                           capture_output=True, timeout=30)
        except BaseException:
            self.stop()
            raise

    def fail(self) -> None:
        self.failing.fail("write")

    def heal(self) -> None:
        self.failing.heal()

    def stop(self) -> None:
        self.heal()
        if os.path.ismount(self.path):
            try:
                subprocess.run(["umount", self.path], timeout=60, capture_output=True)
            except subprocess.TimeoutExpired:
                pass
            if os.path.ismount(self.path):
                subprocess.run(["umount", "-l", self.path], timeout=30, capture_output=True)
        if self.loop:
            subprocess.run(["losetup", "-d", self.loop], timeout=30, capture_output=True)
            self.loop = None
