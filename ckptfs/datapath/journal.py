"""The journal: every change not yet in the index, in the order it happened (trio thread).

Namespace records and extent entries (a file range pointing at a run in a segment) share one
sequence. Only a prefix whose extents are all durable can be committed (`take_committable`),
so the index never points at data that is not on disk and replay always sees operations in
their real order. The flusher (datapath/flusher.py) takes that prefix at each group commit;
the handlers (datapath/writes.py, fuse/ops.py, fuse/handles.py) add to it. The journal also
keeps, per inode, the newest change not yet in the backing directory: what the durability
levels are read from (`touched_seq`), the node tier's undrained index included (`touch`,
`prune`).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable

from ckptfs.datapath.staging import Run
from ckptfs.format import records
from ckptfs.format.records import (
    CommitRec,
    ExtentRec,
    InodeRec,
    LinkRec,
    Record,
    RenameRec,
    RetireRec,
    SetattrRec,
    SizeRec,
    UnlinkRec,
    XExtentRec,
)


class ExtentEntry:
    __slots__ = ("ino", "foff", "run")

    def __init__(self, ino: int, foff: int, run: Run) -> None:
        self.ino = ino
        self.foff = foff
        self.run = run


# What a change touches, for the levels: the inode it changes, the directories whose entries
_TOUCHES_INO = frozenset((InodeRec, ExtentEntry, ExtentRec, SetattrRec, SizeRec, LinkRec,
                          XExtentRec))
_TOUCHES_PARENT = {InodeRec: ("parent",), UnlinkRec: ("parent",), LinkRec: ("parent",),
                   RenameRec: ("old_parent", "new_parent")}


class Journal:
    """Changes not yet in the index, in order. Trio thread only."""

    def __init__(self, committed_seq: int = 0, *, last_stamp: int = 0,
                 stamp_hook: Callable[[list, int], None] | None = None) -> None:
        """`committed_seq`: the last change already in the index (a mount's replay says it);
        `last_stamp`: this writer's newest COMMIT stamp in it; `stamp_hook(records, stamp)`:
        called with the records of each commit group and the stamp it gets (the view notes
        its inodes' commit times: view.View.stamped)."""
        self.entries: deque = deque()
        self.last_seq = committed_seq  # sequence number of the newest change
        self.committed_seq = committed_seq
        self.unsent = b""  # encoded records whose index write failed, to be written first
        self.unsent_upto = committed_seq
        self.unsent_version = 1  # the index version those records need (RETIRE: 2)
        # The COMMIT stamps: a hybrid logical clock (docs/format.md). A stamp is the wall
        # clock in ns, but always above this writer's previous stamp and above every stamp it
        # has seen in another writer's index (`seen_ns`, raised as their tails are read), so
        # a change made after seeing another writer's change is ordered after it, whatever
        # the two hosts' clocks say.
        self.last_stamp = last_stamp
        self.seen_ns = 0
        self.stamp_hook = stamp_hook
        # inode -> sequence number of its newest change not known to be in the backing
        # directory (a directory's too when an entry of it changed): the levels
        self.touched: dict[int, int] = {}
        self._prune_at = 4096

    def saw(self, stamp: int) -> None:
        """A COMMIT stamp read in another writer's index: the own stamps come after it."""
        if stamp > self.seen_ns:
            self.seen_ns = stamp

    def stamp(self) -> int:
        """The next COMMIT stamp (trio thread)."""
        s = max(time.time_ns(), self.last_stamp + 1, self.seen_ns + 1)
        self.last_stamp = s
        return s

    def add(self, item: Record | ExtentEntry) -> None:
        self.last_seq += 1
        self.entries.append((self.last_seq, item))
        t = type(item)
        if t in _TOUCHES_INO:
            self.touched[item.ino] = self.last_seq
        if t in _TOUCHES_PARENT:
            for name in _TOUCHES_PARENT[t]:
                self.touched[getattr(item, name)] = self.last_seq

    def touch(self, recs, seq: int) -> None:
        """Records committed before this mount whose changes are not in the backing
        directory yet (the node tier's undrained index): pending until `seq` is."""
        for item in recs:
            t = type(item)
            if t in _TOUCHES_INO:
                self.touched[item.ino] = seq
            if t in _TOUCHES_PARENT:
                for name in _TOUCHES_PARENT[t]:
                    self.touched[getattr(item, name)] = seq

    def touched_seq(self, inos) -> int:
        """The sequence number of the newest change to any of `inos` still pending in some
        level (0: none): what says whether a file or a tree is staged, node- or
        backing-durable (Control.level_of)."""
        touched = self.touched
        return max((touched.get(i, 0) for i in inos), default=0)

    def prune(self, upto: int) -> None:
        """Forget the changes up to `upto` (in the backing directory): nothing is pending of
        them any more. Done when the table has doubled since it was last pruned."""
        if len(self.touched) > self._prune_at:
            self.touched = {i: s for i, s in self.touched.items() if s > upto}
            self._prune_at = max(4096, 2 * len(self.touched))

    def tail(self) -> Record | ExtentEntry | None:
        return self.entries[-1][1] if self.entries else None

    def take_committable(self) -> tuple[bytes, int]:
        """Encode the longest committable prefix, followed by a COMMIT record: (bytes, the
        sequence number it covers). Records taken but not yet confirmed (a failed index write)
        are taken again first."""
        parts = [self.unsent] if self.unsent else []
        upto = self.unsent_upto if self.unsent else self.committed_seq
        if not self.unsent:
            self.unsent_version = 1
        entries = self.entries
        n = 0
        for _, item in entries:  # up to the first extent whose segment is not durable yet
            if type(item) is ExtentEntry and not item.run.seg.durable:
                break
            n += 1
        # Encoded before any entry leaves the journal: a record that cannot be encoded (a
        # defect: the handlers keep every field inside records.LIMITS) raises here and takes
        # nothing with it.
        prefix = list(itertools.islice(entries, n))
        folded = fold_setattrs(prefix)
        encode = records.encode
        version = self.unsent_version
        taken = []
        for i, (seq, item) in enumerate(prefix):
            upto = seq
            if i in folded:
                continue
            if type(item) is ExtentEntry:
                run = item.run
                parts.append(encode(ExtentRec(item.ino, item.foff, run.length, run.log,
                                              run.loff, run.crc)))
            else:
                if type(item) is RetireRec:
                    version = max(version, records.RETIRE_INDEX_VERSION)
                elif type(item) in records.CROSS_WRITER_RECORDS:
                    version = max(version, records.CROSS_INDEX_VERSION)
                parts.append(encode(item))
            taken.append(item)
        for _ in range(n):
            entries.popleft()
        self.unsent_version = version
        if not parts:
            return b"", upto
        self.unsent = b"".join(parts)
        self.unsent_upto = upto
        stamp = self.stamp()
        if self.stamp_hook is not None and taken:
            self.stamp_hook(taken, stamp)
        return self.unsent + encode(CommitRec(upto, stamp)), upto

    def confirm(self, upto: int) -> None:
        """The records up to `upto` are durable in the index."""
        self.unsent = b""
        if upto > self.committed_seq:
            self.committed_seq = upto

    def pending(self) -> bool:
        return bool(self.entries) or bool(self.unsent)


def fold_setattrs(group: list[tuple[int, Record | ExtentEntry]]) -> set[int]:
    """Put the SETATTR of a file into the file's INODE record where one commit group holds
    both and replay ends with the same tree: the positions of the SETATTRs folded so.

    A file a job writes is an INODE, its EXTENTs and the SETATTR at close (the times the
    writes moved), so a tree of small files costs its index, and every mount, three records
    per file; folded, two. Replay sets the same attributes either way when nothing between
    the two changes the file's attributes (an EXTENT changes none; a SIZE or another SETATTR
    does: no fold then) and the INODE record's time is not the one its directory keeps: an
    INODE record also sets its directory's times (namespace.Namespace._apply_inode), so a
    later record of the group must set them again (another entry created there, or the
    directory's SETATTR). Within one group that is all the same: a group commits whole."""
    born: dict[int, tuple[int, int]] = {}  # file -> (position of its INODE, its directory)
    dir_set: dict[int, int] = {}  # directory -> position of the last record setting its times
    pairs = []
    for i, (_, item) in enumerate(group):
        t = type(item)
        if t is InodeRec:
            dir_set[item.parent] = i
            if item.mode & 0o170000 == 0o100000:  # (S_IFREG)
                born[item.ino] = (i, item.parent)
        elif t is SetattrRec:
            dir_set[item.ino] = i
            b = born.pop(item.ino, None)
            if b is not None:
                pairs.append((b[0], i, b[1]))
        elif t is SizeRec:
            born.pop(item.ino, None)
    folded = set()
    for at, i, parent in pairs:
        if dir_set.get(parent, -1) > at:
            inode, attrs = group[at][1], group[i][1]
            inode.mode = (inode.mode & ~0o7777) | (attrs.mode & 0o7777)
            inode.uid, inode.gid = attrs.uid, attrs.gid
            inode.atime_ns, inode.mtime_ns, inode.ctime_ns = (attrs.atime_ns, attrs.mtime_ns,
                                                              attrs.ctime_ns)
            folded.add(i)
    return folded
