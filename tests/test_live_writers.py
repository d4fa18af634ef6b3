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

from test_multiwriter import bits, cli, listed, verify_ok

torch = pytest.importorskip("torch")

SLACK_S = 4.0  # a loaded 2-CPU machine: the look itself, the daemon's scheduling


def wait_for(cond, limit: float, step: float = 0.02) -> float:
    """Seconds until cond() holds; fails past `limit`."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > limit:
            pytest.fail(f"not within {limit:.1f} s")
        time.sleep(step)
    return time.monotonic() - t0


def save(m, rel: str, t) -> str:
    p = os.path.join(m.mountpoint, rel)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    torch.save(t, p)
    return p


def load(m, rel: str):
    return torch.load(os.path.join(m.mountpoint, rel), weights_only=True)


def loads_as(m, rel: str, t) -> bool:
    """Whether `rel` loads on mount m as `t`. A load whose open came before the overwrite
    reached m may read old and new bytes mixed (docs/scaling.md: a file already open may or
    may not show later changes) and fail to load: not yet."""
    import pickle
    try:
        return bits(load(m, rel)) == bits(t)
    except (RuntimeError, EOFError, pickle.UnpicklingError):
        return False


def exists(m, rel: str) -> bool:
    return os.path.exists(os.path.join(m.mountpoint, rel))


@pytest.mark.timeout(90)
def test_durable_on_one_mount_shows_on_the_others_within_the_delay(mounts):
    backing = mounts.backing()
    visibility(mounts, backing, backing)


def visibility(mounts, backing: str, other: str) -> float:
    """Mount b writes (over `other`: the same backing directory, maybe through another
    client of a network file system), mounts a (--refresh 1) and `now` (--refresh 0) over
    `backing` see it. Returns how long a took to see the first file."""
    a = mounts.mount(backing, writer_id="w0", refresh=1.0)
    now = mounts.mount(backing, writer_id="w2", refresh=0)  # looks at every open and lookup
    b = mounts.mount(other, writer_id="w1")  # joins after both: a new writer directory
    v1, v2 = torch.arange(5000, dtype=torch.float32), torch.full((3000,), 7.0)
    assert not exists(a, "step_1/x.pt")  # (a negative lookup, nothing cached)
    save(b, "step_1/x.pt", v1)
    b.sync()  # durable on b
    assert bits(load(now, "step_1/x.pt")) == bits(v1)  # at once with --refresh 0
    dt = wait_for(lambda: exists(a, "step_1/x.pt"), 1.0 + SLACK_S)
    assert bits(load(a, "step_1/x.pt")) == bits(v1)
    # an overwrite (same name, same inode on b): the new bytes on the next open, although a
    # has the file's attributes and pages cached
    save(b, "step_1/x.pt", v2)
    b.sync()
    wait_for(lambda: loads_as(a, "step_1/x.pt", v2), 1.0 + SLACK_S)
    assert bits(load(a, "step_1/x.pt")) == bits(v2)
    assert bits(load(now, "step_1/x.pt")) == bits(v2)
    # a listing shows new entries; a name b removes or renames goes from a's cached entries
    save(b, "step_1/y.pt", v1)
    os.rename(os.path.join(b.mountpoint, "step_1/x.pt"), os.path.join(b.mountpoint,
                                                                     "step_1/z.pt"))
    b.sync()
    # (the kernel is told to forget the old name by a worker thread after the view changed:
    # a listing may show the change a few ms before the name's cached entry goes)
    wait_for(lambda: sorted(os.listdir(os.path.join(a.mountpoint, "step_1"))) ==
             ["y.pt", "z.pt"] and not exists(a, "step_1/x.pt"), 1.0 + SLACK_S)
    assert bits(load(a, "step_1/z.pt")) == bits(v2)
    os.unlink(os.path.join(b.mountpoint, "step_1/y.pt"))
    b.sync()
    assert not exists(now, "step_1/y.pt")
    wait_for(lambda: not exists(a, "step_1/y.pt"), 1.0 + SLACK_S)
    st = a.status()
    assert st["writers"] == 3 and st["refresh_polls"] > 0 and st["writers_joined"] == 2
    print(f"visible on the 1 s mount after {dt:.2f} s")
    return dt


def backing_calls(pid: int, backing: str, seconds: float) -> list[str] | None:
    """The system calls of every thread of process `pid` on `backing` (a path under it, or
    a descriptor of one) during `seconds`, traced by strace; None where strace is missing or
    cannot attach (not root, ptrace refused)."""
    import shutil
    import signal
    import subprocess
    import tempfile

    if shutil.which("strace") is None:
        return None
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
        p = subprocess.Popen(["strace", "-f", "-qq", "-y", "-p", str(pid), "-o", out.name],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(seconds)
        if p.poll() is not None:  # (it could not attach)
            return None
        p.send_signal(signal.SIGINT)
        p.wait(10)
        real = os.path.realpath(backing)
        return [line for line in out.read().splitlines() if real in line]


LOOK_COUNTS = ("refresh_polls", "refresh_listdirs", "refresh_stats", "refresh_reads")


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


def idle_and_quiet(mounts, backing: str, other: str) -> None:
    """Mount a (--refresh 0.2) over `backing` and b over `other` (the same directory, maybe
    through another client of a network file system): idle, a makes no calls to the backing
    store, and its first lookup after that sees what b did meanwhile."""
    a = mounts.mount(backing, writer_id="w0", refresh=0.2)
    b = mounts.mount(other, writer_id="w1")
    v1, v2 = torch.zeros(10), torch.arange(77, dtype=torch.float32)
    save(b, "f.pt", v1)
    b.sync()
    wait_for(lambda: exists(a, "f.pt"), 0.2 + SLACK_S)
    pauses = a.status()["refresh_idle_pauses"]
    assert bits(load(a, "f.pt")) == bits(v1)  # (f.pt cached by a's kernel now)
    wait_for(lambda: a.status()["refresh_idle_pauses"] > pauses, 0.4 + SLACK_S)
    # (a pause before the load, on a stalled test, is followed by a look the load asked for
    # and another pause: quiet means nothing moved over more than a --refresh period)
    s0 = a.status()
    t0 = time.monotonic()
    keys = LOOK_COUNTS + ("refresh_idle_pauses",)
    while True:
        time.sleep(0.3)
        s = a.status()
        if {k: s[k] for k in keys} == {k: s0[k] for k in keys}:
            break
        assert time.monotonic() - t0 < 0.8 + SLACK_S, "the idle mount went on looking"
        s0 = s
    calls = backing_calls(s0["pid"], backing, 3.0)
    s1 = a.status()
    assert {k: s1[k] for k in LOOK_COUNTS} == {k: s0[k] for k in LOOK_COUNTS}
    assert calls is None or calls == [], calls[:20]
    print("calls on the backing store by the idle mount in 3 s:",
          "(strace cannot attach)" if calls is None else len(calls))
    os.unlink(os.path.join(b.mountpoint, "f.pt"))
    save(b, "g.pt", v2)
    b.sync()
    time.sleep(0.3)  # (longer than a's --refresh: its kernel asks again for f.pt)
    assert not exists(a, "f.pt")  # at once: the lookup looked first
    assert bits(load(a, "g.pt")) == bits(v2)
    # (one look, the lookup's; a second once a --refresh period passed since, the load of
    # g.pt having asked, when this test stalled that long)
    assert 1 <= a.status()["refresh_polls"] - s1["refresh_polls"] <= 2


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
    wait_for(lambda: exists(a, "f.pt"), 0.2 + SLACK_S)
    with open(os.path.join(a.mountpoint, "f.pt"), "rb"):
        s0 = a.status()
        wait_for(lambda: a.status()["refresh_polls"] >= s0["refresh_polls"] + 5, 30)
        s1 = a.status()
    polls = s1["refresh_polls"] - s0["refresh_polls"]
    assert s1["refresh_reads"] == s0["refresh_reads"]
    # (one other writer; a look may be under way at either reading)
    assert polls - 1 <= s1["refresh_stats"] - s0["refresh_stats"] <= polls + 1
    assert 2 * polls - 2 <= s1["refresh_listdirs"] - s0["refresh_listdirs"] <= 2 * polls + 2
    pauses = s1["refresh_idle_pauses"]
    wait_for(lambda: a.status()["refresh_idle_pauses"] > pauses, 0.4 + SLACK_S)


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
             0.4 + SLACK_S)
    assert a.status()["writers_unread"] == 1
    assert not exists(a, "step_1")
    os.rmdir(index)
    os.rename(index + ".away", index)
    wait_for(lambda: exists(a, "step_1/x.pt"), 0.2 + SLACK_S)
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
            wait_for(lambda: b.status()["index_snapshots"] > snaps, 10)
            wait_for(lambda: os.listdir(am) and a.status()["writers_reread"] >= r,
                     0.2 + SLACK_S)  # (a listing looks when a look is due)
        for k in range(files):
            wait_for(lambda: exists(a, f"r{r}_{k}"), 0.2 + SLACK_S)
            with open(f"{am}/r{r}_{k}", "rb") as f:
                assert f.read() == bytes([r + k & 255]) * size
                opened = max(opened, fds_into(pid, wdir))  # (in use: a keeps them open)
    if what == "retired-logs":
        wait_for(lambda: b.status()["logs_retired"] >= 3, 10)
    # at most one descriptor per data log still there, within a few looks
    wait_for(lambda: fds_into(pid, wdir) <= len(backingdir.data_logs(wdir)), 0.6 + SLACK_S)
    assert opened >= 1  # (it did open them)
    wait_for(lambda: fds_into(pid, wdir) == 0, 0.4 + SLACK_S)  # idle: none


@pytest.mark.timeout(60)
def test_refresh_option_is_checked(mounts):
    with pytest.raises(Exception, match="--refresh"):
        mounts.mount(mounts.backing(), writer_id="w0", refresh=-1)
    assert errno.ESTALE  # (the error an open of a vanished entry gives once, then retried)


def tree_of(root: str) -> dict:
    """path -> (mode, bytes) for files, (mode, None) for directories, below root."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root) + "/"] = (os.stat(p).st_mode, None)
        for n in files:
            p = os.path.join(d, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = (os.stat(p).st_mode, f.read())
    return out


def shards(m, step: int, rank: int) -> None:
    for i in range(3):
        save(m, f"step_{step}/rank_{rank}/t{i}.pt", torch.full((500 + i,), float(step * 10 + rank)))


@pytest.mark.timeout(120)
def test_changes_to_other_writers_entries_hold_everywhere(mounts, tmp_path):
    """From mount a: rotation (rm -rf of a step holding b's shards), an overwrite, truncate,
    chmod and utime of b's files, a rename over b's file and of b's file, rmdir of b's empty
    directory, a rename of a directory both wrote into. b and a third mount see the same tree
    (b carries out the deletes of its own entries), and so do both after a remount, a
    read-only mount, ls, verify and export."""
    backing = mounts.backing()
    cross_writer_changes(mounts, backing, backing, str(tmp_path))


def cross_writer_changes(mounts, backing: str, other: str, tmp: str) -> None:
    """The changes of test_changes_to_other_writers_entries_hold_everywhere; mount b is over
    `other` (the same backing directory, maybe through another client)."""
    a = mounts.mount(backing, writer_id="w0", refresh=0)
    b = mounts.mount(other, writer_id="w1", refresh=0)
    c = mounts.mount(backing, writer_id="w2", refresh=0)
    for step in (1, 2, 3):
        shards(a, step, 0)
        shards(b, step, 1)
    for name in ("latest", "cfg", "tmp", "keep"):
        save(b, f"shared/{name}", torch.tensor([len(name)]))
    os.makedirs(os.path.join(b.mountpoint, "shared/empty"))
    a.sync()
    b.sync()
    am = a.mountpoint
    assert sorted(os.listdir(f"{am}/step_1")) == ["rank_0", "rank_1"]
    import shutil
    shutil.rmtree(f"{am}/step_1")  # the rotation: rank 0 deletes every node's shards
    new_latest = torch.arange(100)
    save(a, "shared/latest", new_latest)  # torch.save over b's file (O_TRUNC)
    os.truncate(f"{am}/shared/cfg", 10)
    os.chmod(f"{am}/shared/cfg", 0o600)
    os.utime(f"{am}/shared/keep", ns=(10**18, 10**18))
    save(a, "shared/tmp.new", torch.ones(7))
    os.rename(f"{am}/shared/tmp.new", f"{am}/shared/tmp")  # over b's file
    os.rename(f"{am}/shared/keep", f"{am}/shared/kept")  # b's file moves
    os.rmdir(f"{am}/shared/empty")
    os.rename(f"{am}/step_2", f"{am}/step_2.old")  # both writers' shards move
    with pytest.raises(OSError) as ei:
        os.rmdir(f"{am}/step_3")
    assert ei.value.errno == errno.ENOTEMPTY
    a.sync()
    want = tree_of(am)
    assert "step_1/" not in want and "shared/empty/" not in want and "shared/keep" not in want
    assert want["shared/cfg"][0] & 0o777 == 0o600 and len(want["shared/cfg"][1]) == 10
    assert os.stat(f"{am}/shared/kept").st_mtime_ns == 10**18
    assert sorted(os.listdir(f"{am}/step_2.old")) == ["rank_0", "rank_1"]
    assert bits(load(a, "step_2.old/rank_1/t0.pt")) == bits(torch.full((500,), 21.0))
    for m in (b, c):
        assert tree_of(m.mountpoint) == want, m.mountpoint
    assert os.stat(f"{b.mountpoint}/shared/kept").st_mtime_ns == 10**18
    b.sync()  # b's own UNLINKs of what a deleted of its tree (it carried them out)
    for m in (a, b, c):
        m.stop()
    a2 = mounts.mount(backing, writer_id="w0")
    b2 = mounts.mount(other, writer_id="w1")
    ro = mounts.mount(other, ro=True)
    for m in (a2, b2, ro):
        assert tree_of(m.mountpoint) == want, m.mountpoint
    assert bits(load(ro, "shared/latest")) == bits(new_latest)
    verify_ok(backing)
    r = cli("verify", backing)
    assert "0 index warnings" in r.stdout, r.stdout + r.stderr
    names = {p for p in listed(backing) if p}
    assert names == {"/" + k.rstrip("/") for k in want} | {"/"}
    out = os.path.join(tmp, "export")
    r = cli("export", backing, out)
    assert r.returncode == 0, r.stderr
    assert {k: v[1] for k, v in tree_of(out).items()} == {k: v[1] for k, v in want.items()}
    # a's index holds the whiteouts of b's entries (XUNLINK) under the new index version;
    # b's own index the UNLINKs it made of them
    from ckptfs.format import records
    sa = records.read_index(os.path.join(backing, "writers", "w0", "index.log"))
    sb = records.read_index(os.path.join(backing, "writers", "w1", "index.log"))
    assert sa.version == records.CROSS_INDEX_VERSION
    assert any(type(r) is records.XUnlinkRec and r.writer == "w1" for g in sa.groups for r in g)
    assert any(type(r) is records.XExtentRec for g in sa.groups for r in g)  # cfg, kept
    assert sum(type(r) is records.UnlinkRec for g in sb.groups for r in g) >= 6


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
    from ckptfs.datapath.flusher import Journal
    j = Journal()
    j.seen_ns = time.time_ns() + 3600 * 10**9  # another writer's clock is an hour ahead
    first = j.stamp()
    assert first > j.seen_ns and j.stamp() > first


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


def run_dcp_job(a, b, out: str, steps: int = 5, kill_at: int = 3, timeout: float = 240):
    """tests/dcp_rotation_job.py under torchrun: 4 ranks (gloo), two per mount, in a network
    namespace of its own that has only the loopback interface (the rendezvous and gloo can
    reach nothing else), restarted once (--max-restarts 1) after one rank is killed."""
    import shutil
    import socket
    import subprocess
    import sys
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        pytest.skip("needs root, unshare and ip (a network namespace with loopback only)")
    with socket.socket() as s:  # (a free port number; the namespace has its own ports anyway)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    job = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dcp_rotation_job.py")
    cmd = (f"ip link set lo up && exec {torchrun} --nnodes 1 --nproc-per-node 4 "
           f"--max-restarts 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:{port} "
           "--local-addr 127.0.0.1 "
           f"{job} {a.mountpoint} {b.mountpoint} {steps} {kill_at} {out}")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    r = subprocess.run(["unshare", "--net", "sh", "-c", cmd], capture_output=True, text=True,
                       timeout=timeout, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-6000:]
    return r


@pytest.mark.timeout(300)
def test_torchrun_dcp_rotation_and_a_restarted_rank(mounts, tmp_path):
    """The job: DCP saves into step_N every step from 4 ranks on two mounts, rank 0 removes
    step_N-2 (both mounts' shards), a rank is killed after step 3 and torchrun restarts the
    group; every rank reloads step 3 through its own mount (mounted all along) bit for bit
    and the job runs to step 5. Then both mounts, a remount and ls/verify show steps 4 and 5
    only, complete."""
    dcp_job(mounts, mounts.backing(), None, tmp_path)


def dcp_job(mounts, backing: str, other: str | None, tmp_path) -> float:
    """The job of test_torchrun_dcp_rotation_and_a_restarted_rank; the second mount over
    `other` (another client's path of the backing directory) when given."""
    import json
    a = mounts.mount(backing, writer_id="node0")
    b = mounts.mount(other or backing, writer_id="node1")
    out = tmp_path / "out"
    out.mkdir()
    t0 = time.monotonic()
    run_dcp_job(a, b, str(out))
    took = time.monotonic() - t0
    reports = {p.name: json.loads(p.read_text()) for p in out.iterdir()}
    assert sorted(reports) == [f"rank{r}-1.json" for r in range(4)], sorted(reports)
    for rep in reports.values():
        assert rep["loopback"] and rep["master"] == "127.0.0.1", rep
        assert rep["loaded"] == 3 and rep["exact"] is True, rep
        assert rep["steps_seen"] == [4, 5], rep
    for m in (a, b):
        root = os.path.join(m.mountpoint, "ckpt")
        assert sorted(os.listdir(root)) == ["step_4", "step_5"], (m.mountpoint,
                                                                  os.listdir(root))
        for s in ("step_4", "step_5"):
            names = sorted(os.listdir(os.path.join(root, s)))
            assert ".metadata" in names and len([n for n in names if n.endswith(".distcp")]) == 4
    a.stop()
    b.stop()
    ro = mounts.mount(backing, ro=True)
    assert sorted(os.listdir(os.path.join(ro.mountpoint, "ckpt"))) == ["step_4", "step_5"]
    verify_ok(backing)
    assert {p for p in listed(backing) if p.count("/") == 2} == {"/ckpt/step_4", "/ckpt/step_5"}
    print(f"job with one restart: {took:.1f} s")
    return took


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
        wait_for(lambda: not os.path.exists(d), 0.5 + SLACK_S)
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
