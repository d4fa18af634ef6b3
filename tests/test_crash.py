"""Crash consistency: the daemon is killed with SIGKILL at random points while a writer process
checkpoints; after `ckptfs umount` (which must detach the stale mount) and a remount, every file
whose fsync / sync returned before the kill reads back exactly, every other file is absent or a
prefix of what was written (each file is written once, front to back, with known contents),
nothing else appears, and `ckptfs verify` exits 0. A torn index tail (truncated at random byte
positions, garbage appended) never stops a mount and never changes what the committed prefix
says.

CKPTFS_CRASH_ITERS sets the number of kill/remount rounds (default 10)."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import pytest
from helpers import (
    KiB, check_tree, cli, content, read_all, read_journal, wait_unmounted, writer_main,
)

from ckptfs import api
from ckptfs.daemon import replay
from ckptfs.format import backingdir, records
from ckptfs.namespace import Namespace

pytestmark = pytest.mark.timeout(240)

ITERS = int(os.environ.get("CKPTFS_CRASH_ITERS", "10"))
CRASH_WRITER_OPTS = dict(staging_size="8M", segment_size="1M", idle_flush=0.1, writer_id="w")


def test_kill_9_mid_checkpoint(mounts, tmp_path):
    backing = mounts.backing()
    mnt = str(tmp_path / "mnt")
    os.mkdir(mnt)
    rng = random.Random(1234)
    planned: dict[str, int] = {}
    durable: set[str] = set()
    seen: dict[str, tuple | None] = {}
    ctx = multiprocessing.get_context("fork")
    m = mounts.mount(backing, mnt, **CRASH_WRITER_OPTS)
    totals = [0, 0, 0]
    for it in range(ITERS):
        jpath = str(tmp_path / f"journal{it}")
        w = ctx.Process(target=writer_main, args=(mnt, it, rng.randrange(1 << 30), jpath))
        w.start()
        time.sleep(rng.uniform(0.2, 1.5))
        os.kill(m.pid, signal.SIGKILL)
        w.join(30)
        assert not w.is_alive(), "writer hung on the dead mount"
        assert api.is_mounted(mnt), "the dead daemon's mount should still be there"
        # The stale mount: `ckptfs umount` detaches it lazily and says so.
        res = cli("umount", mnt)
        msg = res.stderr.strip()
        assert res.returncode != 0 and "daemon is gone" in msg and "detached" in msg, \
            (res.returncode, res.stdout, res.stderr)
        assert msg.startswith("ckptfs: "), msg
        assert wait_unmounted(mnt), "ckptfs umount left the stale mount behind"
        m._reap(kill=False)
        p, d = read_journal(jpath)
        planned.update(p)
        durable |= d
        # The index never points at garbage.
        res = cli("verify", backing)
        assert res.returncode == 0, f"verify after kill {it}: {res.stdout}{res.stderr}"
        m = mounts.mount(backing, mnt, **CRASH_WRITER_OPTS)
        log = mounts.log(m)
        counts = check_tree(mnt, planned, durable, seen, full=it in (0, ITERS - 1))
        totals = [a + b for a, b in zip(totals, counts)]
        assert "Traceback" not in log, log
    m.stop()
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr
    print(f"\n{ITERS} kills: {len(planned)} files planned, {len(durable)} durable before the "
          f"kill; per remount exact/partial/absent summed: {totals}")
    assert len(durable) > 0 and len(planned) > len(durable)


# ---------------------------------------------------------------- torn index tail
def tree_of_index(index: bytes, tmp) -> dict[str, int]:
    """{path: size} of the files that replay of `index` (read-only, in process) yields."""
    p = os.path.join(tmp, "probe-index.log")
    with open(p, "wb") as f:
        f.write(index)
    ns = Namespace(now_ns=0)
    replay(ns, p)
    out = {}

    def walk(x, prefix):
        for name, ino in x.children.items():
            c = ns.inodes[ino]
            path = f"{prefix}{name.decode()}"
            if c.children is not None:
                out[path + "/"] = -1
                walk(c, path + "/")
            else:
                out[path] = c.size
    walk(ns.inodes[1], "")
    return out


def mounted_tree(mnt: str) -> dict[str, int]:
    out = {}
    for d, dirs, files in os.walk(mnt):
        for n in dirs:
            out[os.path.relpath(os.path.join(d, n), mnt) + "/"] = -1
        for n in files:
            p = os.path.join(d, n)
            out[os.path.relpath(p, mnt)] = os.path.getsize(p)
    return out


@pytest.mark.either_transport  # (what a mount makes of its index, before any request)
def test_torn_index_tail_and_garbage(mounts, tmp_path):
    backing = mounts.backing()
    m = mounts.mount(backing, **CRASH_WRITER_OPTS)
    rng = random.Random(99)
    sizes = {}
    for j in range(24):
        name = f"d{j % 3}/f{j}"
        os.makedirs(os.path.join(m.mountpoint, f"d{j % 3}"), exist_ok=True)
        sizes[name] = rng.choice([0, 100, 5000, 300 * KiB, 1200 * KiB])
        with open(os.path.join(m.mountpoint, name), "wb") as f:
            f.write(content(name, sizes[name]))
        m.sync()  # many commit groups
    m.stop()
    index_path = os.path.join(backing, "writers", "w", backingdir.INDEX_NAME)
    orig = read_all(index_path)
    # A mount retires the data logs its index no longer points into, so each cut (which
    # forgets commits) gets the logs back as they were when the whole index was written.
    logs = {p: read_all(p) for p in backingdir.data_logs(os.path.dirname(index_path)).values()}
    assert len(orig) > 2000
    full = tree_of_index(orig, tmp_path)
    assert {k for k in full if not k.endswith("/")} == set(sizes)
    cuts = [0, 7, 16] + sorted(rng.sample(range(17, len(orig)), 5)) + [len(orig)]
    for i, cut in enumerate(cuts):
        garbage = b"" if cut < 16 else (
            rng.randbytes(rng.randint(1, 300)) if i % 3 else
            records.REC_HEADER.pack(0xFFFFFFF0, 0, 1) + rng.randbytes(40))  # huge length field
        with open(index_path, "wb") as f:
            f.write(orig[:cut] + garbage)
        for p, data in logs.items():
            with open(p, "wb") as f:
                f.write(data)
        want = tree_of_index(orig[:max(cut, 16)], tmp_path) if cut >= 16 else {}
        res = cli("verify", backing)
        assert res.returncode == 0, f"cut {cut}: {res.stdout}{res.stderr}"
        if garbage:
            assert "warning:" in res.stderr, f"cut {cut}: no warning about the torn tail"
        m = mounts.mount(backing, **CRASH_WRITER_OPTS)
        try:
            got = mounted_tree(m.mountpoint)
            assert got == want, f"cut at {cut} (+{len(garbage)} garbage bytes): mount shows " \
                f"{len(got)} entries, the committed prefix has {len(want)}"
            for name, size in got.items():
                if not name.endswith("/"):
                    assert read_all(os.path.join(m.mountpoint, name)) == \
                        content(name, sizes[name])[:size], name
            if garbage:
                assert "torn" in mounts.log(m) or "cutting" in mounts.log(m), mounts.log(m)
            if i == len(cuts) - 2:
                # After the tail was cut, new appends are reachable on the next replay.
                with open(os.path.join(m.mountpoint, "after"), "wb") as f:
                    f.write(content("after", 70 * KiB))
                    f.flush()
                    os.fsync(f.fileno())
        finally:
            m.stop()
        if i == len(cuts) - 2:
            m = mounts.mount(backing, **CRASH_WRITER_OPTS)
            assert read_all(os.path.join(m.mountpoint, "after")) == content("after", 70 * KiB)
            assert mounted_tree(m.mountpoint).keys() == set(want) | {"after"}
            m.stop()
        res = cli("verify", backing)
        assert res.returncode == 0, f"cut {cut}, after the remount: {res.stdout}{res.stderr}"
