"""Shared helpers of the reliability tests (crash, full disk, corruption, bad input,
permissions, load): the CLI, deterministic file contents, tree snapshots, other users,
daemon memory figures."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time

from ckptfs import api

KiB, MiB = 1 << 10, 1 << 20
CLI = [sys.executable, "-m", "ckptfs"]
NOBODY = 65534


def cli(*args, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """Run `ckptfs ARGS...`; text output captured."""
    return subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True,
                          timeout=timeout, **kw)


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


def as_user(argv: list[str], uid: int = NOBODY, gid: int = NOBODY, timeout: float = 60,
            **kw) -> subprocess.CompletedProcess:
    """Run argv as another user (no supplementary groups)."""
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
                          + argv, capture_output=True, text=True, timeout=timeout, **kw)


def py_as_user(code: str, uid: int = NOBODY, gid: int = NOBODY, umask: int = 0o022):
    """Run a snippet of Python (system interpreter, no ckptfs import) as another user; the
    snippet sets `R` (a JSON-able object) which is returned."""
    prog = (f"import os, json, errno, stat\nos.umask({umask})\nR = None\n{code}\n"
            "print(json.dumps(R))\n")
    py = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    res = as_user([py, "-c", prog], uid, gid)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


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


def check_files(files: dict[str, bytes], old_root: str, new_root: str) -> None:
    """Every file of `files` (paths under old_root) reads back the same under new_root."""
    for p, data in files.items():
        with open(p.replace(old_root, new_root, 1), "rb") as f:
            assert f.read() == data, p


def write_file(path: str, data: bytes, fsync: bool = False, chunk: int = MiB) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, len(data), chunk):
            os.write(fd, data[off:off + chunk])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


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
