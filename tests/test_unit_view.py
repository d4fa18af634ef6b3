"""The view of many writers (view.View) is a function of their records, not of the order a
mount reads them in (peers.Peers): random histories of three writers (mkdir, create, unlink,
rename in their own trees at a few shared names, and whiteouts of each other's entries), read
whole by a fresh view and, by another, one commit group at a time in a random interleaving of
the writers (as a mount reads their index tails), give the same tree. No mount: the indexes
are written by hand into a backing directory."""

from __future__ import annotations

import os
import random

import pytest
from helpers import view_shape

from ckptfs.format import backingdir, records
from ckptfs.format.records import (
    CommitRec,
    ExtentRec,
    InodeRec,
    RenameRec,
    UnlinkRec,
    XUnlinkRec,
)
from ckptfs.namespace import ROOT_INO, Namespace
from ckptfs.peers import Peers, load_foreign
from ckptfs.replay import replay
from ckptfs.view import Union, View

WRITERS = ("w0", "w1", "w2")
NAMES = [b"a", b"b", b"c", b"d"]


class History:
    """Random changes of the writers, as commit groups, checked against each writer's tree."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.trees = {w: Namespace(now_ns=0) for w in WRITERS}
        self.groups: dict[str, list[tuple[list, int]]] = {w: [] for w in WRITERS}
        self.stamp = 10**18

    def entries(self, w: str):
        t = self.trees[w]
        return [(d.ino, n, i) for d in t.inodes.values() if d.children
                for n, i in d.children.items()]

    def dirs(self, w: str):
        return [d for d in self.trees[w].inodes.values() if d.children is not None]

    def step(self) -> None:
        rng, w = self.rng, self.rng.choice(WRITERS)
        t = self.trees[w]
        kind = rng.choice(["mkdir", "mkdir", "create", "create", "unlink", "rename", "xunlink",
                           "xunlink"])
        recs: list = []
        if kind in ("mkdir", "create"):
            d = rng.choice(self.dirs(w))
            name = rng.choice(NAMES)
            if name in d.children:
                return
            ino = t.new_ino()
            mode = 0o40755 if kind == "mkdir" else 0o100644
            recs.append(InodeRec(ino, d.ino, name, mode, 0, 0, 0, 1, 1, 1))
            if kind == "create":
                recs.append(ExtentRec(ino, 0, 10, 1, records.DATA_HEADER_BYTES + 10 * ino, 7))
        elif kind == "unlink":
            es = [e for e in self.entries(w) if not t.inodes[e[2]].children]
            if not es:
                return
            p, n, _ = rng.choice(es)
            recs.append(UnlinkRec(p, n))
        elif kind == "rename":
            es = self.entries(w)
            if not es:
                return
            p, n, i = rng.choice(es)
            d = rng.choice(self.dirs(w))
            new = rng.choice(NAMES)
            x = t.inodes[i]
            if new in d.children or (x.is_dir and t.is_ancestor(x, d)):
                return
            recs.append(RenameRec(p, n, d.ino, new))
        else:
            other = rng.choice([o for o in WRITERS if o != w])
            es = self.entries(other)
            if not es:
                return
            p, n, i = rng.choice(es)
            recs.append(XUnlinkRec(other, p, i, n))
        for r in recs:
            t.apply(r)
        self.stamp += rng.randrange(1, 10**9)
        self.groups[w].append((recs, self.stamp))

    def write(self, backing: str) -> None:
        os.makedirs(os.path.join(backing, backingdir.WRITERS_DIR))
        for w in WRITERS:
            wdir = os.path.join(backing, backingdir.WRITERS_DIR, w)
            os.makedirs(wdir)
            with open(os.path.join(wdir, backingdir.data_log_name(1)), "wb") as f:
                f.truncate(1 << 30)  # (sparse: every extent lies inside it)
            blob = [records.index_header(records.CROSS_INDEX_VERSION)]
            for seq, (recs, stamp) in enumerate(self.groups[w], 1):
                blob += [records.encode(r) for r in recs] + [records.encode(CommitRec(seq,
                                                                                     stamp))]
            with open(os.path.join(wdir, backingdir.INDEX_NAME), "wb") as f:
                f.write(b"".join(blob))


def written_history(rng: random.Random, tmp_path) -> tuple[History, str]:
    """A random history of 20-70 steps, its indexes written into a backing directory."""
    h = History(rng)
    for _ in range(rng.randrange(20, 70)):
        h.step()
    backing = str(tmp_path / "backing")
    h.write(backing)
    return h, backing


@pytest.mark.parametrize("seed", range(100))
def test_the_view_does_not_depend_on_the_order_it_reads_the_writers_in(tmp_path, seed):
    rng = random.Random(seed)
    h, backing = written_history(rng, tmp_path)
    fresh = load_foreign(Namespace(now_ns=0), backing, None, Union())
    # one group at a time, the writers interleaved at random (each in its own order)
    live = Peers(Namespace(now_ns=0), Union(), backing, None)
    layers = {}
    for w in WRITERS:
        wdir = os.path.join(backing, backingdir.WRITERS_DIR, w)
        layers[w] = live.add_tree(wdir, records.IndexScan(), (0, 0))
    pending = {w: list(h.groups[w]) for w in WRITERS}
    while any(pending.values()):
        w = rng.choice([w for w in WRITERS if pending[w]])
        recs, stamp = pending[w].pop(0)
        live.apply_group(layers[w], recs, stamp)
    assert view_shape(live.view) == view_shape(fresh.view), seed
    assert sorted(c.path for c in live.view.conflict_list()) == \
        sorted(c.path for c in fresh.view.conflict_list()), (live.view.conflict_list(),
                                                             fresh.view.conflict_list())
    assert not [w for w in fresh.union.warnings if "skipped" in w]


@pytest.mark.parametrize("seed", range(100, 160))
def test_the_own_writer_carries_out_the_same_whiteouts_in_any_order(tmp_path, seed):
    """The same, seen by a mount of w0: its own tree is what it is, the other writers come
    one group at a time, and what they removed of w0's tree leaves it (w0 carries their
    whiteouts out), as when it mounts after all of them."""
    rng = random.Random(seed)
    h, backing = written_history(rng, tmp_path)
    own_index = os.path.join(backing, backingdir.WRITERS_DIR, "w0", backingdir.INDEX_NAME)

    def own_view() -> Peers:
        union = Union()
        ns = Namespace(now_ns=0, layer_of=union.layer_of)
        peers = Peers(ns, union, backing, "w0")
        peers.union.writer_dirs[0] = os.path.dirname(own_index)
        replay(ns, own_index)
        return peers
    fresh = own_view()
    fresh.load()
    fresh.view.adopt_pending()
    live = own_view()
    live.load(only="-")  # (no other writer yet: the own tree and its whiteouts, as a mount)
    layers = {w: live.add_tree(os.path.join(backing, backingdir.WRITERS_DIR, w),
                               records.IndexScan(), (0, 0)) for w in WRITERS[1:]}
    live.view.adopt_pending()
    pending = {w: list(h.groups[w]) for w in WRITERS[1:]}
    while any(pending.values()):
        w = rng.choice([w for w in WRITERS[1:] if pending[w]])
        recs, stamp = pending[w].pop(0)
        live.apply_group(layers[w], recs, stamp)
    assert view_shape(live.view) == view_shape(fresh.view), seed


def test_what_the_view_keeps_of_a_removed_entry_goes_once_the_kernel_forgot_it(tmp_path):
    """An entry another writer removes is stale for the kernel only while the kernel still
    knows its inode: the view keeps nothing of one it never looked up, and drops what it
    kept once the kernel forgets it (a job on several nodes removes files all day)."""
    backing = str(tmp_path / "backing")
    wdir = os.path.join(backing, backingdir.WRITERS_DIR, "w1")
    os.makedirs(wdir)
    peers = Peers(Namespace(now_ns=0), Union(), backing, "w0")
    view = peers.view
    layer = peers.add_tree(wdir, records.IndexScan(), (0, 0))
    peers.apply_group(layer, [InodeRec(2, 1, b"seen", 0o100644, 0, 0, 0, 1, 1, 1),
                              InodeRec(3, 1, b"unseen", 0o100644, 0, 0, 0, 1, 1, 1)], 10)
    ns = view.ns
    seen = ns.inodes[ns.inodes[ROOT_INO].children[b"seen"]]
    seen.lookups = 1  # (the kernel looked it up)
    peers.apply_group(layer, [UnlinkRec(1, b"seen"), UnlinkRec(1, b"unseen")], 11)
    assert ns.inodes[ROOT_INO].children == {}
    assert view.gone == {seen.ino}  # an open of it is stale; of the other nothing is kept
    seen.lookups = 0
    ns.maybe_forget(seen)
    view.forgotten(seen.ino)
    assert view.gone == set() and seen.ino not in ns.inodes


def numbers_of(view: View, w: str) -> set[int]:
    """The view's inode numbers of writer w's entries in the tree."""
    layer = view.union.layers[w]
    return {ino for ino, x in view.ns.inodes.items()
            if x.layer == layer and (x.nlink > 0 or x.is_dir and ino in view.names)}


@pytest.mark.parametrize("seed", range(200, 260))
def test_a_rewritten_index_read_again_gives_the_same_view_and_numbers(tmp_path, seed):
    """Another writer's index rewritten (an index snapshot: the same tree in another file,
    with what it committed since) is read whole again, its old tree dropped from the view
    (directories at every depth) and the new one merged in: the view is the one a fresh
    mount builds, and an entry the kernel knows keeps its number (a directory it holds
    a name of stays valid for a LOOKUP in it)."""
    rng = random.Random(seed)
    h, backing = written_history(rng, tmp_path)
    fresh = load_foreign(Namespace(now_ns=0), backing, None, Union())
    live = Peers(Namespace(now_ns=0), Union(), backing, None)
    layers = {w: live.add_tree(os.path.join(backing, backingdir.WRITERS_DIR, w),
                               records.IndexScan(), (0, 0)) for w in WRITERS}
    pending = {w: list(h.groups[w]) for w in WRITERS}
    applied: dict[str, list] = {w: [] for w in WRITERS}
    rewrites = rng.randrange(1, 4)
    while any(pending.values()):
        w = rng.choice([w for w in WRITERS if pending[w]])
        applied[w].append(pending[w].pop(0))
        live.apply_group(layers[w], *applied[w][-1])
        if rewrites and rng.random() < 0.15:
            rewrites -= 1
            w = rng.choice(WRITERS)  # its index rewritten, with groups not read yet
            k = rng.randrange(len(pending[w]) + 1)
            applied[w] += pending[w][:k]
            del pending[w][:k]
            for x in live.ns.inodes.values():
                x.lookups = 1  # (the kernel knows every entry)
            before = numbers_of(live.view, w)
            scan = records.IndexScan(groups=[g for g, _ in applied[w]],
                                     group_times=[t for _, t in applied[w]])
            wdir = os.path.join(backing, backingdir.WRITERS_DIR, w)
            assert live.reload_tree(layers[w], wdir, scan, (0, 0)) == layers[w]
            after = numbers_of(live.view, w)
            assert not after & live.view.gone, seed  # (kept or new: the kernel's are valid)
            assert before - after <= live.view.gone, seed  # (those it lost are stale)
    assert view_shape(live.view) == view_shape(fresh.view), seed
    assert sorted(c.path for c in live.view.conflict_list()) == \
        sorted(c.path for c in fresh.view.conflict_list())


DEEP = 2000


def chain(levels: int, top: int = 1) -> list:
    """mkdir d/d/d/... `levels` deep below directory `top` (inodes top+1 ...), a file f at the
    bottom."""
    recs = [InodeRec(top + 1 + i, top + i, b"d", 0o40755, 0, 0, 0, 1, 1, 1)
            for i in range(levels)]
    return recs + [InodeRec(top + 1 + levels, top + levels, b"f", 0o100644, 0, 0, 0, 1, 1, 1)]


def depth_of(view: View) -> tuple[int, bool]:
    """How many directories d/d/... the view has from its root down, and whether f is in the
    last one."""
    ns, x, n = view.ns, view.ns.inodes[ROOT_INO], 0
    while b"d" in x.children:
        x, n = ns.inodes[x.children[b"d"]], n + 1
    return n, b"f" in x.children


def test_a_tree_thousands_of_levels_deep_comes_and_goes(tmp_path):
    """Another writer's tree 2,000 directories deep: built, merged, removed by whiteouts of a
    third writer (from the bottom up, as `rm -r` does), carried out by its own writer, and
    dropped, without a recursion per level (Python stops near 1,000 of them)."""
    backing = str(tmp_path / "backing")
    wdirs = {w: os.path.join(backing, backingdir.WRITERS_DIR, w) for w in ("w1", "w2")}
    for d in wdirs.values():
        os.makedirs(d)
    recs = chain(DEEP)
    bottom = recs[-1].ino
    removal = [XUnlinkRec("w1", DEEP + 1, bottom, b"f")] + \
        [XUnlinkRec("w1", 1 + i, 2 + i, b"d") for i in reversed(range(DEEP))]
    # one commit group at a time, as a mount's looks read them
    peers = Peers(Namespace(now_ns=0), Union(), backing, None)
    l1, l2 = (peers.add_tree(wdirs[w], records.IndexScan(), (0, 0)) for w in ("w1", "w2"))
    peers.apply_group(l1, recs, 10)
    assert depth_of(peers.view) == (DEEP, True)
    peers.apply_group(l2, removal[:DEEP // 2], 11)  # (f and the lowest directories)
    assert depth_of(peers.view) == (DEEP - DEEP // 2 + 1, False)
    peers.apply_group(l2, removal[DEEP // 2:], 12)
    assert peers.ns.inodes[ROOT_INO].children == {}
    # a deep tree that leaves the view (its writer's directory gone), or is read again
    peers = Peers(Namespace(now_ns=0), Union(), backing, None)
    l1 = peers.add_tree(wdirs["w1"], records.IndexScan(), (0, 0))
    peers.apply_group(l1, recs, 10)
    for x in peers.ns.inodes.values():
        x.lookups = 1
    assert peers.reload_tree(l1, wdirs["w1"], records.IndexScan(groups=[recs],
                                                                  group_times=[10]), (0, 0)) == l1
    assert depth_of(peers.view) == (DEEP, True) and not peers.view.gone
    peers.drop_tree(l1)
    assert peers.ns.inodes[ROOT_INO].children == {} and len(peers.view.gone) == DEEP + 1
    # read whole, as a mount does, and by its own writer, which carries the removal out
    h = {"w1": [(recs, 10)], "w2": [(removal, 11)]}
    for w, groups in h.items():
        blob = [records.index_header(records.CROSS_INDEX_VERSION)]
        for seq, (g, stamp) in enumerate(groups, 1):
            blob += [records.encode(r) for r in g] + [records.encode(CommitRec(seq, stamp))]
        with open(os.path.join(wdirs[w], backingdir.INDEX_NAME), "wb") as f:
            f.write(b"".join(blob))
    whole = load_foreign(Namespace(now_ns=0), backing, None, Union())
    assert whole.ns.inodes[ROOT_INO].children == {}
    # (the top one, with all below it)
    assert whole.whiteouts.carry_out(whole.union.layers["w1"]) == 1
    assert whole.trees[whole.union.layers["w1"]].inodes.keys() == {ROOT_INO}
    union = Union()
    ns = Namespace(now_ns=0, layer_of=union.layer_of)
    own = Peers(ns, union, backing, "w1")
    own.union.writer_dirs[0] = wdirs["w1"]
    replay(ns, os.path.join(wdirs["w1"], backingdir.INDEX_NAME))
    own.load()
    own.view.adopt_pending()
    assert ns.inodes[ROOT_INO].children == {} and len(ns.inodes) == 1
