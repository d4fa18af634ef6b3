"""A job's life on one mount: checkpoints saved and the old ones deleted, with real mounts.
Data logs with no live byte left are retired while mounted (a RETIRE record, then the file
goes), a mount finishes what a crash left (dead or half-retired logs), the index snapshot
keeps the index near the size of the live tree, the cleaner moves what is left in mostly
dead logs; after every remount the files read back bit-exact and `ckptfs verify` is clean."""

from __future__ import annotations

import os
import shutil
import time

import pytest
from helpers import (
    KiB, check_files, cli, content, kill_mid_write, proc_status, read_all,
    read_journal_with_deletes, wait_for, write_file,
)

from ckptfs.format import backingdir, records

pytestmark = pytest.mark.timeout(120)

OPTS = dict(staging_size="16M", segment_size="1M", log_size="4M", writer_id="w",
            idle_flush=0.1)


def wdir(backing: str) -> str:
    return os.path.join(backing, "writers", "w")


def logs_of(backing: str) -> list[int]:
    return sorted(backingdir.data_logs(wdir(backing)))


def after_cleaner_turns(m, n: int = 2) -> dict:
    """Mount m's status once the maintainer has given the cleaner `n` more turns (ticks that
    found the writers idle) than it had at the call: with n >= 2 a whole turn began after the
    call, so what the cleaner has not done by then it chose not to do (a sleep would also pass
    when the maintainer never ran)."""
    start = m.status()["cleaner_turns"]
    return wait_for(lambda: (s := m.status())["cleaner_turns"] >= start + n and s,
                    f"{n} turns of the cleaner")


def snapshot_processes(session: int) -> list[int]:
    """PIDs of the index snapshot processes (datapath/snapshotter.py) of the daemon that leads
    `session` (api.Mount starts each daemon so: its pid): they stay in it when the daemon is
    killed, and other mounts on the machine, whose snapshot processes must not be touched,
    have sessions of their own."""
    out = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"ckptfs.datapath.mover" in f.read() and os.getsid(int(pid)) == session:
                    out.append(int(pid))
        except (OSError, ValueError):
            continue
    return out


def save_step(mnt: str, step: int, files: int = 4, size: int = 700 * KiB) -> dict[str, bytes]:
    d = os.path.join(mnt, f"step_{step}")
    os.mkdir(d)
    out = {}
    for i in range(files):
        name = f"step_{step}/t{i}.pt"
        out[name] = content(name, size + i)
        write_file(os.path.join(mnt, name), out[name])
    return out


def test_rotation_retires_logs_while_mounted(mounts):
    backing = mounts.backing()
    m = mounts.mount(backing, **OPTS)
    live: dict[str, dict[str, bytes]] = {}
    for step in range(8):
        live[step] = save_step(m.mountpoint, step)
        m.sync()
        if step >= 2:
            shutil.rmtree(os.path.join(m.mountpoint, f"step_{step - 2}"))
            del live[step - 2]
    wait_for(lambda: m.status()["logs_retired"] >= 4, "logs to be retired")
    st = m.status()
    kept = sum(len(d) for f in live.values() for d in f.values())
    assert st["live_bytes"] == kept, st
    assert st["data_logs"] <= 4 and len(logs_of(backing)) <= 4, (st, logs_of(backing))
    assert st["bytes_reclaimed"] > 0 and st["dead_bytes"] < 4 << 20, st
    m.stop()
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr
    scan = records.read_index(os.path.join(wdir(backing), backingdir.INDEX_NAME))
    retired = [r.log for g in scan.groups for r in g if type(r) is records.RetireRec]
    assert scan.version == 2 and retired and not set(retired) & set(logs_of(backing))
    m = mounts.mount(backing, **OPTS)
    for files in live.values():
        check_files(files, m.mountpoint)
    # a new log never takes the number of a retired one
    more = save_step(m.mountpoint, 99)
    m.sync()
    assert min(logs_of(backing)) > 0 and max(logs_of(backing)) > max(retired)
    check_files(more, m.mountpoint)
    m.stop()


def test_a_mount_finishes_dead_and_half_retired_logs(mounts):
    backing = mounts.backing()
    m = mounts.mount(backing, **OPTS)
    files = save_step(m.mountpoint, 1)
    m.stop()
    # a log a crash left with nothing committed in it, and a retired log whose file a crash
    # kept (its RETIRE is in the index, the unlink was lost)
    w = wdir(backing)
    top = max(logs_of(backing))
    with open(os.path.join(w, backingdir.data_log_name(top + 1)), "wb") as f:
        f.write(records.data_log_header("w", top + 1) + bytes(8192))
    m = mounts.mount(backing, **OPTS)
    wait_for(lambda: top + 1 not in logs_of(backing), "the dead log to be retired")
    check_files(files, m.mountpoint)
    m.stop()
    with open(os.path.join(w, backingdir.data_log_name(top + 1)), "wb") as f:
        f.write(records.data_log_header("w", top + 1))
    m = mounts.mount(backing, **OPTS)
    wait_for(lambda: top + 1 not in logs_of(backing), "the retired log's file to go")
    m.stop()
    scan = records.read_index(os.path.join(w, backingdir.INDEX_NAME))
    retired = [r.log for g in scan.groups for r in g if type(r) is records.RetireRec]
    assert retired == [top + 1], retired  # retired once, its file removed twice
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr


def test_index_snapshot_keeps_the_index_near_the_live_tree(mounts):
    backing = mounts.backing()
    opts = dict(OPTS, clean_idle=0.2, index_snapshot_min="4K")
    m = mounts.mount(backing, **opts)
    index = os.path.join(wdir(backing), backingdir.INDEX_NAME)
    live: dict[int, dict[str, bytes]] = {}
    sizes = []
    for step in range(8):
        live[step] = save_step(m.mountpoint, step, files=20, size=3 * KiB)
        # an overwrite and a truncate: pieces that are parts of runs
        name = f"step_{step}/t1.pt"
        with open(os.path.join(m.mountpoint, name), "r+b") as f:
            f.seek(100)
            f.write(b"x" * 50)
        os.truncate(os.path.join(m.mountpoint, f"step_{step}/t2.pt"), 1000)
        data = bytearray(live[step][name])
        data[100:150] = b"x" * 50
        live[step][name] = bytes(data)
        live[step][f"step_{step}/t2.pt"] = live[step][f"step_{step}/t2.pt"][:1000]
        m.sync()
        if step >= 2:
            shutil.rmtree(os.path.join(m.mountpoint, f"step_{step - 2}"))
            del live[step - 2]
        # (a whole turn of the maintainer with the writers idle: a snapshot that was due is
        # in place)
        after_cleaner_turns(m)
        sizes.append(os.path.getsize(index))
    # (a snapshot may have been taken steps ago and the index have grown since: the wait is
    # for one that brings it near the live tree, which the maintainer takes once it is idle)
    wait_for(lambda: (s := m.status())["index_snapshots"] >= 2
             and s["index_size_bytes"] <= 2.5 * s["index_fresh_bytes"], "index snapshots")
    assert max(sizes[4:]) < 3 * min(sizes[4:]), sizes
    before = {n: os.stat(os.path.join(m.mountpoint, n)) for f in live.values() for n in f}
    m.stop()
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr
    assert not os.path.exists(index + ".fresh")
    m = mounts.mount(backing, **opts)
    for files in live.values():
        check_files(files, m.mountpoint)
    for n, st0 in before.items():
        st1 = os.stat(os.path.join(m.mountpoint, n))
        assert (st1.st_ino, st1.st_size, st1.st_mtime_ns, st1.st_mode) == \
            (st0.st_ino, st0.st_size, st0.st_mtime_ns, st0.st_mode), n
    m.stop()


@pytest.fixture(scope="module")
def tree_40k(tmp_path_factory) -> str:
    """A backing directory of 40,000 files in 1,000 directories (ckptfs bench mount's layout),
    built once for the module: each test takes a copy of its own (it changes the tree)."""
    from ckptfs.bench.mount import build

    path = str(tmp_path_factory.mktemp("tree_40k"))
    build(path, 40_000, 1000, 4096, 100)
    return path


def test_an_index_snapshot_is_written_by_a_process_of_its_own(mounts, tree_40k):
    """The snapshot's second tree (the index replayed) lives in a process of its own: the
    daemon's memory does not grow by a tree while a snapshot of it is written (a tree of
    28,000 files: ~30 MB in the daemon's process, which it would keep after), the process
    reports its peak, and the tree reads the same after a remount."""
    import threading

    from ckptfs.bench.mount import WRITER

    backing = shutil.copytree(tree_40k, mounts.backing(), dirs_exist_ok=True)
    opts = dict(OPTS, writer_id=WRITER, clean_idle=0.2, index_snapshot_ratio=1.1)
    m = mounts.mount(backing, **opts).wait_settled()  # (its staging memory resident)

    def rss() -> int:
        return proc_status(m.pid)["VmRSS"]
    base, peak, done = rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.005)
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        dirs = sorted(os.listdir(m.mountpoint))
        for d in dirs[:12]:  # the index grows by the removals, the live tree shrinks
            shutil.rmtree(os.path.join(m.mountpoint, d))
        # (snapshots may come between the removals too: the index ends near a fresh one)
        st = wait_for(lambda: (s := m.status())["index_snapshots"] >= 1
                      and s["maintenance"] == "idle"
                      and s["index_size_bytes"] <= 1.1 * s["index_fresh_bytes"] and s,
                      "an index snapshot", timeout=60)
    finally:
        done.set()
        sampler.join()
    print(f"\ndaemon RSS {base >> 20} MiB, at most {peak[0] >> 20} MiB during the removals and "
          f"the snapshot; the snapshot's process {st['index_snapshot_peak_rss_bytes'] >> 20} MiB")
    assert peak[0] - base < 32 << 20, (base, peak[0])  # (in the daemon: +64 MiB)
    assert st["index_snapshot_peak_rss_bytes"] > 30 << 20, st
    keep = dirs[12]
    names = sorted(os.listdir(os.path.join(m.mountpoint, keep)))
    m.stop()
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr
    m = mounts.mount(backing, **opts)
    assert sorted(os.listdir(m.mountpoint)) == dirs[12:]
    assert sorted(os.listdir(os.path.join(m.mountpoint, keep))) == names
    m.stop()


def test_an_unmount_during_an_index_snapshot_leaves_no_fresh_index(mounts, tree_40k):
    """Unmounted while the snapshot's process has its fresh index half written (the process
    held there by SIGSTOP): the daemon kills the process, waits for it to end and removes the
    fresh index; the index in place replays to the same tree."""
    import signal
    import threading

    from ckptfs.bench.mount import WRITER

    backing = shutil.copytree(tree_40k, mounts.backing(), dirs_exist_ok=True)
    opts = dict(OPTS, writer_id=WRITER, clean_idle=0.2, index_snapshot_ratio=1.1)
    m = mounts.mount(backing, **opts)
    fresh = os.path.join(backing, "writers", WRITER, backingdir.INDEX_NAME) + ".fresh"
    dirs = sorted(os.listdir(m.mountpoint))
    daemon = m.pid
    held: list[int] = []
    stop = threading.Event()

    def catch() -> None:  # the snapshot's process, stopped while its fresh index exists
        while not stop.is_set():
            if os.path.exists(fresh):
                for pid in snapshot_processes(daemon):
                    os.kill(pid, signal.SIGSTOP)
                    held.append(pid)
                if held and os.path.exists(fresh):
                    return
                for pid in held:  # (put in place before the stop: the next one)
                    os.kill(pid, signal.SIGCONT)
                held.clear()
            time.sleep(0.0005)
    catcher = threading.Thread(target=catch)
    catcher.start()
    removed = 0
    try:
        for d in dirs[:30]:  # each removal grows the index, and starts snapshots
            shutil.rmtree(os.path.join(m.mountpoint, d))
            removed += 1
            if not catcher.is_alive():
                break
        catcher.join(timeout=30)
    finally:
        stop.set()
        catcher.join()
    assert held, "no snapshot was caught writing its fresh index"
    keep = dirs[removed]
    names = sorted(os.listdir(os.path.join(m.mountpoint, keep)))
    m.stop()
    assert not os.path.exists(fresh)
    assert not set(held) & set(snapshot_processes(daemon)), held
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr
    m = mounts.mount(backing, **opts)
    assert sorted(os.listdir(m.mountpoint)) == dirs[removed:]
    assert sorted(os.listdir(os.path.join(m.mountpoint, keep))) == names
    m.stop()


def test_a_small_tree_gets_its_index_snapshot_without_idle_writers(mounts):
    """A job that saves so often that its writers are never idle for --clean-idle still gets
    index snapshots while its tree is small (they take milliseconds), the first one too."""
    backing = mounts.backing()
    m = mounts.mount(backing, **dict(OPTS, clean_idle=3600, index_snapshot_min="4K"))
    for step in range(8):
        save_step(m.mountpoint, step, files=20, size=3 * KiB)
        m.sync()
        if step >= 2:
            shutil.rmtree(os.path.join(m.mountpoint, f"step_{step - 2}"))
    st = wait_for(lambda: (s := m.status())["index_snapshots"] >= 1 and s, "an index snapshot")
    assert st["index_size_bytes"] <= 2.5 * st["index_fresh_bytes"], st
    m.stop()
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_tree_that_shrank_gets_its_index_snapshot(mounts):
    """The fresh index's size is estimated when the tree is large (a job's new checkpoint
    saved, the old ones not yet deleted); once most of the tree is deleted, the index is
    compared with what a fresh index of the smaller tree would take, not with the estimate
    of the larger one, which it would not pass again for a long time."""
    backing = mounts.backing()
    m = mounts.mount(backing, **dict(OPTS, clean_idle=0.2, index_snapshot_min="4K"))
    index = os.path.join(wdir(backing), backingdir.INDEX_NAME)
    for step in range(6):
        save_step(m.mountpoint, step, files=40, size=KiB)
    m.sync()
    # (two whole turns of the maintainer with the writers idle: the tree's fresh index is
    # estimated, large)
    st = after_cleaner_turns(m)
    assert st["index_fresh_bytes"] > 0, st
    before, snapshots = os.path.getsize(index), st["index_snapshots"]
    for step in range(5):
        shutil.rmtree(os.path.join(m.mountpoint, f"step_{step}"))
    m.sync()
    st = after_cleaner_turns(m)
    assert st["index_snapshots"] > snapshots, st
    # (a sixth of the tree is left: its fresh index is about a sixth of the index before)
    assert os.path.getsize(index) < before / 3, (before, st)
    m.stop()
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_cleaner_moves_what_is_left_in_mostly_dead_logs(mounts):
    """Logs a third live, in holes too small to punch, are left alone with --clean-below 0
    and emptied with the default: their live bytes move into the current log while a reader
    reads them (every read the old copy or the new one), the emptied logs are retired, and
    the files read back bit-exact after a remount."""
    backing = mounts.backing()
    opts = dict(OPTS, clean_idle=0.3, index_snapshot_ratio=0)
    m = mounts.mount(backing, clean_below=0, **opts)
    kept: dict[str, bytes] = {}
    for step in range(10):
        files = save_step(m.mountpoint, step, files=60, size=20 * KiB)
        m.sync()
        # keep one file in three: the logs are a third live, in holes too small to punch
        for i, name in enumerate(files):
            if i % 3:
                os.unlink(os.path.join(m.mountpoint, name))
            else:
                kept[name] = files[name]
    m.sync()
    st = after_cleaner_turns(m)
    assert st["logs_cleaned"] == 0 and st["data_logs"] >= 3, st  # (--clean-below 0: off)
    many = st["data_logs"]
    m.stop()
    m = mounts.mount(backing, **opts)  # the default --clean-below: 0.5
    # a reader while the cleaner moves: every read is the old copy or the new one
    import threading

    from helpers import read_uncached
    stop, bad, reads = threading.Event(), [], [0]

    def reader() -> None:
        while not stop.is_set():
            for name, data in kept.items():
                if read_uncached(os.path.join(m.mountpoint, name)) != data:
                    bad.append(name)
                reads[0] += 1
    t = threading.Thread(target=reader)
    t.start()
    try:
        st = wait_for(lambda: (s := m.status())["logs_cleaned"] >= 2
                      and s["logs_retired"] >= 2 and s["maintenance"] == "idle" and s,
                      "the cleaner")
    finally:
        stop.set()
        t.join()
    assert not bad and reads[0] > 0, (bad, reads)
    assert st["bytes_moved"] > 0 and st["data_logs"] < many, st
    m.sync()  # (moved bytes count for their new log once durable)
    st = m.status()
    assert st["live_bytes"] == sum(len(v) for v in kept.values()), st
    check_files(kept, m.mountpoint)
    m.stop()
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr
    m = mounts.mount(backing, **opts)
    check_files(kept, m.mountpoint)
    m.stop()


# ---------------------------------------------------------------- crashes
CRASH_OPTS = dict(staging_size="8M", segment_size="256K", log_size="1M", writer_id="w",
                  idle_flush=0.05, clean_idle=0.05, clean_below=0.6,
                  index_snapshot_min="2K", index_snapshot_ratio=1.5)
CRASH_ITERS = int(os.environ.get("CKPTFS_LIFECYCLE_CRASH_ITERS", "8"))


def rotating_writer(mnt: str, it: int, seed: int, journal_path: str) -> None:
    """Checkpoints i<it>_s<k>/ of a few files, each saved, fsynced ('D name' once durable),
    the older ones deleted so that two stay (and one file of each kept a while longer: logs
    partly dead, for the cleaner), short pauses between steps (the maintainer's idle time),
    until the file system goes away. 'P name size' is noted before a file is created, 'U name'
    before it is deleted."""
    import random as _random

    rng = _random.Random(seed)
    jfd = os.open(journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(line: str) -> None:
        os.write(jfd, (line + "\n").encode())

    try:
        for k in range(10_000):
            d = f"i{it}_s{k}"
            os.mkdir(os.path.join(mnt, d))
            names = []
            for j in range(rng.randint(2, 5)):
                name = f"{d}/f{j}"
                size = rng.choice([0, 3000, 70 * KiB, 300 * KiB, 600 * KiB])
                note(f"P {name} {size}")
                write_file(os.path.join(mnt, name), content(name, size))
                names.append(name)
            fd = os.open(os.path.join(mnt, d), os.O_RDONLY)
            os.fsync(fd)  # a barrier: everything before it is durable
            os.close(fd)
            for name in names:
                note(f"D {name}")
            if k >= 2:
                old = f"i{it}_s{k - 2}"
                for n in sorted(os.listdir(os.path.join(mnt, old)))[1:]:
                    note(f"U {old}/{n}")
                    os.unlink(os.path.join(mnt, old, n))
            if k >= 4:
                old = f"i{it}_s{k - 4}"
                for n in os.listdir(os.path.join(mnt, old)):
                    note(f"U {old}/{n}")
                shutil.rmtree(os.path.join(mnt, old))
            time.sleep(rng.uniform(0.0, 0.25))
    except OSError:
        pass  # the daemon is gone: the point
    finally:
        os.close(jfd)


def live_per_log(backing: str) -> dict[int, int]:
    """Offline: the live bytes the committed index points at in each data log."""
    from ckptfs.namespace import Namespace
    from ckptfs.replay import replay

    ns = Namespace(now_ns=0)
    replay(ns, os.path.join(wdir(backing), backingdir.INDEX_NAME))
    out: dict[int, int] = {}
    for x in ns.inodes.values():
        if x.emap is not None:
            for p in x.emap.pieces:
                out[p.run.log] = out.get(p.run.log, 0) + p.length
    return out


def test_a_log_held_only_by_unlinked_open_files_waits_for_their_close(mounts):
    """A closed log whose live bytes all belong to files unlinked but still open has nothing
    the cleaner could move (no name reaches them; their dead neighbours are holes too small
    to punch): it is not looked at again and again, and it goes once they are closed."""
    backing = mounts.backing()
    m = mounts.mount(backing, **dict(OPTS, clean_idle=0.2, index_snapshot_ratio=0))
    files = save_step(m.mountpoint, 0, files=220, size=20 * KiB)  # log 1 fills: log 2 opens
    m.sync()
    first = logs_of(backing)[0]
    held = {name: open(os.path.join(m.mountpoint, name), "rb")
            for i, name in enumerate(files) if i % 3 == 0}
    try:
        for name in files:
            os.unlink(os.path.join(m.mountpoint, name))
        m.sync()
        st = after_cleaner_turns(m)
        assert st["logs_cleaned"] == 0 and st["bytes_moved"] == 0, st
        assert first in logs_of(backing)  # (its live bytes: the open files')
        for name, f in held.items():
            assert f.read() == files[name], name
    finally:
        for f in held.values():
            f.close()
    wait_for(lambda: first not in logs_of(backing), "the log to go after the close")
    m.stop()
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_remount_leaves_the_last_log_of_a_small_tree_where_it_is(mounts):
    """The log a mount last wrote is mostly empty when a small tree is mounted again:
    copying its few live bytes into a new log would free nothing (less than a segment)."""
    backing = mounts.backing()
    opts = dict(OPTS, clean_idle=0.2)
    m = mounts.mount(backing, **opts)
    write_file(os.path.join(m.mountpoint, "x"), b"x" * 1000)
    m.stop()
    before = logs_of(backing)
    m = mounts.mount(backing, **opts)
    st = after_cleaner_turns(m)
    assert st["logs_cleaned"] == 0 and st["bytes_moved"] == 0, st
    assert logs_of(backing)[:len(before)] == before
    m.stop()


def test_kill_9_while_cleaning_retiring_and_snapshotting(mounts, tmp_path):
    import multiprocessing
    import random

    from helpers import first_mismatch

    from ckptfs import api

    backing = mounts.backing()
    mnt = str(tmp_path / "mnt")
    os.mkdir(mnt)
    rng = random.Random(4321)
    ctx = multiprocessing.get_context("fork")
    planned: dict[str, int] = {}
    durable: set[str] = set()
    deleted: set[str] = set()
    seen_doing: set[str] = set()
    m = mounts.mount(backing, mnt, **CRASH_OPTS)
    for it in range(CRASH_ITERS):
        jpath = str(tmp_path / f"journal{it}")
        w = ctx.Process(target=rotating_writer, args=(mnt, it, rng.randrange(1 << 30), jpath))
        w.start()
        # half the kills wait for the maintainer to be in the middle of something
        deadline = time.monotonic() + rng.uniform(0.8, 2.5)
        want = rng.choice(["cleaning", "retiring", "index snapshot", None])
        while time.monotonic() < deadline:
            try:
                doing = api.status(mnt, timeout=5)["maintenance"]
            except OSError:
                break
            if doing != "idle":
                seen_doing.add(doing.split(" data log")[0])
                if want is not None and want in doing:
                    break
            time.sleep(rng.uniform(0.0, 0.02))
        daemon = m.pid
        kill_mid_write(m, w, mnt)
        # an index snapshot's process dies with its daemon (it would write a fresh index
        # while the next mount runs)
        wait_for(lambda: not snapshot_processes(daemon), "the snapshot process to die with the "
                 "daemon", timeout=5)
        p, d, u = read_journal_with_deletes(jpath)
        planned.update(p)
        durable |= d
        deleted |= u
        res = cli("verify", backing)
        assert res.returncode == 0, f"verify after kill {it}: {res.stdout}{res.stderr}"
        live = live_per_log(backing)
        dead = {n for n in logs_of(backing) if live.get(n, 0) == 0}
        m = mounts.mount(backing, mnt, **CRASH_OPTS)
        for name, size in planned.items():
            path = os.path.join(mnt, name)
            if not os.path.exists(path):
                assert name not in durable or name in deleted, \
                    f"{name}: durable and never deleted, gone after kill {it}"
                continue  # absent: never durable, or deleted (its unlink committed)
            got, want_bytes = read_all(path), content(name, size)
            if name in durable:
                assert got == want_bytes, f"{name}: durable, first difference at " \
                    f"{first_mismatch(got, want_bytes)} after kill {it}"
            else:
                assert want_bytes.startswith(got), f"{name}: not a state it ever had"
        # what the crash left (dead logs, a half-retired one, a stray fresh index) is finished
        wait_for(lambda: not dead & set(logs_of(backing)), f"dead logs {dead} to be retired")
        # (the new mount's own snapshot may be writing one: it is put in place soon)
        wait_for(lambda: not os.path.exists(os.path.join(wdir(backing), "index.log.fresh")),
                 "no fresh index left", timeout=10)
        assert "Traceback" not in mounts.log(m), mounts.log(m)
    m.stop()
    # a log the cleaner emptied just before the unmount is retired by the next mount
    live = live_per_log(backing)
    dead = {n for n in logs_of(backing) if live.get(n, 0) == 0}
    m = mounts.mount(backing, mnt, **CRASH_OPTS)
    wait_for(lambda: not dead & set(logs_of(backing)), f"dead logs {dead} to be retired")
    m.stop()
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr
    print(f"\n{CRASH_ITERS} kills; the maintainer was seen {sorted(seen_doing)}; "
          f"{len(planned)} files planned, {len(durable)} durable")
    assert len(durable) > 0


def test_dead_checkpoints_are_punched_out_of_a_log_still_in_use(mounts):
    backing = mounts.backing()
    opts = dict(OPTS, log_size="64M", clean_idle=0.2, index_snapshot_ratio=0)
    m = mounts.mount(backing, **opts)
    live: dict[int, dict[str, bytes]] = {}
    for step in range(6):
        live[step] = save_step(m.mountpoint, step)
        m.sync()
        if step >= 2:
            shutil.rmtree(os.path.join(m.mountpoint, f"step_{step - 2}"))
            del live[step - 2]
    m.sync()
    # (a tick may punch an early step while the loop still runs: the wait is for all of them)
    st = wait_for(lambda: (s := m.status())["bytes_punched"] > 0 and s["dead_bytes"] < 4 << 20
                  and s, "the dead checkpoints punched")
    kept = sum(len(d) for f in live.values() for d in f.values())
    assert st["live_bytes"] == kept, st
    disk = sum(os.stat(p).st_blocks * 512 for p in backingdir.data_logs(wdir(backing)).values())
    prealloc = (64 << 20) - st["data_log_bytes"]  # (the log is allocated ahead of its end)
    assert disk < kept + prealloc + (1 << 20), (disk, kept, prealloc)
    for files in live.values():
        check_files(files, m.mountpoint)
    m.stop()
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr
    m = mounts.mount(backing, **opts)
    for files in live.values():
        check_files(files, m.mountpoint)
    m.stop()


def test_compact_writes_aligned_segments_above_every_retired_number(mounts):
    backing = mounts.backing()
    m = mounts.mount(backing, **OPTS)
    live: dict[int, dict[str, bytes]] = {}
    for step in range(6):
        live[step] = save_step(m.mountpoint, step, files=7, size=300 * KiB)
        m.sync()
        if step >= 2:
            shutil.rmtree(os.path.join(m.mountpoint, f"step_{step - 2}"))
            del live[step - 2]
    wait_for(lambda: m.status()["logs_retired"] >= 2, "retired logs")
    m.stop()
    index = os.path.join(wdir(backing), backingdir.INDEX_NAME)
    retired = {r.log for g in records.read_index(index).groups for r in g
               if type(r) is records.RetireRec}
    before = logs_of(backing)
    res = cli("compact", backing)
    assert res.returncode == 0, res.stdout + res.stderr
    after = logs_of(backing)
    assert min(after) > max(max(before), max(retired)), (before, retired, after)
    scan = records.read_index(index)
    # inode numbers are kept (other writers' records may name them), so a NUMBERS record
    # keeps them from reuse: version 2, nothing newer
    assert scan.version == 2 and any(type(r) is records.NumbersRec for g in scan.groups for r in g)
    for g in scan.groups:
        for r in g:
            if type(r) is records.ExtentRec:
                assert r.loff >= records.DATA_HEADER_BYTES and r.length <= 2 << 20
    for n in after:  # whole segments, padded to the alignment
        assert os.path.getsize(os.path.join(wdir(backing), backingdir.data_log_name(n))) \
            % 4096 == 0
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr
    m = mounts.mount(backing, **OPTS)
    for files in live.values():
        check_files(files, m.mountpoint)
    m.stop()
