"""Memory is the nearest tier: a written segment's buffer keeps its bytes until the staging
pool hands it out again, and READs of its runs are served from there, not from the disk
(staging.Staging.kept). What must hold: a file read back right after its fsync comes from
memory (read_memory_bytes) with no byte read from disk; once more than the staging size was
written after it, its segments' buffers are reused and it comes from disk, right; and reads
racing with writes that recycle the buffers (the queue threads land payloads in the buffers
offered next) never see another segment's bytes."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest

from helpers import content, first_mismatch, read_uncached, status_reaches, write_file

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20


def _same(got: bytes, want: bytes, what: str) -> None:
    assert len(got) == len(want), (what, len(got), len(want))
    assert got == want, f"{what}: first wrong byte at {first_mismatch(got, want)}"


def test_read_back_after_fsync_comes_from_memory(mounts):
    m = mounts.mount()  # (4 MiB segments, 64 MiB of staging)
    p = os.path.join(m.mountpoint, "a.bin")
    data = content("a", 24 * MiB + 12345)  # six segments and a piece
    write_file(p, data, fsync=True)
    st = m.status()
    assert st["staging_kept_bytes"] >= len(data)  # (written, their buffers in the pool)
    disk, memory = st["read_disk_bytes"], st["read_memory_bytes"]
    _same(read_uncached(p), data, "a.bin")
    # (every byte went through the daemon's read path: the READs had their chance to read
    # the disk)
    status_reaches(m, "read_memory_bytes", memory + len(data))
    st = m.status()
    assert st["read_disk_bytes"] == disk, st


def test_a_file_whose_buffers_were_reused_comes_from_disk(mounts):
    m = mounts.mount()
    first = os.path.join(m.mountpoint, "first.bin")
    data = content("first", 20 * MiB + 999)
    write_file(first, data, fsync=True)
    more = os.path.join(m.mountpoint, "more.bin")
    later = content("more", 80 * MiB)  # past the 64 MiB of staging: every buffer reused
    write_file(more, later, fsync=True)
    st = m.status()
    disk, memory = st["read_disk_bytes"], st["read_memory_bytes"]
    _same(read_uncached(first), data, "first.bin")
    status_reaches(m, "read_disk_bytes", disk + len(data))
    assert m.status()["read_memory_bytes"] == memory  # (not one byte of it was kept)
    # the later file: its last segments are still kept, its first ones come from disk
    _same(read_uncached(more), later, "more.bin")
    st = m.status()
    assert st["read_memory_bytes"] > memory and st["read_disk_bytes"] > disk + len(data), st


def test_reads_while_writes_recycle_the_buffers(mounts):
    """Readers read back files just written while a writer keeps writing new ones through a
    small pool (1 MiB segments, 8 of them): the buffers are reused while READs are served
    from them, and offered to the queue threads for the next payloads. The readers pick among
    the files of the last 12 MiB written, so most reads are of the oldest buffers kept, the
    next ones to be reused. Every read is right; both tiers served some."""
    m = mounts.mount(staging_size="8M", segment_size="1M", read_cache="16M")
    root = m.mountpoint
    done: list[tuple[str, int]] = []  # files written (and closed), in order, and where
    # they end in the bytes written so far
    errors: list[str] = []
    stop = threading.Event()
    rng = random.Random(7)
    sizes = [rng.choice([40_000, 300_000, MiB - 3, MiB + 17, 3 * MiB + 5])
             for _ in range(240)]

    def writer() -> None:
        total = 0
        try:
            for i, n in enumerate(sizes):
                name = f"f{i:03d}"
                write_file(os.path.join(root, name), content(name, n), fsync=i % 8 == 7)
                total += n
                done.append((name, total))
        except Exception as exc:  # (said in the test's failure, not lost with the thread)
            errors.append(f"writer: {exc!r}")
        finally:
            stop.set()

    reads = [0]

    def reader(seed: int) -> None:
        r = random.Random(seed)
        try:
            while not stop.is_set() or reads[0] < 200:
                if not done:
                    time.sleep(0.001)
                    continue
                k, total = len(done), done[-1][1]
                first = next(j for j in range(max(0, k - 40), k)
                             if done[j][1] > total - 12 * MiB)
                name = done[r.randrange(first, k)][0]
                i = int(name[1:])
                got = read_uncached(os.path.join(root, name))
                want = content(name, sizes[i])
                if got != want:
                    errors.append(f"{name}: first wrong byte at {first_mismatch(got, want)}")
                    return
                reads[0] += 1
        except Exception as exc:
            errors.append(f"reader: {exc!r}")

    threads = [threading.Thread(target=writer)] + [
        threading.Thread(target=reader, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"
    assert not errors, errors
    st = m.status()
    assert reads[0] >= 200 and st["segments_flushed"] > 3 * 8, (reads[0], st["segments_flushed"])
    assert st["read_memory_bytes"] > 0 and st["read_disk_bytes"] > 0, st
