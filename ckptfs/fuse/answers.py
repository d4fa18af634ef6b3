"""The answer cache: what the trio thread leaves with the queue threads to answer from, and
takes back when it may no longer be true (trio thread only; one exists while they run).

- directory attributes (GETATTR of a directory; `dir_attrs`) and name filters (LOOKUP of a
  name that is not there; `dir_names`), of this writer's own directories;
- prepared LOOKUP answers for the names after one looked up, in the directory's creation
  order (`prepare_lookups`);
- read windows: a handle's next bytes in the read cache, checked, chunks pinned, that its
  READs are answered from (`open_window`), and windows prepared at a LOOKUP for the file's
  next read-only OPEN (`prepare_open`).

Everything that makes them stale goes through one entry point, `invalidate`: the namespace's
changes (dirs_changed, files_changed), an extent map's change (emap_changed), a handle that
can write (inode), a release (fh), a look that brought other writers' changes (view_changed).
The namespace and the refresher tell their changes to the mount's change notices
(namespace.ChangeNotices), which this cache listens to while it exists (fuse/queues.py).
docs/architecture.md, "What the queue threads answer", lists each answer with what
invalidates it; fuse/ring_dirs.c and ring_reads.c answer from it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator

from ckptfs.datapath.readcache import CHUNK_BYTES
from ckptfs.fuse import ring as fring
from ckptfs.fuse.control import CTL_NAME
from ckptfs.fuse.replies import attr_fields, entry_out, open_flags
from ckptfs.namespace import CONTROL_LAYER, ROOT_INO

log = logging.getLogger("ckptfs")

# A read window (the queue threads answer a handle's next READs from the read cache): at most
# this many bytes of the file, and all windows together pin at most this share of the cache.
WINDOW_BYTES = 16 << 20
WINDOW_CACHE_SHARE = 4  # (a quarter)
# Windows prepared at a LOOKUP and not opened yet, at most: a LOOKUP not followed by an open
# (stat, ls -l) leaves one; the oldest goes when a new one would pass this, and any goes once
# it has waited this long (an OPEN follows its LOOKUP at once; the window pins cache chunks).
# Room for the names prepared ahead in four directories read in turn (below).
PREPARED_MAX = 16
PREPARED_TTL_S = 2.0
# LOOKUP answers prepared for the names that follow a name looked up in a directory's
# creation order (a restore loads a checkpoint's files in about the order they were saved),
# and how many may stand at most (more: all go, the next ones are prepared anew). A
# checkpoint is often loaded from several directories in turn (a model's tensors and each
# optimizer state's: one file of each in turn), each with its names prepared ahead: room for
# twelve such directories (fuse/ring_reads.c holds 64, and wakes the trio thread once a
# directory has LOOKUPS_LEFT of them left: every second file, with four ahead).
LOOKUPS_AHEAD = 4
LOOKUPS_MAX = 48
NAME_ORDERS = 64  # directories whose names' order is kept (all go beyond)
NAME_ORDER_MAX = 1 << 17  # names of a directory whose order is kept, at most


class AnswerCache:
    """What the queue threads answer from (module docstring), for one run of them.

    Attributes:
        windows: handle -> its read window: (inode, extent map, start, end, pinned chunks).
        window_pins: chunk -> how many windows pin it (all windows together pin at most a
            WINDOW_CACHE_SHARE of the read cache).
        prepared: handles of prepared windows -> (when prepared (time.monotonic()), how many
            names ahead of the last LOOKUP its file is: 0 for that one, the file's inode),
            oldest first; `prepared_ino`: inode -> handle.
        lookups: prepared LOOKUP answers: inode -> (directory, name); `lookups_put`: some put
            since the last clear (one may stand unlisted).
        lookup_next: directory -> the name of the last LOOKUP answered from them there (a
            pass may take those of several directories read in turn: each has its next names
            prepared).
        name_order: directory -> (its names in creation order, name -> position).
        names_refused: directories too large for a name filter.
        creating: the trio thread makes the files the queue threads created, whose
            changes they know already (`making_created`).
    """

    def __init__(self, ring: fring.Ring, ops, entry_valid: tuple[int, int],
                 settle: Callable[[], None]) -> None:
        """`ring`: the queue threads; `ops`: the handlers (their tree, handles and reader);
        `entry_valid`: the mount's entry timeout as the protocol's; `settle`: takes in what
        the queue threads noted (Intake.settle), after a look's changes."""
        self.ring = ring
        self.ops = ops
        self.entry_valid = entry_valid
        self.settle = settle
        self.creating = False
        self.names_refused: set[int] = set()
        self.name_filters_built = 0  # directories' names left with the queue threads
        self.windows: dict[int, tuple] = {}
        self.window_pins: collections.Counter = collections.Counter()
        self.prepared: dict[int, tuple[float, int, int]] = {}
        self.prepared_ino: dict[int, int] = {}
        self.lookups: dict[int, tuple[int, bytes]] = {}
        self.lookup_next: dict[int, bytes] = {}
        self.lookups_put = False
        self.name_order: dict[int, tuple[list, dict]] = {}

    def counts(self) -> dict:
        return dict(ring_read_windows=len(self.windows),
                    ring_windows_prepared=len(self.prepared),
                    ring_lookups_prepared=len(self.lookups),
                    ring_name_filters_built=self.name_filters_built)

    def close(self) -> None:
        """The queue threads stop: every answer is taken back, the windows' chunks let go."""
        self.lookups.clear()
        self.lookups_put = False
        for fh in list(self.windows):
            self.drop_window(fh)

    # ------------------------------------------------------------ directories
    def dir_attrs(self, d, nodeid: int, attr_out: bytes) -> None:
        """The queue threads answer GETATTR of directory d with `attr_out`
        until a directory changes (the namespace's change notices, the refresher's look at
        other writers, a request pyfuse3 served). Only this writer's own directories, under the
        number the kernel knows them by."""
        if d.layer == 0 and d.ino == nodeid:
            self.ring.attr_put(nodeid, attr_out, self.ops.inherited_gid(d))

    def dir_names(self, nodeid: int) -> None:
        """After a LOOKUP of a name not in directory `nodeid`: the queue threads
        answer the next ones (a new file's open(O_CREAT) asks for its name first) from its
        names (they learn those it gains: name_added), until a look at other writers is
        due. Only this writer's own directories, under the number the kernel knows them by;
        one with another writer's directory merged into it loses them at every look that
        brings changes (view_changed), the others keep them."""
        ring, ops = self.ring, self.ops
        ring.absent_until(ops.others.fresh_until())
        if nodeid in self.names_refused or ring.has_names(nodeid):
            return
        d = ops.inode(nodeid)
        if not self._own_dir(d, nodeid):
            return
        self.name_filters_built += 1
        names = d.children.keys()
        if not ring.names_put(nodeid, [*names, CTL_NAME] if nodeid == ROOT_INO else names):
            self.names_refused.add(nodeid)  # (too large: not built again at every LOOKUP)

    @staticmethod
    def _own_dir(d, nodeid: int) -> bool:
        """Whether d is one of this writer's own live directories, known to the kernel as
        `nodeid`."""
        return d.layer == 0 and d.ino == nodeid and d.children is not None and d.nlink > 0

    def keeps_names(self, nodeid: int) -> bool:
        """Whether the names the queue threads hold of directory `nodeid` are all it has
        whatever other writers changed: one of this writer's own live directories with no
        other writer's directory merged into it (its names come only by this writer's
        records). Asked as a look that brings changes starts and once it is applied, when
        what it merged in shows; meanwhile no LOOKUP is answered absent (ring.view_changed)."""
        d = self.ops.ns.inodes.get(nodeid)
        return d is not None and self._own_dir(d, nodeid) and not self.ops.others.merged(d)

    # ------------------------------------------------------------ prepared LOOKUPs
    def count_looked(self, looked: list[int]) -> None:
        """The LOOKUPs the queue threads answered from prepared answers: each is one more
        lookup of its inode that the kernel holds (its FORGET counts them back)."""
        inodes, lookups = self.ops.ns.inodes, self.lookups
        for ino in looked:
            key = lookups.pop(ino, None)
            x = inodes.get(ino)
            if x is None:  # (a defect: its answer named an inode the tree let go of)
                log.error("a LOOKUP answered by a queue thread names inode %d, unknown", ino)
                continue
            x.lookups += 1
            if key is not None:
                self.lookup_next[key[0]] = key[1]

    def prepare_lookups(self, parent: int, name: bytes) -> None:
        """After a LOOKUP found `name` in directory `parent`: the answers to LOOKUPs of the
        names after it in the directory's creation order (LOOKUPS_AHEAD of them), each
        file's next OPEN prepared too where its bytes are cached (prepare_open), so that the
        queue threads answer a restore's next files without the trio thread (fuse/ring_reads.c,
        fr_lookup). Only files no one has open with one name, in one of this writer's own
        directories; every change of a directory or of a file's attributes, a handle that
        can write, a file's extent map changing and a look at other writers that brings
        changes take them all back (drop_lookups). Never raises."""
        try:
            self._prepare_lookups(parent, name)
        except Exception:
            log.exception("prepared lookups in directory %d", parent)
            self.drop_lookups()

    def _prepare_lookups(self, parent: int, name: bytes) -> None:
        ops = self.ops
        d = ops.ns.inodes.get(parent)
        if d is None or not self._own_dir(d, parent) or ops.others.merged(d):
            return
        order = self.name_order.get(parent)
        if order is None:
            if len(d.children) > NAME_ORDER_MAX:
                return
            if len(self.name_order) >= NAME_ORDERS:
                self.name_order.clear()
            names = list(d.children)
            order = self.name_order[parent] = (names, {n: i for i, n in enumerate(names)})
        names, index = order
        i = index.get(name)
        if i is None:
            return
        lookups, ring, children, inodes = self.lookups, self.ring, d.children, ops.ns.inodes
        if len(lookups) + LOOKUPS_AHEAD > LOOKUPS_MAX:
            self.drop_lookups()
        ring.absent_until(ops.others.fresh_until())  # (none answered once a look is due)
        now = time.monotonic()
        for ahead, n in enumerate(names[i + 1:i + 1 + LOOKUPS_AHEAD], 1):
            y = inodes.get(children.get(n, 0))
            if (y is None or y.emap is None or y.opens or y.nlink != 1
                    or y.layer == CONTROL_LAYER):
                continue
            ops.dcp.saw_name(parent, n, y.ino)  # (its LOOKUP may be answered in C)
            # (first: its OPEN follows the LOOKUP at once; one prepared before is now nearer:
            # most of a restore's names ahead were prepared by the LOOKUPs before)
            fh = self.prepared_ino.get(y.ino)
            if fh is not None:
                self._prepared_nearer(fh, y.ino, ahead, now)
            else:
                self.prepare_open(y, ahead)
            if y.ino in lookups:
                continue
            if not ring.lookup_put(parent, n, y.ino,
                                   entry_out(y, attr_fields(y), self.entry_valid)):
                return
            lookups[y.ino] = (parent, n)
            self.lookups_put = True
            y.emap.watcher = self.emap_changed  # (a change of its bytes takes them back)

    def lookup_served(self, x) -> None:
        """A LOOKUP of file x served here: an answer prepared for it goes, unused (the
        kernel asked before it stood). Left standing, it would answer the file's next LOOKUP
        (once the kernel let its entry go) while the window prepared with it is gone with
        this OPEN: that OPEN would come here."""
        key = self.lookups.pop(x.ino, None)
        if key is not None:
            self.ring.lookup_drop(*key)

    def drop_lookups(self) -> None:
        """Every prepared LOOKUP answer goes (what they say may have changed). (Also one
        no longer listed: a name answered and prepared again before the first answer's note
        was taken has its second answer standing unlisted.)"""
        if self.lookups_put:
            self.lookups.clear()
            self.lookups_put = False
            self.ring.lookups_clear()

    # ------------------------------------------------------------ invalidation
    def invalidate(self, *, dirs: bool = False, view: bool = False, emap=None, inode=None,
                   fh: int | None = None) -> None:
        """The one way what the queue threads answer from is taken back. `fh`: that handle's
        read window only (its release, a failure). Else every prepared LOOKUP goes (a file's
        attributes or bytes may have changed), and also: `dirs`, a directory changed: the
        directories' attributes and the names' order (not for the changes of the files the
        queue threads created, which they know); `emap`, a file's extent map changed: the
        read windows over it; `inode`, a handle that can write opened it: its read windows;
        `view`, a look brought other writers' changes: every read window, the names' order,
        the name filters of directories another writer's directory is merged into, and
        what the queue threads noted meanwhile is taken in (`settle`)."""
        if fh is not None:
            self.drop_window(fh)
            return
        if dirs:
            if self.creating:
                return
            self.ring.dirs_changed()
        self.drop_lookups()
        if dirs or view:
            self.name_order.clear()
        if view or emap is not None or inode is not None:
            for h, w in list(self.windows.items()):
                if view or w[1] is emap or w[0] is inode:
                    self.drop_window(h)
        if view:
            self.names_refused.clear()
            self.ring.view_changed(self.keeps_names)  # (no more creates there from here)
            self.settle()  # (the files they created are in the tree before others' names)

    @contextlib.contextmanager
    def making_created(self) -> Iterator[None]:
        """While the trio thread makes the files the queue threads created (Landing.make_created):
        the queue threads have their directories' names and attributes as they are after it,
        so the notices of those changes take nothing back."""
        self.creating = True
        try:
            yield
        finally:
            self.creating = False

    # namespace.ChangeListener: what the queue threads answer from follows the tree
    def dirs_changed(self) -> None:
        self.invalidate(dirs=True)

    def files_changed(self) -> None:
        self.invalidate()

    def view_changed(self) -> None:
        self.invalidate(view=True)

    def emap_changed(self, emap) -> None:
        """The watcher of the extent maps of files with read windows or prepared LOOKUPs
        (ExtentMap.watcher): one of them changed."""
        self.invalidate(emap=emap)

    def name_added(self, parent: int, name: bytes) -> None:
        """Not an invalidation: the directory's name filter takes the name before any answer
        says it exists."""
        if not self.creating:
            self.ring.name_added(parent, name)

    # read windows: the queue threads answer a handle's READs from the read cache
    def open_window(self, fh: int, off: int) -> None:
        """For a READ of handle fh at `off` answered here (before its reply): the queue threads
        answer its next READs of the bytes from there (from 0 for a file that fits in one
        window, unless the bytes cached from 0 stop short of `off`: `torch.load` reads a
        zip's directory at its end in several small READs first) that are in the read cache,
        checked, from the cache's buffers (fuse/ring_reads.c, fr_read), until the
        window runs out (the READ past it comes here and opens the next), the handle is
        released, or the file may change (a write, a truncate, a handle that can write, a look
        at other writers that brings changes). Only for a handle that reads alone: the only
        open one of its file, read-only (so no WRITE the queue threads answered can be
        behind what it reads; a copy-up, which gives the file a new extent map, tells the
        old one: ExtentMap.replaced). Never raises (a failure: no window)."""
        try:
            self._open_window(fh, off)
        except Exception:
            log.exception("read window of handle %d", fh)
            self.drop_window(fh)
            self.ring.window_drop(fh)  # (one the queue threads hold unknown to the trio thread)

    def _open_window(self, fh: int, off: int) -> None:
        ops = self.ops
        h = ops.handles.by_fh.get(fh)
        if h is None:
            return
        x = h.inode
        if (x.opens != 1 or h.flags & os.O_ACCMODE != os.O_RDONLY or x.emap is None
                or x.layer == CONTROL_LAYER):
            self.drop_window(fh)
            return
        start = 0 if x.size <= WINDOW_BYTES else off
        old = self.windows.get(fh)
        reader = ops.reader
        share = reader.cache.max_chunks // WINDOW_CACHE_SHARE
        # (an open handle's window goes before prepared ones, which may never be opened: as
        # many of those go as its chunks need, up to half the windows' share)
        need = min(share // 2, (min(x.size - start, WINDOW_BYTES) + CHUNK_BYTES - 1)
                   // CHUNK_BYTES + 1)
        pins = self.window_pins
        while True:  # (chunks are counted once, however many windows pin them)
            budget = share - len(pins) + (sum(pins[k] == 1 for k in old[4]) if old else 0)
            if budget >= need or not self.prepared:
                break
            self._drop_prepared()
        got = reader.read_window(x.emap, start, x.size, WINDOW_BYTES, fring.WINDOW_PARTS,
                                 budget, pins) if budget > 0 and start < x.size else None
        if start < off and budget > 0 and (got is None
                                            or start + sum(map(len, got[0])) <= off):
            if got is not None:  # (short of the reader: from where it reads then)
                reader.cache.unpin(got[1])
            got = reader.read_window(x.emap, off, x.size, WINDOW_BYTES, fring.WINDOW_PARTS,
                                     budget, pins)
            start = off
        if got is None:
            self.drop_window(fh)
            return
        ok = self._set_window(fh, x, start, got)  # (replaces the old one: unused now)
        if old is not None:
            if not ok:
                del self.windows[fh]
            self._unpin_window(old[4])

    def _set_window(self, fh: int, x, start: int, got, nodeid: int = 0,
                    open_flags: int = 0) -> bool:
        """Leave with the queue threads `got` (Reader.read_window's, from `start` of file x)
        as handle fh's window (a prepared one with `nodeid`: Ring.window); False when no
        window was free (its chunks are let go)."""
        parts, keys, eof = got
        try:
            ok = self.ring.window(fh, start, eof, parts, nodeid, open_flags)
        except BaseException:
            self.ops.reader.cache.unpin(keys)
            raise
        if not ok:
            self.ops.reader.cache.unpin(keys)
            return False
        self.windows[fh] = (x, x.emap, start, start + sum(map(len, parts)), keys)
        self.window_pins.update(keys)
        x.emap.watcher = self.emap_changed
        return True

    def prepare_open(self, x, ahead: int = 0) -> None:
        """After a LOOKUP found file x (or a file `ahead` names after it, prepare_lookups):
        when its first bytes are in the read cache, checked, and no one has it open, a
        window over them is prepared with a new handle number, and the queue threads answer
        the file's next read-only OPEN themselves (fuse/ring_reads.c, fr_open): a restore's small
        file is then a LOOKUP here and an OPEN, READs and a RELEASE without the trio thread. The
        window is dropped as any other when the file may change; at most PREPARED_MAX wait
        for their OPEN (past it, one of the files furthest ahead goes: those of several
        directories read in turn stand for their next files). Never raises (a failure: no
        window)."""
        try:
            self._prepare_open(x, ahead)
        except Exception:
            log.exception("prepared open of inode %d", x.ino)

    def _prepare_open(self, x, ahead: int) -> None:
        ops = self.ops
        if (x.emap is None or x.opens or not x.size or x.layer == CONTROL_LAYER
                or not ops.handles.may_prepare_open(x)):
            return
        if not ahead:  # (no OPEN there once a look is due; prepare_lookups says it first)
            self.ring.absent_until(ops.others.fresh_until())
        fh = self.prepared_ino.get(x.ino)
        if fh is not None:
            self._prepared_nearer(fh, x.ino, ahead, time.monotonic())
            return
        reader = ops.reader
        budget = reader.cache.max_chunks // WINDOW_CACHE_SHARE - len(self.window_pins)
        got = reader.read_window(x.emap, 0, x.size, WINDOW_BYTES, fring.WINDOW_PARTS,
                                 budget, self.window_pins)
        if got is None:
            return
        fh, fi = ops.handles.prepare_open(x)
        if not self._set_window(fh, x, 0, got, x.ino, open_flags(fi, os.O_RDONLY)):
            return
        self.prepared[fh] = (time.monotonic(), ahead, x.ino)
        self.prepared_ino[x.ino] = fh
        while len(self.prepared) > PREPARED_MAX:
            self._drop_prepared()

    def _prepared_nearer(self, fh: int, ino: int, ahead: int, now: float) -> None:
        """A window prepared before for inode ino (handle fh), whose OPEN did not come yet or
        came here once a look was due, stands for the one asked for now: the newest, as far
        ahead as it is now (no other window of a file no one has open stands)."""
        prepared = self.prepared
        del prepared[fh]
        prepared[fh] = (now, ahead, ino)

    def _drop_prepared(self) -> None:
        """The prepared window of a file furthest ahead of its directory's last LOOKUP goes
        (the oldest of those)."""
        prepared = self.prepared
        self.drop_window(max(prepared, key=lambda fh: prepared[fh][1]))

    def unprepare(self, fh: int) -> None:
        """Handle fh's window is no longer a prepared one (its OPEN came, or it goes)."""
        p = self.prepared.pop(fh, None)
        if p is not None and self.prepared_ino.get(p[2]) == fh:
            del self.prepared_ino[p[2]]

    def expire_prepared(self) -> None:
        """Prepared windows whose OPEN has not come within PREPARED_TTL_S go (a stat sweep's
        would otherwise pin their chunks until the next LOOKUPs push them out)."""
        prepared = self.prepared
        if prepared:
            stale = time.monotonic() - PREPARED_TTL_S
            for fh, (t, _, _) in list(prepared.items()):
                if t > stale:
                    break
                self.drop_window(fh)

    def drop_window(self, fh: int) -> None:
        """Handle fh's READs come here again; its window's chunks are let go (a prepared
        window's OPEN comes here again)."""
        self.unprepare(fh)
        w = self.windows.pop(fh, None)
        if w is None:
            return
        self.ring.window_drop(fh)
        self._unpin_window(w[4])

    def _unpin_window(self, keys) -> None:
        """A window's chunks are let go (counted once more free when no window pins them)."""
        pins = self.window_pins
        for k in keys:
            if pins[k] <= 1:
                del pins[k]
            else:
                pins[k] -= 1
        self.ops.reader.cache.unpin(keys)
