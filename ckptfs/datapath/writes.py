"""A write's bytes, once they sit in a staging segment, become runs, pieces of the file's
extent map and extent entries of the journal: the one place that records them, for every
path a WRITE takes (fuse/handles.py, Handles.piece_recorder). Trio thread."""

from __future__ import annotations

from ckptfs.datapath.journal import ExtentEntry, Journal
from ckptfs.datapath.staging import Checksums, Run
from ckptfs.namespace import Inode


def piece_recorder(journal: Journal, checksums: Checksums, x: Inode, off: int, block: int):
    """on_piece for Staging: records that data bytes [dpos, dpos+k) of a write at file
    offset `off` now sit in `seg` at `soff` (extends the file's last run when the write
    continues it in the same segment, up to `block` bytes, the --checksum-block: one index
    record per file and block of a segment), in x's extent map and, as an extent entry, in
    the journal. The run's CRC32C is owed to `checksums` (staging.Checksums), which take it
    when the request loop is idle, off the writer's wait; where the piece comes with its
    CRC32C (`crc`: of bytes a queue thread landed, taken in C before their record was,
    fuse/ring_landing.c ck_fring_sum_landed), the run takes that in. Such a piece that fits in a
    block but not in the rest of the file's last run starts a run of its own (runs may be
    shorter than a block), so that its checksum is never split; one larger than a block (a
    --checksum-block smaller than a WRITE) is owed like any other."""
    emap = x.emap

    def on_piece(seg, dpos, soff, k, crc=None):
        if crc is not None and k > block:
            crc = None
        while k > 0:
            foff = off + dpos
            run = x.tail_run
            tail = journal.entries[-1][1] if journal.entries else None
            if (run is not None and run.seg is seg and run.soff + run.length == soff
                    and run.length < block and x.tail_end == foff
                    and type(tail) is ExtentEntry and tail.run is run
                    and (crc is None or run.length + k <= block)):
                m = min(k, block - run.length)
                roff = run.length
                run.length += m
                checksums.grew(run, m, crc)
                last = emap.pieces[-1] if emap.pieces else None
                if last is not None and last.run is run and last.start + last.length == foff:
                    emap.grow(m)
                else:
                    emap.insert(foff, m, run, roff)
            else:
                m = min(k, block)
                run = Run(seg, soff, m)
                run.summed = 0
                checksums.grew(run, m, crc)
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
