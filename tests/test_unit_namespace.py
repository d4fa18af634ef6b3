"""Namespace.apply without a mount: each record changes the tree as replay and the live handlers
expect (entries, link counts, parents, times, extents), records that do not fit the tree are
refused with FormatError and leave it unchanged, and change() journals what apply did."""

from __future__ import annotations

import copy
import stat

import pytest

from ckptfs import replay
from ckptfs.format import records
from ckptfs.format.records import (
    CommitRec,
    ExtentRec,
    FormatError,
    InodeRec,
    LinkRec,
    RenameRec,
    SetattrRec,
    SizeRec,
    UnlinkRec,
    XExtentRec,
)
from ckptfs.namespace import RENAME_EXCHANGE, ROOT_INO, ChangeNotices, Namespace

REG, DIR, LNK = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755, stat.S_IFLNK | 0o777


def mk(ino, parent, name, mode=REG, t=100, target=b""):
    return InodeRec(ino, parent, name, mode, 1000, 100, 0, t, t, t, target)


@pytest.fixture
def ns():
    """/a (file 2), /d (dir 3), /d/b (file 4), /e (dir 5)."""
    n = Namespace(now_ns=1)
    for rec in (mk(2, 1, b"a", t=10), mk(3, 1, b"d", DIR, t=20), mk(4, 3, b"b", t=30),
                mk(5, 1, b"e", DIR, t=40)):
        n.apply(rec)
    return n


def names(ns, ino=ROOT_INO):
    return dict(ns.inodes[ino].children)


def shape(ns):
    """What apply may change: entries, link counts, parents, sizes, modes, times."""
    return {i: (x.mode, x.nlink, x.parent, x.size, x.mtime_ns, x.ctime_ns,
                dict(x.children) if x.children is not None else None)
            for i, x in ns.inodes.items()}


def test_root_and_inode_records(ns):
    root = ns.inodes[ROOT_INO]
    assert names(ns) == {b"a": 2, b"d": 3, b"e": 5}
    assert root.nlink == 4  # . and .. plus the two subdirectories' ..
    d = ns.inodes[3]
    assert d.is_dir and d.nlink == 2 and d.parent == ROOT_INO
    a = ns.inodes[2]
    assert a.nlink == 1 and a.emap is not None and a.children is None
    assert (a.uid, a.gid, a.mtime_ns) == (1000, 100, 10)
    # a directory's times follow the entries created in it
    assert (d.mtime_ns, d.ctime_ns) == (30, 30)
    assert (root.mtime_ns, root.ctime_ns) == (40, 40)
    assert ns.next_ino == 6 and ns.new_ino() == 6 and ns.new_ino() == 7
    assert ns.path_of(4) == "/d/b" and ns.path_of(ROOT_INO) == "/"


def test_symlink_and_special_files(ns):
    ns.apply(mk(6, 1, b"l", LNK, target=b"d/b"))
    ns.apply(mk(7, 1, b"p", stat.S_IFIFO | 0o600))
    x = ns.inodes[6]
    assert x.target == b"d/b" and x.size == 3 and x.emap is None and x.children is None
    assert ns.inodes[7].emap is None and ns.inodes[7].nlink == 1


@pytest.mark.parametrize("rec, why", [
    (mk(2, 1, b"again"), "inode number used twice"),
    (mk(1, 1, b"root"), "the root's number"),
    (mk(9, 1, b"a"), "name taken"),
    (mk(9, 2, b"x"), "parent is a file"),
    (mk(9, 77, b"x"), "parent unknown"),
    (mk(9, 1, b"x", 0o170644), "no such file type"),
    (mk(9, 1, b"x", LNK, target=b"t" * 4097), "symlink target too long"),
    (ExtentRec(3, 0, 10, 1, 4096, 0), "extent of a directory"),
    (ExtentRec(99, 0, 10, 1, 4096, 0), "extent of an unknown inode"),
    (SizeRec(3, 0, 1, 1), "size of a directory"),
    (SetattrRec(99, 0o644, 0, 0, 1, 1, 1), "setattr of an unknown inode"),
    (UnlinkRec(1, b"missing"), "unlink of a missing entry"),
    (UnlinkRec(1, b"d"), "rmdir of a non-empty directory"),
    (UnlinkRec(2, b"x"), "unlink in a file"),
    (LinkRec(3, 1, b"dirlink"), "hard link of a directory"),
    (LinkRec(2, 1, b"d"), "link over an existing name"),
    (LinkRec(99, 1, b"x"), "link of an unknown inode"),
    (RenameRec(1, b"missing", 1, b"x"), "rename of a missing entry"),
    (RenameRec(1, b"d", 3, b"inside"), "directory into itself"),
    (RenameRec(1, b"e", 1, b"d"), "over a non-empty directory"),
    (RenameRec(1, b"a", 1, b"nothing", RENAME_EXCHANGE), "exchange with a missing entry"),
    (RenameRec(3, b"b", 1, b"d", RENAME_EXCHANGE), "exchange puts a directory inside itself"),
    (RenameRec(1, b"a", 2, b"x"), "rename into a file"),
    (CommitRec(1, 1), "a commit is not a change"),
])
def test_records_that_do_not_fit_are_refused(ns, rec, why):
    before = shape(ns)
    with pytest.raises(FormatError):
        ns.apply(rec)
    assert shape(ns) == before, why


def test_inode_number_out_of_range():
    ns = Namespace(now_ns=0)
    with pytest.raises(FormatError):
        ns.apply(mk(1 << 44, 1, b"far"))


def test_unlink_and_rmdir(ns):
    ns.apply(UnlinkRec(3, b"b"))
    assert names(ns, 3) == {} and 4 not in ns.inodes  # no link, no kernel reference: forgotten
    ns.apply(UnlinkRec(1, b"d"))
    assert b"d" not in names(ns) and ns.inodes[ROOT_INO].nlink == 3 and 3 not in ns.inodes


def test_unlinked_inode_stays_while_referenced(ns):
    b = ns.inodes[4]
    b.lookups = 1
    ns.apply(UnlinkRec(3, b"b"))
    assert ns.inodes[4] is b and b.nlink == 0 and b.emap is not None
    b.lookups = 0
    ns.maybe_forget(b)
    assert 4 not in ns.inodes and b.emap is None


def test_hard_links(ns):
    ns.apply(LinkRec(2, 3, b"hard"))
    a = ns.inodes[2]
    assert a.nlink == 2 and names(ns, 3)[b"hard"] == 2
    ns.apply(UnlinkRec(1, b"a"))
    assert a.nlink == 1 and ns.inodes[2] is a and ns.path_of(2) == "/d/hard"


def test_rename_within_and_across_directories(ns):
    ns.apply(RenameRec(1, b"a", 1, b"a2"))
    assert names(ns) == {b"a2": 2, b"d": 3, b"e": 5}
    ns.apply(RenameRec(3, b"b", 5, b"b"))
    assert names(ns, 3) == {} and names(ns, 5) == {b"b": 4}
    # a directory moves: its parent and both link counts follow
    ns.apply(RenameRec(1, b"d", 5, b"d"))
    d, e, root = ns.inodes[3], ns.inodes[5], ns.inodes[ROOT_INO]
    assert d.parent == 5 and e.nlink == 3 and root.nlink == 3
    assert ns.path_of(3) == "/e/d" and ns.is_ancestor(e, d) and not ns.is_ancestor(d, e)


def test_rename_onto_itself_changes_nothing(ns):
    ns.apply(LinkRec(2, 1, b"same"))
    before = shape(ns)
    ns.apply(RenameRec(1, b"a", 1, b"same"))  # both names are one inode: POSIX says no-op
    assert shape(ns) == before


def test_rename_over_a_file_and_an_empty_directory(ns):
    ns.apply(mk(6, 1, b"victim", t=50))
    ns.apply(RenameRec(1, b"a", 1, b"victim"))
    assert names(ns)[b"victim"] == 2 and 6 not in ns.inodes and b"a" not in names(ns)
    ns.apply(mk(7, 5, b"empty", DIR, t=60))
    ns.apply(UnlinkRec(3, b"b"))
    ns.apply(RenameRec(1, b"d", 5, b"empty"))  # a directory over an empty one
    e = ns.inodes[5]
    assert names(ns, 5) == {b"empty": 3} and 7 not in ns.inodes
    assert e.nlink == 3 and ns.inodes[3].parent == 5 and ns.inodes[ROOT_INO].nlink == 3


def test_rename_over_a_file_with_other_links(ns):
    ns.apply(LinkRec(4, 1, b"other"))
    ns.apply(RenameRec(1, b"a", 3, b"b"))
    b = ns.inodes[4]
    assert b.nlink == 1 and names(ns)[b"other"] == 4 and names(ns, 3)[b"b"] == 2


def test_exchange(ns):
    ns.apply(RenameRec(1, b"a", 3, b"b", RENAME_EXCHANGE))
    assert names(ns)[b"a"] == 4 and names(ns, 3)[b"b"] == 2
    # a file and a directory swap places: the directory's parent and the link counts follow
    ns.apply(RenameRec(1, b"e", 3, b"b", RENAME_EXCHANGE))
    assert names(ns)[b"e"] == 2 and names(ns, 3)[b"b"] == 5
    e, d, root = ns.inodes[5], ns.inodes[3], ns.inodes[ROOT_INO]
    assert e.parent == 3 and d.nlink == 3 and root.nlink == 3


def test_exchange_moves_the_replaced_directory_too(ns):
    ns.apply(RenameRec(3, b"b", 1, b"e", RENAME_EXCHANGE))  # a file in d, a directory in /
    e, d, root = ns.inodes[5], ns.inodes[3], ns.inodes[ROOT_INO]
    assert names(ns, 3) == {b"b": 5} and names(ns)[b"e"] == 4
    assert e.parent == 3 and d.nlink == 3 and root.nlink == 3
    assert ns.path_of(5) == "/d/b" and ns.path_of(4) == "/e"


def test_extents_newest_wins_and_size(ns):
    ns.apply(ExtentRec(2, 0, 100, 1, 4096, 11))
    ns.apply(ExtentRec(2, 50, 100, 2, 8192, 22))
    a = ns.inodes[2]
    assert a.size == 150
    got = [(p.start, p.length, p.run.log, p.run.loff, p.roff) for p in a.emap.pieces]
    assert got == [(0, 50, 1, 4096, 0), (50, 100, 2, 8192, 0)]
    assert a.emap.pieces[1].run.crc == 22 and a.emap.pieces[1].run.seg is None
    ns.apply(ExtentRec(2, 10, 5, 3, 4096, 0))  # inside: splits the older piece
    assert [(p.start, p.length, p.run.log, p.roff) for p in a.emap.pieces] == [
        (0, 10, 1, 0), (10, 5, 3, 0), (15, 35, 1, 15), (50, 100, 2, 0)]
    assert a.size == 150  # an extent inside the file does not shrink it


def test_size_clips_and_grows(ns):
    a = ns.inodes[2]
    a.tail_run = object()
    ns.apply(ExtentRec(2, 0, 100, 1, 4096, 0))
    ns.apply(SizeRec(2, 30, 7, 8))
    assert a.size == 30 and a.emap.stored_bytes() == 30 and a.tail_run is None
    assert (a.mtime_ns, a.ctime_ns) == (7, 8)
    ns.apply(SizeRec(2, 1000, 9, 9))  # a hole: nothing stored past 30
    assert a.size == 1000 and a.emap.stored_bytes() == 30


def test_setattr_keeps_the_file_type(ns):
    ns.apply(SetattrRec(3, 0o102750, 5, 6, 1, 2, 3))  # a stray type in the mode is ignored
    d = ns.inodes[3]
    assert d.mode == stat.S_IFDIR | 0o2750 and d.is_dir
    assert (d.uid, d.gid, d.atime_ns, d.mtime_ns, d.ctime_ns) == (5, 6, 1, 2, 3)


def test_change_journals_what_it_applies(ns):
    seen = []
    ns.journal_hook = seen.append
    recs = [mk(6, 1, b"new"), LinkRec(6, 3, b"l"), RenameRec(1, b"new", 5, b"n"),
            SetattrRec(6, 0o600, 0, 0, 1, 1, 1), UnlinkRec(5, b"n")]
    for r in recs:
        ns.change(r)
    assert seen == recs
    assert ns.path_of(6) == "/d/l" and ns.inodes[6].nlink == 1


def test_change_of_an_unlinked_open_file_is_not_journaled(ns):
    seen = []
    ns.journal_hook = seen.append
    b = ns.inodes[4]
    b.opens = 1
    ns.change(UnlinkRec(3, b"b"))
    ns.change(SetattrRec(4, 0o600, 0, 0, 1, 1, 1))
    ns.change(SizeRec(4, 0, 1, 1))
    assert seen == [UnlinkRec(3, b"b")]  # no name reaches it after a remount
    assert b.mode & 0o777 == 0o600 and b.size == 0  # but the open file still changes


def test_failed_change_is_not_journaled(ns):
    seen = []
    ns.journal_hook = seen.append
    with pytest.raises(FormatError):
        ns.change(UnlinkRec(1, b"missing"))
    assert seen == []


class Heard:
    """A listener of the change notices (as the answer cache is while the queue threads run):
    what it was told, in order."""

    def __init__(self) -> None:
        self.told: list = []

    def dirs_changed(self) -> None:
        self.told.append("dirs")

    def files_changed(self) -> None:
        self.told.append("files")

    def view_changed(self) -> None:
        self.told.append("view")

    def name_added(self, parent: int, name: bytes) -> None:
        self.told.append(("name", parent, name))


def test_change_notices_tell_the_listener_attached_what_each_change_changed():
    """The namespace made with change notices tells them each change of a directory (and
    every name a directory gains) or of a file's attributes, and the refresher's view
    changes come the same way; the listener attached hears them, none before it is
    attached or after it is detached."""
    notices, heard = ChangeNotices(), Heard()
    n = Namespace(now_ns=1, notices=notices)
    n.change(mk(2, 1, b"a"))
    n.change(mk(3, 1, b"d", DIR))
    assert not notices.listening and heard.told == []
    notices.attach(heard)
    n.change(mk(4, 3, b"b"))
    n.change(LinkRec(4, 1, b"h"))
    n.change(RenameRec(3, b"b", 1, b"c"))
    n.change(RenameRec(1, b"a", 1, b"c", RENAME_EXCHANGE))
    n.change(SetattrRec(3, DIR, 5, 6, 1, 1, 1))  # a directory's attributes
    n.change(SetattrRec(2, REG, 5, 6, 1, 1, 1))  # a file's
    n.change(SizeRec(2, 5, 2, 2))
    n.change(UnlinkRec(1, b"h"))
    notices.view_changed()
    assert heard.told == ["dirs", ("name", 3, b"b"), "dirs", ("name", 1, b"h"),
                          "dirs", ("name", 1, b"c"),
                          "dirs", ("name", 1, b"c"), ("name", 1, b"a"),
                          "dirs", "files", "files", "dirs", "view"]
    notices.detach()
    n.change(UnlinkRec(1, b"c"))
    notices.view_changed()
    assert len(heard.told) == 14 and names(n) == {b"a": 4, b"d": 3}


def test_a_tree_is_made_with_its_writer_layers():
    """A tree gets the layer its records' runs belong to and the layers of other writers
    (for XEXTENT records: bytes in their data logs) when it is made; a writer it does not
    know is refused."""
    n = Namespace(now_ns=1, layer=3, layer_of={"w1": 5}.get)
    n.apply(mk(2, 1, b"a"))
    n.apply(ExtentRec(2, 0, 10, 1, 4096, 0))
    n.apply(XExtentRec(2, 10, 20, "w1", 7, 8192, 40, 0, 5))
    assert [(p.run.layer, p.run.log) for p in n.inodes[2].emap.pieces] == [(3, 1), (5, 7)]
    with pytest.raises(FormatError, match="w2"):
        n.apply(XExtentRec(2, 30, 5, "w2", 7, 8192, 40, 0, 0))


def test_replaying_the_same_records_builds_the_same_tree(ns):
    """The live tree and a replayed one come from the same function: applying a recorded
    history again gives an equal tree."""
    seen = []
    live = Namespace(journal_hook=seen.append, now_ns=1)
    for r in (mk(2, 1, b"a"), mk(3, 1, b"d", DIR), LinkRec(2, 3, b"h"),
              RenameRec(1, b"a", 3, b"a"), ExtentRec(2, 0, 10, 1, 4096, 0),
              SizeRec(2, 5, 2, 2), mk(4, 3, b"x", DIR), RenameRec(3, b"x", 1, b"x"),
              UnlinkRec(3, b"h")):
        live.change(copy.copy(r))
    again = Namespace(now_ns=1)
    for r in seen:
        again.apply(r)
    assert shape(again) == shape(live)


def test_replay_applies_groups_and_skips_records_that_do_not_fit(tmp_path):
    idx = tmp_path / "index.log"
    groups = [[mk(2, 1, b"a"), mk(3, 1, b"d", DIR)], [UnlinkRec(1, b"missing"), mk(4, 3, b"f")]]
    data = records.index_header()
    for seq, g in enumerate(groups, 1):
        data += b"".join(records.encode(r) for r in g) + records.encode(CommitRec(seq, seq * 7))
    idx.write_bytes(data)
    ns = Namespace(now_ns=0)
    last, valid, warnings = replay.replay(ns, str(idx))
    assert (last, valid) == (2, len(data))
    assert names(ns) == {b"a": 2, b"d": 3} and names(ns, 3) == {b"f": 4}
    assert len(warnings) == 1 and "record skipped" in warnings[0] and "missing" in warnings[0]
    # each inode knows the time of the commit that last changed it (the union's merge order)
    assert ns.inodes[2].commit_ns == 7 and ns.inodes[4].commit_ns == 14


def test_extents_beyond_their_log_are_dropped_and_named(tmp_path):
    (tmp_path / "data-000001.log").write_bytes(bytes(4096 + 8192))
    ns = Namespace(now_ns=0)
    for r in (mk(3, 1, b"d", DIR), mk(4, 3, b"f"), ExtentRec(4, 0, 8192, 1, 4096, 0),
              ExtentRec(4, 8192, 10, 1, 4096 + 8192, 0), ExtentRec(4, 9000, 10, 2, 4096, 0)):
        ns.apply(r)
    warnings = replay.validate_extents(ns, str(tmp_path))
    assert len(warnings) == 2
    assert all("/d/f" in w and "beyond the log" in w for w in warnings)
    assert all(w.kind == records.EXTENT_DROPPED for w in warnings)  # verify: DAMAGED
    f = ns.inodes[4]
    assert [(p.start, p.length) for p in f.emap.pieces] == [(0, 8192)]
    assert f.size == 9010  # the size stays: the dropped bytes read as a hole
