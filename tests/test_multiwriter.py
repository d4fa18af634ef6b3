"""Many writers, one backing directory: real mounts, real writer processes (torch.save per tensor).

Layout of the checkpoints: `step_<s>/rank_<r>/<models.file_name(tensor)>`, 8 ranks = 4 daemons
(writer ids w0..w3) x 2 writer processes. Every restore is compared bit for bit with the tensors
that were saved (regenerated from the same seed)."""

from __future__ import annotations

import errno
import json
import os
import time

import pytest
from helpers import (
    DAEMONS, FUSE_URING, RANKS, RANK_SPECS, bits, check_rank, cli, daemon_of, finish, four_writers,
    listed, proc_status, rank_dir, rank_paths, read_tree, save_ranks, start_rank, verify_ok,
    writer_files_digest,
)

from ckptfs import api
from ckptfs.bench import models
from ckptfs.format import records
from ckptfs.format.records import CommitRec, InodeRec, UnlinkRec
from ckptfs.namespace import ROOT_INO

torch = pytest.importorskip("torch")


# ---------------------------------------------------------------------------- tests
@pytest.mark.timeout(90)
def test_four_daemons_eight_ranks_restore_on_ro_mount(mounts):
    backing = mounts.backing()
    ms = four_writers(mounts, backing)
    save_ranks(ms, 1)

    ro = mounts.mount(backing, ro=True)
    st = ro.status()
    assert st["readonly"] is True and st["writers"] == DAEMONS and st["conflicts"] == 0
    for r in range(RANKS):
        check_rank(ro.mountpoint, 1, r)
    assert sorted(os.listdir(os.path.join(ro.mountpoint, "step_1"))) == \
        [f"rank_{r}" for r in range(RANKS)]
    # each writer wrote only into its own directory
    assert sorted(os.listdir(os.path.join(backing, "writers"))) == [f"w{i}" for i in range(4)]

    verify_ok(backing)
    names = listed(backing)
    for r in range(RANKS):
        assert f"/step_1/rank_{r}" in names
        assert rank_paths(1, r) <= names, r


@pytest.mark.timeout(120)
def test_killed_writer_others_intact_and_restart(mounts):
    backing = mounts.backing()
    ms = four_writers(mounts, backing)
    save_ranks(ms, 1)  # step 1 durable everywhere (sync on every mount)

    victim = 1
    vranks = [r for r in range(RANKS) if daemon_of(r) == victim]
    writers = {}
    for r in range(RANKS):
        slow = daemon_of(r) == victim
        writers[r] = start_rank(ms[daemon_of(r)], 2, r, pause_s=0.3 if slow else 0.0,
                                progress=slow)
    for r in vranks:
        writers[r].wait_saved(1)
    # SIGKILL the daemon while its ranks are saving step 2. The dead mount stays in place
    # (ENOTCONN) until it is detached, as on a node whose daemon died: detaching it at once
    # would let the ranks' next paths resolve to the empty directory underneath.
    os.kill(ms[victim].pid, 9)
    for w in writers.values():
        w.wait(60)
    ms[victim].kill()  # reap, lazy unmount of the stale mount
    assert not api.is_mounted(ms[victim].mountpoint)
    assert os.listdir(ms[victim].mountpoint) == []
    for r in range(RANKS):
        if r in vranks:
            assert writers[r].error, "the killed daemon's writers must see an error"
            assert writers[r].saved < len(RANK_SPECS)
        else:
            assert writers[r].error is None, writers[r].error
    for i, m in enumerate(ms):
        if i != victim:
            m.sync()

    ro = mounts.mount(backing, ro=True)
    for r in range(RANKS):
        check_rank(ro.mountpoint, 1, r)  # the victim's synced step is intact too
        if r not in vranks:
            check_rank(ro.mountpoint, 2, r)
    for r in vranks:  # whatever of the interrupted step was committed reads without errors
        d = rank_dir(ro.mountpoint, 2, r)
        if os.path.exists(d):
            read_tree(d)
    verify_ok(backing)

    others = {f"w{i}": writer_files_digest(backing, f"w{i}") for i in range(DAEMONS)
              if i != victim}
    # restart the victim with the same identity, on the same mount point
    again = mounts.mount(backing, mountpoint=ms[victim].mountpoint, writer_id=f"w{victim}")
    for r in vranks:
        check_rank(again.mountpoint, 1, r)
    check_rank(again.mountpoint, 2, 0)  # the others' step 2, committed before the restart
    finish([start_rank(again, 3, r) for r in vranks])
    again.sync()
    assert {w: writer_files_digest(backing, w) for w in others} == others

    ro2 = mounts.mount(backing, ro=True)
    for r in range(RANKS):
        check_rank(ro2.mountpoint, 1, r)
        if r not in vranks:
            check_rank(ro2.mountpoint, 2, r)
        else:
            check_rank(ro2.mountpoint, 3, r)
    verify_ok(backing)
    names = listed(backing)
    for r in vranks:
        assert rank_paths(3, r) <= names


@pytest.mark.timeout(90)
def test_late_writer_sees_committed_files_and_copies_up(mounts):
    backing = mounts.backing()
    w0 = mounts.mount(backing, writer_id="w0")
    w1 = mounts.mount(backing, writer_id="w1")
    finish([start_rank(w0, 1, 0), start_rank(w1, 1, 1)])
    w0.sync()
    w1.sync()

    late = mounts.mount(backing, writer_id="w2")  # joins while w0, w1 are mounted
    check_rank(late.mountpoint, 1, 0)
    check_rank(late.mountpoint, 1, 1)

    # new rank directory inside the others' step_1, and a file inside w0's own rank_0
    finish([start_rank(late, 1, 2)])
    extra = torch.arange(1000, dtype=torch.int64)
    torch.save(extra, os.path.join(rank_dir(late.mountpoint, 1, 0), "extra.pt"))
    late.sync()
    check_rank(late.mountpoint, 1, 2)
    check_rank(late.mountpoint, 1, 0)

    ro = mounts.mount(backing, ro=True)
    for r in range(3):
        check_rank(ro.mountpoint, 1, r)
    got = torch.load(os.path.join(rank_dir(ro.mountpoint, 1, 0), "extra.pt"), weights_only=True)
    assert bits(got) == bits(extra)
    assert sorted(os.listdir(os.path.join(ro.mountpoint, "step_1"))) == \
        ["rank_0", "rank_1", "rank_2"]

    # the copy-up survives a restart of the late writer
    late.stop()
    late2 = mounts.mount(backing, writer_id="w2")
    check_rank(late2.mountpoint, 1, 2)
    assert "extra.pt" in os.listdir(rank_dir(late2.mountpoint, 1, 0))
    verify_ok(backing)
    names = listed(backing)
    assert "/step_1/rank_0/extra.pt" in names and rank_paths(1, 2) <= names


@pytest.mark.timeout(90)
def test_conflict_later_commit_wins(mounts):
    backing = mounts.backing()
    # (they do not look at each other's changes while mounted: each creates its own file at
    # a path the other has too, as two nodes do within one --refresh)
    a = mounts.mount(backing, writer_id="w0", refresh=30)
    b = mounts.mount(backing, writer_id="w1", refresh=30)
    va, vb, vc, vd = (torch.full((1000,), float(i)) for i in range(4))

    def save(m, rel, t):
        p = os.path.join(m.mountpoint, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        torch.save(t, p)
        m.sync()
        time.sleep(0.01)

    save(a, "step_1/shared.pt", va)
    save(b, "step_1/shared.pt", vb)  # w1 commits later: w1 wins
    save(b, "step_1/other.pt", vc)
    save(a, "step_1/other.pt", vd)  # w0 commits later: w0 wins, although "w0" < "w1"
    save(a, "step_1/only_a.pt", va)

    ro = mounts.mount(backing, ro=True)
    assert ro.status()["conflicts"] == 2

    def load(rel):
        return torch.load(os.path.join(ro.mountpoint, rel), weights_only=True)
    assert bits(load("step_1/shared.pt")) == bits(vb)
    assert bits(load("step_1/other.pt")) == bits(vd)
    assert bits(load("step_1/only_a.pt")) == bits(va)

    r = cli("ls", "--conflicts", backing)
    assert r.returncode == 0, r.stderr
    lines = {ln.split(":", 1)[0]: ln for ln in r.stdout.splitlines() if ln.strip()}
    assert set(lines) == {"/step_1/shared.pt", "/step_1/other.pt"}, r.stdout
    for path, winner in (("/step_1/shared.pt", "w1"), ("/step_1/other.pt", "w0")):
        ln = lines[path]
        assert "w0" in ln and "w1" in ln
        assert ln.rstrip().endswith(f"(winner: {winner})"), ln
        assert ln.split(": ", 1)[1].startswith(f"{winner} @"), ln  # winner listed first
    verify_ok(backing)


@pytest.mark.timeout(60)
def test_ro_mounts_refuse_changes_and_coexist(mounts):
    backing = mounts.backing()
    w = mounts.mount(backing, writer_id="w0")
    finish([start_rank(w, 1, 0)])
    os.mkdir(os.path.join(w.mountpoint, "emptydir"))
    w.sync()

    ro1 = mounts.mount(backing, ro=True)
    ro2 = mounts.mount(backing, ro=True)  # two read-only mounts at once
    for ro in (ro1, ro2):
        check_rank(ro.mountpoint, 1, 0)
    for ro in (ro1, ro2):
        root = ro.mountpoint
        existing = os.path.join(rank_dir(root, 1, 0), models.file_name("model.embed.weight"))
        attempts = {
            "create": lambda: os.open(os.path.join(root, "new.pt"), os.O_CREAT | os.O_WRONLY,
                                      0o644),
            "write": lambda: os.open(existing, os.O_WRONLY),
            "truncate": lambda: os.truncate(existing, 0),
            "unlink": lambda: os.unlink(existing),
            "mkdir": lambda: os.mkdir(os.path.join(root, "d")),
            "rmdir": lambda: os.rmdir(os.path.join(root, "emptydir")),
            "rename": lambda: os.rename(existing, os.path.join(root, "moved.pt")),
        }
        for what, fn in attempts.items():
            with pytest.raises(OSError) as ei:
                fn()
            assert ei.value.errno == errno.EROFS, what
    for ro in (ro1, ro2):  # nothing changed, both still serve
        check_rank(ro.mountpoint, 1, 0)
        assert os.path.isdir(os.path.join(ro.mountpoint, "emptydir"))
    ro1.stop()
    check_rank(ro2.mountpoint, 1, 0)
    # the read-only mounts left no writer behind
    assert os.listdir(os.path.join(backing, "writers")) == ["w0"]


@pytest.mark.timeout(120)
@pytest.mark.skipif(FUSE_URING, reason="the benchmark makes its mounts itself, never over "
                    "io_uring: the pass on /dev/fuse runs it")
def test_bench_scaling_quick_json(tmp_path):
    out = tmp_path / "scaling.json"
    work = tmp_path / "work"
    work.mkdir()
    r = cli("bench", "scaling", "--quick", "--dir", work, "--json", out, timeout=110)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["bench"] == "scaling" and res["config"]["writers"] == [1, 2, 4]
    assert res["machine"]["cpus"] >= 1
    measured = [x for x in res["runs"] if x["label"] == "measured"]
    assert [x["writers"] for x in measured] == [1, 2, 4]
    payloads = {x["payload_bytes"] for x in res["runs"]}
    assert len(payloads) == 1  # the same checkpoint for every writer count
    for x in res["runs"]:
        assert x["ok"], x.get("error")
        assert x["durable_s"] > 0 and x["gbps"] > 0
        assert x["bytes_durable"] >= x["payload_bytes"]
        n = x["writers"]
        # per writer: writers/<id>/ + writer.json, writer.lock, index.log, >= 1 data log;
        # plus ckptfs.json and writers/
        assert x["backing_entries"] >= 2 + 5 * n
        assert x["backing_entries"] < x["plain_entries"]
        assert x["plain_files"] == x["tensors"]
    for n in ("1", "2", "4"):
        s = res["summary"][n]
        assert s["runs_ok"] == s["runs"] == 1
        assert s["gbps_min"] <= s["gbps_median"] <= s["gbps_max"]
    assert "| writers |" in r.stdout
    assert os.listdir(work) == []  # every run cleaned up after itself
    with open("/proc/self/mountinfo") as f:
        assert not [ln for ln in f if str(tmp_path) in ln]


@pytest.mark.timeout(60)
def test_ro_mount_reads_with_o_direct_where_the_store_allows(mounts):
    """A read-only (restore) mount probes O_DIRECT with a read of an existing data log (it may
    write nothing) and then reads the logs past the backing store's page cache, like a
    read-write mount."""
    backing = mounts.backing()
    w = mounts.mount(backing, writer_id="w0")
    rw_mode = w.status()["io_mode"]
    finish([start_rank(w, 1, 0)])
    w.stop()
    before = sorted(os.listdir(os.path.join(backing, "writers", "w0")))
    ro = mounts.mount(backing, ro=True)
    st = ro.status()
    assert st["io_mode"] == rw_mode  # "direct" on ext4/xfs, "buffered" on tmpfs
    check_rank(ro.mountpoint, 1, 0)
    assert ro.status()["read_disk_bytes"] > 0
    ro.stop()
    assert sorted(os.listdir(os.path.join(backing, "writers", "w0"))) == before


# levels: past Python's recursion limit (1,000), so a merge, adoption or removal with a call
# per level fails; the paths (LEVEL and "/" a level) pass PATH_MAX (4,096 bytes) near level
# 1,010, so every walk goes by directory fds
DEEP = 1100
LEVEL = "dir"


def deep_walk(root: str, levels: int) -> tuple[int, bytes | None]:
    """Down dir/dir/... from `root` by directory descriptors, listing each level: (how
    many levels hold exactly `dir`, the bytes of f in the last one, if it lists just f)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in range(levels + 1):
            names = os.listdir(fd)
            if names != [LEVEL]:
                break
            nfd = os.open(LEVEL, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        if names != ["f"]:
            return level, None
        f = os.open("f", os.O_RDONLY, dir_fd=fd)
        try:
            return level, os.read(f, 1 << 20)
        finally:
            os.close(f)
    finally:
        os.close(fd)


def deep_make(root: str, levels: int, data: bytes) -> None:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            os.mkdir(LEVEL, dir_fd=fd)
            nfd = os.open(LEVEL, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        f = os.open("f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=fd)
        try:
            os.write(f, data)
        finally:
            os.close(f)
    finally:
        os.close(fd)


def _descend(root: str, levels: int) -> int:
    """A descriptor of dir/dir/... `levels` deep below `root`, one level at a time (paths past
    PATH_MAX); the caller closes it."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            nfd = os.open(LEVEL, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def deep_remove(root: str, levels: int) -> None:
    """rm -r of dir/dir/.../f below `root`, from the bottom up, one descriptor at a time."""
    fd = _descend(root, levels)
    try:
        os.unlink("f", dir_fd=fd)
        for _ in range(levels):
            up = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = up
            os.rmdir(LEVEL, dir_fd=fd)
    finally:
        os.close(fd)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tree_thousands_of_levels_deep_shows_on_the_other_mount_and_goes(mounts):
    """One writer's tree 1,100 directories deep, a file at the bottom: the other mount lists
    every level and reads the file (its looks merge the tree in, level by level, without a
    recursion per level), so does a remount of it; then the other mount removes the whole
    tree (whiteouts of another writer's entries), and the writer sees it gone, live and
    after a remount."""
    backing = mounts.backing()
    a = mounts.mount(backing, writer_id="w0")
    b = mounts.mount(backing, writer_id="w1")
    data = os.urandom(5000)
    deep_make(a.mountpoint, DEEP, data)
    a.sync()
    time.sleep(1.0)  # (--refresh: b's next look reads it)
    assert deep_walk(b.mountpoint, DEEP) == (DEEP, data)
    b.stop()
    b = mounts.mount(backing, mountpoint=b.mountpoint, writer_id="w1")
    assert deep_walk(b.mountpoint, DEEP) == (DEEP, data)
    deep_remove(b.mountpoint, DEEP)
    assert os.listdir(b.mountpoint) == []
    b.sync()
    time.sleep(1.0)
    assert os.listdir(a.mountpoint) == []
    a.stop()
    a = mounts.mount(backing, mountpoint=a.mountpoint, writer_id="w0")
    assert os.listdir(a.mountpoint) == []
    assert "Traceback" not in mounts.log(a) + mounts.log(b)
    a.stop()
    b.stop()
    assert listed(backing) <= {"", "/"}
    verify_ok(backing)


@pytest.mark.timeout(300)
def test_another_writers_deep_tree_is_adopted_and_moved(mounts):
    """Into one writer's trees 1,100 directories deep the other mount creates a file at the
    bottom (every directory above it adopted into its own tree) and renames a whole tree
    (every entry in it made its own); both mounts see the result, live and after a remount
    of the one that changed it."""
    backing = mounts.backing()
    a = mounts.mount(backing, writer_id="w0")
    b = mounts.mount(backing, writer_id="w1")
    data = os.urandom(5000)
    for top in ("x", "y"):
        os.mkdir(os.path.join(a.mountpoint, top))
        deep_make(os.path.join(a.mountpoint, top), DEEP, data)
    a.sync()
    time.sleep(1.0)  # (--refresh: b's next look reads it)
    fd = os.open(os.path.join(b.mountpoint, "x"), os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(DEEP):
            nfd = os.open(LEVEL, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        g = os.open("g", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=fd)
        try:
            os.write(g, b"made by w1")
        finally:
            os.close(g)
    finally:
        os.close(fd)
    os.rename(os.path.join(b.mountpoint, "y"), os.path.join(b.mountpoint, "z"))
    b.sync()
    time.sleep(1.0)
    for m in (b, a, mounts.mount(backing, ro=True)):
        assert sorted(os.listdir(m.mountpoint)) == ["x", "z"], m.mountpoint
        assert deep_walk(os.path.join(m.mountpoint, "z"), DEEP) == (DEEP, data)
        assert _bottom(os.path.join(m.mountpoint, "x")) == (["f", "g"], b"made by w1")
    b.stop()
    b = mounts.mount(backing, mountpoint=b.mountpoint, writer_id="w1")
    assert deep_walk(os.path.join(b.mountpoint, "z"), DEEP) == (DEEP, data)
    assert _bottom(os.path.join(b.mountpoint, "x")) == (["f", "g"], b"made by w1")
    assert "Traceback" not in mounts.log(a) + mounts.log(b)


def _bottom(root: str) -> tuple[list[str], bytes]:
    """The names in the deepest directory of dir/dir/... below `root`, and the bytes of its g."""
    fd = _descend(root, DEEP)
    try:
        g = os.open("g", os.O_RDONLY, dir_fd=fd)
        try:
            return sorted(os.listdir(fd)), os.read(g, 100)
        finally:
            os.close(g)
    finally:
        os.close(fd)


@pytest.mark.timeout(300)
def test_a_rewritten_index_of_many_mib_is_read_in_bounded_memory(mounts):
    """A writer's index rewritten into one of 25 MiB (its tree, then a long history of files
    made and removed again, then a directory) is read whole again by the other mount, a piece
    at a time: the daemon's peak memory (VmHWM) rises by far less than the index, and the
    view shows the writer's tree."""
    backing = mounts.backing()
    a = mounts.mount(backing, writer_id="w0")
    with open(os.path.join(a.mountpoint, "f"), "wb") as f:
        f.write(b"first")
    a.stop()
    b = mounts.mount(backing, writer_id="w1", no_populate=True)  # (staging is not touched)
    assert os.listdir(b.mountpoint) == ["f"]
    with open(os.path.join(b.mountpoint, "f"), "rb") as f:  # (the read cache's buffers)
        assert f.read() == b"first"
    index = os.path.join(backing, "writers", "w0", "index.log")
    with open(index, "rb") as f:
        old = f.read()
    name, stamp, first, n = b"n" * 255, time.time_ns(), 1 << 20, 45_000
    out = [old]
    for i in range(n):
        out += [records.encode(InodeRec(first + i, ROOT_INO, name, 0o100644, 0, 0, 0, stamp,
                                        stamp, stamp)),
                records.encode(UnlinkRec(ROOT_INO, name)),
                records.encode(CommitRec(first + i, stamp + i))]
    out += [records.encode(InodeRec(first + n, ROOT_INO, b"later", 0o40755, 0, 0, 0, stamp,
                                    stamp, stamp)),
            records.encode(CommitRec(first + n, stamp + n))]
    new = b"".join(out)
    assert len(new) > 25 << 20
    with open(index + ".fresh", "wb") as f:  # (another file, as an index snapshot writes)
        f.write(new)
    before = proc_status(b.pid)["VmHWM"]
    os.rename(index + ".fresh", index)
    time.sleep(1.2)  # (--refresh: the next listing looks first)
    assert sorted(os.listdir(b.mountpoint)) == ["f", "later"]
    grew = proc_status(b.pid)["VmHWM"] - before
    assert grew < 16 << 20, f"the daemon's peak memory rose by {grew >> 20} MiB"
    with open(os.path.join(b.mountpoint, "f"), "rb") as f:
        assert f.read() == b"first"
    assert b.status()["writers_reread"] == 1
    assert "Traceback" not in mounts.log(b)
