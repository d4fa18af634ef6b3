"""What a network file system does differently from a local disk, in the places ckptfs relies
on: O_DIRECT, fallocate, locks across clients, rename over a file that is being read, and
whether a second client sees a file as it was when the first closed it (close-to-open).

    python tests/netfs_probe.py DIR [DIR_ON_A_SECOND_CLIENT]

DIR and the second directory are the same directory reached through two client mounts (two
`mount -t glusterfs` of one volume: two clients with caches of their own, as on two nodes);
with one directory both sides use the same client. Prints one line per finding; the
functions return the figures (tests/test_glusterfs.py checks them). docs/glusterfs.md has the
results for GlusterFS."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import mmap
import multiprocessing as mp
import os
import subprocess
import sys
import time

BLOCK = 4096
STALE_LIMIT_S = 30.0  # an append another client still does not see after this is an error


# ---------------------------------------------------------------- O_DIRECT
def probe_direct(d: str) -> dict[str, dict[str, str]]:
    """O_DIRECT writes of an aligned block and of misaligned ones: what write, fsync and
    close return for each ('ok' or the error)."""
    buf = mmap.mmap(-1, 2 * BLOCK)
    cases = {
        "aligned 4 KiB": (memoryview(buf)[:BLOCK], 0),
        "512 B at 0": (memoryview(buf)[:512], 0),
        "100 B at 0": (memoryview(buf)[:100], 0),
        "4 KiB at offset 7": (memoryview(buf)[:BLOCK], 7),
        "4 KiB from buffer+1": (memoryview(buf)[1:BLOCK + 1], 0),
    }
    out = {}
    path = os.path.join(d, "probe-direct")
    for name, (data, off) in cases.items():
        res = {}
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        except OSError as exc:
            out[name] = {"open": exc.strerror}
            continue
        for step, call in (("write", lambda: os.pwrite(fd, data, off)),
                           ("fsync", lambda: os.fsync(fd)), ("close", lambda: os.close(fd))):
            try:
                call()
                res[step] = "ok"
            except OSError as exc:
                res[step] = errno.errorcode.get(exc.errno, str(exc.errno))
                if step == "close":
                    pass
        if res.get("close") != "ok":
            try:
                os.close(fd)
            except OSError:
                pass
        out[name] = res
    os.unlink(path)
    return out


# ---------------------------------------------------------------- fallocate
def probe_fallocate(d: str, nbytes: int = 256 << 20) -> dict[str, str]:
    """fallocate(2) modes ckptfs uses (0: preallocate a data log) or might: result and time."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    path = os.path.join(d, "probe-fallocate")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    out = {}
    try:
        for mode, name in ((0, "mode 0"), (1, "KEEP_SIZE"), (3, "PUNCH_HOLE|KEEP_SIZE")):
            t = time.perf_counter()
            r = libc.fallocate(fd, mode, 0, nbytes)
            e = ctypes.get_errno()
            ms = (time.perf_counter() - t) * 1e3
            st = os.fstat(fd)
            out[name] = (f"ok in {ms:.1f} ms (size {st.st_size >> 20} MiB, allocated "
                         f"{st.st_blocks * 512 >> 20} MiB)" if r == 0
                         else errno.errorcode.get(e, str(e)))
    finally:
        os.close(fd)
        os.unlink(path)
    return out


# ---------------------------------------------------------------- locks
_TRY_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
try:
    (fcntl.flock if sys.argv[2] == "flock" else fcntl.lockf)(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("acquired")
except OSError as e:
    print("refused" if e.errno in (11, 13) else "error " + e.strerror)
"""


def _try_lock(path: str, kind: str) -> str:
    res = subprocess.run([sys.executable, "-c", _TRY_LOCK, path, kind], capture_output=True,
                         text=True, timeout=60)
    return res.stdout.strip() or res.stderr.strip()


def probe_locks(d1: str, d2: str) -> dict[str, dict[str, str]]:
    """An exclusive flock / fcntl lock held through the first client: what another process
    gets through the same client and through the second; and after the holder closed."""
    out = {}
    p1, p2 = os.path.join(d1, "probe-lock"), os.path.join(d2, "probe-lock")
    for kind in ("flock", "fcntl"):
        fd = os.open(p1, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            (fcntl.flock if kind == "flock" else fcntl.lockf)(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            out[kind] = {"holder": errno.errorcode.get(exc.errno, str(exc.errno))}
            continue
        res = {"same client": _try_lock(p1, kind), "second client": _try_lock(p2, kind)}
        os.close(fd)
        res["second client, after the holder closed"] = _try_lock(p2, kind)
        out[kind] = res
    os.unlink(p1)
    return out


# ---------------------------------------------------------------- rename
def _renamer(d: str, stop, count) -> None:
    i = 0
    while not stop.is_set():
        tmp = os.path.join(d, f"probe-rename.tmp{i % 7}")
        with open(tmp, "wb") as f:
            f.write(b"%08d" % i * (BLOCK // 8))
        os.rename(tmp, os.path.join(d, "probe-rename"))
        i += 1
    count.value = i


def _rename_reader(d: str, stop, out) -> None:
    ok = enoent = estale = torn = 0
    path = os.path.join(d, "probe-rename")
    while not stop.is_set():
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            enoent += 1
            continue
        except OSError as exc:
            if exc.errno != errno.ESTALE:
                raise
            estale += 1
            continue
        if len(data) != BLOCK or data != data[:8] * (BLOCK // 8):
            torn += 1
        else:
            ok += 1
    out.put({"reads": ok + enoent + estale + torn, "ENOENT": enoent, "ESTALE": estale,
             "torn": torn})


def probe_rename(d1: str, d2: str, seconds: float = 3.0) -> dict[str, dict[str, int]]:
    """One process renames fresh files over one name (write_atomic: tmp + rename) as fast as
    it can; another opens and reads that name, through the same client, then through the
    second. A local file system never lets the reader see the name missing or a mix."""
    with open(os.path.join(d1, "probe-rename"), "wb") as f:
        f.write(b"%08d" % 0 * (BLOCK // 8))
    ctx = mp.get_context("fork")
    out = {}
    for where, d in (("same client", d1), ("second client", d2)):
        stop, count, q = ctx.Event(), ctx.Value("i", 0), ctx.Queue()
        ps = [ctx.Process(target=_renamer, args=(d1, stop, count)),
              ctx.Process(target=_rename_reader, args=(d, stop, q))]
        for p in ps:
            p.start()
        time.sleep(seconds)
        stop.set()
        res = q.get(timeout=60)
        for p in ps:
            p.join(60)
        res["renames"] = count.value
        out[where] = res
    for n in os.listdir(d1):
        if n.startswith("probe-rename"):
            os.unlink(os.path.join(d1, n))
    return out


# ---------------------------------------------------------------- close-to-open
def _appender(path: str, n: int, go, done) -> None:
    for i in range(n):
        go.get()
        with open(path, "ab") as f:
            f.write(b"%07d\n" % i * (BLOCK // 8))
            f.flush()
            os.fsync(f.fileno())
        done.put(i)


def _read_direct(path: str) -> int:
    buf = mmap.mmap(-1, 1 << 20)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        total = 0
        while True:
            n = os.preadv(fd, [buf], total)
            total += n
            if n < len(buf):
                return total
    finally:
        os.close(fd)


def probe_close_to_open(d1: str, d2: str, n: int = 100) -> dict[str, dict[str, int]]:
    """A process on the first client appends a block, fsyncs and closes, n times; after each
    close the second client at once (its caches warm from the previous round, as a restore
    that looked at the backing directory before) looks: stat, and a read to the end
    (buffered, O_DIRECT) — plain, and after listing the directory first. Counts the looks
    that saw less than was written."""
    p1, p2 = os.path.join(d1, "probe-cto"), os.path.join(d2, "probe-cto")
    ctx = mp.get_context("fork")
    out = {}
    for mode in ("plain", "after listing the directory"):
        open(p1, "wb").close()
        os.stat(p2)
        with open(p2, "rb") as f:
            f.read()
        go, done = ctx.Queue(), ctx.Queue()
        w = ctx.Process(target=_appender, args=(p1, n, go, done))
        w.start()
        stale = {"stat": 0, "buffered read": 0, "O_DIRECT read": 0}
        longest = 0.0
        try:
            for i in range(n):
                go.put(1)
                done.get(timeout=60)
                want = (i + 1) * BLOCK
                if mode != "plain":
                    os.listdir(d2)
                if os.stat(p2).st_size != want:
                    stale["stat"] += 1
                if _read_direct(p2) != want:
                    stale["O_DIRECT read"] += 1
                with open(p2, "rb") as f:
                    short = len(f.read()) != want
                if short:
                    stale["buffered read"] += 1
                    t0 = time.monotonic()
                    while True:
                        with open(p2, "rb") as f:
                            if len(f.read()) == want:
                                break
                        if time.monotonic() - t0 > STALE_LIMIT_S:
                            raise TimeoutError(f"{p2}: append {i} not seen by this client "
                                               f"{STALE_LIMIT_S:.0f} s after it was fsynced")
                        time.sleep(0.01)
                    longest = max(longest, time.monotonic() - t0)
        finally:
            w.join(60)
            if w.is_alive():  # (the probe gave up: the appender waits for the next go)
                w.kill()
                w.join(10)
        stale["of"] = n
        stale["stale for at most ms"] = round(longest * 1e3)
        out[mode] = stale
    os.unlink(p1)
    return out


def probe_all(d1: str, d2: str | None = None, quick: bool = False) -> dict:
    d2 = d2 or d1
    return {
        "O_DIRECT": probe_direct(d1),
        "fallocate": probe_fallocate(d1),
        "locks": probe_locks(d1, d2),
        "rename": probe_rename(d1, d2, 1.5 if quick else 5.0),
        "close-to-open": probe_close_to_open(d1, d2, 60 if quick else 200),
    }


def main() -> int:
    if len(sys.argv) not in (2, 3):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    res = probe_all(*sys.argv[1:])
    for topic, r in res.items():
        print(f"{topic}:")
        for k, v in r.items():
            print(f"  {k}: {json.dumps(v) if not isinstance(v, str) else v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
