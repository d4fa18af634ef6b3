"""The flusher thread's writes into the data logs (datapath/flusher.py decides when).

`SegmentWriter` places each sealed segment at the next aligned offset of the current data log
(format/logs.LogWriter: rollover, --data-logs round robin, stripes), pads its tail to the
alignment and writes it whole in --io-chunk requests through the flusher's io engine. The
copies of the commit groups appended to the index since the last segment go into a copy block
right after the segment placed last (records.copy_block: what `ckptfs fsck` rebuilds an index
from), or alone at unmount.

A segment written again after a failed sync keeps its place. A buffered write whose writeback
failed (`lost_writeback`) gets its range punched before it is written again: see `_punch_lost`.
"""

from __future__ import annotations

import errno
import os
import time

from ckptfs.datapath.staging import NO_LOG, Segment, round_up
from ckptfs.format import records
from ckptfs.format.logs import LogWriter, punch_hole
from ckptfs.io import alloc_aligned


class SegmentWriter:
    """Segments and commit groups' copies into the data logs. Flusher thread only."""

    def __init__(self, engine, logs: LogWriter, stats, *, align: int,
                 io_chunk_bytes: int) -> None:
        """`engine`: the flusher's io engine; `logs`: its data logs; `stats`: the flusher's
        FlushStats (segments, bytes_written, flush_seconds are counted here)."""
        self.engine = engine
        self.logs = logs
        self.stats = stats
        self.align = align
        self.io_chunk_bytes = io_chunk_bytes
        # (log, offset) -> length of segments whose buffered writeback failed: their range is
        # punched before they are written again (see write)
        self.lost: dict[tuple[int, int], int] = {}
        # Commit groups appended to the index and not yet copied into a data log: they go
        # into a copy block with the next segments written, or at unmount
        # (records.copy_block); `copies_from` is the sequence number before the first.
        self.copies: list[bytes] = []
        self.copies_bytes = 0
        self.copies_from = 0
        self._copy_buf = None

    def close(self) -> None:
        if self._copy_buf is not None:
            self._copy_buf.close()
            self._copy_buf = None

    def copy_later(self, blob: bytes, after: int) -> None:
        """A commit group just appended to the index (`after`: the sequence number the index
        was committed up to before it): copied into a data log with the next write."""
        if not self.copies:
            self.copies_from = after
        self.copies.append(blob)
        self.copies_bytes += len(blob)

    def lost_writeback(self, segs: list[Segment]) -> None:
        """The fdatasync after these buffered segments' writes failed (the flusher writes
        them again, to the same places): each one's range is punched first."""
        for seg in segs:
            self.lost[(seg.log, seg.loff)] = round_up(seg.used, self.align)

    def _place(self, seg: Segment, nbytes: int) -> None:
        seg.log, seg.loff = self.logs.place(nbytes)
        seg.lfrom, seg.lend = self.logs.placed_from, seg.loff + nbytes
        for run in seg.runs:
            run.log = seg.log
            run.loff = seg.loff + run.soff

    def write(self, segs: list[Segment]) -> None:
        """Write `segs` whole (and the copies not yet written, in front); a segment not placed
        yet is placed first, one written before (a retry) goes to the same place."""
        t0 = time.perf_counter()
        reqs = []
        by_log_fd: dict[int, int] = {}
        written = 0
        chunk = self.io_chunk_bytes
        # Place every segment first (placement may roll over to a new data log and close the
        # old one), then resolve file descriptors: a segment placed in a log that is no longer
        # open gets it opened by name, never a stale descriptor number.
        copy = self._copy_placed()  # (right after the segment placed last)
        for seg in segs:
            nbytes = round_up(seg.used, self.align)
            if seg.log == NO_LOG:  # first attempt; a retry keeps its place
                if nbytes > seg.used:  # (padding: no run's checksum covers it)
                    seg.view[seg.used:nbytes] = bytes(nbytes - seg.used)
                self._place(seg, nbytes)
        extra: list[int] = []  # fds opened by name here: synced and closed below
        try:
            if copy is not None:
                log_no, loff, view = copy
                fd, opened = self.logs.fd(log_no)
                if opened:
                    extra.append(fd)
                by_log_fd[log_no] = fd
                reqs.append((fd, view, loff))
            for seg in segs:
                nbytes = round_up(seg.used, self.align)
                fd = by_log_fd.get(seg.log)
                if fd is None:
                    fd, opened = self.logs.fd(seg.log)
                    if opened:
                        extra.append(fd)
                    by_log_fd[seg.log] = fd
                if (seg.log, seg.loff) in self.lost:
                    self._punch_lost(fd, seg, nbytes)
                for off in range(0, nbytes, chunk):
                    n = min(chunk, nbytes - off)
                    reqs.append((fd, seg.view[off:off + n], seg.loff + off))
                written += nbytes
            self.engine.write_all(reqs)
            for fd in extra:  # a log closed since (rollover, retry): sync it now
                self.engine.fsync(fd, datasync=True)
                self.logs.syncs += 1
            self.logs.written(by_log_fd)
            if copy is not None:
                self.copies, self.copies_bytes = [], 0
        finally:
            for _, mv, _ in reqs:
                mv.release()
            for fd in extra:
                os.close(fd)
        self.stats.segments += len(segs)
        self.stats.bytes_written += written
        self.stats.flush_seconds += time.perf_counter() - t0

    def _punch_lost(self, fd: int, seg: Segment, nbytes: int) -> None:
        """Before a segment whose buffered writeback failed is written again: give its range
        back to the file system. ext4 leaves the failed range's blocks unwritten (they read
        as zeros) while a rewrite of the same pages and its fdatasync succeed; punched, the
        rewrite is allocated anew like any first write. Where punching is not supported the
        rewrite is all there is."""
        try:
            punch_hole(fd, seg.loff, nbytes)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
        del self.lost[(seg.log, seg.loff)]

    def _copy_placed(self) -> tuple[int, int, memoryview] | None:
        """The copy block of the commit groups not yet copied, placed in a data log and laid
        out in an aligned buffer of its own: (log, offset, bytes to write); None if there
        are none. The copies stay listed until the write succeeds (a failed one is placed
        again: the space it took is dead bytes)."""
        if not self.copies:
            return None
        body = b"".join(self.copies)
        nbytes = round_up(records.COPY_HEADER.size + len(body), self.align)
        log_no, loff = self.logs.place(nbytes, copy=True)
        if self._copy_buf is None or len(self._copy_buf) < nbytes:
            if self._copy_buf is not None:
                self._copy_buf.close()
            self._copy_buf = alloc_aligned(round_up(nbytes, 1 << 16), populate=False)
        block = records.copy_block(log_no, loff, self.copies_from, body)
        view = memoryview(self._copy_buf)[:nbytes]
        view[:len(block)] = block
        view[len(block):] = bytes(nbytes - len(block))
        return log_no, loff, view

    def write_copies(self) -> None:
        """The copies not yet written, alone (at unmount, or when they grew past the
        flusher's COPY_FLUSH_BYTES while no segment was written), then the logs synced; not
        in a mount that has written no segment (they wait for its first one: a data log made
        for them alone would hold no live byte)."""
        if self.copies and self.logs.open_numbers():
            self.write([])
            self.logs.sync()
