"""Load: many concurrent writers (threads and processes, hundreds of open files) and readers
for a bounded time, everything verified at the end and after a remount; the daemon's memory
stays bounded while writing several times the staging size; data-log rollover under load.

CKPTFS_SOAK_S sets the duration of the concurrent load (default 8 s; `make soak`: 600)."""

from __future__ import annotations

import multiprocessing
import os
import random
import threading
import time

import pytest
from helpers import (
    KiB, MiB, cli, content, proc_status, read_all, status_reaches, verify_and_remount,
)

SOAK_S = float(os.environ.get("CKPTFS_SOAK_S", "8"))
pytestmark = pytest.mark.timeout(max(180, int(SOAK_S * 3 + 120)))


# ---------------------------------------------------------------- concurrent load
KEEP_FILES = 120  # finished files each writer thread keeps; older ones it removes
LOG_BYTES = 64 * MiB  # (small: logs roll over, and are retired, within a few seconds)


def _worker(mnt: str, wid: int, seconds: float, out_path: str) -> None:
    """One process: 3 writer threads, each keeping 40 files open at once and writing them
    round-robin in random chunks, and removing its oldest finished files as it goes (as a job
    rotates its checkpoints), plus a reader thread checking finished files."""
    done: dict[str, int] = {}  # finished and not removed: name -> size
    removed: list[str] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds
    errors: list[str] = []

    def writer(t: int) -> None:
        rng = random.Random(wid * 100 + t)
        n = 0
        mine: list[str] = []  # this thread's finished files, oldest first
        try:
            while time.monotonic() < stop:
                batch = []
                for _ in range(40):
                    name = f"p{wid}/t{t}/f{n}"
                    n += 1
                    size = rng.choice([0, 100, 4 * KiB, 50 * KiB, 300 * KiB])
                    fd = os.open(os.path.join(mnt, name), os.O_WRONLY | os.O_CREAT, 0o644)
                    batch.append([name, size, fd, 0, content(name, size)])
                while batch:
                    for b in list(batch):
                        name, size, fd, pos, data = b
                        k = min(size - pos, rng.choice([1000, 64 * KiB, 200 * KiB]))
                        if k:
                            os.write(fd, data[pos:pos + k])
                            b[3] = pos + k
                        if b[3] >= size:
                            if rng.random() < 0.05:
                                os.fsync(fd)
                            os.close(fd)
                            batch.remove(b)
                            mine.append(name)
                            with lock:
                                done[name] = size
                while len(mine) > KEEP_FILES:
                    old = mine.pop(0)
                    with lock:
                        del done[old]
                        removed.append(old)
                    os.unlink(os.path.join(mnt, old))
        except Exception as exc:  # noqa: BLE001
            errors.append(f"writer {t}: {exc!r}")

    def reader() -> None:
        rng = random.Random(wid)
        try:
            while time.monotonic() < stop:
                with lock:
                    pick = rng.choice(tuple(done.items())) if done else None
                if pick is None:
                    time.sleep(0.01)
                    continue
                name, size = pick
                try:
                    got = read_all(os.path.join(mnt, name))
                except FileNotFoundError:
                    with lock:
                        if name in done:  # (removed since it was picked: fine)
                            errors.append(f"reader: {name} is gone")
                    continue
                if got != content(name, size):
                    errors.append(f"reader: {name} reads {len(got)} bytes, wrong")
        except Exception as exc:  # noqa: BLE001
            errors.append(f"reader: {exc!r}")

    for t in range(3):
        os.makedirs(os.path.join(mnt, f"p{wid}/t{t}"))
    threads = [threading.Thread(target=writer, args=(t,)) for t in range(3)]
    threads.append(threading.Thread(target=reader))
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    with open(out_path, "w") as f:
        for e in errors:
            f.write(f"E {e}\n")
        for name, size in done.items():
            f.write(f"F {name} {size}\n")
        for name in removed:
            f.write(f"R {name}\n")


def test_concurrent_writers_and_readers(mounts, tmp_path):
    """Writers that never pause, removing old files as they go: everything reads back, the
    removed files are gone, and the space the data logs take up stays bounded meanwhile."""
    backing = mounts.backing()
    opts = dict(staging_size="32M", segment_size="2M", log_size=LOG_BYTES, writer_id="w")
    m = mounts.mount(backing, **opts)
    ctx = multiprocessing.get_context("fork")
    procs = []
    for wid in range(3):
        p = ctx.Process(target=_worker, args=(m.mountpoint, wid, SOAK_S,
                                              str(tmp_path / f"out{wid}")))
        p.start()
        procs.append(p)
    # Meanwhile: status and sync from the outside.
    max_open = 0
    samples = []
    while any(p.is_alive() for p in procs):
        st = m.status()
        max_open = max(max_open, len(os.listdir(f"/proc/{m.pid}/fd")))
        assert st["bytes_staged"] <= st["staging_bytes"]
        samples.append((st["live_bytes"], st["data_log_bytes"] - st["bytes_punched"],
                        st["data_log_disk_bytes"]))
        time.sleep(0.5)
        if random.random() < 0.3:
            m.sync()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    files, removed = {}, []
    for wid in range(3):
        with open(tmp_path / f"out{wid}") as f:
            for line in f:
                assert not line.startswith("E "), line
                if line.startswith("R "):
                    removed.append(line.split()[1])
                    continue
                _, name, size = line.split()
                files[name] = int(size)
    assert len(files) + len(removed) > 300
    for name, size in files.items():
        assert read_all(os.path.join(m.mountpoint, name)) == content(name, size), name
    for name in removed:
        assert not os.path.exists(os.path.join(m.mountpoint, name)), name
    total = sum(files.values())
    # Space: logs whose files are all removed are retired on the maintainer's turns, also
    # while the writers write (punching and cleaning wait for idle writers: these never
    # pause), so what the logs hold beyond the live bytes stays within a few logs (those whose
    # last files are not removed yet). (A machine busy with other work may give the last
    # turns after the writers stop.)
    status_reaches(m, "logs_retired", 1)
    live, held, disk = max(samples, key=lambda s: s[1] - s[0])
    assert held - live <= 6 * LOG_BYTES, samples
    print(f"\n{SOAK_S:.0f} s: {len(files) + len(removed)} files written, {len(removed)} "
          f"removed, {total / MiB:.0f} MiB left, by 3 processes x 3 writer threads (120 "
          f"files open per process) + 3 readers; verified live and after a remount; data "
          f"logs held at most {(held - live) / MiB:.0f} MiB more than the {live / MiB:.0f} MiB "
          f"live")
    verify_and_remount(mounts, m, backing, opts, files).stop()


# ---------------------------------------------------------------- memory bound
def test_memory_bound(mounts):
    """Staging 32M, read cache 32M; 400 MiB written by 4 threads into 100 files, then read
    back. VmHWM of the daemon must stay under its baseline after mount + staging + read
    cache + 48 MiB: request buffers (pyfuse3 hands each <=1 MiB WRITE as a fresh bytes, a few
    in flight), the reader's coalesced preads (prefetch, up to 64 MiB read into a bytearray
    before the cache keeps its part... bounded by --prefetch, set to 16M here), thread stacks
    and Python objects for 100 inodes."""
    staging, cache, prefetch = 32 * MiB, 32 * MiB, 16 * MiB
    m = mounts.mount(staging_size="32M", segment_size="4M", read_cache="32M",
                     prefetch="16M", no_populate=True)
    time.sleep(0.5)
    base = proc_status(m.pid)
    nfiles, size = 100, 4 * MiB
    names = [f"f{i:03d}" for i in range(nfiles)]
    blob = {n: content(n, size) for n in names[:1]}  # content is cheap; generate per file

    def write(chunk):
        for n in chunk:
            with open(os.path.join(m.mountpoint, n), "wb") as f:
                data = content(n, size)
                for off in range(0, size, MiB):
                    f.write(data[off:off + MiB])

    threads = [threading.Thread(target=write, args=(names[i::4],)) for i in range(4)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    waiting = 0
    while any(t.is_alive() for t in threads):
        waiting = max(waiting, m.status()["writers_waiting"])
        time.sleep(0.05)
    for t in threads:
        t.join()
    m.sync()
    wrote_s = time.monotonic() - t0
    after_write = proc_status(m.pid)
    for n in names:
        assert read_all(os.path.join(m.mountpoint, n)) == content(n, size), n
    after_read = proc_status(m.pid)
    overhead = 48 * MiB
    bound = base["VmRSS"] + staging + cache + prefetch + overhead
    print(f"\ndaemon baseline RSS {base['VmRSS'] / MiB:.0f} MiB; wrote {nfiles * size / MiB:.0f}"
          f" MiB in {wrote_s:.1f} s (max writers waiting {waiting}); VmHWM after writing "
          f"{after_write['VmHWM'] / MiB:.0f} MiB, after reading {after_read['VmHWM'] / MiB:.0f}"
          f" MiB; bound {bound / MiB:.0f} MiB = baseline + staging 32 + cache 32 + prefetch 16"
          f" + overhead 48")
    assert after_write["VmHWM"] <= bound
    assert after_read["VmHWM"] <= bound
    del blob
    m.stop()


def test_a_mount_that_reads_faults_its_staging_in_only_once_quiet(mounts):
    """A job that resumes reads its checkpoint right after the mount: the staging memory is
    left unfaulted while READs come (FaultIn.when_due), and faulted in once the
    mount has been quiet for a while."""
    m = mounts.mount(staging_size="256M", segment_size="4M")
    path = os.path.join(m.mountpoint, "ckpt")
    with open(path, "wb") as f:
        f.write(content("ckpt", 8 * MiB))
    backing = m.backing
    m.stop()
    m = mounts.mount(backing, staging_size="256M", segment_size="4M")
    path = os.path.join(m.mountpoint, "ckpt")
    end = time.monotonic() + 3.0
    while time.monotonic() < end:  # (READs all the time: each pass drops the cached pages)
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(fd, 8 * MiB, 0) == content("ckpt", 8 * MiB)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    st = m.status()
    assert st["staging_faulted_bytes"] == 0 and st["staging_fixed_buffers"] == 0, st
    st = m.wait_settled(30).status()
    assert st["staging_faulted_bytes"] == 256 * MiB, st


def test_staging_is_faulted_in_while_the_mount_serves(mounts):
    """The mount does not wait for its staging memory: the flusher faults it in and registers
    it with io_uring once the mount serves, and writes landing meanwhile stay exact (faulting
    in changes no byte). With no_populate it stays unfaulted and unregistered."""
    staging, seg = 256 * MiB, 4 * MiB
    m = mounts.mount(staging_size="256M", segment_size="4M")
    names = [f"early{i}" for i in range(4)]

    def write(n):
        with open(os.path.join(m.mountpoint, n), "wb") as f:
            f.write(content(n, 6 * MiB))

    threads = [threading.Thread(target=write, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m.sync()
    st = m.wait_settled(30).status()
    assert st["staging_faulted_bytes"] == staging, st
    # (registered by the flusher right after)
    status_reaches(m, "staging_fixed_buffers", staging // seg)
    assert proc_status(m.pid)["VmRSS"] >= staging
    for n in names:
        assert read_all(os.path.join(m.mountpoint, n)) == content(n, 6 * MiB), n
    backing = m.backing
    m.stop()
    m2 = mounts.mount(backing, staging_size="256M", segment_size="4M", no_populate=True)
    base = proc_status(m2.pid)["VmRSS"]
    for n in names:
        assert read_all(os.path.join(m2.mountpoint, n)) == content(n, 6 * MiB), n
    with open(os.path.join(m2.mountpoint, "late"), "wb") as f:
        f.write(content("late", 8 * MiB))
    m2.sync()
    time.sleep(0.5)
    st = m2.wait_settled(1).status()  # (nothing to wait for)
    assert st["staging_fixed_buffers"] == 0 and st["staging_faulted_bytes"] == 0
    # (the read cache and the segments written take their memory; most of staging does not)
    assert proc_status(m2.pid)["VmRSS"] < base + staging // 2


# ---------------------------------------------------------------- log rollover
def test_log_rollover_in_batch(mounts):
    """Small data logs (3 MiB, 1 MiB segments) so that flush batches of several segments
    cross a log boundary all the time; no errors involved."""
    backing = mounts.backing()
    m = mounts.mount(backing, staging_size="16M", segment_size="1M", log_size="3M")
    for i in range(30):
        with open(os.path.join(m.mountpoint, f"f{i}"), "wb") as f:
            f.write(content(f"f{i}", 3 * MiB + 1000))
    m.stop()
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout[-2000:]
