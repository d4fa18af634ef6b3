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
from helpers_reliability import KiB, cli, content, read_all, write_file

from ckptfs.format import backingdir, records

pytestmark = pytest.mark.timeout(120)

OPTS = dict(staging_size="16M", segment_size="1M", log_size="4M", writer_id="w",
            idle_flush=0.1)


def wdir(backing: str) -> str:
    return os.path.join(backing, "writers", "w")


def logs_of(backing: str) -> list[int]:
    return sorted(backingdir.data_logs(wdir(backing)))


def wait_for(pred, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def save_step(mnt: str, step: int, files: int = 4, size: int = 700 * KiB) -> dict[str, bytes]:
    d = os.path.join(mnt, f"step_{step}")
    os.mkdir(d)
    out = {}
    for i in range(files):
        name = f"step_{step}/t{i}.pt"
        out[name] = content(name, size + i)
        write_file(os.path.join(mnt, name), out[name])
    return out


def check(mnt: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        assert read_all(os.path.join(mnt, name)) == data, name


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
        check(m.mountpoint, files)
    # a new log never takes the number of a retired one
    more = save_step(m.mountpoint, 99)
    m.sync()
    assert min(logs_of(backing)) > 0 and max(logs_of(backing)) > max(retired)
    check(m.mountpoint, more)
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
    check(m.mountpoint, files)
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
        wait_for(lambda: m.status()["maintenance"] == "idle", "the maintainer")
        time.sleep(0.5)
        sizes.append(os.path.getsize(index))
    st = wait_for(lambda: (s := m.status())["index_snapshots"] >= 2 and s, "index snapshots")
    assert st["index_size_bytes"] <= 2.5 * st["index_fresh_bytes"], st
    assert max(sizes[4:]) < 3 * min(sizes[4:]), sizes
    before = {n: os.stat(os.path.join(m.mountpoint, n)) for f in live.values() for n in f}
    m.stop()
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr
    assert not os.path.exists(index + ".fresh")
    m = mounts.mount(backing, **opts)
    for files in live.values():
        check(m.mountpoint, files)
    for n, st0 in before.items():
        st1 = os.stat(os.path.join(m.mountpoint, n))
        assert (st1.st_ino, st1.st_size, st1.st_mtime_ns, st1.st_mode) == \
            (st0.st_ino, st0.st_size, st0.st_mtime_ns, st0.st_mode), n
    m.stop()


def test_the_cleaner_moves_what_is_left_in_mostly_dead_logs(mounts):
    backing = mounts.backing()
    opts = dict(OPTS, clean_idle=0.3, index_snapshot_ratio=0)
    m = mounts.mount(backing, clean_below=0, **opts)
    kept: dict[str, bytes] = {}
    for step in range(6):
        files = save_step(m.mountpoint, step, files=5, size=600 * KiB)
        m.sync()
        for name in list(files)[1:]:  # keep one file of each step: the logs are ~20% live
            os.unlink(os.path.join(m.mountpoint, name))
        kept[list(files)[0]] = files[list(files)[0]]
    m.sync()
    time.sleep(1.5)
    st = m.status()
    assert st["logs_cleaned"] == 0 and st["data_logs"] >= 3, st  # (--clean-below 0: off)
    many = st["data_logs"]
    m.stop()
    m = mounts.mount(backing, **opts)  # the default --clean-below: 0.5
    st = wait_for(lambda: (s := m.status())["logs_cleaned"] >= 2 and s["logs_retired"] >= 2
                  and s["maintenance"] == "idle" and s, "the cleaner")
    assert st["bytes_moved"] > 0 and st["data_logs"] < many, st
    m.sync()  # (moved bytes count for their new log once durable)
    st = m.status()
    assert st["live_bytes"] == sum(len(v) for v in kept.values()), st
    check(m.mountpoint, kept)
    m.stop()
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr
    m = mounts.mount(backing, **opts)
    check(m.mountpoint, kept)
    m.stop()
