"""The aggregation: aligned in-memory segments, data runs and per-file extent maps.

Everything here is owned by the trio thread, except that the flusher thread reads sealed
segments' memory and fills in a run's log location (plain attribute writes) before it reports
the segment durable. A run's checksum is taken on the trio thread after its pieces land, while
the request loop waits for a request (`Checksums`; datapath/writes.py records what is owed).

- A `Segment` wraps one buffer of the fixed pool while it fills and drains.
- A `Run` is a contiguous stretch of one file's bytes inside one segment (or, after replay, one
  EXTENT record in a data log). Consecutive writes that continue a file extend its run, so a
  file written front to back costs one index record per segment it touches.
- An `ExtentMap` maps a file's byte ranges to `Piece`s: parts of runs; newer writes clip older
  pieces.
"""

from __future__ import annotations

import bisect
import operator
from collections import deque
from typing import Callable, NamedTuple

import trio
from crc32c import crc32c

from ckptfs.io import alloc_aligned, crc32c_shift

# The longest run of a file's bytes under one CRC32C (--checksum-block). A read of a place not
# yet read loads and checks its whole run (and the 4 MiB read chunks it spans); a reader
# jumping from item to item (DCP loads the items of its one file in state-dict order, laid
# out by size) loads 2-3 chunks per jump with runs of a whole 8 MiB segment, 1-2 with 2 MiB
# runs: a 2.1 GB DCP restore read 5.40 -> 5.09 GB from disk and took 8.24 -> 7.47 s
# (docs/performance-notes.md). Each run costs an index record and ~380 bytes of daemon
# memory (~200 MB per TB held in a mount at 2 MiB).
CHECKSUM_BLOCK_BYTES = 2 << 20


NO_LOG = -1  # the log (and offset) of a segment or run not placed in a data log yet


class Segment:
    """One fill of a pool buffer. Lives on (tiny, without its buffer) while runs point at it.

    Once written (`released`: its buffer is back in the pool) the segment keeps its buffer,
    and with it its bytes, until the pool hands that buffer out again (`Staging.kept`): its
    runs are read from memory until then (Run.memory)."""

    __slots__ = ("buf", "view", "used", "runs", "log", "loff", "sealed", "durable", "number",
                 "released", "lfrom", "lend")

    def __init__(self, buf, number: int) -> None:
        self.buf = buf
        self.view = memoryview(buf)
        self.used = 0
        self.runs: list[Run] = []
        self.log = NO_LOG
        self.loff = NO_LOG
        self.sealed = False
        self.durable = False
        self.number = number
        self.released = False  # written: its buffer is in the free pool (kept until reused)
        # The log bytes [lfrom, lend) are the segment's (set where it is placed): from the
        # end of the segment placed before it in that log (what lies between is padding or
        # a copy block, never a run) to the end of its padding
        self.lfrom = NO_LOG
        self.lend = NO_LOG


class Run:
    """File bytes stored contiguously: in a staging segment at `soff`, and (once durable) in
    data log `log` at `loff`. `crc` is the CRC32C of the run's first `summed` bytes: all
    `length` of them for a run from the index, and for a run that is filling once the
    staging's `Checksums` have caught up with it (before its segment goes back to the pool,
    so before any index record of it is written)."""

    __slots__ = ("seg", "soff", "length", "log", "loff", "crc", "verified", "layer", "dead",
                 "summed")

    def __init__(self, seg: Segment | None, soff: int, length: int, log: int = NO_LOG,
                 loff: int = NO_LOG, crc: int = 0, verified: bool = False,
                 layer: int = 0) -> None:
        self.seg = seg
        self.soff = soff
        self.length = length
        self.log = log
        self.loff = loff
        self.crc = crc
        self.verified = verified
        self.layer = layer  # which writer's data logs hold it (0: this mount's own)
        self.dead = 0  # bytes no extent map points at any more (cleaner.LogSpace)
        self.summed = length  # the bytes `crc` covers (Checksums)

    def memory(self) -> memoryview | None:
        """The run's bytes while they are still in staging memory (its segment staged, or
        written and its buffer not reused yet), else None. Trio thread: the buffer is reused
        there only, so the view holds these bytes until the caller's next await."""
        seg = self.seg
        if seg is not None and seg.buf is not None:
            return seg.view[self.soff:self.soff + self.length]
        return None


class Piece(NamedTuple):
    """Bytes [start, start + length) of a file are bytes [roff, roff + length) of `run`.
    Immutable: a map that changes a piece puts a new one in its place."""

    start: int
    length: int
    run: Run
    roff: int


# a piece's start, the key its map is sorted by (and a kept segment's log range's start:
# Staging.kept_ranges)
_START = operator.itemgetter(0)


class ExtentMap:
    """The file's bytes as sorted, non-overlapping pieces of runs; a range no piece covers is a
    hole (reads as zeros).

    A map's `on_dead(run, n)`, when it is made with one (the daemon's tree gives every map
    of its files cleaner.LogSpace.dead: namespace.Namespace), hears of every `n` bytes of
    `run` that the map stops pointing at: an overwrite or truncate clips them, a forgotten
    inode drops its map.

    A map's `watcher(emap)`, when it has one (the answer cache sets it on the maps of the files
    the queue threads answer from: fuse/answers.py), hears of the map's first change, and is
    cleared: a write, truncate or drop, or its file getting another map (`replaced`: a
    copy-up)."""

    __slots__ = ("pieces", "stored", "watcher", "on_dead")

    def __init__(self, on_dead: Callable[[Run, int], None] | None = None) -> None:
        self.pieces: list[Piece] = []
        self.on_dead = on_dead
        # The bytes the pieces hold (st_blocks, asked for on every stat: kept up to date
        # instead of summed; see also `grow`).
        self.stored = 0
        self.watcher: Callable[[ExtentMap], None] | None = None

    def replaced(self) -> None:
        """The file gets another map (a copy-up): whoever watches this one hears of it."""
        if self.watcher is not None:
            self._changed()

    def _changed(self) -> None:
        watcher, self.watcher = self.watcher, None
        watcher(self)

    def end(self) -> int:
        if not self.pieces:
            return 0
        p = self.pieces[-1]
        return p.start + p.length

    def insert(self, start: int, length: int, run: Run, roff: int) -> None:
        """Newest wins: clip whatever older pieces overlap [start, start+length)."""
        if self.watcher is not None:
            self._changed()
        self.stored += length
        pieces = self.pieces
        if not pieces or start >= pieces[-1].start + pieces[-1].length:
            pieces.append(Piece(start, length, run, roff))
            return
        self.punch(start, start + length)
        i = bisect.bisect_left(pieces, start, key=_START)
        pieces.insert(i, Piece(start, length, run, roff))

    def grow(self, m: int) -> None:
        """The last piece goes on for `m` more bytes of its run (a write that continues the
        file where its last write ended, landing right after it in the same run)."""
        if self.watcher is not None:
            self._changed()
        p = self.pieces[-1]
        self.pieces[-1] = Piece(p.start, p.length + m, p.run, p.roff)
        self.stored += m

    def punch(self, lo: int, hi: int) -> None:
        """Remove the bytes [lo, hi) from the map (the range reads as zeros afterwards)."""
        if self.watcher is not None:
            self._changed()
        pieces = self.pieces
        i = bisect.bisect_right(pieces, lo, key=_START) - 1
        if i < 0:
            i = 0
        out: list[Piece] = []
        dead = self.on_dead
        j = i
        while j < len(pieces) and pieces[j].start < hi:
            p = pieces[j]
            s, n, run, roff = p
            e = s + n
            if e <= lo:
                out.append(p)
            else:
                self.stored -= min(e, hi) - max(s, lo)
                if dead is not None:
                    dead(run, min(e, hi) - max(s, lo))
                if s < lo:
                    out.append(Piece(s, lo - s, run, roff))
                if e > hi:
                    out.append(Piece(hi, e - hi, run, roff + (hi - s)))
            j += 1
        pieces[i:j] = out

    def drop(self) -> None:
        """Forget every piece (the file is gone)."""
        if self.watcher is not None:
            self._changed()
        dead = self.on_dead
        if dead is not None:
            for p in self.pieces:
                dead(p.run, p.length)
        self.pieces = []
        self.stored = 0

    def truncate(self, size: int) -> None:
        if self.watcher is not None:  # (also a truncate up: the file's end moves)
            self._changed()
        end = self.end()
        if size < end:
            self.punch(size, end)

    def find(self, lo: int, hi: int) -> list[Piece]:
        """Pieces overlapping [lo, hi), clipped to it, in file order."""
        pieces = self.pieces
        i = bisect.bisect_right(pieces, lo, key=_START) - 1
        if i < 0:
            i = 0
        out = []
        while i < len(pieces):
            p = pieces[i]
            s, n, run, roff = p
            if s >= hi:
                break
            e = s + n
            if e > lo:
                if s >= lo and e <= hi:
                    out.append(p)
                else:
                    cs, ce = max(s, lo), min(e, hi)
                    out.append(Piece(cs, ce - cs, run, roff + (cs - s)))
            i += 1
        return out

    def runs(self) -> list[Run]:
        pieces = self.pieces
        if len(pieces) == 1:
            return [pieces[0].run]
        seen: dict[int, Run] = {}
        for p in pieces:
            seen.setdefault(id(p.run), p.run)
        return list(seen.values())

    def share(self, other: "ExtentMap") -> None:
        """Point at `other`'s pieces (a view of another writer's file: view.View); the stored
        bytes are copied, not shared."""
        if self.watcher is not None:
            self._changed()
        self.pieces = other.pieces
        self.stored = other.stored

    def stored_bytes(self) -> int:
        return self.stored


# Checksums owed at most this many bytes; beyond it the oldest are summed at once, on the
# write's own path. It bounds the work left for a commit or a buffer's return to the pool,
# and how long the request loop sums without looking at other trio tasks.
CHECKSUMS_OWED_BYTES = 32 << 20
CHECKSUM_SLICE_BYTES = 64 << 10  # summed between two looks for the next request (~5 us)


class Checksums:
    """The CRC32C of the bytes that landed in staging, taken while the request loop has
    nothing else to do.

    A 1 MiB WRITE's payload is cold in the CPU cache once the kernel copied it into the
    segment: its CRC32C costs ~85 us, a quarter of the request, and the writer waits for the
    reply all that time (a 2.1 GB torch.save is ~7% faster with no checksum at all,
    docs/performance-notes.md). So a write only records what it owes (`grew`), and the
    request loop sums owed bytes in slices whenever no request is waiting (fuse/loop.py):
    between a reply and the writer's next request, and while torch.save serialises its next
    tensor. What is owed is bounded (CHECKSUMS_OWED_BYTES: past it, the oldest bytes are
    summed at once) and is settled before it is needed: before a segment's buffer goes back
    to the pool (`settle(seg)`, from `Staging.release`). That also comes before any index
    record carries the checksum: the journal commits a run's extent only once its segment
    is durable, and a durable segment has been released.

    Runs owe in landing order, and a run only grows while its segment is open, so the queue
    is ordered by segment too. The bytes a queue thread landed come with their CRC32C,
    taken in C before their records are taken (fuse/ring_landing.c, ck_fring_sum_landed: no Python
    per slice): a run that owes nothing takes it in (`grew` with a crc) and is never queued;
    one that owes bytes already owes these too. Trio thread only.
    """

    def __init__(self, cap: int = CHECKSUMS_OWED_BYTES) -> None:
        self.cap = cap
        self.runs: deque[Run] = deque()  # the runs with summed < length, oldest first
        self.owed = 0
        self.paid_idle = 0  # bytes summed while the request loop had nothing else to do
        self.taken_landing = 0  # bytes whose CRC32C came with them (the queue threads')

    def grew(self, run: Run, n: int, crc: int | None = None) -> None:
        """`run` grew by `n` bytes (already added to run.length): owed, or summed already
        where `crc` is their CRC32C."""
        if run.summed + n == run.length:  # (it owed nothing before)
            if crc is not None:
                run.crc = crc32c_shift(run.crc, n) ^ crc
                run.summed = run.length
                self.taken_landing += n
                return
            self.runs.append(run)
        self.owed += n
        if self.owed > self.cap:
            self.pay(self.owed - self.cap)

    def pay(self, budget: int) -> None:
        """Sum up to `budget` owed bytes, oldest first."""
        runs = self.runs
        while budget > 0 and runs:
            run = runs[0]
            k = min(run.length - run.summed, budget)
            at = run.soff + run.summed
            run.crc = crc32c(run.seg.view[at:at + k], run.crc, 0)
            run.summed += k
            self.owed -= k
            budget -= k
            if run.summed == run.length:
                runs.popleft()

    def pay_idle(self) -> None:
        """One slice, for the request loop's idle moments."""
        before = self.owed
        self.pay(CHECKSUM_SLICE_BYTES)
        self.paid_idle += before - self.owed

    def settle(self, seg: Segment) -> None:
        """Everything owed up to and including `seg`'s runs is summed."""
        runs = self.runs
        while runs and runs[0].seg.number <= seg.number:
            self.pay(runs[0].length - runs[0].summed)


class Staging:
    """The bounded pool of aligned segment buffers and the currently open segment.

    `append` copies a write into the open segment and returns the runs it landed in; when the
    pool is empty it waits (backpressure) until the flusher returns a buffer. `seal_hook` is
    called with each segment that fills up or is sealed explicitly.
    """

    def __init__(self, segment_bytes: int, staging_bytes: int,
                 seal_hook: Callable[[Segment], None]) -> None:
        """A pool of `staging_bytes` (at least two segments), mapped, not faulted in: the
        daemon has that done once the mount serves (datapath/faultin.py)."""
        if segment_bytes % 4096:
            raise ValueError("segment size must be a multiple of 4096")
        self.segment_bytes = segment_bytes
        self.buffers = [alloc_aligned(segment_bytes, populate=False, huge=True)
                        for _ in range(max(2, staging_bytes // segment_bytes))]
        # In the order the buffers came back: the one written longest ago is reused first.
        self.free: deque = deque(self.buffers)
        # Written segments whose buffers are in `free` and still hold their bytes, by buffer
        # (id): their runs are read from memory (Run.memory). A segment loses its buffer the
        # moment the buffer is taken for a new segment or offered as a tail (_reuse), both
        # on the trio thread, which is where its bytes are read too. Nothing beyond the
        # pool is held.
        self.kept: dict[int, Segment] = {}
        # The same by data log: log -> the kept segments' (lfrom, lend, seg), sorted
        self.kept_ranges: dict[int, list[tuple[int, int, Segment]]] = {}
        self.free_event = trio.Event()
        self.open: Segment | None = None
        self.seal_hook = seal_hook
        self.numbers = 0
        self.last_write = trio.current_time()  # built inside the trio run (daemon._serve)
        self.waiting_writers = 0
        self.error: OSError | None = None  # set while the flusher cannot make progress
        self.checksums = Checksums()
        # Set while the tails are offered to another thread that may copy write payloads
        # into them (the queue threads: fuse/ring.py): takes them back and records what
        # landed there. Everything that changes the open segment or takes a free buffer
        # calls claim() first.
        self.claimer: Callable[[], None] | None = None

    def offer(self, claim: Callable[[], None] | None) -> None:
        """The tails are offered to another thread until `claim` takes them back (None: they
        are no longer offered, and nothing is to be recorded)."""
        self.claimer = claim

    def claim(self) -> None:
        """Staging is about to change here: no other thread copies into the tails from now
        until they are offered again, and what it copied is recorded. The claimer is let go
        before it runs: the staging calls it makes to record what landed claim nothing."""
        claim = self.claimer
        if claim is not None:
            self.claimer = None
            claim()

    @property
    def capacity_bytes(self) -> int:
        return len(self.buffers) * self.segment_bytes

    def staged_segments(self) -> int:
        return len(self.buffers) - len(self.free)

    async def _open_segment(self) -> Segment:
        """The open segment, opening one from the pool (waiting for a free buffer: the
        backpressure). Several writers may wait at once: when buffers come back, the first
        one opens a segment and the others share it."""
        while True:
            self.claim()
            if self.open is not None:
                return self.open
            if self.free:
                break
            if self.error is not None:
                raise self.error
            ev = self.free_event
            if ev.is_set():  # stale: a release happened and its buffers are taken again
                ev = self.free_event = trio.Event()
            self.waiting_writers += 1
            try:
                await ev.wait()
            finally:
                self.waiting_writers -= 1
        self.numbers += 1
        self.open = Segment(self._take(), self.numbers)
        return self.open

    def _take(self):
        """The next free buffer, for a new segment (the written segment it held loses it)."""
        buf = self.free.popleft()
        self._reuse(buf)
        return buf

    def _reuse(self, buf) -> None:
        """`buf` is about to get new bytes: the written segment it still held lets go of it
        (its runs are read from the data log from now on)."""
        seg = self.kept.pop(id(buf), None)
        if seg is None:
            return
        seg.buf = None
        seg.view.release()
        if seg.lfrom != NO_LOG:
            ranges = self.kept_ranges[seg.log]
            i = bisect.bisect_left(ranges, seg.lfrom, key=_START)
            while ranges[i][2] is not seg:  # (a retried placement may share its start)
                i += 1
            del ranges[i]
            if not ranges:
                del self.kept_ranges[seg.log]

    def release(self, seg: Segment) -> None:
        """The flusher wrote `seg`: its buffer goes back to the pool (its runs' checksums
        are taken first), and keeps its bytes readable until it is reused (kept)."""
        self.checksums.settle(seg)
        seg.released = True
        buf = seg.buf
        self.kept[id(buf)] = seg
        if seg.lfrom != NO_LOG:
            ranges = self.kept_ranges.setdefault(seg.log, [])
            if not ranges or ranges[-1][0] < seg.lfrom:  # (the common case: log order)
                ranges.append((seg.lfrom, seg.lend, seg))
            else:
                bisect.insort(ranges, (seg.lfrom, seg.lend, seg), key=_START)
        self.free.append(buf)
        self.free_event.set()

    def kept_bytes(self) -> int:
        """Bytes of written segments still readable from memory."""
        return sum(seg.used for seg in self.kept.values())

    def in_memory(self, log: int, lo: int, hi: int) -> bool:
        """Whether every run byte of this mount's data log `log` in [lo, hi) is in a kept
        segment: the segments placed there from lo to hi are all kept, end to end."""
        ranges = self.kept_ranges.get(log)
        if not ranges:
            return False
        i = bisect.bisect_right(ranges, lo, key=_START) - 1
        if i < 0:
            return False
        pos = lo
        while i < len(ranges):
            a, b, _ = ranges[i]
            if a > pos:
                return False
            pos = max(pos, b)
            if pos >= hi:
                return True
            i += 1
        return False

    def seal(self) -> Segment | None:
        self.claim()
        seg = self.open
        if seg is None or seg.used == 0:
            return None
        self.open = None
        seg.sealed = True
        self.seal_hook(seg)
        return seg

    def tails(self) -> tuple[memoryview | None, memoryview | None]:
        """Where the next write's bytes would go: the unused rest of the open segment (or the
        first free buffer, not taken yet), then the next free buffer; None where no buffer is
        free. A request may be read straight into them; its bytes count only once `landed`
        is called, before any other task runs."""
        self.claim()
        return self.offered_tails()

    def offered_tails(self) -> tuple[memoryview | None, memoryview | None]:
        """tails() without the claim: what the claim hook's owner offers."""
        seg, free = self.open, self.free
        if self.kept and free:  # (bytes may land in what is offered from now on)
            self._reuse(free[0])
            if seg is None and len(free) > 1:
                self._reuse(free[1])
        if seg is not None:
            return seg.view[seg.used:], (memoryview(free[0]) if free else None)
        if not free:
            return None, None
        return memoryview(free[0]), (memoryview(free[1]) if len(free) > 1 else None)

    def landed(self, k: int, on_piece: Callable[..., None], base: int = 0,
               crc: int | None = None) -> None:
        """The first `k` bytes of the first of `tails()` not yet filled are file data now
        (read there in place): data offset `base` on; `crc`: their CRC32C where it was taken
        in C before their record was taken (passed on to on_piece)."""
        self.claim()
        seg = self.open
        if seg is None:  # tails() offered the first free buffer: it becomes the open segment
            self.numbers += 1
            seg = self.open = Segment(self._take(), self.numbers)
        soff = seg.used
        seg.used = soff + k
        if crc is None:
            on_piece(seg, base, soff, k)
        else:
            on_piece(seg, base, soff, k, crc)
        if seg.used == self.segment_bytes:
            self.seal()
        self.last_write = trio.current_time()

    async def append(self, data, on_piece: Callable[[Segment, int, int, int], None],
                     base: int = 0) -> None:
        """Copy `data` into staging. For each piece call on_piece(segment, data offset
        (+ `base`), segment offset, length) right after it is copied (before any other task
        runs)."""
        mv = memoryview(data)
        n = len(mv)
        pos = 0
        while pos < n:
            self.claim()
            seg = self.open
            if seg is None:
                seg = await self._open_segment()
            room = self.segment_bytes - seg.used
            k = room if room < n - pos else n - pos
            soff = seg.used
            seg.view[soff:soff + k] = mv[pos:pos + k]
            seg.used = soff + k
            on_piece(seg, base + pos, soff, k)
            pos += k
            if seg.used == self.segment_bytes:
                self.seal()
        self.last_write = trio.current_time()

    def close(self) -> None:
        for b in self.buffers:
            self._reuse(b)
            try:
                b.close()
            except BufferError:
                pass  # a memoryview still points at it; the mapping goes with the process
        self.buffers = []
        self.free.clear()


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align

