"""The node tier (--local-dir): segments are committed in a directory on node-local storage first
and drained to the backing directory in the background (ckptfs/datapath/tier.py).

What a user relies on, each on real mounts: the backing directory stays an ordinary one (a mount
without the tier, `ckptfs verify`), the levels (`user.ckptfs.level`, `ckptfs sync --level`,
`ckptfs wait`), a killed daemon (node-durable files come back bit-exact from the same local
directory and the drain finishes; without it, exactly the backing-durable files are there),
a foreign local directory refused, local space bounded (writers wait, never fail), and the
cleaner's removals and hole punching done to both copies."""

from __future__ import annotations

import errno
import multiprocessing
import os
import random
import shutil
import signal
import threading
import time

import pytest
from helpers import (
    CRASH_WRITER_OPTS, MiB, check_files, check_tree, cli, content, flip_byte, kill_mid_write,
    proc_status, read_journal, status_reaches, wait_for, wait_unmounted, write_file, writer_main,
)

from ckptfs import api
from ckptfs.bench import drop_caches

pytestmark = pytest.mark.timeout(180)

OPTS = dict(staging_size="16M", segment_size="1M", idle_flush=0.2, writer_id="w")


def _write(mnt: str, name: str, size: int, fsync: bool = False) -> bytes:
    data = content(name, size)
    path = os.path.join(mnt, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_file(path, data, fsync=fsync)
    return data


def _blocks(d: str) -> int:
    return sum(os.stat(os.path.join(d, n)).st_blocks * 512 for n in os.listdir(d)
               if n.startswith("data-"))


def _tier_mount(mounts, tmp_path, held: bool = False, **opts):
    """A mount with the node tier (OPTS, then `opts`) over a fresh backing directory, its
    local directory tmp_path/local. Its drain waits while the file `hold` exists (made here
    with `held`). Returns (mount, backing, local, hold)."""
    backing, local = mounts.backing(), str(tmp_path / "local")
    os.mkdir(local)
    hold = str(tmp_path / "hold-drain")
    if held:
        open(hold, "w").close()
    m = mounts.mount(backing, local_dir=local, env={"CKPTFS_HOLD": f"drain:{hold}"},
                     **dict(OPTS, **opts))
    return m, backing, local, hold


def test_a_save_drains_into_an_ordinary_backing_directory(mounts, tmp_path):
    backing, local = mounts.backing(), str(tmp_path / "local")
    os.mkdir(local)
    m = mounts.mount(backing, local_dir=local, **OPTS)
    files = {f"step/t{i}.pt": b"" for i in range(12)}
    for i, name in enumerate(files):
        files[name] = _write(m.mountpoint, name, (i * 397 * 1024) % (5 * MiB) + 1,
                             fsync=i % 3 == 0)
    assert api.level(os.path.join(m.mountpoint, "step/t0.pt")) in ("node", "backing")
    api.sync(m.mountpoint)  # (--durability backing: the backing directory has it all)
    assert api.level(os.path.join(m.mountpoint, "step")) == "backing"
    assert api.level(m.mountpoint) == "backing"
    st = api.status(m.mountpoint)
    assert st["tier_backlog_bytes"] == 0 and st["tier_drained_bytes"] > 0, st
    assert st["tier_backing_seq"] == st["tier_node_seq"] > 0, st
    check_files(files, m.mountpoint)
    m.stop()
    own = os.path.join(backing, "writers", "w")
    assert os.path.exists(os.path.join(local, "writers", "w", "index.log"))
    # the backing directory alone: a read-only mount without the tier, and the offline check
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr
    ro = mounts.mount(backing, ro=True)
    check_files(files, ro.mountpoint)
    ro.stop()
    with open(os.path.join(own, "index.log"), "rb") as b, \
            open(os.path.join(local, "writers", "w", "index.log"), "rb") as lo:
        assert b.read() == lo.read(), "the backing index is the node tier's, byte for byte"


def test_levels_and_a_killed_daemon_with_node_durability(mounts, tmp_path):
    """Step 0 is saved and synced to the backing directory; then the drain is held and step 1
    saved with --durability node: fsync and sync return, its level is node, `ckptfs wait
    --level backing` times out. kill -9. Without the local directory (a copy of the backing
    directory, a fresh local one) exactly step 0 is there; with it, step 1 is back bit-exact,
    the drain finishes once let go, and the backing directory alone then shows both."""
    m, backing, local, hold = _tier_mount(mounts, tmp_path, durability="node")
    env = {"CKPTFS_HOLD": f"drain:{hold}"}
    step0 = {f"step0/t{i}.pt": _write(m.mountpoint, f"step0/t{i}.pt", 300_000 * (i + 1))
             for i in range(4)}
    api.sync(m.mountpoint, "backing")
    assert api.level(os.path.join(m.mountpoint, "step0")) == "backing"
    open(hold, "w").close()
    step1 = {f"step1/t{i}.pt": _write(m.mountpoint, f"step1/t{i}.pt", 700_000 * (i + 1),
                                      fsync=i == 0) for i in range(4)}
    api.sync(m.mountpoint)  # (--durability node)
    assert api.level(os.path.join(m.mountpoint, "step1")) == "node"
    assert api.level(os.path.join(m.mountpoint, "step1/t0.pt")) == "node"
    assert api.level(os.path.join(m.mountpoint, "step0")) == "backing"
    assert api.level(m.mountpoint) == "node"
    res = cli("wait", "--level", "backing", "--timeout", "1",
              os.path.join(m.mountpoint, "step1"))
    assert res.returncode == 1 and "is node, not backing" in res.stderr, res.stderr
    assert cli("wait", "--level", "node", os.path.join(m.mountpoint, "step1")).returncode == 0
    st = api.status(m.mountpoint)
    assert st["tier_backlog_bytes"] > 0 and st["tier_backing_seq"] < st["tier_node_seq"], st
    os.kill(m.pid, signal.SIGKILL)
    cli("umount", m.mountpoint)
    assert wait_unmounted(m.mountpoint)
    m.proc.wait(10)

    # the node lost: the backing directory (copied, so the real one stays for below) with a
    # fresh local directory, and with none
    lost = str(tmp_path / "backing-copy")
    shutil.copytree(backing, lost, symlinks=True)
    fresh = str(tmp_path / "fresh-local")
    os.mkdir(fresh)
    n = mounts.mount(lost, local_dir=fresh, **OPTS)
    check_files(step0, n.mountpoint, absent=("step1",))
    n.stop()
    ro = mounts.mount(lost, ro=True)
    check_files(step0, ro.mountpoint, absent=("step1",))
    ro.stop()

    # the same node again: everything node-durable is back, and drains
    again = mounts.mount(backing, local_dir=local, env=env, **OPTS)
    check_files({**step0, **step1}, again.mountpoint)
    assert api.level(os.path.join(again.mountpoint, "step1")) == "node"
    os.unlink(hold)
    api.wait_level(os.path.join(again.mountpoint, "step1"), "backing", timeout=60)
    again.stop()
    ro = mounts.mount(backing, ro=True)
    check_files({**step0, **step1}, ro.mountpoint)
    ro.stop()


def test_a_local_directory_of_another_backing_directory_is_refused(mounts, tmp_path):
    a, b = mounts.backing("a"), mounts.backing("b")
    local = str(tmp_path / "local")
    os.mkdir(local)
    m = mounts.mount(a, local_dir=local, **OPTS)
    _write(m.mountpoint, "x.pt", 1000)
    m.stop()
    mp = str(tmp_path / "mp")
    os.mkdir(mp)
    res = cli("mount", b, mp, "--local-dir", local, "--writer-id", "w")
    assert res.returncode != 0 and "node tier of another backing directory" in res.stderr, \
        res.stderr
    assert not api.is_mounted(mp)
    other = str(tmp_path / "other")
    os.makedirs(os.path.join(other, "writers", "w"))
    res = cli("mount", a, mp, "--local-dir", other, "--writer-id", "w")
    assert res.returncode != 0 and "not a ckptfs node tier" in res.stderr, res.stderr
    os.unlink(os.path.join(local, "writers", "w", "index.log"))  # (its logs stay)
    res = cli("mount", a, mp, "--local-dir", local, "--writer-id", "w")
    assert res.returncode != 0 and "holds data logs but no index" in res.stderr, res.stderr
    res = cli("mount", a, mp, "--durability", "node")
    assert res.returncode != 0 and "needs the node tier" in res.stderr, res.stderr


@pytest.mark.parametrize("backing_too", [False, True])
def test_a_damaged_local_index_is_mended_from_the_backing_copy_or_refused(
        mounts, tmp_path, backing_too):
    """A byte of the local index changed where the drain had copied it (a bad sector): the
    damaged commit group comes back from the backing copy, and every file reads back through
    the tier. With the backing copy damaged in the same group too, nothing can mend it: the
    mount is refused, saying the local index is damaged (not that the backing directory
    changed); with the local directory moved away, the backing directory alone reads back
    every file but the damaged group's (and the next one's, when the damage hit a commit
    record)."""
    m, backing, local, _ = _tier_mount(mounts, tmp_path)
    files = {}
    for i in range(6):
        files[f"t{i}.pt"] = _write(m.mountpoint, f"t{i}.pt", 100_000 + i)
        api.sync(m.mountpoint, "backing")  # (a commit group each)
    m.stop()
    index = os.path.join(local, "writers", "w", "index.log")
    at = os.path.getsize(index) // 2
    flip_byte(index, at)
    if not backing_too:
        again = mounts.mount(backing, local_dir=local, **OPTS)
        check_files(files, again.mountpoint)
        assert "repaired from the backing copy" in mounts.log(again)
        again.stop()
        return
    flip_byte(os.path.join(backing, "writers", "w", "index.log"), at + 1)  # (other bytes)
    mp = str(tmp_path / "mp")
    os.mkdir(mp)
    res = cli("mount", backing, mp, "--local-dir", local, "--writer-id", "w")
    if res.returncode == 0:  # (unmounted before the assertion fails)
        cli("unmount", mp)
    assert res.returncode != 0 and "node tier's index" in res.stderr \
        and "is damaged (" in res.stderr and "checksum" in res.stderr, res.stderr
    assert not api.is_mounted(mp)
    os.rename(local, local + ".away")
    alone = mounts.mount(backing, writer_id="w")
    there = {n: d for n, d in files.items() if os.path.exists(os.path.join(alone.mountpoint, n))}
    # (replay resumes after the next intact commit record: damage to a group's own commit
    # record costs the group after it too)
    assert len(files) - 2 <= len(there) < len(files), sorted(there)
    check_files(there, alone.mountpoint)


def test_local_space_is_bounded_and_writers_wait_for_the_drain(mounts, tmp_path):
    """--local-size 12M with 1 MiB segments (data logs of 3 MiB): 40 MB saved while the drain
    is held fill the tier and the writer waits (it neither fails nor finishes); let go, it
    finishes, drained logs are removed to make room, and every file reads back (from the
    backing copy where the local one is gone)."""
    m, backing, local, hold = _tier_mount(mounts, tmp_path, held=True, local_size="12M")
    files: dict[str, bytes] = {}
    errors: list[BaseException] = []

    def save() -> None:
        try:
            for i in range(10):
                files[f"t{i}.pt"] = _write(m.mountpoint, f"t{i}.pt", 4 * MiB)
            api.sync(m.mountpoint)
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    t = threading.Thread(target=save)
    t.start()
    # the writer had its chance: staging (16M) and the tier (12M) are full of undrained data
    status_reaches(m, "writers_waiting", 1, timeout=60)
    st = api.status(m.mountpoint)
    assert t.is_alive() and not errors, errors
    assert st["tier_backlog_bytes"] >= 6 * MiB, st
    assert _blocks(os.path.join(local, "writers", "w")) <= 12 * MiB
    os.unlink(hold)
    t.join(120)
    assert not t.is_alive() and not errors, errors
    st = api.status(m.mountpoint)
    assert st["tier_evicted_logs"] > 0, st
    # (a commit after the sync - the copies of commit groups, say - is drained in turn)
    wait_for(lambda: api.status(m.mountpoint)["tier_backlog_bytes"] == 0, timeout=60,
             what="the backlog drained")
    assert _blocks(os.path.join(local, "writers", "w")) <= 12 * MiB
    check_files(files, m.mountpoint)
    m.stop()
    again = mounts.mount(backing, local_dir=local, **OPTS)
    check_files(files, again.mountpoint)
    again.stop()


def test_the_daemons_memory_does_not_grow_with_the_backlog(mounts, tmp_path):
    """With the drain held, 320 MB wait on the local disk to be drained: the daemon's resident
    memory at 320 MB of backlog is within 24 MiB of what it was at 32 MB (what it keeps per
    commit is a note of where the logs end, never their bytes); let go, the backlog drains."""
    m, _, _, hold = _tier_mount(mounts, tmp_path, held=True, local_size="1G")
    files: dict[str, bytes] = {}

    def save(first: int, n: int) -> int:
        for i in range(first, first + n):
            files[f"t{i}.pt"] = _write(m.mountpoint, f"t{i}.pt", 4 * MiB)
        api.sync(m.mountpoint, "node")
        return status_reaches(m, "tier_backlog_bytes", 4 * MiB * (first + n), timeout=60)

    save(0, 8)
    before = proc_status(m.pid)["VmRSS"]
    backlog = save(8, 72)
    grew = proc_status(m.pid)["VmRSS"] - before
    assert backlog >= 320 * MiB and grew < 24 * MiB, (backlog, grew)
    os.unlink(hold)
    wait_for(lambda: m.status()["tier_backlog_bytes"] == 0, timeout=120,
             what="the backlog drained")
    check_files({k: files[k] for k in ("t0.pt", "t79.pt")}, m.mountpoint)


def test_the_cleaner_removes_retired_logs_from_both_copies(mounts, tmp_path):
    backing, local = mounts.backing(), str(tmp_path / "local")
    os.mkdir(local)
    m = mounts.mount(backing, local_dir=local, local_size="64M", clean_idle=0.2, **OPTS)
    for i in range(8):
        _write(m.mountpoint, f"old/t{i}.pt", 3 * MiB)
    api.sync(m.mountpoint)
    logs = sorted(n for n in os.listdir(os.path.join(backing, "writers", "w"))
                  if n.startswith("data-"))
    assert len(logs) >= 2, logs
    shutil.rmtree(os.path.join(m.mountpoint, "old"))
    keep = _write(m.mountpoint, "new.pt", 100_000)
    api.sync(m.mountpoint)
    status_reaches(m, "logs_retired", 1, timeout=60)
    for d in (os.path.join(backing, "writers", "w"), os.path.join(local, "writers", "w")):
        left = set(n for n in os.listdir(d) if n.startswith("data-"))
        assert logs[0] not in left, (d, left)
    check_files({"new.pt": keep}, m.mountpoint)
    m.stop()
    ro = mounts.mount(backing, ro=True)
    check_files({"new.pt": keep}, ro.mountpoint, absent=("old",))
    ro.stop()


@pytest.mark.glusterfs
@pytest.mark.timeout(300)
def test_kill_9_while_draining_to_a_glusterfs_volume(gdir, mounts, tmp_path):
    """The crash test's writer (files written front to back; fsync'ed and synced ones
    journaled) into a mount with the node tier, --durability node, the backing directory on the
    GlusterFS volume; the daemon killed -9 at a random point, three times, the drain busy. After
    each kill, the backing directory alone (what a node that lost its local directory sees)
    holds a state the tree had: no file nobody wrote, none with bytes that were never there;
    remounted with the same local directory, every file whose fsync or sync returned is
    bit-exact. At the end the drain finishes and the backing directory alone shows it all."""
    local = str(tmp_path / "local")
    os.mkdir(local)
    mnt = str(tmp_path / "mnt")
    os.mkdir(mnt)
    opts = {**CRASH_WRITER_OPTS, "local_dir": local, "durability": "node"}
    rng = random.Random(2468)
    planned, durable, seen = {}, set(), {}
    ctx = multiprocessing.get_context("fork")
    m = mounts.mount(gdir, mnt, **opts)
    for it in range(3):
        jpath = str(tmp_path / f"journal{it}")
        w = ctx.Process(target=writer_main, args=(mnt, it, rng.randrange(1 << 30), jpath))
        w.start()
        time.sleep(rng.uniform(0.5, 1.5))
        kill_mid_write(m, w, mnt)
        p, d = read_journal(jpath)
        planned.update(p)
        durable |= d
        alone = mounts.mount(gdir, ro=True)
        check_tree(alone.mountpoint, planned, set(), {}, full=True)
        alone.stop()
        m = mounts.mount(gdir, mnt, **opts)
        check_tree(mnt, planned, durable, seen, full=True)
        assert "Traceback" not in mounts.log(m)
    m.stop()  # (drains everything)
    assert durable and len(planned) > len(durable)
    assert cli("verify", gdir).returncode == 0
    alone = mounts.mount(gdir, ro=True)
    check_tree(alone.mountpoint, planned, durable, dict(seen), full=True)
    alone.stop()


def test_a_failing_backing_directory_leaves_node_durability_and_catches_up(failing, mounts,
                                                                          tmp_path):
    """The backing directory on failing_fs. While its writes fail, `sync` (--durability node)
    returns and the file's level is node, `sync --level backing` fails with EIO, the status
    counts the drain's errors; healed, the drain catches up by itself and the backing
    directory alone holds everything."""
    _failing_backing_catches_up(mounts, tmp_path, failing.mountpoint,
                                lambda: failing.fail("write fsync"), failing.heal)


def test_a_disk_under_the_backing_directory_that_fails_writes(failing_disk, mounts, tmp_path):
    """The same with the backing directory on ext4 over a block device whose writes fail
    (helpers.FailingDisk), the drain's writes buffered (--io buffered): the kernel drops
    the pages whose writeback failed, so the drain must copy that range again (punched
    first: ext4 keeps it unwritten otherwise), and a mount of the backing directory alone,
    caches dropped, reads every byte back."""
    _failing_backing_catches_up(mounts, tmp_path, failing_disk.path, failing_disk.fail,
                                failing_disk.heal, io="buffered")


def _failing_backing_catches_up(mounts, tmp_path, root: str, fail, heal, **extra) -> None:
    backing = os.path.join(root, "backing")
    os.mkdir(backing)
    local = str(tmp_path / "local")
    os.mkdir(local)
    m = mounts.mount(backing, local_dir=local, durability="node", **OPTS, **extra)
    files = {"a.pt": _write(m.mountpoint, "a.pt", 2 * MiB)}
    api.sync(m.mountpoint, "backing")
    fail()
    try:
        files["b.pt"] = _write(m.mountpoint, "b.pt", 3 * MiB + 17, fsync=True)
        api.sync(m.mountpoint)
        assert api.level(os.path.join(m.mountpoint, "b.pt")) == "node"
        with pytest.raises(OSError) as e:
            api.sync(m.mountpoint, "backing")
        assert e.value.errno == errno.EIO
        status_reaches(m, "tier_drain_errors", 1)
        st = api.status(m.mountpoint)
        assert st["tier_backlog_bytes"] > 0 and "Input/output error" in st["tier_drain_last_error"]
    finally:
        heal()
    api.wait_level(os.path.join(m.mountpoint, "b.pt"), "backing", timeout=60)
    api.sync(m.mountpoint, "backing")
    m.stop()
    drop_caches()  # (what the backing store holds, not its page cache)
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr
    ro = mounts.mount(backing, ro=True)
    check_files(files, ro.mountpoint)
    ro.stop()


def test_the_readme_recipe_dcp_async_save_and_a_rotation(mounts, tmp_path):
    """The README's recipe for jobs that can change one line: DCP's async_save into a mount
    with the node tier and --durability node; once the future is done, waiting for the node
    level covers what came after DCP's last fsync (its .metadata rename); the drain is held,
    so the step is not yet backing; the rotation removes the older step only after
    api.wait_level(newer, "backing"), which returns once the drain is let go. A mount of the
    backing directory alone then restores the newer step with dcp.load."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    m, backing, local, hold = _tier_mount(mounts, tmp_path, durability="node")
    gen = torch.Generator().manual_seed(7)
    states = {s: {f"layer{i}.weight": torch.randn(64 * (i + 1), 257, generator=gen)
                  for i in range(6)} for s in (1, 2)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no process group: DCP says it saves alone)
        dcp.async_save(states[1], checkpoint_id=f"{m.mountpoint}/step_1").result()
        api.wait_level(f"{m.mountpoint}/step_1", "backing", timeout=60)
        open(hold, "w").close()
        fut = dcp.async_save(states[2], checkpoint_id=f"{m.mountpoint}/step_2")
        fut.result()
    newer = f"{m.mountpoint}/step_2"
    assert api.wait_level(newer, "node", timeout=60) == "node"
    with pytest.raises(TimeoutError):
        api.wait_level(newer, "backing", timeout=0.5)
    os.unlink(hold)
    assert api.wait_level(newer, "backing", timeout=60) == "backing"
    shutil.rmtree(f"{m.mountpoint}/step_1")
    m.stop()

    ro = mounts.mount(backing, ro=True)
    assert sorted(os.listdir(ro.mountpoint)) == ["step_2"]
    out = {k: torch.empty_like(v) for k, v in states[2].items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=f"{ro.mountpoint}/step_2")
    for k, v in states[2].items():
        assert torch.equal(out[k], v), k
    ro.stop()


def test_index_snapshots_reach_the_backing_directory(mounts, tmp_path):
    """Index snapshots with the tier: the local index is replaced at once, the backing index
    whole once the drain reaches that commit (byte for byte the local one then). A kill -9
    while the drain is held after a snapshot leaves the backing index a prefix of the
    replaced one (kept as index.pre-swap); the remount with the same local directory
    replaces it, and the backing directory alone then holds the live tree."""
    opts = dict(OPTS, durability="node", clean_idle=0.2, index_snapshot_min="4K")
    m, backing, local, hold = _tier_mount(mounts, tmp_path, **opts)
    env = {"CKPTFS_HOLD": f"drain:{hold}"}
    own_b = os.path.join(backing, "writers", "w", "index.log")
    own_l = os.path.join(local, "writers", "w")
    live: dict[str, bytes] = {}

    def step(k: int) -> None:
        for i in range(20):
            name = f"step_{k}/t{i}.pt"
            live[name] = _write(m.mountpoint, name, 1000 + 37 * i + k)
        api.sync(m.mountpoint)
        if k >= 2:
            shutil.rmtree(os.path.join(m.mountpoint, f"step_{k - 2}"))
            for name in [n for n in live if n.startswith(f"step_{k - 2}/")]:
                del live[name]

    k = 0
    while api.status(m.mountpoint)["index_snapshots"] < 1:
        assert k < 40, "no index snapshot after 40 steps"
        step(k)
        k += 1
        time.sleep(0.3)  # (the cleaner and the snapshot run after --clean-idle without writes)
    api.sync(m.mountpoint, "backing")
    api.wait_level(m.mountpoint, "backing", timeout=60)
    with open(own_b, "rb") as b, open(os.path.join(own_l, "index.log"), "rb") as lo:
        assert b.read() == lo.read(), "the backing index is the snapshot, byte for byte"
    assert not os.path.exists(os.path.join(own_l, "index.pre-swap"))

    open(hold, "w").close()
    before = api.status(m.mountpoint)["index_snapshots"]
    while api.status(m.mountpoint)["index_snapshots"] == before:
        assert k < 80, "no second index snapshot"
        step(k)
        k += 1
        time.sleep(0.3)
    assert os.path.exists(os.path.join(own_l, "index.pre-swap"))
    api.sync(m.mountpoint)  # (node)
    os.kill(m.pid, signal.SIGKILL)
    cli("umount", m.mountpoint)
    assert wait_unmounted(m.mountpoint)
    m.proc.wait(10)

    os.unlink(hold)
    again = mounts.mount(backing, local_dir=local, env=env, **opts)
    check_files(live, again.mountpoint)
    api.wait_level(again.mountpoint, "backing", timeout=60)
    again.stop()
    assert not os.path.exists(os.path.join(own_l, "index.pre-swap"))
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr
    ro = mounts.mount(backing, ro=True)
    check_files(live, ro.mountpoint)
    names = {os.path.relpath(os.path.join(d, f), ro.mountpoint)
             for d, _, fs in os.walk(ro.mountpoint) for f in fs}
    assert names == set(live), sorted(names ^ set(live))[:5]
    ro.stop()
