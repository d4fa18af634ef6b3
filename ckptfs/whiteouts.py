"""Whiteouts: the entries of other writers that a writer removed from the view.

A writer cannot change another writer's files, so removing another writer's entry (unlink,
rmdir, a rename over it, a copy-up) writes an XUNLINK record into its own index: (the other
writer, the directory's number in that writer's tree, the entry's number, its name). Every
view hides such an entry from then on, whatever order it reads the writers in: a file at
once, a directory while nothing inside it is visible (what its writer puts in it later
shows, and the directory with it). The own writer carries out the whiteouts of its own
entries (view.View.adopt_pending); a writer that removes the entry itself, as it does when it
next mounts or is compacted (`carry_out`), ends the whiteout (`forget`).

`Whiteouts` holds them for the view (view.View.whiteout records each, as the indexes are
read and as this mount removes other writers' entries) and answers what they hide; trio
thread, like the view.
"""

from __future__ import annotations

from ckptfs.format.records import RenameRec, UnlinkRec, XUnlinkRec
from ckptfs.namespace import Inode, Namespace


class Whiteouts:
    """The whiteouts every writer's index holds, by the writer whose entries they hide.

    `wo[writer]` holds (its directory, the entry's inode, the name) of each; `wo_dirs`
    says where each whited-out inode's entries are, to look at them again when something
    inside such a directory changes (it hides the directory only while it is empty)."""

    def __init__(self, union, trees: dict[int, Namespace]) -> None:
        self.union = union  # view.Union: the writers' layers
        self.trees = trees  # layer -> the other writer's tree, as read (peers.Peers)
        self.wo: dict[str, set[tuple[int, int, bytes]]] = {}
        self.wo_dirs: dict[tuple[str, int], set[tuple[int, bytes]]] = {}
        # (layer, directory) of other writers' trees found all whited out (_empty): true
        # until their trees change or a whiteout goes (more whiteouts keep it true), so a
        # tree removed level by level from the bottom costs one step per level, not the
        # whole depth below each
        self._emptied: set[tuple[int, int]] = set()

    def add(self, rec: XUnlinkRec) -> int | None:
        """Record a whiteout; returns the layer of the writer whose entry it hides when that
        writer's tree is in the view (0: the own writer), else None (applied if it comes)."""
        self.wo.setdefault(rec.writer, set()).add((rec.parent, rec.ino, rec.name))
        # (kept for every whiteout: the inode may not be in its writer's tree as read so far)
        self.wo_dirs.setdefault((rec.writer, rec.ino), set()).add((rec.parent, rec.name))
        layer = self.union.layer_of(rec.writer)
        if layer is None or (layer != 0 and layer not in self.trees):
            return None
        return layer

    def trees_changed(self) -> None:
        """A tree was installed, dropped or changed: what was found all whited out may not
        be any more."""
        self._emptied.clear()

    def whited(self, layer: int, parent: int, s: Inode, name: bytes) -> bool:
        """Whether entry `name` -> s of directory `parent` in writer `layer`'s tree is hidden."""
        wo = self.wo.get(self.union.writer_ids[layer])
        if not wo or (parent, s.ino, name) not in wo:
            return False
        return not s.is_dir or self._empty(layer, s, wo)

    def _empty(self, layer: int, d: Inode, wo: set) -> bool:
        """Nothing in another writer's directory `d` is visible (all of it whited out)."""
        t = self.trees[layer]
        emptied = self._emptied
        top, todo, seen = d, [d], 0
        while todo:
            d = todo.pop()
            seen += 1
            if seen > len(t.inodes):  # (a damaged tree with a cycle: not empty)
                return False
            for name, ci in d.children.items():
                if (d.ino, ci, name) not in wo:
                    return False
                c = t.inodes[ci]
                if c.is_dir and (layer, ci) not in emptied:
                    todo.append(c)
        emptied.add((layer, top.ino))
        return True

    def leaving(self, t: Namespace, wid: str, group: list) -> list[int]:
        """The inodes of tree t (writer wid) that whiteouts name and the records of `group`
        may remove (an UNLINK, or a RENAME over them)."""
        if wid not in self.wo:
            return []
        out = []
        for rec in group:
            kind = type(rec)
            if kind is UnlinkRec:
                where = (rec.parent, rec.name)
            elif kind is RenameRec:
                where = (rec.new_parent, rec.new_name)
            else:
                continue
            d = t.inodes.get(where[0])
            ino = d.children.get(where[1]) if d is not None and d.children else None
            if ino is not None and (wid, ino) in self.wo_dirs:
                out.append(ino)
        return out

    def forget(self, wid: str, t: Namespace, inos: list[int]) -> None:
        """Whiteouts of inodes that left writer wid's tree t for good hide nothing any more
        (a writer never uses an inode number again): the view lets go of them, or a job on
        several nodes deleting each other's files would grow them all its life."""
        wo = self.wo.get(wid)
        if wo is None:
            return
        for ino in inos:
            if ino in t.inodes:
                continue  # (another name of it is left)
            for parent, name in self.wo_dirs.pop((wid, ino), ()):
                wo.discard((parent, ino, name))
                self._emptied.clear()
        if not wo:
            del self.wo[wid]

    def settled(self, recs) -> set[tuple[str, int]]:
        """(writer, ino) of the whiteouts among `recs` (this writer's XUNLINK records) whose
        entry its writer has removed from its tree as this view has read it: an index
        snapshot may leave them out once every view has read that (datapath/snapshotter.py)."""
        out = set()
        for rec in recs:
            layer = self.union.layer_of(rec.writer)
            t = self.trees.get(layer) if layer else None
            if t is not None and rec.ino < t.next_ino and rec.ino not in t.inodes:
                out.add((rec.writer, rec.ino))
        return out

    def carry_out(self, layer: int) -> int:
        """Remove from writer `layer`'s own tree the entries other writers' whiteouts hide, as
        that writer does when it next mounts (`ckptfs compact` of that writer does it for it:
        its fresh index must not bring them back). Returns how many entries went."""
        t = self.trees[layer]
        wo = self.wo.get(self.union.writer_of(layer), set())

        def remove(parent: int, ino: int, name: bytes) -> None:
            # (all of it whited out: what `whited` asks; each entry after those inside it)
            found, todo = [], [(parent, ino, name)]
            while todo:
                p, i, n = todo.pop()
                found.append((p, n))
                x = t.inodes.get(i)
                if x is not None and x.is_dir:
                    todo.extend((i, ci, cname) for cname, ci in x.children.items())
            for p, n in reversed(found):
                t.apply(UnlinkRec(p, n))
            self._emptied.clear()
        gone = 0
        for parent, ino, name in sorted(wo):
            p = t.inodes.get(parent)
            if p is None or p.children is None or p.children.get(name) != ino:
                continue
            if self.whited(layer, parent, t.inodes[ino], name):
                remove(parent, ino, name)
                gone += 1
        return gone
