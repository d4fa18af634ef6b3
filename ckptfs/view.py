"""The union of writers: one view of every writer's tree.

Every writer (one per mount that writes, on any host) owns `writers/<id>/` in the backing
directory and never touches another writer's files. A mount (and `ckptfs ls`/`verify`) shows
the union of all writers' trees, built when it mounts:

1. its own writer's index is replayed into the live namespace (layer 0, writable: replay.py);
2. every other writer's index is replayed into a namespace of its own (layers 1.., in writer-id
   order: peers.py) and grafted onto the live tree by path: directories that exist in several
   writers merge; where two writers have a non-directory (or a directory and a file) at the
   same path, the later commit wins (the COMMIT time of the group that last changed the
   entry; ties go to the greater writer id). `conflicts` lists every such path.

Grafted entries keep their data where it is (runs carry their layer; the reader opens that
writer's logs). They are read-only in the mount (EROFS) except that new entries may be created
inside a grafted directory: the directory is then adopted into the own writer ("copy-up").
The trio thread owns the view. Three parts, each a module:

- view.py (`View`): the merged tree: which version shows at a name (the conflict rule), its
  lookups, and what this mount removes of it;
- peers.py (`Peers`): the other writers' indexes read into trees and followed as they grow
  (fuse/refresh.py reads their tails in a worker thread; `Peers.apply_group` applies them
  one commit group at a time);
- whiteouts.py (`Whiteouts`): the other writers' entries a writer removed, and what they hide.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptfs.datapath.staging import ExtentMap
from ckptfs.format.records import RenameRec, UnlinkRec, XUnlinkRec
from ckptfs.namespace import ROOT_INO, Inode, Namespace

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

    def layer_of(self, writer: str) -> int | None:
        return self.layers.get(writer)

    def writer_of(self, layer: int) -> str:
        return self.writer_ids.get(layer, "")


INF = 1 << 63  # the stamp of an own change not committed yet: it commits after all seen
ENTRY = 1  # kernel invalidations View.changed collects: (ENTRY, directory ino, name)
INODE = 2  # (INODE, ino): attributes and cached data
MASK = (1 << LAYER_SHIFT) - 1  # a view inode number -> the number in its writer's tree


def show(x: Inode, s: Inode) -> None:
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


def resolve(cands: list, writer_of) -> tuple:
    """The conflict rule, over the versions at one name (View._candidates: (layer, inode,
    directory), the own one first, then by layer): directories merge; otherwise the greater
    (commit stamp, writer id) wins, an own entry not committed yet counting as newest.
    Returns the winner (None: no version), the directories that merge with it (none for a
    file) and the versions it hides."""
    def key(c) -> tuple[int, str]:
        layer, s, _ = c
        return (s.commit_ns or INF) if layer == 0 else s.commit_ns, writer_of(layer)
    occ, group, losers = None, [], []
    for c in cands:
        if occ is None:
            occ, group = c, ([c] if c[1].is_dir else [])
        elif group and c[1].is_dir:
            group.append(c)
        elif key(c) > key(occ):
            losers += group or [occ]
            occ, group = c, ([c] if c[1].is_dir else [])
        else:
            losers.append(c)
    return occ, group, losers


class View:
    """The union of the writers as one tree.

    Each other writer's tree (`trees[layer]`) is built from its own index and only from it
    (peers.Peers); `ns` holds this mount's own tree (layer 0; empty for read-only mounts and
    offline tools) and the merged view: each directory of the view maps a name to the version
    that wins there, and `members` says which directories of other writers it merges. The
    view at a name is a function of the trees and of the whiteouts (XUNLINK records: another
    writer's entry removed; whiteouts.Whiteouts), so applying the records in any order ends
    in the same view:

    - candidates are the own entry at that name and each member directory's entry, minus the
      whited-out ones (a whited-out directory only while nothing inside it is visible);
    - directories merge; otherwise the greater (commit stamp, writer id) wins (an own entry
      not committed yet counts as newest), the others are listed in `conflicts`;
    - a whiteout of an own entry is carried out by the own writer (an UNLINK of its own).

    Entries of other writers get inode numbers layer << 44 | their number. `changed`
    collects what the kernel must forget (it caches entries and attributes) and `gone` the
    inodes that left the view by another writer's change (an open of one is stale)."""

    def __init__(self, ns: Namespace, union: Union, trees: dict[int, Namespace], whiteouts,
                 own: str | None) -> None:
        self.ns = ns
        self.union = union
        self.trees = trees  # layer -> another writer's tree (peers.Peers installs them)
        self.whiteouts = whiteouts  # whiteouts.Whiteouts of those trees and the own one
        self.own = own
        self.root = ns.inodes[ROOT_INO]
        self.members: dict[Inode, dict[int, int]] = {self.root: {}}
        self.placed: dict[tuple[int, int], Inode] = {}  # (layer, its dir) -> view directory
        self.hidden_own: dict[tuple[Inode, bytes], int] = {}  # own entries a conflict hides
        self.conflicts: dict[tuple[Inode, bytes], list[tuple[int, Inode]]] = {}
        self.names: dict[int, tuple[Inode, bytes]] = {}  # view ino -> where it is (one name)
        self.gone: set[int] = set()
        # directories the kernel knows that left the view because their writer's tree was read
        # again under new numbers (they are still there, under another number)
        self.renumbered_dirs: set[int] = set()
        self.dirty: set[int] = set()  # changed by another writer since the kernel saw them
        self.changed: list[tuple] = []
        self.adopt: list[XUnlinkRec] = []  # whiteouts of own entries, to carry out
        # Directories whose members are yet to be merged (_later), and whether a merge or
        # carrying out of whiteouts is under way: the walks down a tree (a directory that
        # appears or goes, every level of it) and up it (whiteouts of directories carried out
        # as they empty) take their next step from a list, not a call deeper, so a tree of
        # any depth goes through (a recursion would stop near 1,000 levels, half applied)
        self._todo: list[tuple[Inode, dict[int, int], bool]] = []
        self._merging = False
        self._adopting = False

    def whiteout(self, rec: XUnlinkRec) -> int | None:
        """A whiteout read or made: recorded, and one of an own entry queued for the own
        writer to carry out (adopt_pending). Returns the layer of the entry it hides when
        that writer's tree is in the view (Whiteouts.add)."""
        layer = self.whiteouts.add(rec)
        if layer == 0 and self.own:
            self.adopt.append(rec)
        return layer

    # ------------------------------------------------------------ whiteouts of own entries
    def _own_children(self, d: Inode) -> bool:
        inodes = self.ns.inodes
        if any(inodes[c].layer == 0 for c in d.children.values()):
            return True
        return any(k[0] is d for k in self.hidden_own)

    def adopt_pending(self) -> None:
        """Carry out other writers' whiteouts of own entries found so far (a read-write
        mount): an UNLINK of the own writer (journaled), so the own tree, its index and its
        space accounting agree with the view. One carried out may let the next one up apply
        (own_removed): it joins the list this loop works through."""
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
            self.whiteouts.forget(self.own, self.ns, [x.ino])
        self.own_removed(p)

    def own_removed(self, d: Inode) -> None:
        """An own entry left own directory d: a whiteout waiting for d to empty may apply."""
        ups = self.whiteouts.wo_dirs.get((self.own or "", d.ino))
        if ups and not self._own_children(d):
            for up in ups:
                self.adopt.append(XUnlinkRec(self.own or "", up[0], d.ino, up[1]))
            self.adopt_pending()

    # ------------------------------------------------------------ removals by this mount
    def whiteout_foreign(self, layer: int, parent: int, s: Inode, name: bytes) -> None:
        """This writer removes another writer's entry (an XUNLINK record, journaled)."""
        rec = XUnlinkRec(self.union.writer_of(layer), parent, s.ino, name)
        self.ns.change(rec)
        self.whiteout(rec)

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
        self.set_members(d, {}, fresh=False)

    def run_writer(self, run) -> str:
        """The writer whose data log holds `run`."""
        return self.union.writer_of(run.layer)

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
            if self.whiteouts.wo and self.whiteouts.whited(layer, parent, s, name):
                continue
            out.append((layer, s, parent))
        return out

    def versions(self, v: Inode, name: bytes) -> list[tuple[int, Inode, int]]:
        """Every version at `name` in view directory v (the visible one and those a conflict
        hides): what an unlink, rmdir, or rename over or away from the name removes."""
        return self._candidates(v, name)

    def remerge(self, v: Inode, name: bytes, notify: bool) -> None:
        """Make v's entry `name` what the trees and whiteouts say it is."""
        cands = self._candidates(v, name)
        win, group, losers = resolve(cands, self.union.writer_of)
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
                  and members.get(cur.layer) == cur.ino & MASK):
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
        show(x, s)
        return x

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
        self.renumbered_dirs.discard(ino)
        if self.own:
            self.whiteouts.forget(self.own, self.ns, [ino])

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
        """set_members(d, ...), now when no merge is under way, else by the one that is,
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
                self.set_members(d, members, fresh)
        except BaseException:
            self._todo.clear()
            raise
        finally:
            self._merging = False

    def set_members(self, d: Inode, members: dict[int, int], fresh: bool) -> None:
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
                if d.layer == layer and d.ino & MASK == src:
                    show(d, s)
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
        wo = self.whiteouts
        for layer, src in self.members.get(d, {}).items():
            t = self.trees.get(layer)
            s = t.inodes.get(src) if t is not None else None
            if s is None or s.children is None:
                continue
            inodes = t.inodes
            for name, si in s.children.items():
                c = inodes[si]
                if wo.wo and wo.whited(layer, src, c, name):
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
        self.renumbered_dirs.discard(old)

    def conflict_list(self) -> list[Conflict]:
        out = []
        for (v, name), vs in self.conflicts.items():
            path = self.ns.path_of(v.ino).rstrip("/") + "/" + name.decode(
                errors="surrogateescape")
            out.append(Conflict(path, [(self.union.writer_of(layer), s.commit_ns)
                                       for layer, s in vs]))
        return out
