"""The one way a tree's history and data move: the records of a tree as a fresh index would
hold them (an index snapshot, `ckptfs compact`), and the live extents of data logs read back,
checked and cut into extents for copying (`chunks`: the cleaner puts them into staging,
`ckptfs compact` into a SegmentPacker over the one log writer, format/logs.LogWriter).

`tree_records(ns, extents)` writes a tree as commit groups:

1. one group with the directories, parents before children (an INODE record each), the
   other writers' entries this writer removed (XUNLINK), and a NUMBERS record (the inode and
   data log numbers used so far);
2. per commit time, in order, a group with every other entry last changed then: its INODE
   record with its final mode, owner and times (a LINK per further name of a hard-linked
   file), a file's extents (`extents(x, ino)`) and a SIZE where the file is longer than its
   data; so each inode's commit time (which decides conflicts between writers: replay.py)
   stays what it was, at two records for a file of one extent;
3. per commit time, in order, a group with a SETATTR of each directory last changed then (its
   final mode, owner and times: the INODE records created in it set its times as they come,
   docs/format.md, and its commit time);
4. an empty group with the time of the last commit, so the index still ends there.

Replaying those groups gives the same tree (names, inode numbers unless renumbered, sizes,
data, attributes, directory times, commit times). Worker threads may run all of it: it
touches only the namespace it is given. A mount's index snapshot runs it in a process of its
own (`python -m ckptfs.datapath.mover`: snapshot_main; the section below says why).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
from collections import defaultdict
from typing import Callable, Iterable

from crc32c import crc32c

from ckptfs.format import backingdir, records
from ckptfs.format.records import (
    CommitRec,
    ExtentRec,
    InodeRec,
    LinkRec,
    NumbersRec,
    Record,
    SetattrRec,
    SizeRec,
    XExtentRec,
)
from ckptfs.datapath.staging import Run
from ckptfs.format.index import FRESH_SUFFIX, write_fresh
from ckptfs.namespace import ROOT_INO, Inode, Namespace
from ckptfs.format.logs import RunReader
from ckptfs.io import alloc_aligned
from ckptfs.replay import apply_group, bulk_load, validate_extents
from ckptfs import system
from ckptfs.system import libc, status_bytes

# Bytes of each record a fresh index holds per entry (header 9 + body): the estimate of how
# large a fresh index of a tree would be, without writing it.
_INODE_BYTES = 9 + 62
_LINK_BYTES = 9 + 16
_EXTENT_BYTES = 9 + 36
_SETATTR_BYTES = 9 + 44
_SIZE_BYTES = 9 + 32
_COMMIT_BYTES = 9 + 16


def fresh_index_bytes(inodes: Iterable[Inode], ns: Namespace) -> int:
    """About the size of a fresh index of the tree (tree_records' output), from the inodes
    `inodes` of `ns` (all of them, or a slice: the sums add up)."""
    total = 0
    for x in inodes:
        if x.layer != 0:
            continue
        total += _COMMIT_BYTES // 4  # (about one commit per four inodes)
        if x.children is not None:
            total += _SETATTR_BYTES
            for name, ino in x.children.items():
                c = ns.inodes.get(ino)
                if c is not None and c.layer == 0:
                    total += _INODE_BYTES + len(name) + len(c.target)
        elif x.emap is not None:
            total += _EXTENT_BYTES * len(x.emap.pieces)
            if x.size != x.emap.end():
                total += _SIZE_BYTES
            if x.nlink > 1:
                total += (x.nlink - 1) * (_LINK_BYTES - _INODE_BYTES)
    return total


def walk(ns: Namespace):
    """(directory, name, inode) of every entry of the tree, parents before children, in the
    order a fresh index lists them (and `ckptfs compact` lays their data out)."""
    stack = [ns.inodes[ROOT_INO]]
    while stack:
        d = stack.pop()
        for name in sorted(d.children, reverse=True):
            x = ns.inodes[d.children[name]]
            yield d, name, x
            if x.children is not None:
                stack.append(x)


def tree_records(ns: Namespace, extents: Callable[[Inode, int], Iterable[Record]], *,
                 seq: int, last_time: int, renumber: bool = False, next_log: int = 0,
                 numbers: bool = True, xunlinks: Iterable = ()) -> tuple[bytes, int]:
    """The commit groups of a fresh index of `ns` (module docstring) and the index version
    they need. `extents(x, ino)` yields the encoded extent records of file `x` (its number in
    the new index: `ino`); `renumber` gives the inodes fresh numbers 2, 3, ... in tree order
    (else they keep theirs); every COMMIT carries sequence number `seq`; with `numbers`, a
    NUMBERS record says no inode number of the tree's history and no data log below
    `next_log` (or one the tree names) is used again (index version 2); `xunlinks`: the other
    writers' entries this writer removed (XUNLINK records, index version 3)."""
    new_of: dict[int, int] = {ROOT_INO: ROOT_INO}  # inode number -> its number here
    out: list[bytes] = []  # group 1: the directories
    enc = records.encode
    version = records.RETIRE_INDEX_VERSION if numbers else 1
    entries: dict[int, list[bytes]] = defaultdict(list)  # commit time -> the other entries
    dirs: dict[int, list[Inode]] = defaultdict(list)  # commit time -> directories
    root = ns.inodes[ROOT_INO]
    dirs[root.commit_ns].append(root)
    for d, name, x in walk(ns):  # (extents() is called in this order: compact lays data so)
        parent = new_of[d.ino]
        if x.ino in new_of:  # another name of a hard-linked file
            entries[x.commit_ns].append(enc(LinkRec(new_of[x.ino], parent, name)))
            continue
        new = new_of[x.ino] = len(new_of) + 1 if renumber else x.ino
        rec = enc(InodeRec(new, parent, name, x.mode, x.uid, x.gid, x.rdev, x.atime_ns,
                           x.mtime_ns, x.ctime_ns, x.target))
        if x.children is not None:
            out.append(rec)
            dirs[x.commit_ns].append(x)
            continue
        group = entries[x.commit_ns]
        group.append(rec)
        if x.emap is not None:
            for rec in extents(x, new):
                if type(rec) in records.CROSS_WRITER_RECORDS:
                    version = max(version, records.CROSS_INDEX_VERSION)
                group.append(enc(rec))
            if x.size != x.emap.end():
                group.append(enc(SizeRec(new, x.size, x.mtime_ns, x.ctime_ns)))
    for rec in xunlinks:
        out.append(enc(rec))
        version = max(version, records.CROSS_INDEX_VERSION)
    if numbers:
        next_ino = len(new_of) + 1 if renumber else ns.next_ino
        out.append(enc(NumbersRec(next_ino, max(next_log, ns.last_log + 1))))
    first = min(min(dirs), min(entries, default=min(dirs)))
    out.append(enc(CommitRec(seq, first)))
    for when in sorted(entries):
        out += entries[when]
        out.append(enc(CommitRec(seq, when)))
    for when in sorted(dirs):
        for x in dirs[when]:
            out.append(enc(SetattrRec(new_of[x.ino], x.mode, x.uid, x.gid, x.atime_ns,
                                      x.mtime_ns, x.ctime_ns)))
        out.append(enc(CommitRec(seq, when)))
    out.append(enc(CommitRec(seq, max(last_time, first))))
    return b"".join(out), version


def extents_in_place(pieces_of: RunReader,
                     writer_of: Callable[[int], str]) -> Callable[[Inode, int], list[Record]]:
    """extents() for an index snapshot: every piece stays where it is. A piece that is a run
    whole keeps the run's checksum; one that is part of a run (an overwrite or a truncate cut
    it) gets the checksum of its own bytes, read and checked against the run's first. A piece
    in another writer's run (a file taken over without its bytes) stays an XEXTENT record."""

    def extents(x: Inode, ino: int) -> list[Record]:
        out: list[Record] = []
        for start, n, run, roff in x.emap.pieces:
            if run.layer != 0:
                out.append(XExtentRec(ino, start, n, writer_of(run.layer), run.log, run.loff,
                                      run.length, run.crc, roff))
                continue
            if roff == 0 and n == run.length:
                crc = run.crc
            else:
                crc = crc32c(memoryview(pieces_of.read_run(run))[roff:roff + n])
            out.append(ExtentRec(ino, start, n, run.log, run.loff + roff, crc))
        return out
    return extents


def build_snapshot(index_path: str, upto: int, writer_id: str, uid: int, gid: int,
                   root_time_ns: int, settled: frozenset = frozenset()) -> tuple[str, int, int]:
    """Worker thread: the index snapshot of the first `upto` bytes of this writer's index (a
    commit boundary), written and fsynced beside it (format/index.py: FRESH_SUFFIX). Returns
    (its path, its size, its index version). The root starts as at a mount (`uid`, `gid`,
    `root_time_ns`); the XUNLINK records of (writer, ino) in `settled` are left out (their
    writers removed those entries: whiteouts.Whiteouts.settled). Raises OSError when a piece's
    bytes fail their checksum (no snapshot: the damage stays where it is, for reads and
    `ckptfs verify` to report)."""
    with open(index_path, "rb") as f:
        data = f.read(upto)
    if len(data) != upto:
        raise OSError(errno.EIO, f"{index_path}: {len(data)} bytes read, {upto} committed")
    layers: dict[str, int] = {writer_id: 0}

    def layer_of(writer: str) -> int:
        return layers.setdefault(writer, len(layers))
    ns = Namespace(uid=uid, gid=gid, now_ns=root_time_ns, layer_of=layer_of)
    warnings: list = []
    last_time = 0  # the last commit's stamp: the snapshot ends with it

    def apply(group: list, when: int) -> None:
        nonlocal last_time
        apply_group(ns, group, when, index_path, warnings)
        last_time = when
    with bulk_load():
        scan = records.scan_index(index_path, data, on_group=apply)
    del data
    writer_dir = os.path.dirname(index_path)
    validate_extents(ns, writer_dir)  # (dropped at mount already, with a warning)
    writers = {layer: w for w, layer in layers.items()}
    pieces_of = RunReader({0: writer_dir})
    try:
        blob, version = tree_records(
            ns, extents_in_place(pieces_of, writers.__getitem__), seq=scan.last_seq,
            last_time=last_time,
            next_log=max(backingdir.data_logs(writer_dir), default=0) + 1,
            xunlinks=[r for r in ns.xunlinks if (r.writer, r.ino) not in settled])
    finally:
        pieces_of.close()
    fresh = index_path + FRESH_SUFFIX
    size = write_fresh(fresh, blob, version)
    return fresh, size, version


# ---------------------------------------------------------------- the snapshot's process
# An index snapshot replays the index into a second tree: in a process of its own the daemon
# neither holds that tree (a large one's memory would stay with the daemon after it is freed:
# the allocator keeps its arenas) nor shares its GIL with it (the request thread would wait
# for the replay's Python). The daemon's maintainer starts it (snapshotter.py) and waits.
SNAPSHOT_NICE = 10  # (a snapshot yields the CPU to the application and the daemon)


def snapshot_command() -> tuple[list[str], dict, str]:
    """The command line, environment and working directory of a snapshot's process
    (system.child_command: this interpreter and package, isolated from where the daemon was
    started)."""
    return system.child_command("ckptfs.datapath.mover")


def snapshot_args(index_path: str, upto: int, writer_id: str, uid: int, gid: int,
                  root_time_ns: int, settled: frozenset, parent: int,
                  dir_fd: int | None = None) -> bytes:
    """build_snapshot's arguments as the process reads them from its standard input.
    `dir_fd`: the writer's directory as the daemon holds it open (passed to the process):
    the process then reaches the index and the logs through it, not through the names
    above it (backingdir.Dir says why)."""
    return json.dumps({"index": index_path, "upto": upto, "writer": writer_id, "uid": uid,
                       "gid": gid, "root_time_ns": root_time_ns, "settled": sorted(settled),
                       "parent": parent, "dir_fd": dir_fd}).encode()


def snapshot_result(out: bytes, returncode: int) -> tuple[str, int, int, int]:
    """(fresh path, size, version, the process's peak memory) from what the process wrote, or
    the OSError it reported (EIO where it ended without an answer: killed, or a fault; its
    last line says why)."""
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        res = json.loads(lines[-1])
    except (IndexError, ValueError):
        res = None
    if not isinstance(res, dict) or ("fresh" not in res and "errno" not in res):
        why = lines[-1] if lines else "no output"
        raise OSError(errno.EIO, f"index snapshot process ended with {returncode}: {why}")
    if "errno" in res:
        raise OSError(res["errno"], res["error"])
    return res["fresh"], res["size"], res["version"], res.get("peak_rss", 0)


def _die_with_parent(parent: int) -> None:
    """SIGKILL when the daemon ends (kill -9 too: PR_SET_PDEATHSIG), so that no snapshot of a
    mount that is gone writes a fresh index while the writer's next mount runs."""
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # (it ended before the prctl)
        os._exit(1)


def snapshot_main() -> int:
    """`python -m ckptfs.datapath.mover`: one build_snapshot (arguments: snapshot_args on
    standard input), its result as a JSON line on standard output (snapshot_result)."""
    args = json.loads(sys.stdin.buffer.read())
    _die_with_parent(args["parent"])
    try:
        os.nice(SNAPSHOT_NICE)
    except OSError:
        pass
    index = args["index"]
    if args.get("dir_fd") is not None:  # (the directory, whatever its path names by now)
        index = os.path.join(f"/proc/self/fd/{int(args['dir_fd'])}", os.path.basename(index))
    try:
        fresh, size, version = build_snapshot(
            index, args["upto"], args["writer"], args["uid"], args["gid"],
            args["root_time_ns"], frozenset((w, i) for w, i in args["settled"]))
    except OSError as exc:
        res = {"errno": exc.errno or errno.EIO, "error": str(exc)}
    else:
        res = {"fresh": fresh, "size": size, "version": version}
    # (VmHWM: getrusage would count the daemon's, whose memory this process shared until its
    # exec)
    res["peak_rss"] = status_bytes("VmHWM") or 0
    sys.stdout.write(json.dumps(res) + "\n")
    sys.stdout.flush()
    return 0


# ---------------------------------------------------------------- copying extents
def live_pieces(x: Inode) -> list[tuple[Inode, int, int, Run, int]]:
    """The pieces (file, start, length, run, offset in the run) of file `x`, in file order."""
    return [(x, s, n, run, roff) for s, n, run, roff in x.emap.pieces]


def chunks(pieces, data_of: Callable[[Run], bytes | None], block: int):
    """Copying extents: the bytes of each piece (x, start, n, run, roff) whose run's bytes
    `data_of(run)` has (read and checked against the run's checksum: RunReader.read_run; None:
    skipped), in chunks of at most `block` bytes (a reader checks an extent whole): yields
    (x, file offset, bytes, run, offset in the run)."""
    for x, s, n, run, roff in pieces:
        data = data_of(run)
        if data is None:
            continue
        view = memoryview(data)
        for k in range(0, n, block):
            m = min(block, n - k)
            yield x, s + k, view[roff + k:roff + k + m], run, roff + k


class SegmentPacker:
    """Extents packed back to back into aligned segments, each written whole (its tail padded
    to the alignment) through the one LogWriter: what staging and the flusher do in a mount,
    for `ckptfs compact`. `extents[key]` collects (file offset, length, log, log offset, crc)
    of every extent put for `key` once its segment is placed."""

    def __init__(self, logs, engine, segment_bytes: int, align: int) -> None:
        self.logs, self.engine, self.align = logs, engine, align
        self.buf = alloc_aligned(segment_bytes, populate=False)
        self.view = memoryview(self.buf)
        self.used = 0
        self.pending: list[tuple] = []  # (key, foff, segment offset, length, crc)
        self.extents: dict = defaultdict(list)
        self.bytes = 0

    def put(self, key, foff: int, data) -> None:
        n = len(data)
        if self.used + n > len(self.buf):
            self.flush()
        self.view[self.used:self.used + n] = data
        self.pending.append((key, foff, self.used, n, crc32c(data)))
        self.used += n
        self.bytes += n

    def flush(self) -> None:
        if not self.used:
            return
        nbytes = -(-self.used // self.align) * self.align
        self.view[self.used:nbytes] = bytes(nbytes - self.used)
        lg, off = self.logs.place(nbytes)
        fd, opened = self.logs.fd(lg)
        try:
            self.engine.write_all([(fd, self.view[:nbytes], off)])
            if opened:
                self.engine.fsync(fd, datasync=True)
        finally:
            if opened:
                os.close(fd)
        self.logs.written({lg})
        for key, foff, soff, n, crc in self.pending:
            self.extents[key].append((foff, n, lg, off + soff, crc))
        self.pending.clear()
        self.used = 0

    def close(self) -> None:
        self.view.release()
        self.buf.close()


if __name__ == "__main__":
    sys.exit(snapshot_main())
