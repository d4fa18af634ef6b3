"""Many writers, one live tree: what one mount makes durable shows on the others while they
stay mounted (within --refresh), and changes to other writers' entries (delete, rename,
overwrite, truncate, chmod, rmdir) made on any read-write mount hold everywhere: on the other
mounts, after remounts, and in `ckptfs ls`, `verify` and `export`.

Real mounts over one backing directory, writer ids w0, w1, ... (docs/scaling.md)."""

from __future__ import annotations

import errno
import os
import time

import pytest
from helpers import (
    SLACK_S, bits, cli, cross_writer_changes, dcp_job, exists, idle_and_quiet, load, save,
    tree_of, verify_ok, visibility, wait_for,
)


torch = pytest.importorskip("torch")


@pytest.mark.timeout(90)
def test_durable_on_one_mount_shows_on_the_others_within_the_delay(mounts):
    backing = mounts.backing()
    visibility(mounts, backing, backing)


@pytest.mark.timeout(90)
def test_an_idle_mount_makes_no_calls_and_looks_at_the_next_lookup(mounts):
    """A mount nobody uses (no open, lookup or listing, nothing open) stops looking after one
    --refresh period: no listing, stat or read of the backing store over seconds (its
    counters, and strace of all its threads where strace can attach: nothing at all on the
    backing directory). The first lookup after that looks first: a file another writer made
    durable meanwhile is there, and one it removed is gone although this mount's kernel had
    the name cached (entries are kept for --refresh only)."""
    backing = mounts.backing()
    idle_and_quiet(mounts, backing, backing)


@pytest.mark.timeout(60)
def test_a_mount_in_use_looks_with_a_few_calls_per_look(mounts):
    """While a file is open on it, a mount goes on looking in the background (every
    --refresh) although nothing changes, and each look costs one listing of writers/ and,
    per other writer, a listing of its directory and a stat of its index; no read. Once
    the file is closed, the looks stop. (How often: the benchmark's bench scaling --idle.)"""
    backing = mounts.backing()
    a = mounts.mount(backing, writer_id="w0", refresh=0.2)
    b = mounts.mount(backing, writer_id="w1")
    save(b, "f.pt", torch.zeros(10))
    b.sync()
    wait_for(lambda: exists(a, "f.pt"), timeout=0.2 + SLACK_S, step=0.02)
    with open(os.path.join(a.mountpoint, "f.pt"), "rb"):
        s0 = a.status()
        wait_for(lambda: a.status()["refresh_polls"] >= s0["refresh_polls"] + 5, timeout=30,
                 step=0.02)
        s1 = a.status()
    polls = s1["refresh_polls"] - s0["refresh_polls"]
    assert s1["refresh_reads"] == s0["refresh_reads"]
    # (one other writer; a look may be under way at either reading)
    assert polls - 1 <= s1["refresh_stats"] - s0["refresh_stats"] <= polls + 1
    assert 2 * polls - 2 <= s1["refresh_listdirs"] - s0["refresh_listdirs"] <= 2 * polls + 2
    pauses = s1["refresh_idle_pauses"]
    wait_for(lambda: a.status()["refresh_idle_pauses"] > pauses, timeout=0.4 + SLACK_S, step=0.02)


@pytest.mark.timeout(60)
def test_a_writer_whose_index_could_not_be_read_at_mount_joins_later(mounts):
    """A writer whose index cannot be read when a mount starts (here its index.log is a
    directory for a while, as a transient EIO would leave it) is read again at every look:
    the mount counts it (writers_unread) meanwhile, and shows its files within the delay
    once its index can be read."""
    backing = mounts.backing()
    b = mounts.mount(backing, writer_id="w1")
    v = torch.arange(300, dtype=torch.float32)
    save(b, "step_1/x.pt", v)
    b.stop()
    index = os.path.join(backing, "writers", "w1", "index.log")
    os.rename(index, index + ".away")
    os.mkdir(index)
    a = mounts.mount(backing, writer_id="w0", refresh=0.2)
    assert not exists(a, "step_1")
    # read again at the next lookup, and failed
    wait_for(lambda: not exists(a, "step_1") and a.status()["refresh_reads"] >= 2,
             timeout=0.4 + SLACK_S, step=0.02)
    assert a.status()["writers_unread"] == 1
    assert not exists(a, "step_1")
    os.rmdir(index)
    os.rename(index + ".away", index)
    wait_for(lambda: exists(a, "step_1/x.pt"), timeout=0.2 + SLACK_S, step=0.02)
    assert bits(load(a, "step_1/x.pt")) == bits(v)
    assert a.status()["writers_unread"] == 0
    assert mounts.log(a).count("writer w1 skipped") == 1  # (logged once, not at every look)


def fds_into(pid: int, wdir: str) -> int:
    """Descriptors process `pid` has open on data logs of writer directory `wdir` (also
    on removed ones)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        n += target.startswith(os.path.join(wdir, "data-"))
    return n


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["index-snapshots", "retired-logs"])
def test_a_watching_mount_lets_go_of_other_writers_logs(mounts, what):
    """A mount reading another writer's files opens that writer's data logs. It lets go of a
    log that writer retires, and of every log of its old tree when that writer puts an index
    snapshot in place (the tree is read anew): the descriptors do not pile up with every
    snapshot or retired log (a retired log's space would stay taken); idle, it holds none."""
    from ckptfs.format import backingdir
    backing = mounts.backing()
    opts = dict(staging_size="8M", segment_size="1M", idle_flush=0.1, clean_idle=0.1)
    if what == "index-snapshots":
        opts.update(index_snapshot_min="2K", index_snapshot_ratio=1.1)
    else:
        opts.update(log_size="2M", index_snapshot_ratio=0)
    b = mounts.mount(backing, writer_id="w1", **opts)
    # (read-only: no writer directory, so b stays the only writer and retires at once)
    a = mounts.mount(backing, ro=True, refresh=0.2)
    pid = a.status()["pid"]
    wdir = os.path.realpath(os.path.join(backing, "writers", "w1"))
    bm, am = b.mountpoint, a.mountpoint
    files = 20 if what == "index-snapshots" else 1
    opened = 0
    size = 2000 if what == "index-snapshots" else 1536 << 10
    for r in range(5):
        snaps = b.status()["index_snapshots"]
        for k in range(files):
            with open(f"{bm}/r{r}_{k}", "wb") as f:
                f.write(bytes([r + k & 255]) * size)
            if r:
                os.unlink(f"{bm}/r{r - 1}_{k}")
        b.sync()
        if what == "index-snapshots" and r:  # the snapshot, then a's look reading it whole
            wait_for(lambda: b.status()["index_snapshots"] > snaps, timeout=10, step=0.02)
            wait_for(lambda: os.listdir(am) and a.status()["writers_reread"] >= r,
                     timeout=0.2 + SLACK_S, step=0.02)  # (a listing looks when a look is due)
        for k in range(files):
            wait_for(lambda: exists(a, f"r{r}_{k}"), timeout=0.2 + SLACK_S, step=0.02)
            with open(f"{am}/r{r}_{k}", "rb") as f:
                assert f.read() == bytes([r + k & 255]) * size
                opened = max(opened, fds_into(pid, wdir))  # (in use: a keeps them open)
    if what == "retired-logs":
        wait_for(lambda: b.status()["logs_retired"] >= 3, timeout=10, step=0.02)
    # at most one descriptor per data log still there, within a few looks
    wait_for(lambda: fds_into(pid, wdir) <= len(backingdir.data_logs(wdir)),
             timeout=0.6 + SLACK_S, step=0.02)
    assert opened >= 1  # (it did open them)
    wait_for(lambda: fds_into(pid, wdir) == 0, timeout=0.4 + SLACK_S, step=0.02)  # idle: none


@pytest.mark.timeout(60)
def test_refresh_option_is_checked(mounts):
    with pytest.raises(Exception, match="--refresh"):
        mounts.mount(mounts.backing(), writer_id="w0", refresh=-1)
    assert errno.ESTALE  # (the error an open of a vanished entry gives once, then retried)


@pytest.mark.timeout(120)
def test_changes_to_other_writers_entries_hold_everywhere(mounts, tmp_path):
    """From mount a: rotation (rm -rf of a step holding b's shards), an overwrite, truncate,
    chmod and utime of b's files, a rename over b's file and of b's file, rmdir of b's empty
    directory, a rename of a directory both wrote into. b and a third mount see the same tree
    (b carries out the deletes of its own entries), and so do both after a remount, a
    read-only mount, ls, verify and export."""
    backing = mounts.backing()
    cross_writer_changes(mounts, backing, backing, str(tmp_path))


def crafted_writer(backing: str, wid: str, files: dict[str, bytes], stamp: int) -> None:
    """A writer directory made by hand (as a node whose clock is far off would leave it): its
    files under /shared, committed with COMMIT stamp `stamp`."""
    from crc32c import crc32c

    from ckptfs.format import backingdir, records
    wdir = os.path.join(backing, "writers", wid)
    os.makedirs(wdir, mode=0o700)
    data = b"".join(files.values())
    with open(os.path.join(wdir, backingdir.data_log_name(1)), "wb") as f:
        f.write(records.data_log_header(wid, 1) + data)
    recs = [records.InodeRec(2, 1, b"shared", 0o40755, os.getuid(), os.getgid(), 0, stamp,
                             stamp, stamp)]
    off = records.DATA_HEADER_BYTES
    for i, (name, body) in enumerate(files.items()):
        recs.append(records.InodeRec(3 + i, 2, name.encode(), 0o100644, os.getuid(),
                                     os.getgid(), 0, stamp, stamp, stamp))
        recs.append(records.ExtentRec(3 + i, 0, len(body), 1, off, crc32c(body)))
        off += len(body)
    blob = records.index_header() + b"".join(map(records.encode, recs)) + records.encode(
        records.CommitRec(len(recs), stamp))
    with open(os.path.join(wdir, backingdir.INDEX_NAME), "wb") as f:
        f.write(blob)


def test_commit_stamps_follow_every_stamp_seen():
    from ckptfs.datapath.journal import Journal
    j = Journal()
    ahead = time.time_ns() + 3600 * 10**9
    j.saw(ahead)  # another writer's clock is an hour ahead
    j.saw(0)  # (an older stamp read later changes nothing)
    first = j.stamp()
    assert first > ahead and j.stamp() > first


def test_commit_stamps_go_on_from_the_writers_last_one_and_are_told_with_their_records():
    """A journal made where a replay left off: its first commit follows the sequence number
    and the COMMIT stamp the index ended with (this writer's clock was an hour ahead then),
    and the records of each commit group are told with the stamp they get."""
    from ckptfs.datapath.journal import Journal
    from ckptfs.format import records
    last = time.time_ns() + 3600 * 10**9
    told = []
    j = Journal(7, last_stamp=last, stamp_hook=lambda recs, stamp: told.append((recs, stamp)))
    rec = records.InodeRec(2, 1, b"f", 0o100644, 0, 0, 0, 1, 1, 1)
    j.add(rec)
    blob, upto = j.take_committable()
    assert upto == 8 and len(told) == 1 and told[0][0] == [rec] and told[0][1] > last
    assert blob.endswith(records.encode(records.CommitRec(8, told[0][1])))


@pytest.mark.timeout(60)
def test_an_overwrite_after_seeing_wins_over_a_clock_an_hour_ahead(mounts):
    """A writer whose clock is an hour ahead made shared/x and shared/y; a mount with the
    right clock then overwrites x in place. What it had seen decides, not the clocks: after a
    remount x is the overwrite, y the other writer's, no conflict, and the overwriting
    writer's commit stamps are above the skewed one."""
    backing = mounts.backing()
    ahead = time.time_ns() + 3600 * 10**9
    crafted_writer(backing, "wfuture", {"x": b"old-x" * 100, "y": b"old-y" * 100}, ahead)
    a = mounts.mount(backing, writer_id="w0")
    with open(os.path.join(a.mountpoint, "shared/x"), "r+b") as f:  # in place: copied up
        f.write(b"NEW")
    a.sync()
    a.stop()
    a2 = mounts.mount(backing, writer_id="w0")
    with open(os.path.join(a2.mountpoint, "shared/x"), "rb") as f:
        assert f.read() == b"NEW" + (b"old-x" * 100)[3:]
    with open(os.path.join(a2.mountpoint, "shared/y"), "rb") as f:
        assert f.read() == b"old-y" * 100
    from ckptfs.format import records
    scan = records.read_index(os.path.join(backing, "writers", "w0", "index.log"))
    assert scan.group_times and min(scan.group_times) > ahead
    assert a2.status()["conflicts"] == 0
    verify_ok(backing)


@pytest.mark.timeout(300)
def test_torchrun_dcp_rotation_and_a_restarted_rank(mounts, tmp_path):
    """The job: DCP saves into step_N every step from 4 ranks on two mounts, rank 0 removes
    step_N-2 (both mounts' shards), a rank is killed after step 3 and torchrun restarts the
    group; every rank reloads step 3 through its own mount (mounted all along) bit for bit
    and the job runs to step 5. Then both mounts, a remount and ls/verify show steps 4 and 5
    only, complete."""
    dcp_job(mounts, mounts.backing(), None, tmp_path)


@pytest.mark.timeout(120)
def test_compaction_keeps_what_other_writers_removed_removed(mounts):
    """Writer w1 goes away before it sees what w0 did to its entries (rm -rf of its step_1, a
    rename of its step_2/y, an overwrite of its latest). `ckptfs compact` of w1 alone, then of
    every writer, then --merge: the tree stays the same each time (nothing w0 removed comes
    back, whose inode numbers w0's records name), and verify is clean."""
    backing = mounts.backing()
    b = mounts.mount(backing, writer_id="w1", refresh=30)
    for rel in ("step_1/rank_1/x.pt", "step_1/rank_1/x2.pt", "step_2/y.pt", "latest.pt"):
        save(b, rel, torch.arange(2000 + len(rel)))
    b.stop()
    a = mounts.mount(backing, writer_id="w0", refresh=0)
    import shutil
    shutil.rmtree(os.path.join(a.mountpoint, "step_1"))
    os.rename(os.path.join(a.mountpoint, "step_2/y.pt"), os.path.join(a.mountpoint, "step_2/z.pt"))
    save(a, "latest.pt", torch.ones(3))
    save(a, "step_3/own.pt", torch.zeros(5))
    want = tree_of(a.mountpoint)
    a.stop()
    for args in (["--writer", "w1"], [], ["--merge", "--into", "merged"]):
        r = cli("compact", backing, *args, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        ro = mounts.mount(backing, ro=True)
        assert tree_of(ro.mountpoint) == want, args
        ro.stop()
        verify_ok(backing)
        if args == ["--writer", "w1"]:  # w1 mounts again: its logs w0 still uses stay
            mounts.mount(backing, writer_id="w1").stop()
            verify_ok(backing)
    assert os.listdir(os.path.join(backing, "writers")) == ["merged"]


@pytest.mark.timeout(90)
def test_a_lookup_in_a_directory_a_peers_reread_renumbered_is_estale(mounts, tmp_path):
    """When this mount reads another writer's rewritten index (an index snapshot) while a
    READ holds one of that writer's logs, the writer's tree takes a new layer and the
    kernel's numbers of it go stale. A LOOKUP in such a directory answers ESTALE, not
    ENOENT: through a descriptor of the old directory the application sees ESTALE (NFS's
    stale handle), a path from the mount point is walked again and finds the name."""
    import threading
    hold = tmp_path / "hold-loads"
    backing = mounts.backing()
    a = mounts.mount(backing, writer_id="w0", staging_size="8M", segment_size="1M",
                     idle_flush=0.1, clean_idle=0.1, index_snapshot_min="2K",
                     index_snapshot_ratio=1.1)
    b = mounts.mount(backing, ro=True, refresh=0.2, env={"CKPTFS_HOLD": f"loader:{hold}"})
    am, bm = a.mountpoint, b.mountpoint
    os.mkdir(f"{am}/D")
    first = os.urandom(1 << 20)
    with open(f"{am}/D/f1", "wb") as f:
        f.write(first)
    a.sync()
    wait_for(lambda: exists(b, "D/f1"), timeout=0.2 + SLACK_S, step=0.02)
    fd = os.open(f"{bm}/D", os.O_RDONLY | os.O_DIRECTORY)  # (D by its number before)
    got: list = []
    hold.touch()
    reader = threading.Thread(target=lambda: got.append(open(f"{bm}/D/f1", "rb").read()))
    try:
        reader.start()
        wait_for(lambda: b.status()["read_loads_in_flight"] >= 1, timeout=20, step=0.02)
        snaps = a.status()["index_snapshots"]
        for k in range(40):  # (the index grows past the snapshot's ratio)
            with open(f"{am}/D/tmp{k}", "wb") as f:
                f.write(b"x" * 100)
            os.unlink(f"{am}/D/tmp{k}")
        with open(f"{am}/D/f2", "wb") as f:
            f.write(b"second")
        a.sync()
        wait_for(lambda: a.status()["index_snapshots"] > snaps, timeout=20, step=0.02)
        wait_for(lambda: b.status()["writers_reread"] >= 1, timeout=0.2 + SLACK_S, step=0.02)
        assert b.status()["read_loads_in_flight"] >= 1  # (the READ held a's log throughout)
        with pytest.raises(OSError) as e:
            os.stat("f2", dir_fd=fd)
        assert e.value.errno == errno.ESTALE
        assert os.stat(f"{bm}/D/f2").st_size == 6  # (a LOOKUP: no load, which waits)
    finally:
        hold.unlink(missing_ok=True)
        reader.join(timeout=30)
        os.close(fd)
    assert got == [first]
    with open(f"{bm}/D/f2", "rb") as f:
        assert f.read() == b"second"
    assert "Traceback" not in mounts.log(b)


@pytest.mark.timeout(90)
def test_no_new_name_in_a_directory_another_writer_removed(mounts):
    """A directory this mount still holds open (a working directory, say) that another
    writer's change removed takes no new names: ENOENT, as in a directory removed here, and
    nothing a remount would have to skip."""
    backing = mounts.backing()
    a = mounts.mount(backing, writer_id="w0", refresh=0.5)
    d = os.path.join(a.mountpoint, "D")
    os.mkdir(d)
    open(os.path.join(d, "x"), "wb").close()
    a.sync()
    fd = os.open(d, os.O_RDONLY)
    try:
        b = mounts.mount(backing, writer_id="w1")
        os.unlink(os.path.join(b.mountpoint, "D", "x"))
        os.rmdir(os.path.join(b.mountpoint, "D"))
        b.sync()
        wait_for(lambda: not os.path.exists(d), timeout=0.5 + SLACK_S, step=0.02)
        with pytest.raises(FileNotFoundError):
            os.open("new", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd)
        with pytest.raises(FileNotFoundError):
            os.mkdir("sub", dir_fd=fd)
    finally:
        os.close(fd)
    a.sync()
    a.stop()
    a2 = mounts.mount(backing, writer_id="w0")
    assert "D" not in os.listdir(a2.mountpoint)
    assert "record skipped" not in mounts.log(a2)
