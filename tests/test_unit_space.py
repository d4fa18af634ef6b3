"""Space accounting without a mount: the live bytes of each data log follow every overwrite,
truncate and unlink (cleaner.LogSpace.dead, the on_dead of every extent map of the tree it is
given to), the RETIRE record and the
version-2 index header it needs, and an IndexWriter putting a fresh index in place."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from ckptfs.datapath import cleaner
from ckptfs.datapath.staging import Run, Segment
from ckptfs.format import records
from ckptfs.format.backingdir import Dir
from ckptfs.format.index import IndexWriter, write_fresh
from ckptfs.format.records import (
    CommitRec,
    ExtentRec,
    FormatError,
    InodeRec,
    RetireRec,
    SizeRec,
    UnlinkRec,
)
from ckptfs.namespace import Namespace
from ckptfs.replay import replay, validate_extents

KiB = 1 << 10


@pytest.fixture
def space():
    return cleaner.LogSpace(4096)


def _file(ns: Namespace, ino: int, name: bytes) -> None:
    ns.apply(InodeRec(ino, 1, name, stat.S_IFREG | 0o644, 0, 0, 0, 1, 1, 1))


def test_replayed_pieces_count_and_changes_take_bytes_off(space):
    ns = Namespace(now_ns=0, on_dead=space.dead)
    _file(ns, 2, b"a")
    _file(ns, 3, b"b")
    ns.apply(ExtentRec(2, 0, 100 * KiB, 1, 4096, 0))
    ns.apply(ExtentRec(3, 0, 50 * KiB, 2, 4096, 0))
    space.count(ns, {})
    assert space.live == {1: 100 * KiB, 2: 50 * KiB}
    ns.apply(SizeRec(2, 60 * KiB, 2, 2))  # truncate: 40 KiB of log 1 die
    assert space.live[1] == 60 * KiB
    # an overwrite (its new bytes count once their segment is durable: the next test)
    ns.apply(ExtentRec(2, 10 * KiB, 20 * KiB, 2, 60 * KiB, 0))
    assert space.live == {1: 40 * KiB, 2: 50 * KiB}
    ns.apply(UnlinkRec(1, b"b"))  # the last name, no handle: everything of it dies
    assert space.live == {1: 40 * KiB, 2: 0}


def test_a_segment_counts_when_durable_with_what_survived(space):
    ns = Namespace(now_ns=0, on_dead=space.dead)
    _file(ns, 2, b"a")
    x = ns.inodes[2]
    seg = Segment(bytearray(64 * KiB), 1)
    run = Run(seg, 0, 64 * KiB, log=5, loff=4096)  # (placed: the flusher sets both)
    seg.runs.append(run)
    seg.used, seg.log, seg.loff = 64 * KiB, 5, 4096
    x.emap.insert(0, 64 * KiB, run, 0)
    x.emap.truncate(16 * KiB)  # before it is durable: remembered on the run
    assert run.dead == 48 * KiB and space.live == {}
    seg.durable = True
    space.durable(seg)
    assert space.live == {5: 16 * KiB} and space.ends[5] == 4096 + 64 * KiB
    x.emap.truncate(0)
    assert space.live == {5: 0}


def test_only_the_tree_given_the_space_takes_bytes_off(space):
    """Another tree in the same process and thread (an offline tool's, a test's) that names the
    same logs lets go of its pieces without touching the mount's count."""
    own, other = Namespace(now_ns=0, on_dead=space.dead), Namespace(now_ns=0)
    for ns in (own, other):
        _file(ns, 2, b"a")
        ns.apply(ExtentRec(2, 0, 100 * KiB, 1, 4096, 0))
    space.count(own, {})
    other.apply(SizeRec(2, 0, 2, 2))
    other.apply(UnlinkRec(1, b"a"))
    assert space.live == {1: 100 * KiB}
    own.apply(SizeRec(2, 30 * KiB, 2, 2))  # (and the own tree's changes still count)
    assert space.live == {1: 30 * KiB}


def test_retire_record_needs_index_version_2(tmp_path):
    rec = RetireRec(7)
    frame = records.encode(rec)
    blen, _, rtype = records.REC_HEADER.unpack_from(frame)
    assert rtype == records.R_RETIRE
    assert records.decode(rtype, frame[records.REC_HEADER.size:]) == rec
    path = str(tmp_path / "index.log")
    w = IndexWriter(Dir(str(tmp_path)), "index.log", 0)
    assert w.version == 1
    w.append(records.encode(CommitRec(1, 5)))
    w.append(frame + records.encode(CommitRec(2, 6)), version=records.RETIRE_INDEX_VERSION)
    w.close()
    scan = records.read_index(path)
    assert scan.version == 2 and scan.groups[-1] == [rec]
    ns = Namespace(now_ns=0)
    replay(ns, path)
    assert ns.retired == {7} and ns.last_log == 7
    # code that reads version 1 only refuses it (instead of cutting the index at the record)
    v3 = records.index_header(records.INDEX_VERSION + 1)
    with open(path, "r+b") as f:
        f.write(v3)
    with pytest.raises(FormatError, match="newer"):
        records.read_index(path)


def test_an_extent_in_a_retired_log_is_reported_as_such(tmp_path):
    ns = Namespace(now_ns=0)
    _file(ns, 2, b"a")
    ns.apply(ExtentRec(2, 0, 4096, 3, 4096, 0))
    ns.apply(RetireRec(3))
    warnings = validate_extents(ns, str(tmp_path))
    assert len(warnings) == 1 and "retired" in warnings[0] and "dropped" in warnings[0]


def test_replace_puts_a_fresh_index_in_place_with_what_came_after(tmp_path):
    path = str(tmp_path / "index.log")
    w = IndexWriter(Dir(str(tmp_path)), "index.log", 0)
    g1 = records.encode(InodeRec(2, 1, b"a", stat.S_IFREG | 0o644, 0, 0, 0, 1, 1, 1)) + \
        records.encode(UnlinkRec(1, b"a")) + records.encode(CommitRec(2, 10))
    w.append(g1)
    upto = w.size
    g2 = records.encode(InodeRec(3, 1, b"b", stat.S_IFREG | 0o644, 0, 0, 0, 1, 1, 1)) + \
        records.encode(CommitRec(3, 11))
    w.append(g2)
    fresh = path + ".fresh"
    write_fresh(fresh, records.encode(CommitRec(2, 10)))  # the first group, as a snapshot
    w.replace("index.log.fresh", upto, 1)
    assert not os.path.exists(fresh)
    w.append(records.encode(RetireRec(1)) + records.encode(CommitRec(4, 12)), version=2)
    w.close()
    scan = records.read_index(path)
    assert scan.version == 2 and scan.last_seq == 4
    assert [type(r) for g in scan.groups for r in g] == [InodeRec, RetireRec]


# ---------------------------------------------------------------- the index snapshot
def _tree(ns: Namespace) -> dict:
    """Everything replay builds that a snapshot must keep, by path."""
    out = {}

    def walk(d, prefix):
        for name, ino in sorted(d.children.items()):
            x = ns.inodes[ino]
            p = prefix + name.decode()
            data = None
            if x.emap is not None:
                data = [(s, n, r.log, r.loff + ro) for s, n, r, ro in x.emap.pieces]
            out[p] = (x.ino, x.mode, x.uid, x.gid, x.rdev, x.nlink, x.size, x.atime_ns,
                      x.mtime_ns, x.ctime_ns, x.target, x.commit_ns, data)
            if x.children is not None:
                walk(x, p + "/")
    root = ns.inodes[1]
    out["/"] = (root.mode, root.uid, root.gid, root.mtime_ns, root.ctime_ns, root.atime_ns)
    walk(root, "")
    return out


def _history(tmp_path) -> tuple[str, bytes]:
    """A writer directory whose index has a history: hard links, a truncate into a run,
    an unlink, a rename, a retired log. Returns (the index's path, the data log's payload)."""
    from crc32c import crc32c

    from ckptfs.format import backingdir
    from ckptfs.format.records import LinkRec, RenameRec, SetattrRec

    wdir = tmp_path / "w"
    wdir.mkdir()
    payload = os.urandom(64 * KiB)
    with open(wdir / backingdir.data_log_name(3), "wb") as f:
        f.write(records.data_log_header("w", 3) + payload)
    base = records.DATA_HEADER_BYTES
    reg, d = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755
    groups = [
        [InodeRec(2, 1, b"dir", d, 5, 6, 0, 10, 10, 10),
         InodeRec(3, 2, b"whole", reg, 5, 6, 0, 11, 11, 11),
         ExtentRec(3, 0, 16 * KiB, 3, base, crc32c(payload[:16 * KiB])),
         InodeRec(4, 2, b"cut", reg, 5, 6, 0, 12, 12, 12),
         ExtentRec(4, 0, 32 * KiB, 3, base + 16 * KiB, crc32c(payload[16 * KiB:48 * KiB]))],
        [SizeRec(4, 20 * KiB, 13, 13),  # a truncate into the run: part of it stays
         ExtentRec(4, 4 * KiB, 4 * KiB, 3, base + 48 * KiB, crc32c(payload[48 * KiB:52 * KiB])),
         LinkRec(3, 1, b"hard"),
         InodeRec(5, 1, b"sym", stat.S_IFLNK | 0o777, 0, 0, 0, 14, 14, 14, b"dir/whole"),
         InodeRec(6, 1, b"gone", reg, 0, 0, 0, 15, 15, 15),
         InodeRec(7, 2, b"sparse", reg, 0, 0, 0, 16, 16, 16),
         SizeRec(7, 1 << 30, 17, 17)],
        [UnlinkRec(1, b"gone"), RenameRec(2, b"sparse", 1, b"moved"),
         SetattrRec(2, 0o700, 5, 6, 1, 2, 3), RetireRec(1)],
    ]
    blob = b""
    for i, g in enumerate(groups):
        blob += b"".join(records.encode(r) for r in g) + records.encode(CommitRec(i + 1, 100 + i))
    index = str(wdir / "index.log")
    write_fresh(index, blob)
    return index, payload


def test_a_snapshot_replays_to_the_same_tree(tmp_path):
    from crc32c import crc32c

    from ckptfs.datapath import mover

    index, payload = _history(tmp_path)
    want = Namespace(uid=5, gid=6, now_ns=7)
    replay(want, index)
    fresh, size, version = mover.build_snapshot(index, os.path.getsize(index), "w", 5, 6, 7)
    assert version == 2 and size == os.path.getsize(fresh)
    got = Namespace(uid=99, gid=99, now_ns=99)  # the snapshot's root SETATTR wins
    replay(got, fresh)
    assert _tree(got) == _tree(want)
    assert got.next_ino == want.next_ino == 8 and got.last_log >= 3
    # the piece the truncate cut has the checksum of its own bytes; the run whole keeps its
    scan = records.read_index(fresh)
    ext = {(r.ino, r.foff): r for g in scan.groups for r in g if type(r) is ExtentRec}
    assert ext[(4, 0)].length == 4 * KiB and ext[(4, 0)].crc == crc32c(payload[16 * KiB:20 * KiB])
    assert ext[(3, 0)].crc == crc32c(payload[:16 * KiB])
    assert scan.group_times[-1] == 102  # the index still ends at its last commit's time


def test_the_snapshot_process_writes_what_build_snapshot_writes(tmp_path):
    """The daemon's snapshot process (python -m ckptfs.datapath.mover, snapshotter.py) gives
    the same fresh index as build_snapshot in this process, and reports a damaged index as
    the OSError build_snapshot raises."""
    import subprocess

    from ckptfs.datapath import mover

    index, _ = _history(tmp_path)
    upto = os.path.getsize(index)
    fresh, size, version = mover.build_snapshot(index, upto, "w", 5, 6, 7)
    with open(fresh, "rb") as f:
        want = f.read()
    os.unlink(fresh)
    cmd, env, cwd = mover.snapshot_command()

    def run(args: bytes) -> tuple[str, int, int, int]:
        p = subprocess.run(cmd, input=args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           env=env, cwd=cwd, timeout=60)
        return mover.snapshot_result(p.stdout, p.returncode)
    got = run(mover.snapshot_args(index, upto, "w", 5, 6, 7, frozenset(), os.getpid()))
    assert got[:3] == (fresh, size, version) and got[3] > 0
    with open(fresh, "rb") as f:
        assert f.read() == want
    with pytest.raises(OSError) as e:  # (more committed bytes than the index has)
        run(mover.snapshot_args(index, upto + 1, "w", 5, 6, 7, frozenset(), os.getpid()))
    assert e.value.errno == errno.EIO and "committed" in str(e.value)
    # a process that is not the daemon's child ends at once, writing nothing
    with pytest.raises(OSError, match="ended with 1"):
        run(mover.snapshot_args(index, upto, "w", 5, 6, 7, frozenset(), 1))


def test_snapshot_results_are_read_strictly():
    from ckptfs.datapath import mover

    with pytest.raises(OSError) as e:
        mover.snapshot_result(b'{"errno": 28, "error": "no space"}\n', 0)
    assert e.value.errno == 28
    with pytest.raises(OSError, match="ended with -9: no output"):
        mover.snapshot_result(b"", -9)
    with pytest.raises(OSError, match="Traceback"):
        mover.snapshot_result(b"Traceback (most recent call last)\n", 1)
    assert mover.snapshot_result(b'{"fresh": "f", "size": 1, "version": 2, "peak_rss": 3}',
                                 0) == ("f", 1, 2, 3)


def test_dead_ranges_are_the_gaps_between_live_ones_in_whole_blocks():
    from ckptfs.datapath.reclaim import PUNCH_MIN_BYTES, Reclaimer, _merge, _subtract

    # (no journal, flusher, reader, staging or directory: the gaps are arithmetic)
    m = Reclaimer(Namespace(now_ns=0), None, None, None, None, cleaner.LogSpace(4096), None)
    m.space.ends[1] = 4 << 20
    live = _merge([(4096 + 100, 8192), (1 << 20, (1 << 20) + 10), (2 << 20, 3 << 20)])
    got = m._dead_ranges(1, live, 4 << 20)
    assert got == [(8192, 1 << 20), ((1 << 20) + 4096, 2 << 20), (3 << 20, 4 << 20)]
    m._punched_ranges[1] = [(8192, 1 << 20)]
    assert m._dead_ranges(1, live, 4 << 20) == got[1:]  # what was punched is not punched again
    assert m._dead_ranges(1, live, 2 << 20) == got[1:2]  # nothing past where the log ended
    assert _subtract([(0, 1 << 20)], [(4096, 8192)]) == [(8192, 1 << 20)]  # (4 KiB < min)
    assert PUNCH_MIN_BYTES > 4096


def test_live_ranges_are_whole_runs():
    """A run a truncate left one piece of stays live whole: a read of that piece checks the
    checksum of the whole run, so none of its bytes may be punched."""
    import trio

    from ckptfs.datapath.reclaim import Reclaimer
    from ckptfs.datapath.staging import ExtentMap

    # (no journal, flusher, reader, staging or directory: a pass over the tree)
    m = Reclaimer(Namespace(now_ns=0), None, None, None, None, cleaner.LogSpace(4096), None)
    x = m.ns.inodes[1].__class__(50, stat.S_IFREG | 0o644, 0, 0)
    x.emap = ExtentMap()
    run = Run(None, 0, 2 << 20, log=1, loff=1 << 20, crc=7)
    x.emap.insert(0, 2 << 20, run, 0)
    x.emap.truncate(4096)  # one 4 KiB piece of the 2 MiB run is left
    m.ns.inodes[50] = x
    live = trio.run(m.live_ranges, {1})
    assert live == {1: [(1 << 20, 3 << 20)]}


def test_compact_refuses_a_writer_whose_index_cannot_be_read(tmp_path):
    """A writer whose index fails to load has no tree in the view: compacting it would write
    the other writers' files into it and delete its logs. It is refused, nothing changes."""
    from ckptfs.format import backingdir
    from ckptfs.tools.compact import compact_writer

    backingdir.check_backing(str(tmp_path), create=True)
    wdir = tmp_path / "writers" / "w"
    wdir.mkdir(parents=True)
    (wdir / "index.log").mkdir()  # cannot be read as a file
    (wdir / backingdir.data_log_name(1)).write_bytes(records.data_log_header("w", 1))
    with pytest.raises(records.FormatError, match="cannot be read"):
        compact_writer(str(tmp_path), "w", 1 << 30, False)
    left = sorted(p.name for p in wdir.iterdir() if p.name not in ("writer.lock", "writer.json"))
    assert left == [backingdir.data_log_name(1), "index.log"]  # its log was not deleted


def test_every_own_log_is_named_while_another_writers_index_cannot_be_read(tmp_path):
    """A writer whose index could not be read has no tree in the view, so the XEXTENT records
    of its files copied up from this writer are not known: until its tree is loaded, every own
    log counts as named by others (none is retired, punched or cleaned). Once it is read, only
    the log its records name."""
    from ckptfs.format import backingdir
    from ckptfs.format.records import XExtentRec
    from ckptfs.replay import read_writer
    from ckptfs.peers import load_foreign
    from ckptfs.view import Union

    backingdir.check_backing(str(tmp_path), create=True)
    wdir = tmp_path / "writers" / "w1"
    wdir.mkdir(parents=True)
    (wdir / "index.log").mkdir()  # cannot be read as a file
    union = Union(writer_dirs={0: str(tmp_path / "writers" / "w0")})
    peers = load_foreign(Namespace(now_ns=0), str(tmp_path), "w0", union)
    layer = union.layer_of("w1")
    assert layer is not None and peers.unloaded() == [layer]
    own = {1: 0, 2: 100, 3: 0}  # (the cleaner's LogSpace.live: log -> live bytes)
    assert cleaner.logs_named_by_others(peers, own) == {1, 2, 3}
    (wdir / "index.log").rmdir()
    recs = [InodeRec(2, 1, b"f", stat.S_IFREG | 0o644, 0, 0, 0, 1, 1, 1),
            XExtentRec(2, 0, 100, "w0", 3, 4096, 100, 0, 0)]
    (wdir / "index.log").write_bytes(
        records.index_header(records.CROSS_INDEX_VERSION) + b"".join(map(records.encode, recs))
        + records.encode(CommitRec(len(recs), 1)))
    peers.add_tree(str(wdir), *read_writer(str(wdir)), layer)
    assert peers.unloaded() == []
    assert peers.trees[layer].inodes[2].size == 100
    assert cleaner.logs_named_by_others(peers, own) == {3}
    # the other writer overwrites the file with bytes of its own: nothing of w0 is named
    peers.apply_group(layer, [ExtentRec(2, 0, 100, 1, 4096, 0)], 2)
    assert cleaner.logs_named_by_others(peers, own) == set()
    assert peers.trees[layer].cross_files == set()


def test_a_snapshot_leaves_out_the_whiteouts_it_is_told_are_settled(tmp_path):
    from ckptfs.datapath import mover
    from ckptfs.format.records import XUnlinkRec

    wdir = tmp_path / "w"
    wdir.mkdir()
    recs = [InodeRec(2, 1, b"f", stat.S_IFREG | 0o644, 0, 0, 0, 1, 1, 1),
            XUnlinkRec("other", 1, 5, b"gone"), XUnlinkRec("other", 1, 6, b"there")]
    index = str(wdir / "index.log")
    write_fresh(index, b"".join(map(records.encode, recs)) + records.encode(CommitRec(3, 9)),
                records.CROSS_INDEX_VERSION)
    fresh, _, _ = mover.build_snapshot(index, os.path.getsize(index), "w", 0, 0, 1,
                                       frozenset({("other", 5)}))
    got = [r for g in records.read_index(fresh).groups for r in g]
    assert [(r.ino, r.name) for r in got if type(r) is XUnlinkRec] == [(6, b"there")]
    assert [r.name for r in got if type(r) is InodeRec] == [b"f"]
