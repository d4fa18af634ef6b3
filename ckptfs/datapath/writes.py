"""A write's bytes, once they sit in a staging segment, become runs, pieces of the file's
extent map and extent entries of the journal: the one place that records them, for the
handlers (fuse/ops.py) and the fast path's writes in place (fuse/fastpath.py). Trio thread."""

from __future__ import annotations

from crc32c import crc32c

from ckptfs.datapath.flusher import ExtentEntry, Journal
from ckptfs.datapath.staging import Run
from ckptfs.namespace import Inode


def piece_recorder(journal: Journal, x: Inode, off: int, block: int):
    """on_piece for Staging: records that data bytes [dpos, dpos+k) of a write at file
    offset `off` now sit in `seg` at `soff` (extends the file's last run when the write
    continues it in the same segment, up to `block` bytes, the --checksum-block: one index
    record per file and block of a segment), in x's extent map and, as an extent entry, in
    the journal.

    The run's CRC32C is carried along piece by piece, here, while the bytes are still in
    the CPU cache (the kernel or staging.append has just written them: crc32c runs at
    ~25 GB/s over them). At flush time they are cold (~7.7 GB/s): a pass by the flusher
    would cost ~130 us of CPU and memory bandwidth per MiB, which on a 2-CPU machine comes
    out of the writer's time (~15% of a stream of 1 MiB writes; docs/performance-notes.md).
    The GIL is kept (a release would let the flusher thread in mid-request)."""
    emap = x.emap

    def on_piece(seg, dpos, soff, k):
        while k > 0:
            foff = off + dpos
            run = x.tail_run
            tail = journal.entries[-1][1] if journal.entries else None
            if (run is not None and run.seg is seg and run.soff + run.length == soff
                    and run.length < block and x.tail_end == foff
                    and type(tail) is ExtentEntry and tail.run is run):
                m = min(k, block - run.length)
                run.crc = crc32c(seg.view[soff:soff + m], run.crc, 0)
                roff = run.length
                run.length += m
                last = emap.pieces[-1] if emap.pieces else None
                if last is not None and last.run is run and last.start + last.length == foff:
                    emap.grow(m)
                else:
                    emap.insert(foff, m, run, roff)
            else:
                m = min(k, block)
                run = Run(seg, soff, m, crc=crc32c(seg.view[soff:soff + m], 0, 0))
                seg.runs.append(run)
                if x.nlink > 0:  # an unlinked, still open file needs no index record
                    journal.add(ExtentEntry(x.ino, foff, run))
                emap.insert(foff, m, run, 0)
                x.tail_run = run
            x.tail_end = foff + m
            dpos += m
            soff += m
            k -= m
    return on_piece
