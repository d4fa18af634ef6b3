"""Other writers' entries in this mount's view: adopted into this writer's tree before they
change, and whether the view of them is fresh (trio thread only; one `OtherWriters` per
mount, CkptOperations.others).

A mount shows other writers' trees merged into its own (view.View, docs/scaling.md); their
entries cannot change in place. A handler that changes one first makes it this writer's own:
a directory is adopted (`own_dir`: an INODE record gives it an own inode number), a file is
copied up (`copy_up`: an INODE record and XEXTENT records that point at the other writer's
runs, no byte copied), a directory moved by a rename with everything in it
(`before_rename`). The live inode stays the same object and answers to its old number too, so
the kernel's cached entries stay valid and handles open on it read on.

The view is fresh while no look at other writers is due (`refresh_due`, `fresh_until`: the
--refresh contract, fuse/refresh.py); an open of an inode that a look removed or changed
fails with ESTALE (`fresh`), so that the kernel walks the path again.
"""

from __future__ import annotations

import errno
import math

import pyfuse3

from ckptfs.datapath.staging import ExtentMap
from ckptfs.format.records import InodeRec, SizeRec, XExtentRec
from ckptfs.namespace import CONTROL_LAYER, Inode, Namespace


class OtherWriters:
    """Other writers' entries made own (copy-up), and the freshness of the view of them."""

    def __init__(self, ns: Namespace, view=None, refresher=None, readonly: bool = False) -> None:
        """`ns`: the tree; `view`: the other writers' trees merged into it (view.View; None:
        the tree is this writer's alone); `refresher`: what reads their index tails
        (fuse/refresh.py; None: no look is ever due); `readonly`: a read-only mount, whose
        entries never change (EROFS)."""
        self.ns = ns
        self.view = view
        self.refresher = refresher
        self.readonly = readonly

    # ------------------------------------------------------------ the view's freshness
    def refresh_due(self) -> bool:
        """Whether an open, lookup or listing has to look at other writers' changes first:
        the last look is older than --refresh (docs/scaling.md, the visibility contract)."""
        r = self.refresher
        return r is not None and r.due()

    async def refresh(self) -> None:
        """Look at other writers' changes now (refresh_due said so)."""
        await self.refresher.refresh()

    def fresh_until(self) -> float:
        """Until when (time.monotonic()) a lookup's answer needs no look at other writers
        first (refresh_due)."""
        r = self.refresher
        return math.inf if r is None else r.fresh_until()

    def merged(self, d: Inode) -> bool:
        """Whether another writer's directory is merged into view directory d (its entries
        then come and go with that writer's changes too)."""
        return self.view is not None and bool(self.view.members.get(d))

    def fresh(self, x: Inode) -> None:
        """An open of an inode that another writer's change removed from the tree, or changed
        since the kernel cached its attributes, fails with ESTALE: the kernel then walks the
        path again, asking (LOOKUP) for every entry, and opens what is there now."""
        view = self.view
        if view is not None and (x.ino in view.gone or x.ino in view.dirty):
            view.dirty.discard(x.ino)
            raise pyfuse3.FUSEError(errno.ESTALE)

    def fresh_dir(self, ino: int) -> None:
        """A LOOKUP that finds nothing in a directory whose writer's tree was read again
        under new numbers (an index rewritten while a READ held one of its logs: the kernel
        still holds the old number) fails with ESTALE, not ENOENT: the kernel then walks the
        path again (LOOKUP_REVAL) and finds the entry under the directory's new number. (In
        a directory another writer removed it stays ENOENT.)"""
        view = self.view
        if view is not None and ino in view.renumbered_dirs:
            raise pyfuse3.FUSEError(errno.ESTALE)

    def others_at(self, v: Inode, name: bytes) -> bool:
        """Whether `name` in view directory v has a version of another writer (the one shown,
        or one a conflict hides)."""
        view = self.view
        return (view is not None and not self.readonly and v.layer != CONTROL_LAYER
                and any(c[0] != 0 for c in view.versions(v, name)))

    # ------------------------------------------------------------ copy-up
    def own_dir(self, d: Inode) -> Inode:
        """A directory to create entries in. If it belongs to another writer, adopt it into
        this writer's tree first (copy-up): an INODE record gives it an own inode number, and
        the live inode answers to both numbers, so the kernel's cached entries stay valid.
        Its other writers' ancestors are adopted first, top down (without a recursion per
        level: a tree may be thousands of levels deep)."""
        chain = []  # d and its ancestors below the nearest own directory
        while True:
            if self.readonly or d.layer == CONTROL_LAYER:
                raise pyfuse3.FUSEError(errno.EROFS)
            if d.layer == 0:
                break
            chain.append(d)
            d = self.ns.inodes[d.parent]
        parent = d
        for d in reversed(chain):
            name = next(n for n, i in parent.children.items() if i == d.ino)
            del parent.children[name]
            parent.nlink -= 1
            ino = self.ns.new_ino()
            self.ns.change(InodeRec(ino, parent.ino, name, d.mode, d.uid, d.gid, 0, d.atime_ns,
                                    d.mtime_ns, d.ctime_ns))
            fresh = self.ns.inodes[ino]
            d.lookups += fresh.lookups
            old = d.ino
            d.ino, d.layer, d.parent = ino, 0, fresh.parent
            self.ns.inodes[ino] = d  # the old (foreign) number stays an alias of the same inode
            if self.view is not None:
                self.view.renumbered(d, old)
            parent = d
        return parent

    def owned(self, x: Inode, keep_data: bool = True) -> Inode:
        """x made this writer's own, to change it: another writer's directory is adopted
        (own_dir), another writer's file copied up (copy_up)."""
        if self.readonly or x.layer == CONTROL_LAYER:
            raise pyfuse3.FUSEError(errno.EROFS)
        if x.layer == 0:
            return x
        if x.is_dir:
            return self.own_dir(x)
        where = self.view.names.get(x.ino) if self.view is not None else None
        if where is None:
            raise pyfuse3.FUSEError(errno.EROFS)  # no longer reachable by a name
        return self.copy_up(where[0], where[1], x, keep_data)

    def copy_up(self, v: Inode, name: bytes, x: Inode, keep_data: bool = True) -> Inode:
        """Another writer's file x at `name` of view directory v becomes an own file at the
        same name, with the same attributes and bytes: an INODE record, XEXTENT records that
        point at the other writer's runs (no byte is copied; `keep_data` off: an empty file,
        for an O_TRUNC open), and XUNLINKs of every other writer's version there. The live
        inode stays the same object and answers to its old number too (the kernel's cached
        entries stay valid); handles open on it read on."""
        view = self.view
        v = self.own_dir(v)
        view.take_over(v, name, x)
        pieces = list(x.emap.pieces) if keep_data and x.emap is not None else []
        size = x.size if keep_data else 0
        ino = self.ns.new_ino()
        self.ns.change(InodeRec(ino, v.ino, name, x.mode, x.uid, x.gid, x.rdev, x.atime_ns,
                                x.mtime_ns, x.ctime_ns, x.target))
        fresh = self.ns.inodes[ino]
        old = x.ino
        x.lookups += fresh.lookups
        x.ino, x.layer, x.nlink, x.commit_ns = ino, 0, 1, 0
        x.tail_run, x.tail_end = None, -1
        if x.emap is not None:
            x.emap.replaced()
            x.emap, x.size = ExtentMap(self.ns.on_dead), 0
        self.ns.inodes[ino] = x  # the old number stays an alias of the same inode
        for foff, n, run, roff in pieces:
            self.ns.change(XExtentRec(ino, foff, n, view.run_writer(run), run.log, run.loff,
                                      run.length, run.crc, roff))
        if x.emap is not None and x.size != size:
            self.ns.change(SizeRec(ino, size, x.mtime_ns, x.ctime_ns))
        view.renumbered(x, old)
        return x

    def _copy_up_tree(self, d: Inode) -> None:
        """View directory d and everything in it made own (to move it): other writers'
        directories adopted, their files copied up, the versions a conflict hid and the
        other writers' directories merged here removed; each directory's entries before the
        directory itself is done (without a recursion per level)."""
        view = self.view
        d = self.own_dir(d)
        stack = [(d, iter(list(d.children)), b"")]  # (directory, names left, its name)
        while stack:
            d, names, _ = stack[-1]
            for name in names:
                c = self.ns.inodes[d.children[name]]
                if c.is_dir:
                    c = self.own_dir(c)
                    stack.append((c, iter(list(c.children)), name))
                    break
                if c.layer != 0:
                    self.copy_up(d, name, c)
                view.remove_others(d, name)
            else:
                _, _, name = stack.pop()
                view.drop_members(d)
                if stack:
                    view.remove_others(stack[-1][0], name)

    def before_rename(self, op: Inode, name_old: bytes, moving: Inode, np_: Inode,
                      name_new: bytes, target: Inode | None,
                      exchange: bool) -> tuple[Inode, Inode | None]:
        """A rename of `moving` at `name_old` of view directory op to `name_new` of np_
        (where `target` is, or None) in which other writers' entries take part: what moves
        becomes own first (copy-up; a directory with everything in it), the other versions
        at both names go (docs/scaling.md); EXDEV for an exchange. The entries the rename
        then moves and replaces (the own version at `name_new`, if there is one)."""
        view = self.view
        if view is None or self.readonly or not (
                moving.layer != 0 or (target is not None and target.layer != 0)
                or self.others_at(op, name_old)
                or (target is not None and self.others_at(np_, name_new))
                or (moving.is_dir and view.foreign_inside(moving))):
            return moving, target
        if exchange:
            raise pyfuse3.FUSEError(errno.EXDEV)
        if moving.is_dir:
            self._copy_up_tree(moving)
        elif moving.layer != 0:
            moving = self.copy_up(op, name_old, moving)
        view.remove_others(op, name_old)
        if target is not None:
            view.remove_others(np_, name_new)
            target = self.ns.child(np_, name_new)
        return moving, target
