"""Replay and the union of writers.

Every writer (one per mount that writes, on any host) owns `writers/<id>/` in the backing
directory and never touches another writer's files. A mount (and `ckptfs ls`/`verify`) shows
the union of all writers' trees, built when it mounts:

1. its own writer's index is replayed into the live namespace (layer 0, writable);
2. every other writer's index is replayed into a namespace of its own (layers 1.., in writer-id
   order) and grafted onto the live tree by path: directories that exist in several writers
   merge; where two writers have a non-directory (or a directory and a file) at the same path,
   the later commit wins (the COMMIT time of the group that last changed the entry; ties go to
   the greater writer id). `conflicts` lists every such path.

Grafted entries keep their data where it is (runs carry their layer; the reader opens that
writer's logs). They are read-only in the mount (EROFS) except that new entries may be created
inside a grafted directory: the directory is then adopted into the own writer ("copy-up").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ckptfs.format import backingdir, records
from ckptfs.format.records import (
    ExtentRec,
    FormatError,
    InodeRec,
    LinkRec,
    RenameRec,
    SetattrRec,
    SizeRec,
)
from ckptfs.namespace import ROOT_INO, Inode, Namespace

LAYER_SHIFT = 44  # foreign inode number = layer << LAYER_SHIFT | the writer's own number


def replay(ns: Namespace, index_path: str) -> tuple[int, int, list[str]]:
    """Apply an index to `ns`. Returns (last commit sequence, valid bytes, warnings). Records
    that do not fit the tree (a hostile or damaged index) are skipped with a warning. Each
    inode's `commit_ns` is set to the time of the last commit that changed it."""
    backingdir.refresh_attributes(os.path.dirname(index_path) or ".")
    scan = records.read_index(index_path)
    warnings = list(scan.warnings)
    for group, when in zip(scan.groups, scan.group_times):
        for rec in group:
            t = type(rec)
            try:
                target = None
                if t is RenameRec:
                    parent = ns.inodes.get(rec.old_parent)
                    if parent is not None and parent.children is not None:
                        target = parent.children.get(rec.old_name)
                ns.apply(rec)
                if t in (InodeRec, ExtentRec, SetattrRec, SizeRec, LinkRec):
                    target = rec.ino
                if target is not None and target in ns.inodes:
                    ns.inodes[target].commit_ns = when
            except FormatError as exc:
                warnings.append(f"{index_path}: record skipped: {exc}")
    return scan.last_seq, scan.valid_bytes, warnings


def validate_extents(ns: Namespace, writer_dir: str, layer: int = 0) -> list[str]:
    """Extents that point past the end of their data log (or at a missing log) are dropped so
    the index never points at garbage; each is reported."""
    sizes = {n: os.path.getsize(p) for n, p in backingdir.data_logs(writer_dir).items()}
    warnings = []
    for x in list(ns.inodes.values()):
        if x.emap is None:
            continue
        bad = [p for p in x.emap.pieces if p[2].layer == layer and p[2].seg is None and
               (p[2].log not in sizes or p[2].loff + p[2].length > sizes[p[2].log])]
        for p in bad:
            what = ("lies in a log the index retired (its live data was moved or deleted "
                    "before)") if p[2].log in ns.retired else "lies beyond the log"
            warnings.append(f"{writer_dir}: inode {x.ino} ({ns.path_of(x.ino)}): extent at data "
                            f"log {p[2].log} offset {p[2].loff} {what}; dropped")
            x.emap.punch(p[0], p[0] + p[1])
    return warnings


@dataclass
class Conflict:
    path: str
    versions: list[tuple[str, int]]  # (writer id, commit time ns), winner first


@dataclass
class Union:
    """The writers of a backing directory, as layers of one namespace."""

    writer_dirs: dict[int, str] = field(default_factory=dict)  # layer -> writer directory
    writer_ids: dict[int, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    conflicts: list[Conflict] = field(default_factory=list)


def load_foreign(ns: Namespace, backing: str, own_writer: str | None, union: Union,
                 first_layer: int = 1, only: str | None = None) -> None:
    """Replay every writer except `own_writer` (or just `only`) and graft it onto `ns`."""
    layer = first_layer
    for wdir in backingdir.writer_dirs(backing):
        wid = os.path.basename(wdir)
        if wid == own_writer or (only is not None and wid != only):
            continue
        index = os.path.join(wdir, backingdir.INDEX_NAME)
        fns = Namespace(now_ns=0)
        fns.layer = layer
        try:
            if os.path.exists(index):
                _, _, w = replay(fns, index)
                union.warnings += w
        except FormatError as exc:
            union.warnings.append(f"writer {wid} skipped: {exc}")
            continue
        union.warnings += validate_extents(fns, wdir, layer)
        union.writer_dirs[layer] = wdir
        union.writer_ids[layer] = wid
        graft(ns, fns, layer, union)
        layer += 1


def graft(ns: Namespace, src: Namespace, layer: int, union: Union) -> None:
    clones: dict[int, Inode] = {}
    root = ns.inodes[ROOT_INO]
    _merge_dir(ns, root, src, src.inodes[ROOT_INO], layer, union, clones, "")


def _writer_of(x: Inode, union: Union) -> str:
    return union.writer_ids.get(x.layer, "")


def _merge_dir(ns: Namespace, dst: Inode, src_ns: Namespace, src: Inode, layer: int,
               union: Union, clones: dict[int, Inode], path: str) -> None:
    for name, sino in sorted(src.children.items()):
        s = src_ns.inodes[sino]
        p = f"{path}/{name.decode(errors='surrogateescape')}"
        cur_ino = dst.children.get(name)
        if cur_ino is None:
            dst.children[name] = _clone(ns, dst, s, src_ns, layer, union, clones, p).ino
            continue
        cur = ns.inodes[cur_ino]
        if cur.is_dir and s.is_dir:
            _merge_dir(ns, cur, src_ns, s, layer, union, clones, p)
            continue
        mine = (s.commit_ns, union.writer_ids.get(layer, ""))
        theirs = (cur.commit_ns, _writer_of(cur, union))
        if mine > theirs:
            winner, loser = mine, theirs
            _hide(ns, dst, name)
            dst.children[name] = _clone(ns, dst, s, src_ns, layer, union, clones, p).ino
        else:
            winner, loser = theirs, mine
        union.conflicts.append(Conflict(p, [(winner[1], winner[0]), (loser[1], loser[0])]))


def _hide(ns: Namespace, parent: Inode, name: bytes) -> None:
    """Take an entry out of the view (a conflict it lost); its own index is untouched."""
    x = ns.inodes[parent.children.pop(name)]
    if x.is_dir:
        parent.nlink -= 1


def _clone(ns: Namespace, parent: Inode, s: Inode, src_ns: Namespace, layer: int, union: Union,
           clones: dict[int, Inode], path: str) -> Inode:
    if s.ino in clones:  # a hard link inside the other writer's tree
        x = clones[s.ino]
        x.nlink += 1
        return x
    x = Inode((layer << LAYER_SHIFT) | s.ino, s.mode, s.uid, s.gid, s.rdev, s.atime_ns,
              s.mtime_ns, s.ctime_ns, s.target)
    x.layer = layer
    x.commit_ns = s.commit_ns
    x.size = s.size
    x.emap = s.emap
    x.nlink = 1
    clones[s.ino] = x
    ns.inodes[x.ino] = x
    if s.is_dir:
        x.nlink = 2
        x.parent = parent.ino
        parent.nlink += 1
        _merge_dir(ns, x, src_ns, s, layer, union, clones, path)
    return x
