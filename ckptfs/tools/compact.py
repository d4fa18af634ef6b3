"""`ckptfs compact` and `ckptfs gc`: reclaim the space of dead extents, keep the last N steps.

Compaction rewrites what a writer's tree still uses (live extents, verified on the way) into
fresh data logs and a fresh index, then switches over atomically:

- per writer (default): new logs are numbered after the existing ones in the same directory;
  the new index is written beside the old one, fsynced, and renamed over it. Before the rename
  the old index (and logs) are untouched; after it only the new logs are referenced, and the old
  ones are deleted. A crash in between leaves unreferenced logs, which the next compaction
  deletes.
- `--merge` flattens all writers into one new writer (caps the number of index files a
  directory holds, and the replay cost): the new writer directory is built under a temporary
  name and renamed into place, then the old writer directories are removed. A crash in between
  leaves both, which show the same content (the newer commit wins).

Compaction needs the writers it rewrites to be unmounted (it takes their locks).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time

from crc32c import crc32c

from ckptfs.datapath.staging import CHECKSUM_BLOCK_BYTES
from ckptfs.format import backingdir, records
from ckptfs.format.backingdir import WriterDir, WriterInUse
from ckptfs.format.logs import LogReader
from ckptfs.format.records import CommitRec, ExtentRec, InodeRec, LinkRec, SetattrRec, SizeRec
from ckptfs.namespace import ROOT_INO, Inode, Namespace
from ckptfs.replay import Union, load_foreign
from ckptfs.tools.snapshot import Progress


class _Out:
    """Fresh data logs + index records for a tree."""

    def __init__(self, out_dir: str, writer_id: str, first_log: int, log_bytes: int) -> None:
        self.dir = out_dir
        self.writer = writer_id
        self.log = first_log - 1
        self.log_bytes = log_bytes
        self.fd = -1
        self.off = 0
        self.logs: list[int] = []
        self.records: list[bytes] = []
        self.bytes = 0

    def _roll(self) -> None:
        self._close()
        self.log += 1
        path = os.path.join(self.dir, backingdir.data_log_name(self.log))
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(self.fd, records.data_log_header(self.writer, self.log))
        self.off = records.DATA_HEADER_BYTES
        self.logs.append(self.log)

    def _close(self) -> None:
        if self.fd >= 0:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1

    def extent(self, ino: int, foff: int, data: memoryview) -> None:
        if self.fd < 0 or self.off + len(data) > self.log_bytes:
            self._roll()
        os.pwrite(self.fd, data, self.off)
        self.records.append(records.encode(ExtentRec(ino, foff, len(data), self.log, self.off,
                                                    crc32c(data))))
        self.off += len(data)
        self.bytes += len(data)

    def finish(self) -> None:
        self._close()


def _write_tree(ns: Namespace, logs: LogReader, out: _Out, prog: Progress) -> None:
    """Records for every live inode, parents before children, fresh inode numbers."""
    numbers: dict[int, int] = {ROOT_INO: ROOT_INO}
    rec = out.records
    root = ns.inodes[ROOT_INO]
    rec.append(records.encode(SetattrRec(ROOT_INO, root.mode, root.uid, root.gid, root.atime_ns,
                                        root.mtime_ns, root.ctime_ns)))
    stack = [root]
    while stack:
        d = stack.pop()
        for name in sorted(d.children, reverse=True):
            x = ns.inodes[d.children[name]]
            parent = numbers[d.ino]
            if x.ino in numbers:  # another name of a hard-linked file
                rec.append(records.encode(LinkRec(numbers[x.ino], parent, name)))
                continue
            new = numbers[x.ino] = len(numbers) + 1
            rec.append(records.encode(InodeRec(new, parent, name, x.mode, x.uid, x.gid, x.rdev,
                                              x.atime_ns, x.mtime_ns, x.ctime_ns, x.target)))
            if x.children is not None:
                stack.append(x)
            elif x.emap is not None:
                _copy_file(x, new, logs, out, prog)
                rec.append(records.encode(SizeRec(new, x.size, x.mtime_ns, x.ctime_ns)))


def _copy_file(x: Inode, new: int, logs: LogReader, out: _Out, prog: Progress) -> None:
    cached_run, cached = None, b""
    for start, length, run, roff in x.emap.pieces:
        if run is not cached_run:
            cached_run, cached = run, logs.read_run(run)
        view = memoryview(cached)[roff:roff + length]
        # extents of at most what a mount writes by default: a reader checks a run whole
        for k in range(0, length, CHECKSUM_BLOCK_BYTES):
            out.extent(new, start + k, view[k:k + CHECKSUM_BLOCK_BYTES])
        prog.add(length)


def _write_index(path: str, blobs: list[bytes], seq: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, records.index_header())
        blob = b"".join(blobs) + records.encode(CommitRec(seq, time.time_ns()))
        view = memoryview(blob)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sizes(d: str) -> int:
    return sum(os.path.getsize(p) for p in backingdir.data_logs(d).values())


def compact_writer(backing: str, writer: str, log_bytes: int, progress: bool) -> dict:
    wd = WriterDir(backing, writer)
    wd.open()  # the lock: refuses while mounted
    try:
        ns = Namespace(now_ns=0)
        union = Union()
        load_foreign(ns, backing, None, union, only=writer)
        before = _sizes(wd.path)
        old_logs = set(backingdir.data_logs(wd.path))
        index = os.path.join(wd.path, backingdir.INDEX_NAME)
        seq = records.read_index(index).last_seq if os.path.exists(index) else 0
        logs = LogReader(union)
        live = sum(x.emap.stored_bytes() for x in ns.inodes.values() if x.emap is not None)
        prog = Progress(live, f"compact {writer}", force=progress)
        out = _Out(wd.path, writer, max(old_logs, default=0) + 1, log_bytes)
        try:
            _write_tree(ns, logs, out, prog)
            out.finish()
        except BaseException:
            out.finish()
            for n in out.logs:  # nothing references them: the old index is still in place
                os.unlink(os.path.join(wd.path, backingdir.data_log_name(n)))
            raise
        finally:
            logs.close()
            prog.finish()
        tmp = index + ".compact"
        _write_index(tmp, out.records, seq + 1)
        os.rename(tmp, index)
        _fsync_dir(wd.path)
        for n in old_logs:
            os.unlink(os.path.join(wd.path, backingdir.data_log_name(n)))
        _fsync_dir(wd.path)
        return {"writer": writer, "log_bytes_before": before, "log_bytes_after":
                _sizes(wd.path), "live_bytes": out.bytes, "warnings": union.warnings}
    finally:
        wd.close()


def compact_merge(backing: str, into: str, log_bytes: int, progress: bool) -> dict:
    into = backingdir.safe_writer_id(into)
    dirs = backingdir.writer_dirs(backing)
    locks = []
    try:
        for d in dirs:
            w = WriterDir(backing, os.path.basename(d))
            w.open()
            locks.append(w)
        ns = Namespace(now_ns=0)
        union = Union()
        load_foreign(ns, backing, None, union)
        before = sum(_sizes(d) for d in dirs)
        root = os.path.join(backing, backingdir.WRITERS_DIR)
        tmp_dir = os.path.join(root, f".compact-{into}-{os.getpid()}")
        os.makedirs(tmp_dir, mode=0o700)
        backingdir.write_atomic(os.path.join(tmp_dir, "writer.json"), json.dumps({
            "writer": into, "host": socket.gethostname(), "created": time.time(),
            "version": records.FORMAT_VERSION, "merged_from": [os.path.basename(d) for d in dirs],
        }).encode() + b"\n")
        logs = LogReader(union)
        live = sum(x.emap.stored_bytes() for x in ns.inodes.values() if x.emap is not None)
        prog = Progress(live, "compact --merge", force=progress)
        out = _Out(tmp_dir, into, 1, log_bytes)
        try:
            _write_tree(ns, logs, out, prog)
            out.finish()
            _write_index(os.path.join(tmp_dir, backingdir.INDEX_NAME), out.records, 1)
        except BaseException:
            out.finish()
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
        finally:
            logs.close()
            prog.finish()
        final = os.path.join(root, into)
        trash = []
        if os.path.exists(final):  # `into` is one of the merged writers: replace it
            trash.append(final + f".old-{os.getpid()}")
            os.rename(final, trash[-1])
        os.rename(tmp_dir, final)
        _fsync_dir(root)
        for d in dirs:
            if d != final and os.path.exists(d):
                trash.append(d + f".old-{os.getpid()}")
                os.rename(d, trash[-1])
        _fsync_dir(root)
        for t in trash:
            shutil.rmtree(t, ignore_errors=True)
        return {"writer": into, "merged": [os.path.basename(d) for d in dirs],
                "log_bytes_before": before, "log_bytes_after": _sizes(final),
                "live_bytes": out.bytes, "warnings": union.warnings}
    finally:
        for w in locks:
            w.close()


def cmd_compact(a) -> int:
    backingdir.check_backing(a.backing, create=False)
    ids = [os.path.basename(d) for d in backingdir.writer_dirs(a.backing)]
    if not ids:
        print(f"{a.backing}: nothing to compact (no writer)")
        return 0
    try:
        if a.merge:
            reports = [compact_merge(a.backing, a.into, a.log_size, a.progress)]
        else:
            chosen = [a.writer] if a.writer else ids
            if a.writer and a.writer not in ids:
                raise records.FormatError(f"no writer '{a.writer}' in {a.backing}")
            reports = [compact_writer(a.backing, w, a.log_size, a.progress) for w in chosen]
    except WriterInUse as exc:
        print(f"ckptfs: {exc}; unmount it before compacting", file=sys.stderr)
        return 1
    for r in reports:
        for w in r["warnings"]:
            print(f"warning: {w}", file=sys.stderr)
        what = f"merged {', '.join(r['merged'])} into {r['writer']}" if "merged" in r else \
            f"writer {r['writer']}"
        print(f"{what}: data logs {r['log_bytes_before'] / 1e6:.1f} MB -> "
              f"{r['log_bytes_after'] / 1e6:.1f} MB ({r['live_bytes'] / 1e6:.1f} MB live)")
    return 0
