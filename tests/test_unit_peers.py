"""The other writers' indexes read into the view and followed (peers.Peers): a writer that
leaves takes its whole tree with it, and an index of any size is read in pieces, whole or its
tail, in bounded memory. No mount: the indexes are written by hand into a backing directory
(as another writer's mount would) or their records applied as a mount's looks apply them."""

from __future__ import annotations

import os

from helpers import two_writers, view_shape

from ckptfs.format import backingdir, records
from ckptfs.format.records import CommitRec, InodeRec, UnlinkRec
from ckptfs.namespace import ROOT_INO, Namespace
from ckptfs.peers import load_foreign
from ckptfs.view import Union


def test_a_writer_that_leaves_takes_its_directories_at_every_depth(tmp_path):
    """A writer whose directory goes (or whose index is read again) leaves the view with
    every directory of it, however deep, and nothing else."""
    peers, l1, l2 = two_writers(tmp_path)
    peers.apply_group(l1, [InodeRec(2, 1, b"a", 0o40755, 0, 0, 0, 1, 1, 1),
                           InodeRec(3, 2, b"b", 0o40755, 0, 0, 0, 1, 1, 1),
                           InodeRec(4, 3, b"f", 0o100644, 0, 0, 0, 1, 1, 1),
                           InodeRec(5, 1, b"c", 0o40755, 0, 0, 0, 1, 1, 1)], 10)
    peers.apply_group(l2, [InodeRec(2, 1, b"a", 0o40755, 0, 0, 0, 1, 1, 1),
                           InodeRec(3, 2, b"g", 0o100644, 0, 0, 0, 1, 1, 1)], 11)
    assert view_shape(peers.view) == {b"a": {b"b": {b"f": ("w1", 4)}, b"g": ("w2", 3)},
                                      b"c": {}}
    peers.drop_tree(l1)
    assert view_shape(peers.view) == {b"a": {b"g": ("w2", 3)}}
    assert all(x.layer != l1 for x in peers.ns.inodes.values())


def _churn(first_ino: int, n: int) -> bytes:
    """`n` commit groups that each create a file with a 255-byte name and remove it again
    (about 600 bytes of index each; the tree they leave is the one before them)."""
    name = b"n" * 255
    out = []
    for i in range(n):
        ino = first_ino + i
        out += [records.encode(InodeRec(ino, ROOT_INO, name, 0o100644, 0, 0, 0, 1, 1, 1)),
                records.encode(UnlinkRec(ROOT_INO, name)),
                records.encode(CommitRec(ino, 10**18 + ino))]
    return b"".join(out)


def _peak_growth(fn):
    """fn's result and how far the memory Python allocated rose above where it was while
    fn ran (tracemalloc)."""
    import tracemalloc

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        got = fn()
        return got, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_a_large_index_of_another_writer_is_read_in_bounded_memory(tmp_path):
    """Another writer's index of 13 MiB is read a piece at a time, read whole (a mount, a
    rewritten index) and as a tail (what it appended since the last look): the memory the
    reader holds meanwhile rises by far less than the index's size, and the view is the
    writer's tree."""
    from ckptfs.replay import read_tail

    backing = str(tmp_path)
    wdir = os.path.join(backing, backingdir.WRITERS_DIR, "w1")
    os.makedirs(wdir)
    index = os.path.join(wdir, backingdir.INDEX_NAME)
    head = records.index_header(records.CROSS_INDEX_VERSION)
    first = (records.encode(InodeRec(2, ROOT_INO, b"kept", 0o40755, 0, 0, 0, 1, 1, 1))
             + records.encode(CommitRec(1, 10**18)))
    with open(index, "wb") as f:
        f.write(head + first)
    peers = load_foreign(Namespace(now_ns=0), backing, None, Union())
    layer = peers.union.layers["w1"]
    n = 22_000
    churn = _churn(10, n)
    assert len(churn) > 12 << 20
    with open(index, "ab") as f:
        f.write(churn)
    # the tail: read on from where the last read stopped, in pieces, until caught up
    peaks = []
    while peers.offsets[layer] < len(head + first + churn):
        got, peak = _peak_growth(lambda: read_tail(index, peers.offsets[layer],
                                                   peers.index_ids[layer]))
        peaks.append(peak)
        scan, ident = got
        for recs, when in zip(scan.groups, scan.group_times):
            peers.apply_group(layer, recs, when)
        peers.offsets[layer], peers.index_ids[layer] = scan.valid_bytes, ident
    assert len(peaks) > 10 and max(peaks) < 8 << 20, (len(peaks), max(peaks))
    assert sorted(peers.ns.inodes[ROOT_INO].children) == [b"kept"]
    # read whole
    fresh, peak = _peak_growth(lambda: load_foreign(Namespace(now_ns=0), backing, None,
                                                    Union()))
    assert peak < 8 << 20, peak
    assert sorted(fresh.ns.inodes[ROOT_INO].children) == [b"kept"]
    assert fresh.union.warnings == [] and fresh.max_stamp == 10**18 + 10 + n - 1
