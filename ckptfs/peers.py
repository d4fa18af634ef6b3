"""The other writers of a backing directory: their indexes read into trees, and followed.

At mount (and in the offline tools) every other writer's index is read whole into a tree of
its own, under a layer number (`load`); while mounted, fuse/refresh.py looks at the indexes
and hands over what it found: the commit groups a writer appended (`apply_group`), a writer
that appeared (`add_tree`), went away (`drop_tree`) or whose index was rewritten
(`reload_tree`). Each change of a tree is merged into the view (view.View) at once, and the
whiteouts the groups bring are recorded (whiteouts.Whiteouts). Trio thread, except that a
tree read whole may be made in a worker thread (`TreeBuild`) and installed in one step.
"""

from __future__ import annotations

import os
import stat
import time

from ckptfs.format import backingdir
from ckptfs.namespace import ROOT_INO, Inode, Namespace
from ckptfs.replay import Touched, apply_group, bulk_load, read_writer, validate_extents
from ckptfs.view import INODE, LAYER_SHIFT, MASK, Union, View, show
from ckptfs.whiteouts import Whiteouts


def _attributes(x: Inode) -> tuple:
    """What the kernel caches of an inode (its attributes)."""
    return (x.mode, x.uid, x.gid, x.rdev, x.size, x.nlink, x.atime_ns, x.mtime_ns,
            x.ctime_ns, x.target)


class TreeBuild:
    """Another writer's tree made from its index's commit groups as they are read (`group`),
    apart from the view, so that a worker thread may make it; its warnings and newest commit
    stamp join the view's when it is installed (Peers._install)."""

    def __init__(self, layer: int, layer_of, where: str) -> None:
        self.tree = Namespace(now_ns=0, layer=layer, layer_of=layer_of)
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


class Peers:
    """The other writers' trees (`trees[layer]`), each built from its own index and kept up
    to date as it grows; `offsets` and `index_ids` say how far each index was read and which
    file it was. `view` is the union of the trees with the own one (`ns`, layer 0), and
    `whiteouts` what their XUNLINK records hide. The own tree is made with the union's
    writer layers (`Namespace(layer_of=union.layer_of)`): its XEXTENT records name other
    writers by their ids."""

    def __init__(self, ns: Namespace, union: Union, backing: str, own: str | None) -> None:
        self.ns = ns
        self.union = union
        self.backing = backing
        self.own = own
        self.trees: dict[int, Namespace] = {}
        self.whiteouts = Whiteouts(union, self.trees)
        self.view = View(ns, union, self.trees, self.whiteouts, own)
        self.offsets: dict[int, int] = {}  # layer -> bytes of its index applied
        self.index_ids: dict[int, tuple[int, int]] = {}  # layer -> (st_dev, st_ino) read
        self.max_stamp = 0  # the greatest COMMIT stamp read from another writer
        self.next_layer = 1
        self.own_alias = None  # layer under which other trees name the own writer's logs
        self.read_at: float | None = None  # time.monotonic() when load() began to read
        if own:
            union.writer_ids[0] = own
            union.layers[own] = 0

    # ------------------------------------------------------------ layers
    def tree_layer_of(self, writer: str) -> int | None:
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

    def add_writer(self, wdir: str) -> int:
        """A layer number for another writer's directory (its tree comes with `add_tree`)."""
        layer = self.next_layer
        self.next_layer += 1
        wid = os.path.basename(wdir)
        self.union.writer_dirs[layer] = wdir
        self.union.writer_ids[layer] = wid
        self.union.layers[wid] = layer
        return layer

    def assign(self, only: str | None = None) -> None:
        """Layers for the writers of the backing directory (before any index is replayed:
        an XEXTENT record names a writer by id)."""
        for wdir in backingdir.writer_dirs(self.backing):
            wid = os.path.basename(wdir)
            if wid != self.own and (only is None or wid == only) and \
                    wid not in self.union.layers:
                self.add_writer(wdir)

    def unloaded(self) -> list[int]:
        """The layers of other writers without a tree: their index could not be read (at
        mount, or when they appeared). Such a writer's files are not in the view, and what
        its records name (XEXTENT: runs in other writers' logs) is not known."""
        return [layer for layer in self.union.layers.values()
                if layer != 0 and layer not in self.trees]

    # ------------------------------------------------------------ whole trees
    def tree_build(self, layer: int, wdir: str, threaded: bool = False) -> TreeBuild:
        """Writer `layer`'s tree, to be made from its index's commit groups as they are read
        (replay.read_writer's on_group: TreeBuild.group) and then installed (add_tree,
        reload_tree). `threaded`: made in a worker thread, while this one goes on (the
        layer under which other trees name the own writer's logs is made here first)."""
        layer_of = self.tree_layer_of
        if threaded:
            layers = self.union.layers
            alias = self.tree_layer_of(self.own) if layers.get(self.own) == 0 else None

            def layer_of(writer: str) -> int | None:
                found = layers.get(writer)
                return alias if found == 0 else found
        return TreeBuild(layer, layer_of, os.path.join(wdir, backingdir.INDEX_NAME))

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
        view = self.view
        for rec in self.ns.xunlinks:
            view.whiteout(rec)
        for layer in list(self.trees):
            for rec in self.trees[layer].xunlinks:
                view.whiteout(rec)
        view.set_members(view.root, {layer: ROOT_INO for layer in sorted(self.trees)},
                         fresh=True)
        view.changed.clear()

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
        self.whiteouts.trees_changed()
        self.trees[layer] = t
        self.offsets[layer] = scan.valid_bytes
        self.index_ids[layer] = ident
        return t

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
        view = self.view
        view.placed[(layer, ROOT_INO)] = view.root
        members = dict(view.members[view.root])
        members[layer] = ROOT_INO
        view.set_members(view.root, members, fresh=False)
        view.adopt_pending()
        return layer

    def drop_tree(self, layer: int) -> None:
        """A writer whose directory went away (merged by a compaction) or whose index was
        replaced (rewritten): its entries leave the view, directories at every depth (a
        rewritten one comes back through reload_tree)."""
        view = self.view
        for d in [d for d, m in view.members.items() if layer in m]:
            m = view.members.get(d)
            if m is None or layer not in m:
                continue  # (it left the view with a directory above it, its members too)
            view.set_members(d, {k: v for k, v in m.items() if k != layer}, fresh=False)
        self.trees.pop(layer, None)
        self.whiteouts.trees_changed()
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
        one, or a LOOKUP that finds nothing in one of its directories, is answered ESTALE,
        and the kernel walks the path again) when `same_layer` is false or the new tree
        gives a number the kernel knows to another kind of entry. Returns the layer."""
        view = self.view
        wid = self.union.writer_of(layer)
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
        if same_layer and all(stat.S_IFMT(kinds[ino & MASK].mode if ino & MASK in kinds
                                          else x.mode) == stat.S_IFMT(x.mode)
                              for ino, x in known.items()):
            before = {ino: _attributes(x) for ino, x in known.items()}
            self.drop_tree(layer)
            self.union.layers[wid] = layer
            self.add_tree(wdir, scan, ident, layer, built)
            for ino, was in before.items():
                x = self.ns.inodes.get(ino)
                if x is not None and x.layer == layer and _attributes(x) != was:
                    view.dirty.add(ino)
                    view.changed.append((INODE, ino))
            return layer
        self.drop_tree(layer)
        view.renumbered_dirs.update(
            ino for ino, x in known.items() if x.children is not None and ino in view.gone)
        return self.add_tree(wdir, scan, ident, built=built)

    # ------------------------------------------------------------ index tails
    def apply_group(self, layer: int, group: list, when: int) -> list:
        """One commit group read from the tail of another writer's index. Returns its EXTENT
        and XEXTENT records (the reader drops what it cached of those log ranges) and its
        RETIRE records (the reader lets go of those logs)."""
        view, whiteouts = self.view, self.whiteouts
        t = self.trees[layer]
        wid = self.union.writer_of(layer)
        whiteouts.trees_changed()
        touched = Touched()
        first_x = len(t.xunlinks)
        leaving = whiteouts.leaving(t, wid, group)
        apply_group(t, group, when, wid, self.union.warnings, touched)
        if when > self.max_stamp:
            self.max_stamp = when
        whiteouts.forget(wid, t, leaving)
        for rec in t.xunlinks[first_x:]:
            self._whiteout(rec)
        for ino in touched.inos:
            x = self.ns.inodes.get((layer << LAYER_SHIFT) | ino)
            s = t.inodes.get(ino)
            if x is not None and s is not None and x.layer == layer:
                show(x, s)
                if x.lookups > 0 or x.opens > 0:
                    view.dirty.add(x.ino)
                    view.changed.append((INODE, x.ino))
        for parent, name in touched.names:
            self._touch(layer, parent, name)
        view.adopt_pending()
        return touched.runs

    def _whiteout(self, rec) -> None:
        """A whiteout another writer's tree brought: recorded, and the entry it hides looked
        at again."""
        layer = self.view.whiteout(rec)
        if layer:
            self._touch(layer, rec.parent, rec.name)

    def _touch(self, layer: int, parent: int, name: bytes) -> None:
        """Entry `name` of directory `parent` in writer `layer`'s tree changed: the view
        follows where that directory is merged."""
        wid = self.union.writer_of(layer)
        view = self.view
        v = view.placed.get((layer, parent))
        if v is not None:
            view.remerge(v, name, True)
        # a whited-out directory that has become empty (or not) changes its own entry, and
        # so on up (a whiteout may name it at any place it has been)
        wo_dirs = self.whiteouts.wo_dirs
        todo, seen = [parent], set()
        while todo and len(seen) < 4096:
            d = todo.pop()
            for up in wo_dirs.get((wid, d), ()):
                if up in seen:
                    continue
                seen.add(up)
                v = view.placed.get((layer, up[0]))
                if v is not None:
                    view.remerge(v, up[1], True)
                todo.append(up[0])


def load_foreign(ns: Namespace, backing: str, own_writer: str | None, union: Union,
                 only: str | None = None) -> Peers:
    """The writers of `backing` read, their view over `ns` (own_writer's tree is `ns` itself;
    None: every writer's tree is read, as the offline tools do; made with the union's writer
    layers: Peers). `union.conflicts` lists the paths where versions conflict."""
    peers = Peers(ns, union, backing, own_writer)
    peers.load(only)
    union.conflicts = peers.view.conflict_list()
    return peers
