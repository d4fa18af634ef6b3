"""The union of writers: one view of every writer's tree, kept up to date as their indexes grow.

Every writer (one per mount that writes, on any host) owns `writers/<id>/` in the backing
directory and never touches another writer's files. A mount (and `ckptfs ls`/`verify`) shows
the union of all writers' trees, built when it mounts:

1. its own writer's index is replayed into the live namespace (layer 0, writable: replay.py);
2. every other writer's index is replayed into a namespace of its own (layers 1.., in writer-id
   order) and grafted onto the live tree by path: directories that exist in several writers
   merge; where two writers have a non-directory (or a directory and a file) at the same path,
   the later commit wins (the COMMIT time of the group that last changed the entry; ties go to
   the greater writer id). `conflicts` lists every such path.

Grafted entries keep their data where it is (runs carry their layer; the reader opens that
writer's logs). They are read-only in the mount (EROFS) except that new entries may be created
inside a grafted directory: the directory is then adopted into the own writer ("copy-up").
The trio thread owns the view; fuse/refresh.py reads the tails of other writers' indexes
(`read_tail`) in a worker thread and applies them here one commit group at a time.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field

from ckptfs.format import backingdir
from ckptfs.datapath.staging import ExtentMap
from ckptfs.format.records import (
    RenameRec,
    UnlinkRec,
    XUnlinkRec,
)
from ckptfs.namespace import ROOT_INO, Inode, Namespace
from ckptfs.replay import Touched, apply_group, bulk_load, read_writer, validate_extents

LAYER_SHIFT = 44  # foreign inode number = layer << LAYER_SHIFT | the writer's own number


@dataclass
class Conflict:
    path: str
    versions: list[tuple[str, int]]  # (writer id, commit stamp ns), winner first


@dataclass
class Union:
    """The writers of a backing directory, as layers of one namespace."""

    writer_dirs: dict[int, str] = field(default_factory=dict)  # layer -> writer directory
    writer_ids: dict[int, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    conflicts: list[Conflict] = field(default_factory=list)
    layers: dict[str, int] = field(default_factory=dict)  # writer id -> layer of its tree


INF = 1 << 63  # the stamp of an own change not committed yet: it commits after all seen
ENTRY = 1  # kernel invalidations View.changed collects: (ENTRY, directory ino, name)
INODE = 2  # (INODE, ino): attributes and cached data
_MASK = (1 << LAYER_SHIFT) - 1


def _attributes(x: Inode) -> tuple:
    """What the kernel caches of an inode (its attributes)."""
    return (x.mode, x.uid, x.gid, x.rdev, x.size, x.nlink, x.atime_ns, x.mtime_ns,
            x.ctime_ns, x.target)


def _shared_map(src: ExtentMap) -> ExtentMap:
    """An extent map for the view of another writer's file: the same piece lists as the
    file's own map (so its overwrites and truncates show at once), but dropping it when the
    view forgets the inode leaves that writer's tree alone."""
    m = ExtentMap()
    m.share(src)
    return m


class TreeBuild:
    """Another writer's tree made from its index's commit groups as they are read (`group`),
    apart from the view, so that a worker thread may make it; its warnings and newest commit
    stamp join the view's when it is installed (View._install)."""

    def __init__(self, layer: int, layer_of, where: str) -> None:
        self.tree = Namespace(now_ns=0)
        self.tree.layer = layer
        self.tree.layer_of = layer_of
        self.where = where
        self.warnings: list[str] = []
        self.max_stamp = 0

    def group(self, group: list, when: int) -> None:
        apply_group(self.tree, group, when, self.where, self.warnings)
        if when > self.max_stamp:
            self.max_stamp = when

    def relayer(self, layer: int) -> None:
        """The tree under another layer number (its writer's tree is installed anew)."""
        t, old = self.tree, self.tree.layer
        t.layer = layer
        for x in t.inodes.values():
            if x.emap is not None:
                for p in x.emap.pieces:
                    if p.run.layer == old:
                        p.run.layer = layer


class View:
    """The union of the writers as one tree, kept up to date as their indexes grow.

    Each other writer's tree (`trees[layer]`) is built from its own index and only from it;
    `ns` holds this mount's own tree (layer 0; empty for read-only mounts and offline tools)
    and the merged view: each directory of the view maps a name to the version that wins
    there, and `members` says which directories of other writers it merges. The view at a
    name is a function of the trees and of the whiteouts (XUNLINK records: another writer's
    entry removed), so applying the records in any order ends in the same view:

    - candidates are the own entry at that name and each member directory's entry, minus the
      whited-out ones (a whited-out directory only while nothing inside it is visible);
    - directories merge; otherwise the greater (commit stamp, writer id) wins (an own entry
      not committed yet counts as newest), the others are listed in `conflicts`;
    - a whiteout of an own entry is carried out by the own writer (an UNLINK of its own).

    Entries of other writers get inode numbers layer << 44 | their number. `changed`
    collects what the kernel must forget (it caches entries and attributes) and `gone` the
    inodes that left the view by another writer's change (an open of one is stale)."""

    def __init__(self, ns: Namespace, union: Union, backing: str, own: str | None) -> None:
        self.ns = ns
        self.union = union
        self.backing = backing
        self.own = own
        self.trees: dict[int, Namespace] = {}
        self.offsets: dict[int, int] = {}  # layer -> bytes of its index applied
        self.index_ids: dict[int, tuple[int, int]] = {}  # layer -> (st_dev, st_ino) read
        self.root = ns.inodes[ROOT_INO]
        self.members: dict[Inode, dict[int, int]] = {self.root: {}}
        self.placed: dict[tuple[int, int], Inode] = {}  # (layer, its dir) -> view directory
        self.wo: dict[str, set[tuple[int, int, bytes]]] = {}  # writer -> (parent, ino, name)
        # (writer, ino) -> (parent, name) of each whiteout: where a directory's entry is, to
        # look at it again when something inside it changes (it hides it only while empty)
        self.wo_dirs: dict[tuple[str, int], set[tuple[int, bytes]]] = {}
        self.hidden_own: dict[tuple[Inode, bytes], int] = {}  # own entries a conflict hides
        self.conflicts: dict[tuple[Inode, bytes], list[tuple[int, Inode]]] = {}
        self.names: dict[int, tuple[Inode, bytes]] = {}  # view ino -> where it is (one name)
        self.gone: set[int] = set()
        self.dirty: set[int] = set()  # changed by another writer since the kernel saw them
        self.changed: list[tuple] = []
        self.adopt: list[XUnlinkRec] = []  # whiteouts of own entries, to carry out
        self.max_stamp = 0  # the greatest COMMIT stamp read from another writer
        self.next_layer = 1
        self.own_alias = None  # layer under which other trees name the own writer's logs
        self.read_at: float | None = None  # time.monotonic() when load() began to read
        # Directories whose members are yet to be merged (_later), and whether a merge or
        # carrying out of whiteouts is under way: the walks down a tree (a directory that
        # appears or goes, every level of it) and up it (whiteouts of directories carried out
        # as they empty) take their next step from a list, not a call deeper, so a tree of
        # any depth goes through (a recursion would stop near 1,000 levels, half applied)
        self._todo: list[tuple[Inode, dict[int, int], bool]] = []
        self._merging = False
        self._adopting = False
        # (layer, directory) of other writers' trees found all whited out (_empty): true
        # until their trees change or a whiteout goes (more whiteouts keep it true), so a
        # tree removed level by level from the bottom costs one step per level, not the
        # whole depth below each
        self._emptied: set[tuple[int, int]] = set()
        if own:
            union.writer_ids[0] = own
            union.layers[own] = 0
        ns.layer_of = self.layer_of

    # ------------------------------------------------------------ writers
    def layer_of(self, writer: str) -> int | None:
        return self.union.layers.get(writer)

    def _tree_layer_of(self, writer: str) -> int | None:
        """Layers as another writer's tree names them: the own writer's logs under an alias
        layer, so that runs another writer took over are never counted as the own tree's
        (the space accounting of the own logs follows the own tree only)."""
        layer = self.union.layers.get(writer)
        if layer == 0:
            if self.own_alias is None:
                self.own_alias = self.next_layer
                self.next_layer += 1
                self.union.writer_dirs[self.own_alias] = self.union.writer_dirs[0]
                self.union.writer_ids[self.own_alias] = writer
            return self.own_alias
        return layer

    def writer_of(self, layer: int) -> str:
        return self.union.writer_ids.get(layer, "")

    def add_writer(self, wdir: str) -> int:
        """A layer number for another writer's directory (its tree comes with `load_tree`)."""
        layer = self.next_layer
        self.next_layer += 1
        wid = os.path.basename(wdir)
        self.union.writer_dirs[layer] = wdir
        self.union.writer_ids[layer] = wid
        self.union.layers[wid] = layer
        return layer

    def tree_build(self, layer: int, wdir: str, threaded: bool = False) -> TreeBuild:
        """Writer `layer`'s tree, to be made from its index's commit groups as they are read
        (replay.read_writer's on_group: TreeBuild.group) and then installed (add_tree,
        reload_tree). `threaded`: made in a worker thread, while this one goes on (the
        layer under which other trees name the own writer's logs is made here first)."""
        layer_of = self._tree_layer_of
        if threaded:
            layers = self.union.layers
            alias = self._tree_layer_of(self.own) if layers.get(self.own) == 0 else None

            def layer_of(writer: str) -> int | None:
                found = layers.get(writer)
                return alias if found == 0 else found
        return TreeBuild(layer, layer_of, os.path.join(wdir, backingdir.INDEX_NAME))

    def assign(self, only: str | None = None) -> None:
        """Layers for the writers of the backing directory (before any index is replayed:
        an XEXTENT record names a writer by id)."""
        for wdir in backingdir.writer_dirs(self.backing):
            wid = os.path.basename(wdir)
            if wid != self.own and (only is None or wid == only) and \
                    wid not in self.union.layers:
                self.add_writer(wdir)

    def load(self, only: str | None = None) -> None:
        """Build the view of every writer of the backing directory (at mount, or offline)."""
        self.read_at = time.monotonic()
        self.assign(only)
        for wid, layer in sorted(self.union.layers.items(), key=lambda kv: kv[1]):
            if layer == 0:
                continue
            wdir = self.union.writer_dirs[layer]
            built = self.tree_build(layer, wdir)
            with bulk_load():
                got = read_writer(wdir, built.group)
            if isinstance(got, str):
                self.union.warnings.append(got)
                continue
            scan, ident = got
            self._install(layer, wdir, scan, ident, built)
        for rec in self.ns.xunlinks:
            self._whiteout(rec, touch=False)
        for layer in list(self.trees):
            for rec in self.trees[layer].xunlinks:
                self._whiteout(rec, touch=False)
        self.members[self.root] = {layer: ROOT_INO for layer in sorted(self.trees)}
        for layer in self.trees:
            self.placed[(layer, ROOT_INO)] = self.root
        self._populate(self.root)
        self.changed.clear()

    def adopt_pending(self) -> None:
        """Carry out the whiteouts of own entries found so far (a read-write mount)."""
        self._adopt_own()

    def _install(self, layer: int, wdir: str, scan, ident,
                 built: TreeBuild | None = None) -> Namespace:
        """Writer `layer`'s tree into the view: `built`, or made from the groups `scan`
        holds."""
        if built is None:
            built = self.tree_build(layer, wdir)
            with bulk_load():
                for group, when in zip(scan.groups, scan.group_times):
                    built.group(group, when)
        elif built.tree.layer != layer:
            built.relayer(layer)
        t = built.tree
        self.union.warnings += scan.warnings
        self.union.warnings += built.warnings
        if built.max_stamp > self.max_stamp:
            self.max_stamp = built.max_stamp
        self.union.warnings += validate_extents(t, wdir, layer)
        self._emptied.clear()
        self.trees[layer] = t
        self.offsets[layer] = scan.valid_bytes
        self.index_ids[layer] = ident
        return t

    def unloaded(self) -> list[int]:
        """The layers of other writers without a tree: their index could not be read (at
        mount, or when they appeared). Such a writer's files are not in the view, and what
        its records name (XEXTENT: runs in other writers' logs) is not known."""
        return [layer for layer in self.union.layers.values()
                if layer != 0 and layer not in self.trees]

    def add_tree(self, wdir: str, scan, ident, layer: int | None = None,
                 built: TreeBuild | None = None) -> int:
        """A writer that appeared while mounted, or (`layer`) one whose index could not be
        read before: its whole tree (`built`, or made from the groups `scan` holds) joins
        the view."""
        if layer is None:
            layer = self.add_writer(wdir)
        t = self._install(layer, wdir, scan, ident, built)
        for rec in t.xunlinks:
            self._whiteout(rec)
        self.placed[(layer, ROOT_INO)] = self.root
        members = dict(self.members[self.root])
        members[layer] = ROOT_INO
        self._set_members(self.root, members, fresh=False)
        self._adopt_own()
        return layer

    def drop_tree(self, layer: int) -> None:
        """A writer whose directory went away (merged by a compaction) or whose index was
        replaced (rewritten): its entries leave the view, directories at every depth (a
        rewritten one comes back through reload_tree)."""
        for d in [d for d, m in self.members.items() if layer in m]:
            m = self.members.get(d)
            if m is None or layer not in m:
                continue  # (it left the view with a directory above it, its members too)
            self._set_members(d, {k: v for k, v in m.items() if k != layer}, fresh=False)
        self.trees.pop(layer, None)
        self._emptied.clear()
        self.offsets.pop(layer, None)
        self.index_ids.pop(layer, None)
        wid = self.union.writer_ids.get(layer)
        if wid is not None and self.union.layers.get(wid) == layer:
            del self.union.layers[wid]

    def reload_tree(self, layer: int, wdir: str, scan, ident, same_layer: bool = True,
                    built: TreeBuild | None = None) -> int:
        """Writer `layer`'s index was rewritten (an index snapshot, a compaction: another
        file, which replays to the tree read so far or one further on): its tree is built
        again from the new one, and the view follows. Under the same layer, so that an entry
        it still has keeps its number in the view and what the kernel holds of it stays
        valid (a LOOKUP in a directory it keeps a name of, an open of a file it knows); one
        it lost leaves the view, one it gained joins, and the kernel forgets the attributes
        that changed. Under a new layer (the kernel's old numbers then stale: an open of
        one is answered ESTALE) when `same_layer` is false or the new tree gives a number the
        kernel knows to another kind of entry. Returns the layer."""
        wid = self.writer_of(layer)
        known = {x.ino: x for x in self.ns.inodes.values()
                 if x.layer == layer and (x.lookups > 0 or x.opens > 0)}
        if built is None:
            built = self.tree_build(layer, wdir)
            with bulk_load():
                for group, when in zip(scan.groups, scan.group_times):
                    built.group(group, when)
        # (inode numbers are never given twice in one writer's history: one the new tree
        # no longer has was of the same kind)
        kinds = built.tree.inodes
        if same_layer and all(stat.S_IFMT(kinds[ino & _MASK].mode if ino & _MASK in kinds
                                          else x.mode) == stat.S_IFMT(x.mode)
                              for ino, x in known.items()):
            before = {ino: _attributes(x) for ino, x in known.items()}
            self.drop_tree(layer)
            self.union.layers[wid] = layer
            self.add_tree(wdir, scan, ident, layer, built)
            for ino, was in before.items():
                x = self.ns.inodes.get(ino)
                if x is not None and x.layer == layer and _attributes(x) != was:
                    self.dirty.add(ino)
                    self.changed.append((INODE, ino))
            return layer
        self.drop_tree(layer)
        return self.add_tree(wdir, scan, ident, built=built)

    def apply_group(self, layer: int, group: list, when: int) -> list:
        """One commit group read from the tail of another writer's index. Returns its EXTENT
        and XEXTENT records (the reader drops what it cached of those log ranges) and its
        RETIRE records (the reader lets go of those logs)."""
        t = self.trees[layer]
        self._emptied.clear()
        touched = Touched()
        first_x = len(t.xunlinks)
        leaving = self._leaving(t, self.writer_of(layer), group)
        apply_group(t, group, when, self.writer_of(layer), self.union.warnings, touched)
        if when > self.max_stamp:
            self.max_stamp = when
        self._forget_whiteouts(self.writer_of(layer), t, leaving)
        for rec in t.xunlinks[first_x:]:
            self._whiteout(rec)
        for ino in touched.inos:
            x = self.ns.inodes.get((layer << LAYER_SHIFT) | ino)
            s = t.inodes.get(ino)
            if x is not None and s is not None and x.layer == layer:
                self._sync(x, s)
                if x.lookups > 0 or x.opens > 0:
                    self.dirty.add(x.ino)
                    self.changed.append((INODE, x.ino))
        for parent, name in touched.names:
            self._touch(layer, parent, name)
        self._adopt_own()
        return touched.runs

    # ------------------------------------------------------------ whiteouts
    def _leaving(self, t: Namespace, wid: str, group: list) -> list[int]:
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

    def _forget_whiteouts(self, wid: str, t: Namespace, inos: list[int]) -> None:
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

    def settled_whiteouts(self, recs) -> set[tuple[str, int]]:
        """(writer, ino) of the whiteouts among `recs` (this writer's XUNLINK records) whose
        entry its writer has removed from its tree as this view has read it: an index
        snapshot may leave them out once every view has read that (cleaner.Maintainer)."""
        out = set()
        for rec in recs:
            layer = self.union.layers.get(rec.writer)
            t = self.trees.get(layer) if layer else None
            if t is not None and rec.ino < t.next_ino and rec.ino not in t.inodes:
                out.add((rec.writer, rec.ino))
        return out

    def _whiteout(self, rec: XUnlinkRec, touch: bool = True) -> None:
        self.wo.setdefault(rec.writer, set()).add((rec.parent, rec.ino, rec.name))
        # (kept for every whiteout: the inode may not be in its writer's tree as read so far)
        self.wo_dirs.setdefault((rec.writer, rec.ino), set()).add((rec.parent, rec.name))
        layer = self.union.layers.get(rec.writer)
        if layer is None:
            return  # (a writer not in this view: applied if it appears)
        tree = self.ns if layer == 0 else self.trees.get(layer)
        if tree is None:
            return
        if layer == 0:
            if self.own:
                self.adopt.append(rec)
        elif touch:
            self._touch(layer, rec.parent, rec.name)

    def _whited(self, layer: int, parent: int, s: Inode, name: bytes) -> bool:
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

    def _touch(self, layer: int, parent: int, name: bytes) -> None:
        wid = self.writer_of(layer)
        v = self.placed.get((layer, parent))
        if v is not None:
            self.remerge(v, name, True)
        # a whited-out directory that has become empty (or not) changes its own entry, and
        # so on up (a whiteout may name it at any place it has been)
        todo, seen = [parent], set()
        while todo and len(seen) < 4096:
            d = todo.pop()
            for up in self.wo_dirs.get((wid, d), ()):
                if up in seen:
                    continue
                seen.add(up)
                v = self.placed.get((layer, up[0]))
                if v is not None:
                    self.remerge(v, up[1], True)
                todo.append(up[0])

    def _own_children(self, d: Inode) -> bool:
        inodes = self.ns.inodes
        if any(inodes[c].layer == 0 for c in d.children.values()):
            return True
        return any(k[0] is d for k in self.hidden_own)

    def _adopt_own(self) -> None:
        """Carry out other writers' whiteouts of own entries: an UNLINK of the own writer
        (journaled), so the own tree, its index and its space accounting agree with the view.
        One carried out may let the next one up apply (own_removed): it joins the list this
        loop works through."""
        if self._adopting:
            return
        self._adopting = True
        try:
            self._adopt_all()
        finally:
            self._adopting = False

    def _adopt_all(self) -> None:
        while self.adopt:
            rec = self.adopt.pop(0)
            p = self.ns.inodes.get(rec.parent)
            if p is None or p.layer != 0 or p.children is None:
                continue
            if p.children.get(rec.name) != rec.ino and \
                    self.hidden_own.get((p, rec.name)) != rec.ino:
                continue  # not there any more
            x = self.ns.inodes[rec.ino]
            if x.is_dir and self._own_children(x):
                continue  # not empty: a whiteout of a directory waits for that (own_removed)
            self.own_unlink(p, rec.name, x)

    def own_unlink(self, p: Inode, name: bytes, x: Inode, notify: bool = True) -> None:
        """Remove the own entry `name` (inode x, visible or hidden by a conflict) from own
        directory p, journaled."""
        if x.is_dir:
            self._clear(x)
        if p.children.get(name) != x.ino:
            cur = p.children.get(name)
            if cur is not None:
                self._detach(p, name, self.ns.inodes[cur])
            p.children[name] = x.ino
            if x.is_dir:
                p.nlink += 1
        self.hidden_own.pop((p, name), None)
        self.ns.change(UnlinkRec(p.ino, name))
        if x.nlink <= 0 and x.ino in self.ns.inodes:  # (the kernel knows it: stale)
            self.gone.add(x.ino)
        self.remerge(p, name, notify)
        if self.own:
            self._forget_whiteouts(self.own, self.ns, [x.ino])
        self.own_removed(p)

    def own_removed(self, d: Inode) -> None:
        """An own entry left own directory d: a whiteout waiting for d to empty may apply."""
        ups = self.wo_dirs.get((self.own or "", d.ino))
        if ups and not self._own_children(d):
            for up in ups:
                self.adopt.append(XUnlinkRec(self.own or "", up[0], d.ino, up[1]))
            self._adopt_own()

    # ------------------------------------------------------------ changes of other writers' entries
    def whiteout_foreign(self, layer: int, parent: int, s: Inode, name: bytes) -> None:
        """This writer removes another writer's entry (an XUNLINK record, journaled)."""
        rec = XUnlinkRec(self.writer_of(layer), parent, s.ino, name)
        self.ns.change(rec)
        self._whiteout(rec, touch=False)

    def remove_all(self, v: Inode, name: bytes) -> None:
        """unlink, rmdir: every version at `name` in view directory v goes, the own one with
        an UNLINK, those of other writers with XUNLINKs (a version a conflict hid would
        otherwise show in its place)."""
        for layer, s, parent in self._candidates(v, name):
            if layer == 0:
                self.own_unlink(v, name, s, notify=False)
            else:
                self.whiteout_foreign(layer, parent, s, name)
        self.remerge(v, name, False)

    def remove_others(self, v: Inode, name: bytes) -> None:
        """The other writers' versions at `name` go (the own one stays: a rename moves or
        replaces it)."""
        for layer, s, parent in self._candidates(v, name):
            if layer != 0:
                self.whiteout_foreign(layer, parent, s, name)
        self.remerge(v, name, False)

    def take_over(self, v: Inode, name: bytes, x: Inode) -> None:
        """Another writer's file x at `name` of own directory v is about to become an own
        one (copy-up): every other version there goes, and x leaves the entry for the own
        INODE record that follows."""
        for layer, s, parent in self._candidates(v, name):
            if layer == 0:
                self.own_unlink(v, name, s, notify=False)
            else:
                self.whiteout_foreign(layer, parent, s, name)
        if v.children.get(name) == x.ino:
            del v.children[name]
        self.names.pop(x.ino, None)
        self.hidden_own.pop((v, name), None)
        self.conflicts.pop((v, name), None)

    def foreign_inside(self, d: Inode) -> bool:
        """Whether view directory d holds (or merges) anything of another writer."""
        stack = [d]
        inodes = self.ns.inodes
        while stack:
            x = stack.pop()
            if x.layer != 0 or self.members.get(x):
                return True
            for c in x.children.values():
                ci = inodes[c]
                if ci.layer != 0:
                    return True
                if ci.is_dir:
                    stack.append(ci)
        return False

    def drop_members(self, d: Inode) -> None:
        """Every other writer's directory merged into view directory d is removed (XUNLINK;
        each is empty in the view by now: the whiteouts of what was in it came first)."""
        for layer, src in list(self.members.get(d, {}).items()):
            t = self.trees.get(layer)
            s = t.inodes.get(src) if t is not None else None
            if s is None or s.ino == ROOT_INO:
                continue
            p = t.inodes.get(s.parent)
            name = next((n for n, i in p.children.items() if i == src), None) if p else None
            if name is not None:
                self.whiteout_foreign(layer, p.ino, s, name)
        # (no longer merged here: the whited-out directories stay where they are, and what
        # their writers may still put in them shows there)
        self._set_members(d, {}, fresh=False)

    def carry_out(self, layer: int) -> int:
        """Remove from writer `layer`'s own tree the entries other writers' whiteouts hide, as
        that writer does when it next mounts (`ckptfs compact` of that writer does it for it:
        its fresh index must not bring them back). Returns how many entries went."""
        t = self.trees[layer]
        wo = self.wo.get(self.writer_of(layer), set())

        def remove(parent: int, ino: int, name: bytes) -> None:
            # (all of it whited out: what _whited asks; each entry after those inside it)
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
            if self._whited(layer, parent, t.inodes[ino], name):
                remove(parent, ino, name)
                gone += 1
        return gone

    def run_writer(self, run) -> str:
        """The writer whose data log holds `run`."""
        return self.writer_of(run.layer)

    # ------------------------------------------------------------ merging
    def _candidates(self, v: Inode, name: bytes) -> list[tuple[int, Inode, int]]:
        """The versions at `name` in view directory v: (layer, inode in its tree, its
        directory there), the own one first, then by layer."""
        out = []
        if self.own and v.layer == 0:
            x = None
            cur = v.children.get(name)
            if cur is not None:
                xi = self.ns.inodes.get(cur)
                if xi is not None and xi.layer == 0:
                    x = xi
            if x is None:
                h = self.hidden_own.get((v, name))
                if h is not None:
                    x = self.ns.inodes.get(h)
            if x is not None:
                out.append((0, x, v.ino))
        for layer, parent in self.members.get(v, {}).items():
            t = self.trees.get(layer)
            p = t.inodes.get(parent) if t is not None else None
            if p is None or p.children is None:
                continue
            si = p.children.get(name)
            if si is None:
                continue
            s = t.inodes[si]
            if self.wo and self._whited(layer, parent, s, name):
                continue
            out.append((layer, s, parent))
        return out

    def _key(self, c) -> tuple[int, str]:
        layer, s, _ = c
        return (s.commit_ns or INF) if layer == 0 else s.commit_ns, self.writer_of(layer)

    def _resolve(self, cands):
        occ, group, losers = None, [], []
        for c in cands:
            if occ is None:
                occ, group = c, ([c] if c[1].is_dir else [])
            elif group and c[1].is_dir:
                group.append(c)
            elif self._key(c) > self._key(occ):
                losers += group or [occ]
                occ, group = c, ([c] if c[1].is_dir else [])
            else:
                losers.append(c)
        return occ, group, losers

    def versions(self, v: Inode, name: bytes) -> list[tuple[int, Inode, int]]:
        """Every version at `name` in view directory v (the visible one and those a conflict
        hides): what an unlink, rmdir, or rename over or away from the name removes."""
        return self._candidates(v, name)

    def remerge(self, v: Inode, name: bytes, notify: bool) -> None:
        """Make v's entry `name` what the trees and whiteouts say it is."""
        cands = self._candidates(v, name)
        win, group, losers = self._resolve(cands)
        cur_ino = v.children.get(name)
        cur = self.ns.inodes.get(cur_ino) if cur_ino is not None else None
        members = None
        if win is None:
            new = None
        elif group:
            members = {layer: s.ino for layer, s, _ in group if layer != 0}
            own = next((s for layer, s, _ in group if layer == 0), None)
            if own is not None:
                new = own
            elif (cur is not None and cur.is_dir and cur.layer > 0
                  and members.get(cur.layer) == cur.ino & _MASK):
                new = cur  # the view directory stays while its source is in the group
            else:
                new = self._clone(group[0][0], group[0][1])
        else:
            new = win[1] if win[0] == 0 else self._clone(win[0], win[1])
        key = (v, name)
        own_c = cands[0] if cands and cands[0][0] == 0 else None
        if own_c is not None and own_c[1] is not new:
            self.hidden_own[key] = own_c[1].ino
        else:
            self.hidden_own.pop(key, None)
        if losers:
            self.conflicts[key] = [(win[0], win[1])] + [(c[0], c[1]) for c in losers]
        else:
            self.conflicts.pop(key, None)
        if new is cur:
            if new is not None and new.is_dir:
                self._later(new, members or {}, fresh=False)
            return
        if cur is not None:
            self._detach(v, name, cur)
        if new is not None:
            self._attach(v, name, new, members or {})
        if notify and (v is self.root or v.lookups > 0):
            self.changed.append((ENTRY, v.ino, name))
            self.changed.append((INODE, v.ino))

    def _clone(self, layer: int, s: Inode) -> Inode:
        ino = (layer << LAYER_SHIFT) | s.ino
        x = self.ns.inodes.get(ino)
        if x is None or x.layer != layer:
            x = Inode(ino, s.mode, s.uid, s.gid, s.rdev, target=s.target)
            x.layer = layer
            x.nlink = 2 if s.is_dir else 0
            self.ns.inodes[ino] = x
        elif x.is_dir and x.nlink <= 0:  # (one the kernel kept while it was out of the view)
            x.nlink = 2
        self._sync(x, s)
        return x

    @staticmethod
    def _sync(x: Inode, s: Inode) -> None:
        """The view inode x shows another writer's inode s as it is now."""
        x.mode, x.uid, x.gid, x.rdev = s.mode, s.uid, s.gid, s.rdev
        x.atime_ns, x.mtime_ns, x.ctime_ns = s.atime_ns, s.mtime_ns, s.ctime_ns
        x.commit_ns = s.commit_ns
        if s.emap is not None:
            if x.emap is None:
                x.emap = ExtentMap()
            x.emap.share(s.emap)  # (st_blocks: a count, copied; the pieces are shared)
            x.size = s.size
            x.tail_run = None
        elif not s.is_dir:
            x.size = s.size
            x.target = s.target

    def _attach(self, v: Inode, name: bytes, x: Inode, members: dict[int, int]) -> None:
        v.children[name] = x.ino
        if x.layer != 0:
            self.gone.discard(x.ino)
            self.names[x.ino] = (v, name)
        if x.is_dir:
            v.nlink += 1
            x.parent = v.ino
            self._later(x, members, fresh=True)
        elif x.layer != 0:
            x.nlink += 1

    def _detach(self, v: Inode, name: bytes, x: Inode, clear: list | None = None) -> None:
        """Take x out of view directory v (`clear`: a directory's own clearing goes there,
        for _clear's loop)."""
        del v.children[name]
        if x.is_dir:
            v.nlink -= 1
            if x.layer != 0 and self.names.get(x.ino) != (v, name):
                return  # moved: attached in its new place already (a rename in its tree)
            if clear is None:
                self._clear(x)
            else:
                clear.append(x)
        if x.layer == 0:
            return  # an own entry a conflict hides: it stays in the own tree
        if self.names.get(x.ino, (None,))[0] is v:
            del self.names[x.ino]
        x.nlink = 0 if x.is_dir else max(0, x.nlink - 1)
        if x.nlink <= 0:
            self.ns.maybe_forget(x)
            if x.ino in self.ns.inodes:  # (the kernel still knows it: an open of it is stale)
                self.gone.add(x.ino)

    def forgotten(self, ino: int) -> None:
        """The kernel forgot inode `ino` and it left the tree: no request names it again, so
        nothing about it is kept (a long job on several nodes removes files all day)."""
        self.gone.discard(ino)
        self.dirty.discard(ino)
        if self.own:
            self._forget_whiteouts(self.own, self.ns, [ino])

    def _clear(self, d: Inode) -> None:
        """A view directory leaves the view: the other writers' entries in it go with it
        (the own ones stay in the own tree), and so on down."""
        todo = [d]
        while todo:
            d = todo.pop()
            for layer, src in self.members.pop(d, {}).items():
                if self.placed.get((layer, src)) is d:
                    del self.placed[(layer, src)]
            for name in list(d.children):
                c = self.ns.inodes[d.children[name]]
                if c.layer != 0:
                    self._detach(d, name, c, todo)
                elif c.is_dir:
                    todo.append(c)
            for key in [k for k in self.conflicts if k[0] is d]:
                del self.conflicts[key]
            if d.nlink < 0:  # (out of the view before its subdirectories left it)
                d.nlink = 0

    def _later(self, d: Inode, members: dict[int, int], fresh: bool) -> None:
        """_set_members(d, ...), now when no merge is under way, else by the one that is,
        once the step it is in is done (see _todo)."""
        self._todo.append((d, members, fresh))
        if self._merging:
            return
        self._merging = True
        try:
            while self._todo:
                d, members, fresh = self._todo.pop()
                if fresh and d.layer != 0 and d.ino not in self.names:
                    continue  # (left the view again meanwhile: nothing to show in it)
                self._set_members(d, members, fresh)
        except BaseException:
            self._todo.clear()
            raise
        finally:
            self._merging = False

    def _set_members(self, d: Inode, members: dict[int, int], fresh: bool) -> None:
        old = self.members.get(d, {})
        self.members[d] = dict(sorted(members.items()))
        names: set[bytes] = set(d.children) if fresh else set()
        for layer, src in old.items():
            if members.get(layer) != src:
                if self.placed.get((layer, src)) is d:
                    del self.placed[(layer, src)]
                s = self.trees[layer].inodes.get(src) if layer in self.trees else None
                if s is not None and s.children is not None:
                    names.update(s.children)
                # (and whatever it showed or hid here under names it has no more: a rename in
                # the same commit group may not have been looked at yet)
                names.update(d.children)
                names.update(n for (v, n) in self.conflicts if v is d)
        for layer, src in members.items():
            self.placed[(layer, src)] = d
            if fresh or old.get(layer) != src:
                s = self.trees[layer].inodes.get(src)
                if s is not None and s.children is not None:
                    names.update(s.children)
                if d.layer == layer and d.ino & _MASK == src:
                    self._sync(d, s)
        if fresh and self.own and d.layer == 0:
            names.update(n for (p, n) in self.hidden_own if p is d)
        if fresh and not d.children:
            names = self._fill(d, names)
        for name in names:
            self.remerge(d, name, not fresh)

    def _fill(self, d: Inode, names: set[bytes]) -> set[bytes]:
        """A view directory with nothing in it yet (a mount's first view, a directory that
        appears): a file that only one of its members has, not whited out, is shown at once
        (the common case: each rank's files in their own writer's directory; a mount of
        100,000 of them); returns the names the general merge (remerge) decides."""
        found: dict[bytes, list] = {}
        for layer, src in self.members.get(d, {}).items():
            t = self.trees.get(layer)
            s = t.inodes.get(src) if t is not None else None
            if s is None or s.children is None:
                continue
            inodes = t.inodes
            for name, si in s.children.items():
                c = inodes[si]
                if self.wo and self._whited(layer, src, c, name):
                    continue
                got = found.get(name)
                if got is None:
                    found[name] = [layer, c]
                else:
                    got.append(None)  # (more than one: remerge decides)
        rest = names.difference(found)
        children, where = d.children, self.names
        for name, got in found.items():
            if len(got) != 2 or got[1].children is not None or name not in names:
                rest.add(name)
                continue
            x = self._clone(got[0], got[1])
            children[name] = x.ino
            where[x.ino] = (d, name)
            x.nlink += 1
            self.gone.discard(x.ino)
        return rest

    def _populate(self, d: Inode) -> None:
        self._set_members(d, self.members.get(d, {}), fresh=True)

    # ------------------------------------------------------------ own changes
    def stamped(self, items, stamp: int) -> None:
        """The own records `items` were committed with COMMIT stamp `stamp`."""
        inodes = self.ns.inodes
        for it in items:
            t = type(it)
            ino = getattr(it, "ino", None)
            if t is RenameRec:
                p = inodes.get(it.new_parent)
                ino = p.children.get(it.new_name) if p is not None and p.children else None
            if ino is not None:
                x = inodes.get(ino)
                if x is not None and x.layer == 0:
                    x.commit_ns = stamp

    def renumbered(self, x: Inode, old: int) -> None:
        """Another writer's entry x became an own one (copy-up) with a new number."""
        self.names.pop(old, None)
        self.gone.discard(old)
        self.dirty.discard(old)

    def conflict_list(self) -> list[Conflict]:
        out = []
        for (v, name), vs in self.conflicts.items():
            path = self.ns.path_of(v.ino).rstrip("/") + "/" + name.decode(
                errors="surrogateescape")
            out.append(Conflict(path, [(self.writer_of(layer), s.commit_ns)
                                       for layer, s in vs]))
        return out


def load_foreign(ns: Namespace, backing: str, own_writer: str | None, union: Union,
                 only: str | None = None) -> View:
    """The view of the writers of `backing` over `ns` (own_writer's tree is `ns` itself;
    None: every writer's tree is read, as the offline tools do). `union.conflicts` lists
    the paths where versions conflict."""
    view = View(ns, union, backing, own_writer)
    view.load(only)
    union.conflicts = view.conflict_list()
    return view
