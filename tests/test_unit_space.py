"""Space accounting without a mount: the live bytes of each data log follow every overwrite,
truncate and unlink (cleaner.LogSpace through ExtentMap.on_dead), the RETIRE record and the
version-2 index header it needs, and an IndexWriter putting a fresh index in place."""

from __future__ import annotations

import os
import stat

import pytest

from ckptfs.datapath import cleaner
from ckptfs.datapath.staging import Run, Segment
from ckptfs.format import records
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
    sp = cleaner.LogSpace(4096)
    cleaner.install(sp)
    try:
        yield sp
    finally:
        cleaner.uninstall()


def _file(ns: Namespace, ino: int, name: bytes) -> None:
    ns.apply(InodeRec(ino, 1, name, stat.S_IFREG | 0o644, 0, 0, 0, 1, 1, 1))


def test_replayed_pieces_count_and_changes_take_bytes_off(space):
    ns = Namespace(now_ns=0)
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
    ns = Namespace(now_ns=0)
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


def test_retire_record_needs_index_version_2(tmp_path):
    rec = RetireRec(7)
    frame = records.encode(rec)
    blen, _, rtype = records.REC_HEADER.unpack_from(frame)
    assert rtype == records.R_RETIRE
    assert records.decode(rtype, frame[records.REC_HEADER.size:]) == rec
    path = str(tmp_path / "index.log")
    w = IndexWriter(path, 0)
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
    w = IndexWriter(path, 0)
    g1 = records.encode(InodeRec(2, 1, b"a", stat.S_IFREG | 0o644, 0, 0, 0, 1, 1, 1)) + \
        records.encode(UnlinkRec(1, b"a")) + records.encode(CommitRec(2, 10))
    w.append(g1)
    upto = w.size
    g2 = records.encode(InodeRec(3, 1, b"b", stat.S_IFREG | 0o644, 0, 0, 0, 1, 1, 1)) + \
        records.encode(CommitRec(3, 11))
    w.append(g2)
    fresh = path + ".fresh"
    write_fresh(fresh, records.encode(CommitRec(2, 10)))  # the first group, as a snapshot
    w.replace(fresh, upto, 1)
    assert not os.path.exists(fresh)
    w.append(records.encode(RetireRec(1)) + records.encode(CommitRec(4, 12)), version=2)
    w.close()
    scan = records.read_index(path)
    assert scan.version == 2 and scan.last_seq == 4
    assert [type(r) for g in scan.groups for r in g] == [InodeRec, RetireRec]
