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

Compaction needs the writers it rewrites to be unmounted (it takes their locks). It moves data
the one way a mount's cleaner does (datapath/mover.py: the live pieces read back and checked,
cut into extents of at most the default checksum block; the fresh index's records), and
writes the data logs through the one log writer (format/logs.LogWriter: aligned segments,
O_DIRECT where the store allows it, the io engine). It loads no FUSE binding.
"""

from __future__ import annotations

import os
import shutil
import sys

from ckptfs.datapath import mover
from ckptfs.datapath.staging import CHECKSUM_BLOCK_BYTES
from ckptfs.format import backingdir, records
from ckptfs.format.backingdir import WriterDir, WriterInUse
from ckptfs.format.index import fsync_dir, write_fresh
from ckptfs.format.logs import LogWriter, RunReader
from ckptfs.format.records import ExtentRec
from ckptfs.io import open_engine, probe_direct
from ckptfs.namespace import Namespace
from ckptfs.options import BY_NAME
from ckptfs.peers import load_foreign
from ckptfs.view import Union
from ckptfs.tools.snapshot import Progress

SEGMENT_BYTES = BY_NAME["segment-size"].default  # the unit of a write, as a mount's


class _Copy:
    """Fresh data logs for a tree, written as a mount writes them: extents packed into
    aligned segments (mover.SegmentPacker), each written whole with the io engine through the
    one log writer (format/logs.LogWriter; O_DIRECT where the backing store allows it)."""

    def __init__(self, out_dir: str, writer_id: str, first_log: int, log_bytes: int) -> None:
        info = probe_direct(out_dir)
        align = max(info.offset_align, info.mem_align, 4096) if info.supported else 4096
        segment = min(SEGMENT_BYTES, log_bytes - records.DATA_HEADER_BYTES) // align * align
        self.engine = open_engine("auto", depth=8)
        self.where = backingdir.Dir(out_dir)
        self.logs = LogWriter(self.where, writer_id, self.engine, direct=info.supported,
                              align=align, log_bytes=log_bytes, next_log=first_log)
        self.packer = mover.SegmentPacker(self.logs, self.engine, segment, align)

    def copy(self, ns: Namespace, reader: RunReader, prog: Progress) -> None:
        """Every file's live bytes, in tree order, read back and checked, in extents of at
        most the default checksum block (a reader checks a run whole)."""
        last: list = [None, b""]

        def data_of(run) -> bytes:
            if run is not last[0]:
                last[:] = [run, reader.read_run(run)]
            return last[1]
        seen: set[int] = set()
        for _, _, x in mover.walk(ns):
            if x.emap is None or id(x) in seen:
                continue
            seen.add(id(x))
            for _, foff, chunk, _, _ in mover.chunks(mover.live_pieces(x), data_of,
                                                      CHECKSUM_BLOCK_BYTES):
                self.packer.put(id(x), foff, chunk)
                prog.add(len(chunk))
        self.packer.flush()

    def extents(self, x, ino: int) -> list[ExtentRec]:
        return [ExtentRec(ino, foff, n, lg, loff, crc)
                for foff, n, lg, loff, crc in self.packer.extents[id(x)]]

    def finish(self) -> None:
        """Everything written durable, the logs trimmed and closed (the directory stays open
        until close(): abort() may remove the logs still)."""
        try:
            self.packer.flush()
            self.logs.close()
        finally:
            self.packer.close()
            self.engine.close()

    def close(self) -> None:
        self.where.close()

    def abort(self) -> None:
        try:
            self.finish()
        except OSError:
            pass
        try:
            for n in self.logs.opened:  # nothing references them: the old index is in place
                try:
                    self.where.unlink(backingdir.data_log_name(n))
                except FileNotFoundError:
                    pass
        finally:
            self.where.close()


def _index_blob(ns: Namespace, out: _Copy, seq: int, last_time: int,
                xunlinks=(), renumber: bool = True) -> tuple[bytes, int]:
    """The fresh index of the tree copied (mover.tree_records; fresh inode numbers, or with
    `renumber` off the tree's own and a NUMBERS record)."""
    return mover.tree_records(ns, out.extents, seq=seq, last_time=last_time,
                              renumber=renumber, numbers=not renumber, xunlinks=xunlinks)


def _sizes(d: str) -> int:
    return sum(os.path.getsize(p) for p in backingdir.data_logs(d).values())


def compact_writer(backing: str, writer: str, log_bytes: int, progress: bool) -> dict:
    wd = WriterDir(backing, writer)
    wd.open()  # the lock: refuses while mounted
    try:
        union = Union()
        ns = Namespace(now_ns=0, layer_of=union.layer_of)
        # Every writer's index: the writer's entries other writers removed (their XUNLINK
        # records) leave its tree here, and its inode numbers stay (other writers' records
        # name them), so nothing another writer deleted comes back.
        peers = load_foreign(ns, backing, None, union)
        layer = union.layers.get(writer)
        tree = peers.trees.get(layer)
        if tree is None:  # its index could not be read: compacting would lose its tree
            why = [w for w in union.warnings if writer in w]
            raise records.FormatError(f"writer {writer}: its index cannot be read "
                                      f"({'; '.join(why) or 'no tree'}); not compacted")
        named: set[int] = set()  # its logs that other writers' XEXTENT records point into
        if tree is not None:
            peers.whiteouts.carry_out(layer)
            ns = tree
            named = {p.run.log for other, t in peers.trees.items() if other != layer
                     for x in t.inodes.values() if x.emap is not None
                     for p in x.emap.pieces if p.run.layer == layer}
        before = _sizes(wd.path)
        old_logs = set(backingdir.data_logs(wd.path))
        index = os.path.join(wd.path, backingdir.INDEX_NAME)
        scan = records.read_index(index) if os.path.exists(index) else records.IndexScan()
        logs = RunReader(union.writer_dirs)
        live = sum(x.emap.stored_bytes() for x in ns.inodes.values() if x.emap is not None)
        prog = Progress(live, f"compact {writer}", force=progress)
        # (new logs above every number the index ever named: retired ones too)
        first = max(max(old_logs, default=0), tree.last_log if tree else 0) + 1
        out = _Copy(wd.path, writer, first, log_bytes)
        try:
            out.copy(ns, logs, prog)
            out.finish()
        except BaseException:
            out.abort()
            raise
        finally:
            out.close()
            logs.close()
            prog.finish()
        blob, version = _index_blob(ns, out, scan.last_seq + 1,
                                    scan.group_times[-1] if scan.group_times else 0,
                                    tree.xunlinks if tree else (), renumber=tree is None)
        tmp = index + ".compact"
        write_fresh(tmp, blob, version)
        os.rename(tmp, index)
        fsync_dir(wd.path)
        for n in old_logs - named:  # (the others' stay until nothing names them)
            os.unlink(os.path.join(wd.path, backingdir.data_log_name(n)))
        fsync_dir(wd.path)
        return {"writer": writer, "log_bytes_before": before, "log_bytes_after":
                _sizes(wd.path), "live_bytes": out.packer.bytes, "warnings": union.warnings}
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
        union = Union()
        ns = Namespace(now_ns=0, layer_of=union.layer_of)
        peers = load_foreign(ns, backing, None, union)
        before = sum(_sizes(d) for d in dirs)
        root = os.path.join(backing, backingdir.WRITERS_DIR)
        tmp_dir = os.path.join(root, f".compact-{into}-{os.getpid()}")
        os.makedirs(tmp_dir, mode=0o700)
        tmp = backingdir.Dir(tmp_dir)
        try:
            backingdir.write_writer_meta(tmp, into,
                                         merged_from=[os.path.basename(d) for d in dirs])
        finally:
            tmp.close()
        logs = RunReader(union.writer_dirs)
        live = sum(x.emap.stored_bytes() for x in ns.inodes.values() if x.emap is not None)
        prog = Progress(live, "compact --merge", force=progress)
        out = _Copy(tmp_dir, into, 1, log_bytes)
        try:
            out.copy(ns, logs, prog)
            out.finish()
            blob, version = _index_blob(ns, out, 1, peers.max_stamp)
            write_fresh(os.path.join(tmp_dir, backingdir.INDEX_NAME), blob, version)
            fsync_dir(tmp_dir)  # its index and logs are named before the old writers go
        except BaseException:
            out.abort()
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
        finally:
            out.close()
            logs.close()
            prog.finish()
        final = os.path.join(root, into)
        trash = []
        if os.path.exists(final):  # `into` is one of the merged writers: replace it
            trash.append(final + f".old-{os.getpid()}")
            os.rename(final, trash[-1])
        os.rename(tmp_dir, final)
        fsync_dir(root)
        for d in dirs:
            if d != final and os.path.exists(d):
                trash.append(d + f".old-{os.getpid()}")
                os.rename(d, trash[-1])
        fsync_dir(root)
        for t in trash:
            shutil.rmtree(t, ignore_errors=True)
        return {"writer": into, "merged": [os.path.basename(d) for d in dirs],
                "log_bytes_before": before, "log_bytes_after": _sizes(final),
                "live_bytes": out.packer.bytes, "warnings": union.warnings}
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
