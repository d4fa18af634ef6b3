"""Concurrency on a real mount: many writer threads and processes, reads while the flusher
drains, fsync from several threads, delete-while-open, and backpressure with a tiny staging
area. No timing assertions: only contents, errors and completion (with timeouts)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import threading
import time

import pytest
from helpers import read_uncached, write_file

pytestmark = pytest.mark.timeout(150)

KiB, MiB = 1 << 10, 1 << 20


def payload(tag: str, n: int) -> bytes:
    """Deterministic, distinct contents per file (cheap to regenerate for checking)."""
    seed = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:8], "little")
    return random.Random(seed).randbytes(n)


def size_for(tag: str) -> int:
    r = random.Random(tag)
    return r.choice([1, r.randrange(1, 4096), r.randrange(4096, 256 * KiB),
                     r.randrange(256 * KiB, 3 * MiB + 1)])


def writer_job(root: str, who: str, nfiles: int) -> list[str]:
    os.makedirs(os.path.join(root, who), exist_ok=True)
    names = []
    for i in range(nfiles):
        tag = f"{who}/f{i}"
        n = size_for(tag)
        write_file(os.path.join(root, tag), payload(tag, n),
                   chunk=random.Random(tag).choice([None, 4097, 64 * KiB, MiB + 7]))
        names.append(tag)
    return names


def _proc_main(root: str, who: str, nfiles: int, q) -> None:
    try:
        q.put(("ok", writer_job(root, who, nfiles)))
    except BaseException as exc:  # report, do not hang the parent
        q.put(("error", repr(exc)))


def verify(root: str, tags: list[str], uncached: bool = True) -> None:
    for tag in tags:
        p = os.path.join(root, tag)
        got = read_uncached(p) if uncached else open(p, "rb").read()
        want = payload(tag, size_for(tag))
        assert len(got) == len(want), tag
        assert got == want, tag


STALL_S = 10  # no daemon progress at all for this long while clients wait = a hang
CAP_S = 120


def progress(m) -> tuple:
    st = m.status()
    return tuple(st.get(k) for k in ("bytes_written", "segments_flushed", "index_commits",
                                     "fsyncs", "read_disk_bytes", "inodes"))


def diagnose(m) -> str:
    try:
        st = m.status()
    except OSError as exc:
        return f"status unavailable: {exc}"
    keys = ("bytes_written", "bytes_staged", "staging_bytes", "segments_flushed",
            "segments_in_flight", "writers_waiting", "uncommitted_changes", "current_error")
    return ", ".join(f"{k}={st.get(k)}" for k in keys)


def hung(m, what: str, why: str):
    """The mount stopped making progress: record the daemon's state, then SIGKILL it so that
    threads stuck in FUSE requests get an error instead of hanging the test run; fail."""
    info = diagnose(m)
    m.kill()
    pytest.fail(f"{what}: {why} (hang): {info}")


def wait_progressing(m, alive, what: str) -> None:
    """Wait while alive() is true; fail when the daemon makes no progress for STALL_S."""
    last, since = None, time.monotonic()
    t0 = since
    while alive():
        time.sleep(0.25)
        now = time.monotonic()
        try:
            cur = progress(m)
        except OSError:
            cur = None
        if cur != last:
            last, since = cur, now
        elif now - since > STALL_S:
            hung(m, what, f"no progress for {STALL_S} s")
        if now - t0 > CAP_S:
            hung(m, what, f"not done after {CAP_S} s")


def run_threads(m, fn, args_list, what: str = "writers") -> list:
    results: list = [None] * len(args_list)
    errors: list = []

    def wrap(i, args):
        try:
            results[i] = fn(*args)
        except BaseException as exc:
            errors.append(exc)

    ts = [threading.Thread(target=wrap, args=(i, a), daemon=True)
          for i, a in enumerate(args_list)]
    for t in ts:
        t.start()
    wait_progressing(m, lambda: any(t.is_alive() for t in ts), what)
    if errors:
        raise errors[0]
    return results


def sync_or_fail(m) -> None:
    run_threads(m, m.sync, [()], what="sync")


# A staging area smaller than what the tests write: writers also wait for segments here.
BIG = dict(staging_size="64M", segment_size="4M")


def test_threads_and_processes_write_different_files(mounts):
    m = mounts.mount(**BIG)
    root = m.mountpoint
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_proc_main, args=(root, f"p{i}", 20, q), daemon=True)
             for i in range(4)]
    for p in procs:
        p.start()
    tags = [t for r in run_threads(m, writer_job, [(root, f"t{i}", 20) for i in range(8)])
            for t in r]
    wait_progressing(m, lambda: any(p.is_alive() for p in procs), "writer processes")
    for p in procs:
        kind, val = q.get(timeout=30)
        assert kind == "ok", val
        tags += val
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert len(tags) == 12 * 20
    verify(root, tags)
    sync_or_fail(m)
    verify(root, tags)
    assert m.stop() == 0
    m2 = mounts.mount(backing=m.backing)
    verify(m2.mountpoint, tags)
    assert sorted(os.listdir(m2.mountpoint)) == sorted([f"p{i}" for i in range(4)] +
                                                       [f"t{i}" for i in range(8)])


def fg_size(k: int) -> int:
    return random.Random(k).randrange(1, 2 * MiB)


def test_reads_while_flushing(mounts):
    """Write a file and read it back at once, many times, while other threads keep the
    flusher busy: every read sees the complete file (from staging or from the logs)."""
    m = mounts.mount(staging_size="256M", segment_size="1M")
    root = m.mountpoint
    stop = threading.Event()

    def background(i):
        k = 0
        while not stop.is_set() and k < 200:
            tag = f"bg{i}_{k}"
            write_file(os.path.join(root, tag), payload(tag, 700 * KiB))
            k += 1

    def foreground():
        try:
            for k in range(60):
                tag = f"fg{k}"
                data = payload(tag, fg_size(k))
                p = os.path.join(root, tag)
                write_file(p, data)
                for _ in range(3):
                    assert read_uncached(p) == data, tag
                # an older file, by now probably on its way to (or in) the data logs
                if k >= 5:
                    old = f"fg{k - 5}"
                    assert read_uncached(os.path.join(root, old)) == payload(
                        old, fg_size(k - 5)), old
        finally:
            stop.set()

    run_threads(m, lambda f, *a: f(*a), [(background, 0), (background, 1), (foreground,)])
    assert m.status()["segments_flushed"] > 0
    assert m.stop() == 0
    m2 = mounts.mount(backing=m.backing)
    for k in range(60):
        tag = f"fg{k}"
        assert read_uncached(os.path.join(m2.mountpoint, tag)) == payload(tag, fg_size(k))


def test_fsync_from_many_threads(mounts):
    m = mounts.mount(staging_size="256M", segment_size="1M")
    root = m.mountpoint
    n_threads, rounds = 6, 15

    def job(i):
        done = []
        for r in range(rounds):
            tag = f"s{i}_{r}"
            p = os.path.join(root, tag)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                data = payload(tag, size_for(tag) // 2 + 1)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if r % 2:
                    os.fdatasync(fd)
                else:
                    os.fsync(fd)
            finally:
                os.close(fd)
            done.append((tag, len(data)))
            if r % 5 == 0:  # fsync of a directory too
                dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        return done

    results = [t for r in run_threads(m, job, [(i,) for i in range(n_threads)]) for t in r]
    assert m.status()["fsyncs"] >= n_threads * rounds
    # everything fsynced is durable now: a SIGKILL must not lose any of it
    m.kill()
    m2 = mounts.mount(backing=m.backing)
    for tag, n in results:
        assert read_uncached(os.path.join(m2.mountpoint, tag)) == payload(tag, n), tag


def test_deleted_while_open(mounts):
    m = mounts.mount()
    root = m.mountpoint
    p = os.path.join(root, "doomed")
    data = payload("doomed", 3 * MiB + 5)
    write_file(p, data)
    m.sync()  # the data is in the logs (and released from staging)
    fd = os.open(p, os.O_RDWR)
    try:
        os.unlink(p)
        assert not os.path.exists(p)
        assert os.fstat(fd).st_nlink == 0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(fd, len(data) + 10, 0) == data
        assert os.pread(fd, 100, MiB) == data[MiB:MiB + 100]
        # it keeps working as a file: write, read back, survive a barrier
        os.pwrite(fd, b"tail", len(data))
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(fd, 10, len(data) - 2) == data[-2:] + b"tail"
        # a new file under the same name is a different file
        write_file(p, b"new")
        assert open(p, "rb").read() == b"new"
        assert os.pread(fd, 4, len(data)) == b"tail"
    finally:
        os.close(fd)
    assert m.stop() == 0
    m2 = mounts.mount(backing=m.backing)
    assert os.listdir(m2.mountpoint) == ["doomed"]
    assert open(os.path.join(m2.mountpoint, "doomed"), "rb").read() == b"new"


def test_backpressure_small_staging(mounts):
    """8 MiB of staging, 1 MiB segments, 200 MiB written by 4 threads: writers wait for the
    flusher, nothing is lost."""
    m = mounts.mount(staging_size="8M", segment_size="1M")
    root = m.mountpoint
    per_thread, file_bytes = 50 * MiB, 5 * MiB

    def job(i):
        tags = []
        for k in range(per_thread // file_bytes):
            tag = f"bp{i}_{k}"
            write_file(os.path.join(root, tag), payload(tag, file_bytes), chunk=256 * KiB + 3)
            tags.append(tag)
        return tags

    tags = [t for r in run_threads(m, job, [(i,) for i in range(4)]) for t in r]
    assert len(tags) * file_bytes == 200 * MiB
    st = m.status()
    assert st["bytes_written"] >= 200 * MiB
    assert st["staging_bytes"] == 8 * MiB
    sync_or_fail(m)
    st = m.status()
    assert st["bytes_durable"] >= 200 * MiB
    assert st["segments_flushed"] >= 200
    for tag in tags[::7]:
        assert read_uncached(os.path.join(root, tag)) == payload(tag, file_bytes), tag
    assert m.stop() == 0
    m2 = mounts.mount(backing=m.backing)
    for tag in tags:
        got = read_uncached(os.path.join(m2.mountpoint, tag))
        assert hashlib.sha256(got).digest() == hashlib.sha256(
            payload(tag, file_bytes)).digest(), tag


def test_waiting_writers_share_freed_segments(mounts):
    """Many writers blocked on a tiny staging area at once. When the flusher frees several
    segments in one go, every woken writer must use the open segment instead of opening
    another one over it: an overwritten open segment is never sealed, so its data is never
    written, every later barrier hangs and its buffer is lost for good."""
    m = mounts.mount(staging_size="256K", segment_size="64K")
    root = m.mountpoint

    def job(i, rnd):
        tags = []
        for k in range(6):
            tag = f"w{rnd}_{i}_{k}"
            n = random.Random(tag).randrange(1, 200 * KiB)
            write_file(os.path.join(root, tag), payload(tag, n))
            tags.append((tag, n))
        return tags

    for rnd in range(5):
        tags = [t for r in run_threads(m, job, [(i, rnd) for i in range(12)]) for t in r]
        sync_or_fail(m)
        for tag, n in tags:
            assert read_uncached(os.path.join(root, tag)) == payload(tag, n), tag
    assert m.stop() == 0
