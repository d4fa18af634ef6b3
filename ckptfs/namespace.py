"""Inodes, directories and attributes, and the one function that changes them: `apply`.

Every namespace change is an index record (format/records.py). At run time a FUSE handler checks the
request, builds the record and calls `Namespace.change(rec)`, which applies it and hands it to
the journal; on mount, replay calls `apply` with the records read from the index. So the live
tree and the replayed tree are built by the same code.

Owned by the trio thread.
"""

from __future__ import annotations

import errno
import stat
import time
from typing import Callable, Protocol

from ckptfs.datapath.staging import ExtentMap, Run
from ckptfs.format.records import (
    ExtentRec,
    FormatError,
    InodeRec,
    LinkRec,
    Record,
    NumbersRec,
    RenameRec,
    RetireRec,
    SetattrRec,
    SizeRec,
    UnlinkRec,
    XExtentRec,
    XUnlinkRec,
    check,
    in_range,
)

ROOT_INO = 1
DIR_BYTES = 4096  # st_size of a directory
CONTROL_LAYER = -1  # the layer of the mount's control files (/.ckptfs): no writer's
_S_IFMT, _S_IFREG, _S_IFDIR = 0o170000, stat.S_IFREG, stat.S_IFDIR
# the file types an index may hold
_TYPES = frozenset((stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK, stat.S_IFIFO, stat.S_IFSOCK,
                    stat.S_IFCHR, stat.S_IFBLK))


_COMMON: dict[int, int] = {}
_MODES: dict[int, int] = {}  # (of modes up to 0xFFFF, st_mode's width: bounded)


def _common(n: int) -> int:
    """One int object per value for the values most inodes share (owners; below 256 Python
    keeps one anyway)."""
    got = _COMMON.get(n)
    if got is None:
        if len(_COMMON) > 4096:  # (bounded: a tree of many owners gains nothing)
            return n
        got = _COMMON[n] = n
    return got


def _times(a: int, m: int, c: int) -> tuple[int, int, int]:
    """Equal times as one int object (a file's three times are often equal: 32 bytes each
    kept per file otherwise)."""
    if a == m:
        a = m
    if c == m:
        c = m
    return a, m, c


class Inode:
    __slots__ = ("ino", "mode", "uid", "gid", "rdev", "nlink", "size", "atime_ns", "mtime_ns",
                 "ctime_ns", "target", "children", "parent", "emap", "lookups", "opens",
                 "tail_run", "tail_end", "layer", "commit_ns")

    def __init__(self, ino: int, mode: int, uid: int, gid: int, rdev: int = 0,
                 atime_ns: int = 0, mtime_ns: int = 0, ctime_ns: int = 0, target: bytes = b"",
                 on_dead: Callable[[Run, int], None] | None = None):
        self.ino = ino
        self.mode = mode
        self.uid = uid
        self.gid = gid
        self.rdev = rdev
        self.nlink = 0
        fmt = mode & _S_IFMT  # (stat.S_IFMT and friends are calls: a replay makes one per file)
        # a directory's size is one block, as on ext4 (some tools take 0 for "not there")
        self.size = 0 if fmt == _S_IFREG else DIR_BYTES if fmt == _S_IFDIR else len(target)
        self.atime_ns, self.mtime_ns, self.ctime_ns = _times(atime_ns, mtime_ns, ctime_ns)
        self.target = target
        self.children: dict[bytes, int] | None = {} if fmt == _S_IFDIR else None
        self.parent = 0
        self.emap = ExtentMap(on_dead) if fmt == _S_IFREG else None
        self.lookups = 0
        self.opens = 0
        # The run that the next sequential write may extend (see Namespace.write_piece).
        self.tail_run: Run | None = None
        self.tail_end = -1
        # 0: this mount's own writer; >0: another writer's (read-only) entry; CONTROL_LAYER
        self.layer = 0
        self.commit_ns = 0  # wall time of the commit that last changed it (merge order)

    @property
    def is_dir(self) -> bool:
        return self.children is not None


# Records that change a directory's attributes (its entries, times, link count) whatever
# their target; a SETATTR does when its target is a directory.
_DIR_CHANGES = frozenset((InodeRec, RenameRec, UnlinkRec, LinkRec, XUnlinkRec))


class ChangeListener(Protocol):
    """What listens to the tree's changes (fuse/answers.AnswerCache while the queue threads
    run: what they answer from a copy of the trio thread's answers goes when the tree changes
    under it)."""

    def dirs_changed(self) -> None:
        """A directory's attributes or entries changed."""

    def name_added(self, parent: int, name: bytes) -> None:
        """Directory `parent` now has an entry `name` (it may have had one before)."""

    def view_changed(self) -> None:
        """Any directory may have gained entries (other writers' changes came in)."""

    def files_changed(self) -> None:
        """A file's attributes changed (a SETATTR, a size)."""


class ChangeNotices:
    """Where the mount's tree changes are told: by its Namespace (each change it makes) and
    its Refresher (a look that brings other writers' changes). The mount makes one and gives
    it to both; a listener is attached while it runs (the answer cache, for the queue
    threads' life: fuse/queues.py), and until then the notices go to no one. Trio thread."""

    def __init__(self) -> None:
        self._listener: ChangeListener | None = None

    @property
    def listening(self) -> bool:
        return self._listener is not None

    def attach(self, listener: ChangeListener) -> None:
        self._listener = listener

    def detach(self) -> None:
        self._listener = None

    def dirs_changed(self) -> None:
        if self._listener is not None:
            self._listener.dirs_changed()

    def name_added(self, parent: int, name: bytes) -> None:
        if self._listener is not None:
            self._listener.name_added(parent, name)

    def view_changed(self) -> None:
        if self._listener is not None:
            self._listener.view_changed()

    def files_changed(self) -> None:
        if self._listener is not None:
            self._listener.files_changed()


class Namespace:
    """The tree. `journal_hook(rec)` receives every change made through `change()`; `notices`
    (the mount's own tree) are told after each of them that changed a directory or a file's
    attributes;
    `on_dead(run, n)` is given to the extent map of every file the tree makes (a mount's own
    tree: cleaner.LogSpace.dead, which counts the bytes of its data logs that no map points
    at any more; staging.ExtentMap). `layer`: the writer layer its replayed records belong
    to; `layer_of(writer)`: the layer of a writer id in this mount or tool, for XEXTENT
    records (bytes in another writer's data logs; None: not known here)."""

    def __init__(self, journal_hook: Callable[[Record], None] | None = None, uid: int = 0,
                 gid: int = 0, now_ns: int | None = None,
                 on_dead: Callable[[Run, int], None] | None = None,
                 notices: ChangeNotices | None = None, layer: int = 0,
                 layer_of: Callable[[str], int | None] = lambda writer: None) -> None:
        now = time.time_ns() if now_ns is None else now_ns
        root = Inode(ROOT_INO, stat.S_IFDIR | 0o755, uid, gid, 0, now, now, now)
        root.nlink = 2
        root.parent = ROOT_INO
        self.inodes: dict[int, Inode] = {ROOT_INO: root}
        self.next_ino = ROOT_INO + 1
        self.journal_hook = journal_hook
        self.on_dead = on_dead
        self.notices = notices
        self.layer = layer  # (another number when its writer's tree is installed anew)
        self.retired: set[int] = set()  # data logs a RETIRE record named
        self.last_log = 0  # the highest data log number a record named (never reused)
        # Per data log, the highest end of any EXTENT record applied (an upper bound of where
        # the tree's own runs end in it: replay.validate_extents walks the tree only when a
        # log is shorter than that or missing)
        self.extent_ends: dict[int, int] = {}
        # Changes of this writer to other writers' trees (view.View applies them): the
        # entries it removed there (XUNLINK records) ...
        self.xunlinks: list[XUnlinkRec] = []
        # ... and XEXTENT records: bytes in another writer's data logs
        self.layer_of = layer_of
        # The files an XEXTENT record gave bytes of another writer's data logs (some may have
        # none left): where to look for the logs this tree keeps in use in other writers'
        # directories (cleaner.logs_named_by_others), instead of in every file
        self.cross_files: set[int] = set()

    # ------------------------------------------------------------ lookups
    def get(self, ino: int) -> Inode:
        try:
            return self.inodes[ino]
        except KeyError:
            raise OSError(errno.ENOENT, "no such inode") from None

    def child(self, parent: Inode, name: bytes) -> Inode | None:
        if parent.children is None:
            raise OSError(errno.ENOTDIR, "not a directory")
        ino = parent.children.get(name)
        return None if ino is None else self.inodes[ino]

    def new_ino(self) -> int:
        ino = self.next_ino
        self.next_ino += 1
        return ino

    def is_ancestor(self, a: Inode, b: Inode) -> bool:
        """True when directory `a` is `b` or one of b's ancestors."""
        x = b
        for _ in range(len(self.inodes) + 1):  # bounded: never loop on a damaged tree
            if x.ino == a.ino:
                return True
            if x.ino == ROOT_INO:
                return False
            x = self.inodes.get(x.parent)
            if x is None:
                return False
        raise FormatError("directory cycle")

    def path_of(self, ino: int) -> str:
        parts = []
        x = self.inodes.get(ino)
        if x is not None and not x.is_dir:
            # Only directories record their parent (a file may have several names): the first
            # directory that lists it names it. Used for warnings only, so a scan is fine.
            x = next((d for d in self.inodes.values()
                      if d.children and ino in d.children.values()), None)
            if x is None:
                return "/"
            parts.append(next(n for n, i in x.children.items() if i == ino)
                         .decode(errors="surrogateescape"))
        while x is not None and x.ino != ROOT_INO:
            parent = self.inodes.get(x.parent)
            if parent is None or parent.children is None:
                break
            name = next((n for n, i in parent.children.items() if i == x.ino), None)
            if name is None:
                break
            parts.append(name.decode(errors="surrogateescape"))
            x = parent
        return "/" + "/".join(reversed(parts))

    # ------------------------------------------------------------ changes
    def change(self, rec: Record) -> None:
        """A change made by this mount: applied, then journaled. One that the index cannot
        record (records.LIMITS: the handlers check first) raises RecordRangeError before
        anything changes, failing its request, never the flusher that would encode it."""
        if not in_range(rec):
            check(rec)
        self.apply(rec)
        w = self.notices
        if w is not None and w.listening:
            t = type(rec)
            if t in _DIR_CHANGES or (t is SetattrRec and (x := self.inodes.get(rec.ino))
                                     is not None and x.children is not None):
                w.dirs_changed()
                if t is InodeRec or t is LinkRec:
                    w.name_added(rec.parent, rec.name)
                elif t is RenameRec:
                    w.name_added(rec.new_parent, rec.new_name)
                    if rec.flags & RENAME_EXCHANGE:
                        w.name_added(rec.old_parent, rec.old_name)
            elif t is SetattrRec or t is SizeRec:
                w.files_changed()
        if self.journal_hook is not None and not self._orphaned(rec):
            self.journal_hook(rec)

    def _orphaned(self, rec: Record) -> bool:
        """Changes to an unlinked (but still open) file need no record: no name reaches it
        after a remount."""
        if type(rec) in (SetattrRec, SizeRec):
            x = self.inodes.get(rec.ino)
            return x is None or x.nlink <= 0
        return False

    def apply(self, rec: Record) -> None:
        """Apply one record. Raises FormatError when the record does not fit the tree (only a
        damaged or hostile index does that; run-time handlers check before they change)."""
        t = type(rec)
        if t is ExtentRec:
            x = self.inodes.get(rec.ino)
            if x is None or x.emap is None:
                self._file(rec.ino)  # (raises the error that says which)
            foff, length, log = rec.foff, rec.length, rec.log
            x.emap.insert(foff, length, Run(None, 0, length, log, rec.loff, rec.crc, False,
                                            self.layer), 0)
            if foff + length > x.size:
                x.size = foff + length if foff else length  # (the int object shared)
            end = rec.loff + length
            if end > self.extent_ends.get(log, 0):
                self.extent_ends[log] = end
                if log > self.last_log:
                    self.last_log = log
        elif t is InodeRec:
            self._apply_inode(rec)
        elif t is SetattrRec:
            ino = self._ino(rec.ino)
            ino.mode = _MODES.setdefault(m := stat.S_IFMT(ino.mode) | (rec.mode & 0o7777), m)
            uid, gid = rec.uid, rec.gid
            ino.uid = uid if uid < 256 else _common(uid)
            ino.gid = gid if gid < 256 else _common(gid)
            ino.atime_ns, ino.mtime_ns, ino.ctime_ns = _times(rec.atime_ns, rec.mtime_ns,
                                                              rec.ctime_ns)
        elif t is SizeRec:
            ino = self._file(rec.ino)
            ino.emap.truncate(rec.size)
            ino.size = rec.size
            ino.mtime_ns, ino.ctime_ns = rec.mtime_ns, rec.ctime_ns
            ino.tail_run = None
        elif t is UnlinkRec:
            parent = self._dir(rec.parent)
            if rec.name not in parent.children:
                raise FormatError(f"unlink of missing entry {rec.name!r}")
            victim = self.inodes[parent.children[rec.name]]
            if victim.is_dir and victim.children:
                raise FormatError(f"rmdir of non-empty directory {rec.name!r}")
            self._unlink(parent, rec.name)
        elif t is RenameRec:
            self._apply_rename(rec)
        elif t is LinkRec:
            ino = self._ino(rec.ino)
            parent = self._dir(rec.parent)
            if ino.is_dir or rec.name in parent.children:
                raise FormatError(f"bad link {rec.name!r}")
            parent.children[rec.name] = ino.ino
            ino.nlink += 1
        elif t is XExtentRec:
            ino = self._file(rec.ino)
            layer = self.layer_of(rec.writer)
            if layer is None:
                raise FormatError(f"extent in the data logs of writer {rec.writer!r}, which "
                                  "is not in the backing directory")
            run = Run(None, 0, rec.run_length, rec.log, rec.loff, rec.crc, layer=layer)
            ino.emap.insert(rec.foff, rec.length, run, rec.roff)
            self.cross_files.add(rec.ino)
            if rec.foff + rec.length > ino.size:
                ino.size = rec.foff + rec.length
        elif t is XUnlinkRec:
            self.xunlinks.append(rec)
        elif t is RetireRec:
            self.retired.add(rec.log)
            if rec.log > self.last_log:
                self.last_log = rec.log
        elif t is NumbersRec:
            self.next_ino = max(self.next_ino, rec.next_ino)
            self.last_log = max(self.last_log, rec.next_log - 1)
        else:
            raise FormatError(f"unexpected record {rec!r}")

    def _ino(self, ino: int) -> Inode:
        try:
            return self.inodes[ino]
        except KeyError:
            raise FormatError(f"record names unknown inode {ino}") from None

    def _file(self, ino: int) -> Inode:
        x = self._ino(ino)
        if x.emap is None:
            raise FormatError(f"inode {ino} is not a regular file")
        return x

    def _dir(self, ino: int) -> Inode:
        x = self._ino(ino)
        if x.children is None:
            raise FormatError(f"inode {ino} is not a directory")
        return x

    def _apply_inode(self, rec: InodeRec) -> None:
        parent = self.inodes.get(rec.parent)
        if parent is None or parent.children is None:
            self._dir(rec.parent)  # (raises the error that says which)
        ino = rec.ino
        inodes = self.inodes
        if ino in inodes or ino <= ROOT_INO:
            raise FormatError(f"inode {ino} created twice")
        if ino >= 1 << 44:
            raise FormatError(f"inode number {ino} out of range")
        children = parent.children
        name = rec.name
        if name in children:
            raise FormatError(f"entry {name!r} created twice")
        mode = rec.mode
        if mode & _S_IFMT not in _TYPES:
            raise FormatError(f"bad file type in mode {mode:o}")
        if len(rec.target) > 4096:
            raise FormatError("symlink target too long")
        # (a tree holds a few distinct modes, owners and groups: one int object each)
        uid, gid = rec.uid, rec.gid
        x = Inode(ino, _MODES.setdefault(mode, mode) if mode <= 0xFFFF else mode,
                  uid if uid < 256 else _common(uid),
                  gid if gid < 256 else _common(gid), rec.rdev, rec.atime_ns, rec.mtime_ns,
                  rec.ctime_ns, rec.target, self.on_dead)
        inodes[ino] = x
        children[name] = ino
        # a directory's times are not journaled on their own: an entry created in it is its
        # last change that has a time (at run time ops._touch_dir sets the same)
        parent.mtime_ns = parent.ctime_ns = rec.ctime_ns
        if x.children is not None:
            x.nlink = 2
            x.parent = parent.ino
            parent.nlink += 1
        else:
            x.nlink = 1
        if ino >= self.next_ino:
            self.next_ino = ino + 1

    def _unlink(self, parent: Inode, name: bytes) -> None:
        victim = self.inodes[parent.children.pop(name)]
        if victim.is_dir:
            victim.nlink = 0
            parent.nlink -= 1
        else:
            victim.nlink -= 1
        self.maybe_forget(victim)

    def _apply_rename(self, rec: RenameRec) -> None:
        op = self._dir(rec.old_parent)
        np_ = self._dir(rec.new_parent)
        if rec.old_name not in op.children:
            raise FormatError(f"rename of missing entry {rec.old_name!r}")
        moving = self.inodes[op.children[rec.old_name]]
        if moving.is_dir and self.is_ancestor(moving, np_):
            raise FormatError("rename of a directory into itself")
        target_ino = np_.children.get(rec.new_name)
        if target_ino == moving.ino:
            return
        if rec.flags & RENAME_EXCHANGE:
            if target_ino is None:
                raise FormatError("exchange with a missing entry")
            other = self.inodes[target_ino]
            if other.is_dir and self.is_ancestor(other, op):
                raise FormatError("rename of a directory into itself (exchange)")
            op.children[rec.old_name] = other.ino
            np_.children[rec.new_name] = moving.ino
            self._reparent(other, np_, op)
            self._reparent(moving, op, np_)
            return
        if target_ino is not None:
            target = self.inodes[target_ino]
            if target.is_dir and target.children:
                raise FormatError("rename over a non-empty directory")
            self._unlink(np_, rec.new_name)
        del op.children[rec.old_name]
        np_.children[rec.new_name] = moving.ino
        self._reparent(moving, op, np_)

    @staticmethod
    def _reparent(x: Inode, old: Inode, new: Inode) -> None:
        if x.is_dir and old.ino != new.ino:
            x.parent = new.ino
            old.nlink -= 1
            new.nlink += 1

    def maybe_forget(self, x: Inode) -> None:
        """Drop an inode that no directory, kernel reference or open handle holds any more."""
        if x.nlink <= 0 and x.lookups <= 0 and x.opens <= 0 and x.ino != ROOT_INO:
            self.inodes.pop(x.ino, None)
            if x.emap is not None:
                x.emap.drop()  # its bytes are dead now (the data logs' live bytes go down)
            x.emap = None
            x.tail_run = None

    # ------------------------------------------------------------ statistics
    def totals(self) -> tuple[int, int]:
        """(number of inodes, bytes of file data the user sees)."""
        return len(self.inodes), sum(x.size for x in self.inodes.values() if x.emap is not None)


RENAME_EXCHANGE = 2
RENAME_NOREPLACE = 1
