"""Replay: a writer's index into a namespace.

`replay` applies the own writer's index to the live namespace at mount (and the offline tools'
trees); `apply_group` applies one commit group, the function the view (peers.py) and the index
snapshot (datapath/mover.py) use too, and records go through `Namespace.apply`, the function
the live handlers use. Replay distrusts its input: a record that does not fit the tree is
skipped with a warning, and `validate_extents` drops extents past their data log's end.
`read_writer` and `read_tail` read a writer's index whole or the commit groups appended
since a byte offset (peers.py reads other writers' indexes so, fuse/refresh.py their tails).
"""

from __future__ import annotations

import contextlib
import gc
import os

from ckptfs.format import backingdir, records
from ckptfs.format.records import (
    ExtentRec,
    FormatError,
    InodeRec,
    LinkRec,
    RenameRec,
    RetireRec,
    SetattrRec,
    SizeRec,
    UnlinkRec,
    XExtentRec,
)
from ckptfs.namespace import Namespace



@contextlib.contextmanager
def bulk_load():
    """The cyclic garbage collector paused while a tree is built: a replay allocates a few
    objects per record and frees none, so each collection would walk the tree built so far
    for nothing (a third of the replay of 100,000 files; docs/performance-notes.md)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def replay(ns: Namespace, index_path: str) -> tuple[int, int, list[str]]:
    """Apply an index to `ns`. Returns (last commit sequence, valid bytes, warnings). Records
    that do not fit the tree (a hostile or damaged index) are skipped with a warning. Each
    inode's `commit_ns` is set to the time of the last commit that changed it."""
    backingdir.refresh_attributes(os.path.dirname(index_path) or ".")
    warnings: list[str] = []
    with bulk_load():
        scan = records.read_index(
            index_path, lambda group, when: apply_group(ns, group, when, index_path, warnings))
    return scan.last_seq, scan.valid_bytes, scan.warnings + warnings


_INODE_TARGET = frozenset((InodeRec, ExtentRec, SetattrRec, SizeRec, LinkRec, XExtentRec))


def apply_group(ns: Namespace, group: list, when: int, where: str, warnings: list[str],
                touched: "Touched | None" = None) -> None:
    """Apply one commit group (COMMIT stamp `when`) to `ns`, setting the `commit_ns` of each
    inode it changes; `touched` collects the directory entries and inodes it changed."""
    inodes = ns.inodes
    for rec in group:
        t = type(rec)
        try:
            if touched is None and t in _INODE_TARGET:  # (most records, replay's loop)
                ns.apply(rec)
                x = inodes.get(rec.ino)
                if x is not None:
                    x.commit_ns = when
                continue
            target = None
            if t is RenameRec:
                parent = ns.inodes.get(rec.old_parent)
                if parent is not None and parent.children is not None:
                    target = parent.children.get(rec.old_name)
                if touched is not None:
                    touched.names.add((rec.old_parent, rec.old_name))
                    touched.names.add((rec.new_parent, rec.new_name))
            elif touched is not None and t in (InodeRec, LinkRec, UnlinkRec):
                touched.names.add((rec.parent, rec.name))
            ns.apply(rec)
            if t in _INODE_TARGET:
                target = rec.ino
                if touched is not None and t in (ExtentRec, XExtentRec):
                    touched.runs.append(rec)
            elif t is RetireRec and touched is not None:
                touched.runs.append(rec)
            if target is not None and target in inodes:
                inodes[target].commit_ns = when
                if touched is not None:
                    touched.inos.add(target)
        except FormatError as exc:
            warnings.append(records.Damage(records.RECORD_SKIPPED,
                                           f"{where}: record skipped: {exc}"))


def validate_extents(ns: Namespace, writer_dir: str, layer: int = 0,
                     also: str | None = None) -> list[str]:
    """Extents that point past the end of their data log (or at a missing log) are dropped so
    the index never points at garbage; each is reported. `also`: a second directory holding
    the same logs (the node tier's backing copy), the longer of the two copies counting."""
    sizes = {n: os.path.getsize(p) for n, p in backingdir.data_logs(writer_dir).items()}
    for n, p in (backingdir.data_logs(also).items() if also else ()):
        sizes[n] = max(sizes.get(n, 0), os.path.getsize(p))
    if all(end <= sizes.get(n, -1) for n, end in ns.extent_ends.items()):
        return []  # (no run can end beyond its log: the walk below would find nothing)
    warnings = []
    for x in list(ns.inodes.values()):
        if x.emap is None:
            continue
        bad = [p for p in x.emap.pieces if p.run.layer == layer and p.run.seg is None and
               (p.run.log not in sizes or p.run.loff + p.run.length > sizes[p.run.log])]
        for p in bad:
            what = ("lies in a log the index retired (its live data was moved or deleted "
                    "before)") if p.run.log in ns.retired else "lies beyond the log"
            warnings.append(records.Damage(
                records.EXTENT_DROPPED, f"{writer_dir}: inode {x.ino} ({ns.path_of(x.ino)}): "
                f"extent at data log {p.run.log} offset {p.run.loff} {what}; dropped"))
            x.emap.punch(p.start, p.start + p.length)
    return warnings


# The bytes of an index just before where its reader stopped (the end of the last commit
# group it applied: that group's COMMIT record, seq and time, unique to that index). The next
# tail read starts that many bytes early and compares them: a writer that restarted may have
# cut bytes another mount had read (an append that failed, a network file system that lost
# what it had not written back) and appended others over them, and a rewritten index may reuse
# the inode number of one before it; either is then read whole, never from the middle.
MARK_BYTES = 32


def _ident(f, st: os.stat_result, lo: int, end: int) -> tuple:
    """What a tail read checks before it reads on: (st_dev, st_ino, the MARK_BYTES of the
    index before `end`, none before `lo`), read from the open index `f`."""
    at = max(lo, end - MARK_BYTES)
    return st.st_dev, st.st_ino, os.pread(f.fileno(), end - at, at)


def read_writer(wdir: str, on_group: records.OnGroup | None = None
                ) -> "tuple[records.IndexScan, tuple] | str":
    """A writer's index, read whole: (scan, its ident as read), or a warning when it cannot
    be used. A writer without an index yet has an empty tree. The index is read a piece at
    a time, each commit group handed to `on_group` as it is read (then the memory this takes
    does not grow with the index's size; without it, the scan holds every group). (One
    open: the identity and the bytes are of the same file, whatever replaces it
    meanwhile.)"""
    index = os.path.join(wdir, backingdir.INDEX_NAME)
    backingdir.refresh_attributes(wdir)
    try:
        with records.open_index_file(index) as f:
            st = os.fstat(f.fileno())
            scan = records.scan_index_file(index, f, on_group=on_group)
            ident = _ident(f, st, 0, scan.valid_bytes)
    except FileNotFoundError:
        return records.IndexScan(valid_bytes=0), (0, 0)
    except OSError as exc:  # (named by path, not by the descriptor: the same each time)
        return records.Damage(records.WRITER_SKIPPED, f"writer {os.path.basename(wdir)} "
                              f"skipped: {index}: {exc.strerror or exc}")
    except FormatError as exc:
        return records.Damage(records.WRITER_SKIPPED,
                              f"writer {os.path.basename(wdir)} skipped: {exc}")
    return scan, ident


TAIL_BYTES = 1 << 20  # of commit groups a tail read decodes at most (then `stopped`)


def read_tail(index: str, offset: int, ident: tuple | None):
    """The commit groups appended to `index` since byte `offset` (where the groups read
    before end), as records.read_index_tail reads them, up to the first that ends
    TAIL_BYTES or more past `offset` (then scan.stopped: the next read goes on from there),
    and the ident to keep for the next read; None when the index is not the one read before
    (`ident`: another file, or other bytes before `offset`): it is read whole then. Raises
    FormatError, OSError."""
    ident = ident or (0, 0)
    mark = ident[2] if len(ident) > 2 else b""
    start = offset - len(mark)
    with records.open_index_file(index) as f:
        st = os.fstat(f.fileno())
        head = f.read(records.INDEX_HEADER.size)
        # (an index that was not there when read before: whichever is there now is the one)
        if ident[:2] != (0, 0) and (st.st_dev, st.st_ino) != ident[:2] or \
                os.pread(f.fileno(), len(mark), start) != mark:
            return None
        f.seek(offset)
        scan = records.scan_index_file(index, f, tail=True, head=head,
                                       stop_at=records.INDEX_HEADER.size + TAIL_BYTES)
        end = offset
        if scan.valid_bytes >= records.INDEX_HEADER.size:
            end = offset + scan.valid_bytes - records.INDEX_HEADER.size
        scan.valid_bytes = end
        return scan, _ident(f, st, start, end) if end > offset else ident


class Touched:
    """What a commit group of another writer changed in its tree."""

    __slots__ = ("names", "inos", "runs")

    def __init__(self) -> None:
        self.names: set[tuple[int, bytes]] = set()  # (directory, name) in that writer's numbers
        self.inos: set[int] = set()
        # EXTENT / XEXTENT records (the reader drops cached chunks) and RETIRE records (the
        # reader lets go of the log)
        self.runs: list = []
