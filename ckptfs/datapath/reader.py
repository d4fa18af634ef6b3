"""The read path: file range -> pieces of runs -> staging memory, or chunks of the data logs.

Bytes in staging memory are served from there: a segment not written yet, or one written whose
buffer the pool has not handed out again (staging.Staging.kept: a checkpoint read back right
after it was saved does not wait for the disk). Their CRC32C is not checked: it was taken of
these very bytes. Other bytes are read through a cache of
fixed-size chunks of the data logs (CHUNK_BYTES, aligned, so O_DIRECT reads work), in pre-faulted
buffers allocated on first use (up to --read-cache) and then reused, consumed chunks first: this
VM's memory is backed lazily, and reading into fresh buffers runs at first-touch speed. A run's
CRC32C is checked the first time it is read from disk (over the chunks it spans); a mismatch
makes reads of that file fail with EIO, other files are unaffected.

A chunk is cached whole, except where a read plan (readplan.py) loaded just the part of it its
next items need: a cached chunk holds bytes [lo, length) of the log's 4 MiB (_Chunk.holds), and
every read asks whether the bytes it needs are there, not only the chunk.

Files of a checkpoint are written one after another, so they lie one after another in the logs,
and a restore reads them in about that order. A sequential reader therefore triggers readahead
in log order (up to --prefetch bytes ahead: from a file's start the whole window, after a jump as
much as it has read in a row): the next files are on their way while the current one is being
deserialised.

Chunk loads and the checks of readahead run in the reader's own threads (LOAD_THREADS of them,
the read path's queue depth), which hand their results back to the trio thread in batches: one
call there for everything that completed since the last one (_landed), not a trio task and a
worker hand-off per 4 MiB chunk (those cost ~190 us of the trio thread each on this VM, a
tenth of its work in a restore: docs/performance-notes.md).
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from bisect import bisect_right
from collections import OrderedDict, deque

import trio

from ckptfs import failpoints
from ckptfs.datapath.readplan import ReadPlan
from ckptfs.datapath.staging import ExtentMap, Run
from ckptfs.format.logs import RunError, RunReader
from ckptfs.io import alloc_aligned

log = logging.getLogger("ckptfs.reader")

CHUNK_BYTES = 4 << 20
SCRATCH_BYTES = 2 << 20  # a huge page: holds any READ (max 1 MiB)
LOAD_THREADS = 4  # concurrent chunk reads (the queue depth of the read path)
NOTE_SLICE = 4096  # files note_replayed notes between two looks at the requests
EVICT_SCAN_MAX = 256  # chunks a plan's choice of what to let go looks at, oldest first
LOAD_ALIGN = 4096  # a part of a chunk is loaded from and to multiples of this (O_DIRECT)
GATHER_MAX_PARTS = 128  # a READ of more parts is assembled in scratch (writev: IOV_MAX 1024)
_ZEROS = memoryview(bytes(SCRATCH_BYTES))


def _zeros(n: int) -> list:
    return [_ZEROS[:min(n - i, SCRATCH_BYTES)] for i in range(0, n, SCRATCH_BYTES)]


def _widen(need: dict, key: tuple[int, int, int], a: int, b: int) -> None:
    """Add bytes [a, b) of chunk `key` to `need`: chunk key -> the bytes of it needed (one
    range per chunk, from the first to the last byte needed)."""
    was = need.get(key)
    need[key] = (a, b) if was is None else (min(a, was[0]), max(b, was[1]))


def _need(need: dict, layer: int, logno: int, lo: int, hi: int) -> None:
    """Add bytes [lo, hi) of a log to `need` (_widen), chunk by chunk."""
    for idx in range(lo // CHUNK_BYTES, (hi - 1) // CHUNK_BYTES + 1):
        base = idx * CHUNK_BYTES
        _widen(need, (layer, logno, idx), max(lo, base) - base, min(hi, base + CHUNK_BYTES) - base)


class _Load:
    """A chunk load in flight: `done` is set on the trio thread once it landed (in the
    cache, or not: discarded, or failed with `error`); `waited`: a READ waits for it (set
    under the reader's `cond`)."""
    __slots__ = ("done", "error", "waited")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: OSError | None = None
        self.waited = False


_CHECK = object()  # the loader threads' job that checks the runs asked for meanwhile


class _Chunk:
    """A cached chunk: its bytes [lo, length) are the log's (all from 0 but where a read
    plan loaded only the part it needs: _plan_ahead); `short`: the log ends at `length`."""
    __slots__ = ("buf", "view", "lo", "length", "short")

    def __init__(self, buf, lo: int, length: int, short: bool) -> None:
        self.buf = buf
        self.view = memoryview(buf)
        self.lo = lo
        self.length = length
        self.short = short

    def holds(self, a: int, b: int) -> bool:
        """Whether bytes [a, b) of the chunk are here (or lie past the log's end)."""
        return self.lo <= a and (b <= self.length or self.short)

    def serves(self, a: int, b: int) -> bool:
        """Whether bytes [a, b) of the chunk are here, every one of them."""
        return self.lo <= a and b <= self.length


class Reader:
    def __init__(self, writer_dirs: dict[int, str], cache_bytes: int, prefetch_bytes: int,
                 direct: bool = False, populate: bool = False,
                 interruptible=trio.CancelScope, on_fatal=None,
                 fallback: dict[int, str] | None = None, in_memory=None) -> None:
        # told (trio thread) when a loader thread ends on a defect: (exception, where)
        self.on_fatal = on_fatal
        # the data logs: which file holds a run, descriptors (O_DIRECT where it works), chunk
        # reads, checksum checks and their errors
        self.logs = RunReader(writer_dirs, direct=direct, fallback=fallback)
        self.max_chunks = max(8, cache_bytes // CHUNK_BYTES)
        # readahead window in chunks (--prefetch; at least one unless it is 0)
        self.window = max(1, prefetch_bytes // CHUNK_BYTES) if prefetch_bytes > 0 else 0
        self.chunks: OrderedDict[tuple[int, int, int], _Chunk] = OrderedDict()
        self.spare: list = []  # buffers of evicted chunks, reused before allocating
        self.allocated = 0
        if populate:  # like staging: fault the memory in once, at mount, not during a restore
            self.spare = [alloc_aligned(CHUNK_BYTES, populate=True, huge=True)
                          for _ in range(self.max_chunks)]
            self.allocated = self.max_chunks
        self.pins: dict[tuple[int, int, int], int] = {}
        self.loading: dict[tuple[int, int, int], _Load] = {}
        self.gen: dict[tuple[int, int], int] = {}  # bumped when a log range is (re)written
        self.log_end: dict[tuple[int, int], int] = {}  # end of the known runs in each log
        # per log, shared by all readers: (the last chunk a sequential READ touched, the end of
        # the chunks readahead asked for). A READ between the two only asks for the chunks past
        # the end (readahead runs on every sequential READ); a READ before it (a second pass)
        # or at or past the end starts anew, and so does the log's next write (invalidate).
        # Chunks asked for and evicted before use are not asked for again while in the window.
        self.ra_window: dict[tuple[int, int], tuple[int, int]] = {}
        self.bad: dict[Run, str] = {}  # runs that failed their check -> what failed
        # Recycling: a chunk whose every live byte has been served (to handles that had not
        # read those bytes before) is "consumed": its buffer is reused before new memory is
        # allocated, so a streaming restore touches ~the readahead window of fresh memory,
        # not the whole cache (first-touch memory is slow: docs/benchmarks.md).
        self.live: dict[tuple[int, int, int], int] = {}  # bytes of known runs per chunk
        self.served: dict[tuple[int, int, int], int] = {}
        # consumed chunks, oldest first (a dict for its order). Entries of chunks dropped since
        # are removed when _buffer meets them. Not kept in the LRU order of self.chunks: a
        # re-read of a consumed chunk (torch.load reads a file's first MiB again after a seek
        # to the end) moves it to the MRU end, where a scan from the LRU end would not find it.
        self.consumed: dict[tuple[int, int, int], None] = {}
        self.recycled = 0
        # Checksums are checked in the loader threads as soon as all chunks of a run are
        # loaded (readahead), so READ handlers on the trio thread rarely compute one; the
        # first loader thread free takes all those asked for meanwhile in one job (_CHECK).
        self.chunk_runs: dict[tuple[int, int, int], list[Run]] = {}
        self.verifying: set[Run] = set()
        self.verified_ahead = 0
        self.plan_loads = 0  # chunks loaded ahead by a read plan (readplan.py)
        self.plan_misses = 0  # loads a READ under a plan started itself (it did not foresee)
        # The read plans READs follow (one per DCP data file being read: ranks restoring on
        # one node read one each); while there is one, the chunk to let go when the cache is
        # full is one it does not read again, else the one it reads again furthest ahead
        # (_evict, by the plan's chunk map: _map_plan).
        self.plans: dict[ReadPlan, None] = {}
        self.scratch = None  # reply assembly buffer for reads spanning several pieces
        # set by the daemon: readahead runs, and checks ahead of the READs (without it, a
        # READ loads what it needs and checks it itself)
        self.background = False
        # The loader threads (started at the first load): their jobs (chunk loads in the
        # order asked for; a check job goes first) and the checks asked for, both under
        # `cond`; what they completed, handed to the trio thread by one call (_landed) for
        # all that completed before it runs (`posted` while that call is on its way). With
        # `lazy` (set by the fast path, which lands them at every settle of the ring: before
        # every request the trio thread serves and on the idle tick), only a load a READ
        # waits for is handed over by a call of its own: each such call is a wake-up of the
        # trio thread (~60 us of its CPU on this VM), once per chunk of a restore.
        self.lazy = False
        self.cond = threading.Condition()
        self.jobs: deque = deque()
        self.checks: list[tuple[list[Run], list]] = []  # (the runs, their chunks, pinned)
        self.check_queued = False
        self.done: list[tuple] = []
        self.posted = False
        self.stopping = False
        self.threads: list[threading.Thread] = []
        self.token: trio.lowlevel.TrioToken | None = None
        # a wait for the disk, as a context manager yielding its CancelScope: the daemon's is
        # cancelled when the READ's caller is being killed (fuse/interrupts.py), so that the
        # READ is answered while the loader thread's disk read goes on
        self.interruptible = interruptible
        # in_memory(log, lo, hi): whether every run byte of this mount's data log `log` in
        # [lo, hi) is in staging memory (staging.Staging.in_memory): readahead skips it
        self.in_memory = in_memory
        self.disk_reads = 0
        self.disk_bytes = 0
        self.memory_bytes = 0  # bytes READs were served from staging memory
        self.load_seconds = 0.0  # time spent in disk reads (loader threads)
        self.wait_seconds = 0.0  # time READ handlers waited for disk reads

    @property
    def cached(self) -> int:
        return len(self.chunks) * CHUNK_BYTES

    def log_in_use(self, layer: int, number: int) -> bool:
        """A READ, a check or a load holds chunks of the log right now (pinned or loading)."""
        return any(k[0] == layer and k[1] == number for k in (*self.pins, *self.loading))

    def range_in_use(self, layer: int, number: int, lo: int, hi: int) -> bool:
        """A READ, a check or a load holds a chunk of bytes [lo, hi) of the log right now."""
        first, last = lo // CHUNK_BYTES, (hi - 1) // CHUNK_BYTES
        return any(k[0] == layer and k[1] == number and first <= k[2] <= last
                   for k in (*self.pins, *self.loading))

    def hold(self, layer: int, number: int) -> None:
        """Open the log's descriptor now (worker thread; before its file is removed: the
        reads using it go on through the descriptor)."""
        self.logs.fd(layer, number)

    def logs_of(self, layer: int) -> set[int]:
        """The logs of `layer` the reader holds anything of (a descriptor, chunks, their
        bookkeeping)."""
        return self.logs.logs_of(layer) | {
            k[1] for table in (self.chunks, self.live, self.gen, self.log_end, self.ra_window,
                               self.chunk_runs)
            for k in table if k[0] == layer}

    def forget_log(self, layer: int, number: int) -> None:
        """The log is gone (retired) and nothing uses it: close its descriptor, drop its
        chunks and their bookkeeping."""
        key = (layer, number)
        self.logs.forget(layer, number)
        for k in [k for k in self.chunks if k[:2] == key]:
            self.spare.append(self.chunks.pop(k).buf)
        for table in (self.live, self.served, self.consumed, self.chunk_runs):
            for k in [k for k in table if k[:2] == key]:
                del table[k]
        for table in (self.gen, self.log_end, self.ra_window):
            table.pop(key, None)

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            dropped = [j for j in self.jobs if j is not _CHECK]
            self.jobs.clear()
            self.cond.notify_all()
        for _, _, _, ld, *_ in dropped:  # (no READ waits for them once the mount ended)
            ld.error = OSError(errno.EIO, "the reader is closed")
            ld.done.set()
        end = time.monotonic() + 5
        for t in self.threads:  # (one stuck in a read of a store that hangs is left behind)
            t.join(timeout=max(0.0, end - time.monotonic()))
        self.threads = []
        self.logs.close()
        self.chunks.clear()
        self.spare.clear()

    # ------------------------------------------------------------ bookkeeping
    async def note_replayed(self, inodes: list) -> None:
        """note_runs of the files a mount replayed, a slice at a time while the mount already
        serves (on the mount's path it took ~1.7 us per file: 0.17 s of a 100,000-file
        mount). A file's extent map is read when its slice comes, so runs replaced since the
        mount are not noted; runs placed since (they have a segment) are left out, as
        note_runs wants, and so are those of a writer the mount dropped meanwhile; until its
        file is noted a run is read and checked on demand, as a run flushed later is."""
        layers = self.logs.writer_dirs
        for i in range(0, len(inodes), NOTE_SLICE):
            self.note_runs(r for x in inodes[i:i + NOTE_SLICE] if x.emap is not None
                           for r in x.emap.runs() if r.seg is None and r.layer in layers)
            await trio.lowlevel.checkpoint()

    def note_runs(self, runs) -> None:
        """Durable runs known to be in the logs at mount (replayed). Runs flushed later are not
        noted: they are not recycled early nor checked ahead, only read and checked on demand."""
        live, log_end, chunk_runs = self.live, self.log_end, self.chunk_runs
        for r in runs:  # (one pass per mount over every run of the tree: kept lean)
            log = r.log
            if log < 0:
                continue
            layer, loff = r.layer, r.loff
            end = loff + r.length
            key = (layer, log)
            if end > log_end.get(key, 0):
                log_end[key] = end
            first, last = loff // CHUNK_BYTES, (end - 1) // CHUNK_BYTES
            for idx in range(first, last + 1):
                k = (layer, log, idx)
                live[k] = live.get(k, 0) + (r.length if first == last else
                                            min(end, (idx + 1) * CHUNK_BYTES)
                                            - max(loff, idx * CHUNK_BYTES))
                if not r.verified:
                    waiting = chunk_runs.get(k)
                    if waiting is None:
                        chunk_runs[k] = [r]
                    else:
                        waiting.append(r)

    def invalidate(self, layer: int, logno: int, loff: int, length: int) -> None:
        """A log range was written: drop cached chunks over it, and make loads in flight
        over it discard their result."""
        key = (layer, logno)
        self.gen[key] = self.gen.get(key, 0) + 1  # loads in flight on this log are discarded:
        self.ra_window.pop(key, None)  # readahead asks for them again
        for idx in range(loff // CHUNK_BYTES, (loff + length - 1) // CHUNK_BYTES + 1):
            self._let_go((layer, logno, idx))
        if loff + length > self.log_end.get(key, 0):
            self.log_end[key] = loff + length

    def _let_go(self, key: tuple[int, int, int]) -> None:
        """Chunk `key` (if cached) leaves the cache: its buffer is reused, unless the chunk is
        pinned (a READ, a check or a load may still use the buffer: freed later instead)."""
        ch = self.chunks.pop(key, None)
        if ch is not None:
            if key in self.pins:
                self.allocated -= 1
            else:
                self.spare.append(ch.buf)

    # ------------------------------------------------------------ reads
    async def read(self, emap: ExtentMap, off: int, size: int, file_size: int,
                   ahead: int | None = None, seen: list | None = None, gather: bool = False):
        """Bytes [off, off+size) of a file. `ahead`: bytes to read ahead in log order (None:
        the configured --prefetch, the most; in whole chunks, so less than one is none): worth it
        for a reader that continues where it stopped; random readers get only the chunks they
        touch. `seen`: the reading handle's served ranges (for recycling consumed chunks),
        updated here. `gather`: return a list of buffers (views into chunks and segments, valid
        until the next await) instead of one, so a reply can be written with writev and no
        copy."""
        hi = min(off + size, file_size)
        if off >= hi:
            return [] if gather else b""
        ahead = self._window_of(ahead)
        out = self._cached(emap, off, hi, ahead)
        if out is None:
            out = await self._read(emap, off, hi, ahead, gather)
        elif gather:
            out = [out]
        if seen is not None:
            self._account(emap, off, hi, seen)
        return out

    def _cached(self, emap: ExtentMap, off: int, hi: int, ahead: int) -> memoryview | None:
        """The common READ (a small file whole, or the next piece of a big one): [off, hi)
        inside one piece of one checked run whose bytes sit in one cached chunk. Its view, with
        the readahead _read would start, and nothing else _read does (pins, checks, waits:
        none are needed); None for every other READ (_read). Per READ of a small file the
        interpreter runs cold, so this is ~2x less of it (docs/performance-notes.md)."""
        pieces = emap.find(off, hi)
        if len(pieces) != 1:
            return None
        s, n, run, roff = pieces[0]
        if s != off or n != hi - off or not run.verified or run.log < 0:
            return None
        if run.memory() is not None:
            return None
        lo = run.loff + roff
        idx = lo // CHUNK_BYTES
        if (lo + n - 1) // CHUNK_BYTES != idx:
            return None
        key = (run.layer, run.log, idx)
        ch = self.chunks.get(key)
        a = lo % CHUNK_BYTES
        if ch is None or not ch.serves(a, a + n):
            return None
        if ahead:
            self._ahead_of(emap, (key,), off, hi, ahead)
        return self._served(key, ch, a, n)

    def read_window(self, emap: ExtentMap, start: int, file_size: int, limit: int,
                    max_parts: int, max_chunks: int, pinned=()):
        """The file's bytes from `start` on, as far as they lie in checked runs in cached chunks
        (up to `limit` bytes, `max_parts` views, `max_chunks` chunks): (the views, end to end,
        the chunks' keys, whether they reach the file's end), the chunks pinned (unpin them
        once the views are no longer used: the chunks are neither reused nor dropped before);
        None when not one byte is there. Chunks in `pinned` (other windows' already) do not
        count in `max_chunks`. A read window of the queue threads (fuse/ring.c), which
        answer a handle's next READs from it."""
        hi = min(file_size, start + limit)
        parts: list = []
        keys: dict[tuple[int, int, int], None] = {}
        new = 0  # (keys not in pinned)
        pos = start
        last = None  # (the last part: its chunk and where in it it starts and ends)
        for s, n, run, roff in emap.find(start, hi):
            if (s != pos or not run.verified or run.log < 0 or run.memory() is not None
                    or run in self.bad):
                break  # (a hole, a run not checked yet, or bytes still in staging)
            lo = run.loff + roff
            while n > 0:
                key = (run.layer, run.log, lo // CHUNK_BYTES)
                ch = self.chunks.get(key)
                a = lo % CHUNK_BYTES
                k = min(n, CHUNK_BYTES - a)
                fresh = key not in keys and key not in pinned
                if ch is None or not ch.serves(a, a + k) or (fresh and new >= max_chunks):
                    break
                if last is not None and last[0] == key and last[2] == a:
                    # (pieces end to end in one chunk, e.g. a file's runs: one part)
                    last = (key, last[1], a + k)
                    parts[-1] = ch.view[last[1]:a + k]
                elif len(parts) < max_parts:
                    last = (key, a, a + k)
                    parts.append(ch.view[a:a + k])
                else:
                    break
                keys[key] = None
                new += fresh
                pos, lo, n = pos + k, lo + k, n - k
            if n > 0:
                break
        if pos == start:
            return None
        self._pin(keys)
        return parts, list(keys), pos == file_size

    def has(self, emap: ExtentMap, off: int) -> bool:
        """Whether byte `off` of a file is in a checked run in a cached chunk (read_window
        would reach it)."""
        for _, _, run, roff in emap.find(off, off + 1):
            if not run.verified or run.log < 0 or run.memory() is not None:
                return False
            lo = run.loff + roff
            ch = self.chunks.get((run.layer, run.log, lo // CHUNK_BYTES))
            return ch is not None and ch.serves(lo % CHUNK_BYTES, lo % CHUNK_BYTES + 1)
        return False

    def _holds(self, key: tuple[int, int, int], a: int, b: int) -> bool:
        """Whether bytes [a, b) of chunk `key` are cached."""
        ch = self.chunks.get(key)
        return ch is not None and ch.holds(a, b)

    def unpin(self, keys) -> None:
        """The views of a read_window() over these chunks are no longer used."""
        self._unpin(keys)

    def window_served(self, emap: ExtentMap, off: int, hi: int, ahead: int | None,
                      seen: list | None) -> None:
        """Bytes [off, hi) of a file were served from a read_window() (fuse/ring.c): what read()
        does besides the bytes (the chunks become the most recently used, readahead as
        `ahead` says, the handle's `seen` for recycling)."""
        ahead = self._window_of(ahead)
        keys: dict[tuple[int, int, int], None] = {}
        for _, n, run, roff in emap.find(off, hi):
            if run.log < 0 or run.memory() is not None:
                continue
            lo = run.loff + roff
            for idx in range(lo // CHUNK_BYTES, (lo + n - 1) // CHUNK_BYTES + 1):
                keys[(run.layer, run.log, idx)] = None
        for key in keys:
            ch = self.chunks.get(key)
            if ch is not None:
                self._served(key, ch, 0, 0)
        if ahead and keys:
            self._ahead_of(emap, keys, off, hi, ahead)
        if seen is not None:
            self._account(emap, off, hi, seen)

    def _served(self, key: tuple[int, int, int], ch: _Chunk, a: int, n: int) -> memoryview:
        """Bytes [a, a+n) of cached chunk `key`, about to be served: it becomes the most
        recently used, and if it had been consumed, the last consumed one to be reused."""
        self.chunks.move_to_end(key)
        consumed = self.consumed
        if key in consumed:
            del consumed[key]
            consumed[key] = None
        return ch.view[a:a + n]

    def _account(self, emap: ExtentMap, off: int, hi: int, seen: list) -> None:
        """Count the bytes of [off, hi) this handle had not read before against their chunks;
        a chunk whose live bytes are all served becomes the first candidate for reuse."""
        if not seen:  # the handle's first READ
            seen.append([off, hi])
            new = [(off, hi)]
        elif seen[-1][1] == off:  # the common case: reading on from where it stopped
            seen[-1][1] = hi
            new = [(off, hi)]
        else:  # seen: sorted, disjoint; merge [off, hi) in and collect what it adds
            new, pos, merged = [], off, []
            mlo, mhi = off, hi
            for a, b in seen:
                if b < off or a > hi:
                    merged.append([a, b])
                    continue
                if a > pos:
                    new.append((pos, a))
                pos = max(pos, b)
                mlo, mhi = min(mlo, a), max(mhi, b)
            if pos < hi:
                new.append((pos, hi))
            merged.append([mlo, mhi])
            merged.sort()
            seen[:] = merged
        live, served, chunks = self.live, self.served, self.chunks
        for lo, up in new:
            for _, n, run, roff in emap.find(lo, up):
                if run.log < 0 or run.memory() is not None:
                    continue
                a = run.loff + roff
                b = a + n
                for idx in range(a // CHUNK_BYTES, (b - 1) // CHUNK_BYTES + 1):
                    k = (run.layer, run.log, idx)
                    want = live.get(k)
                    if want is None:
                        continue
                    got = served.get(k, 0) + (min(b, (idx + 1) * CHUNK_BYTES)
                                              - max(a, idx * CHUNK_BYTES))
                    served[k] = got
                    if got >= want and k not in self.consumed:
                        self.consumed[k] = None
                        if k in chunks:
                            chunks.move_to_end(k, last=False)

    async def _read(self, emap: ExtentMap, off: int, hi: int, ahead, gather: bool):
        while True:
            pieces = emap.find(off, hi)
            keys: dict[tuple[int, int, int], tuple[int, int]] = {}  # -> the bytes needed
            verify = []
            staged = []
            for _, n, run, roff in pieces:
                if run.memory() is not None:
                    staged.append(run)
                    continue
                if run in self.bad:
                    raise RunError(self.bad[run])
                if run.log < 0:
                    raise RunError("run lost: neither in staging nor in a data log")
                if run.verified:
                    lo, ln = run.loff + roff, n
                else:
                    lo, ln = run.loff, run.length
                    verify.append(run)
                _need(keys, run.layer, run.log, lo, lo + ln)
            if keys:
                if ahead:
                    self._ahead_of(emap, keys, off, hi, ahead)
                self._pin(keys)
                mine = [r for r in verify if r not in self.verifying]
                self.verifying.update(mine)  # checked below: not again by _verify_ahead
                try:
                    missing = {k: ab for k, ab in keys.items() if not self._holds(k, *ab)}
                    if missing:
                        t0 = time.perf_counter()
                        with self.interruptible() as scope:
                            # (a plan's READ loads the part it needs, like its look ahead)
                            await self._wait_loads(missing, isinstance(ahead, ReadPlan))
                        if scope.cancelled_caught:
                            raise InterruptedError(errno.EINTR, "the reader is being killed")
                        self.wait_seconds += time.perf_counter() - t0
                    if any(not self._holds(k, *ab) for k, ab in keys.items()):
                        continue  # invalidated, or a part loaded, meanwhile: look again
                    if any(r.memory() is None for r in staged):
                        continue  # flushed and released while we waited: look again
                    for run in verify:
                        if not run.verified:
                            self._verify(run)
                    return self._copy(pieces, off, hi, gather)
                finally:
                    self._unpin(keys)
                    self.verifying.difference_update(mine)
            return self._copy(pieces, off, hi, gather)

    def _copy(self, pieces: list, off: int, hi: int, gather: bool = False):
        """The bytes of [off, hi): a view into the chunk or segment when one piece covers it
        (pyfuse3 takes any contiguous buffer and copies it into the reply before the next task
        runs, so no copy here), else a view of the scratch buffer. With `gather`, a list: the
        views of each piece in each chunk (zeros for holes), which the fast path's writev
        gathers (up to GATHER_MAX_PARTS of them, else [the scratch view])."""
        def source(run: Run, roff: int, n: int):
            mv = run.memory()
            if mv is not None:
                self.memory_bytes += n
                return [mv[roff:roff + n]]
            parts, lo = [], run.loff + roff
            while n > 0:
                key = (run.layer, run.log, lo // CHUNK_BYTES)
                a = lo % CHUNK_BYTES
                k = min(n, CHUNK_BYTES - a)
                parts.append(self._served(key, self.chunks[key], a, k))
                lo += k
                n -= k
            return parts

        parts, pos = [], off
        for s, n, run, roff in pieces:
            if s > pos:  # a hole reads as zeros
                parts.extend(_zeros(s - pos))
            parts.extend(source(run, roff, n))
            pos = s + n
        if pos < hi:
            parts.extend(_zeros(hi - pos))
        if gather and len(parts) <= GATHER_MAX_PARTS:
            return parts
        if len(parts) == 1:
            return parts[0]
        # Several parts (a chunk or segment boundary, or holes) for pyfuse3, or too many for one
        # writev: assembled in a reused scratch buffer (warm memory; the reply is written from
        # it before any other task runs).
        size = hi - off
        if self.scratch is None or len(self.scratch) < size:
            self.scratch = alloc_aligned(-(-max(size, SCRATCH_BYTES) // SCRATCH_BYTES)
                                         * SCRATCH_BYTES, populate=True, huge=True)
        out = memoryview(self.scratch)[:size]
        pos = 0
        for p in parts:
            out[pos:pos + len(p)] = p
            pos += len(p)
        return [out] if gather else out

    def _verify(self, run: Run) -> None:
        """Check the run over its cached chunks (KeyError: one is not cached); RunError on a
        mismatch or where the log ends before the run does, and the run stays bad."""
        parts, lo, n = [], run.loff, run.length
        while n > 0:
            key = (run.layer, run.log, lo // CHUNK_BYTES)
            ch = self.chunks[key]
            a = lo % CHUNK_BYTES
            k = min(n, CHUNK_BYTES - a)
            if not ch.holds(a, a + k):  # (a part of the chunk without the run's bytes)
                raise KeyError(key)
            parts.append(ch.view[a:min(a + k, ch.length)])
            if a + k > ch.length:  # the log ends before the run does
                break
            lo += k
            n -= k
        try:
            self.logs.check(run, parts)
        except RunError as exc:
            log.error("%s", exc.strerror)  # (the application gets EIO, the log says why)
            self.bad[run] = exc.strerror
            raise
        run.verified = True

    def _verify_ahead(self, key: tuple[int, int, int]) -> None:
        """Chunk `key` just arrived: have a loader thread check every run over it whose
        chunks are now all cached (its chunks stay pinned meanwhile)."""
        if not self.background:
            return
        runs = self.chunk_runs[key]
        keep, ready, pinned = [], [], {}
        for run in runs:
            if run.verified or run in self.bad:
                continue
            keep.append(run)
            if run in self.verifying:
                continue
            need: dict[tuple[int, int, int], tuple[int, int]] = {}
            _need(need, run.layer, run.log, run.loff, run.loff + run.length)
            if all(self._holds(k, *ab) for k, ab in need.items()):
                ready.append(run)
                pinned.update(dict.fromkeys(need))
        if keep:
            self.chunk_runs[key] = keep
        else:
            del self.chunk_runs[key]
        if ready:  # (a chunk may hold hundreds of small runs: one check for all of them)
            self.verifying.update(ready)
            self._pin(pinned)
            self._start_threads()
            with self.cond:
                self.checks.append((ready, list(pinned)))
                if not self.check_queued:  # (ahead of the loads: the sooner a run is
                    # checked, the less often a READ must check it itself)
                    self.check_queued = True
                    self.jobs.appendleft(_CHECK)
                    self.cond.notify()

    def _checked(self, batch: list) -> None:
        for runs, keys in batch:
            self._unpin(keys)
            self.verifying.difference_update(runs)

    def _verify_quietly(self, runs: list[Run]) -> int:
        """Loader thread. A mismatch puts the run in self.bad (the READ reports EIO); a chunk
        dropped meanwhile (its log range rewritten) leaves the check to the READ path."""
        done = 0
        for run in runs:
            if run.verified:  # (a READ that could not wait checked it meanwhile)
                continue
            try:
                self._verify(run)
                done += 1
            except (RunError, KeyError):
                pass
        return done

    def _pin(self, keys) -> None:
        for k in keys:
            self.pins[k] = self.pins.get(k, 0) + 1

    def _unpin(self, keys) -> None:
        for k in keys:
            n = self.pins[k] - 1
            if n:
                self.pins[k] = n
            else:
                del self.pins[k]

    def _buffer(self):
        if self.spare:
            return self.spare.pop()
        stale, pick = [], None
        for key in self.consumed:  # the oldest consumed chunk still cached and not pinned
            if key not in self.chunks:
                stale.append(key)
            elif key not in self.pins:  # (a pinned one may still be checked or served)
                pick = key
                break
        for key in stale:
            del self.consumed[key]
        if pick is not None:
            del self.consumed[pick]
            self.recycled += 1
            return self.chunks.pop(pick).buf
        if self.allocated < self.max_chunks:
            self.allocated += 1
            return alloc_aligned(CHUNK_BYTES, populate=True, huge=True)
        key = self._evict()
        if key is not None:
            return self.chunks.pop(key).buf
        self.allocated += 1  # everything pinned (tiny cache): grow rather than fail
        return alloc_aligned(CHUNK_BYTES, populate=True, huge=True)

    def _evict(self) -> tuple[int, int, int] | None:
        """The cached chunk to let go of: the least recently used one not pinned; while one
        read plan is in use, the least recently used one it does not read again, else the
        one it reads again furthest ahead of its reader. (With several plans at once, ranks
        restoring side by side, least recently used: weighing both plans' futures read more
        from disk than that, tests/test_read_plans.py.)"""
        plan = next(iter(self.plans)) if len(self.plans) == 1 else None
        pins = self.pins
        far, pick = -1, None
        for n, key in enumerate(self.chunks):  # least recently used first
            if key in pins:
                continue
            if n >= EVICT_SCAN_MAX and pick is not None:  # (a large cache: the oldest part)
                break
            if plan is None:
                return key
            if key in plan.soon:
                continue
            at = plan.uses.get(key)
            ahead = None if at is None else plan.next_use(at)
            if ahead is None:
                return key
            if ahead > far:
                far, pick = ahead, key
        if pick is None and plan is not None:  # (only chunks wanted soon are left)
            pick = next((k for k in self.chunks if k not in pins), None)
        return pick

    @staticmethod
    def _map_plan(emap: ExtentMap, plan: ReadPlan) -> None:
        """Once per plan, its items' chunks (the file's extents `emap` as they are now: a
        change later only makes the plan's loads guesses): per item, where each of its chunks'
        parts ends in the file, the chunk, and the bytes of it the item needs: those of its
        runs, whole (a run is checked whole), which may reach into chunks before and after
        the item's bytes, and of the runs its reader's READs reach past its end (plan.reach)
        (plan.parts); per chunk, the plan positions that read it (plan.uses)."""
        parts: list[tuple[list[int], list[tuple[int, int, int]], list[tuple[int, int]]]] = []
        uses: dict[tuple[int, int, int], list[int]] = {}
        for pos, (s, n) in enumerate(plan.items):
            ends: list[int] = []
            keys: list[tuple[int, int, int]] = []
            spans: list[tuple[int, int]] = []
            for fs, m, run, roff in emap.find(s, min(plan.size, s + n + plan.reach)):
                if run.log < 0 or run.memory() is not None:
                    continue
                a = run.loff + roff
                r0, r1 = run.loff, run.loff + run.length
                for idx in range(r0 // CHUNK_BYTES, (r1 - 1) // CHUNK_BYTES + 1):
                    k = (run.layer, run.log, idx)
                    base = idx * CHUNK_BYTES
                    end = fs + min(m, max(0, base + CHUNK_BYTES - a))
                    span = (max(r0, base) - base, min(r1, base + CHUNK_BYTES) - base)
                    if keys and keys[-1] == k:
                        ends[-1] = end
                        spans[-1] = (min(spans[-1][0], span[0]), max(spans[-1][1], span[1]))
                        continue
                    ends.append(end)
                    keys.append(k)
                    spans.append(span)
                    at = uses.setdefault(k, [])
                    if not at or at[-1] != pos:
                        at.append(pos)
            parts.append((ends, keys, spans))
        plan.parts, plan.uses = parts, uses

    def drop_plan(self, plan: ReadPlan) -> None:
        """The handle that followed `plan` is gone."""
        self.plans.pop(plan, None)

    def _start_load(self, key: tuple[int, int, int], part: tuple[int, int] | None = None
                    ) -> _Load:
        """Have a loader thread read chunk `key` (not loading; not cached, or only in part):
        all of it, into a buffer taken now (_buffer: a cached chunk may go for it, so the
        caller pins the chunks it is about to serve), which replaces the part cached on
        landing; or with `part` (a, b), widened to LOAD_ALIGN, the bytes from a to b: into
        a buffer taken now when none of the chunk is cached, else into the chunk's own
        buffer, the bytes between the part and those cached (on one side: a part on both
        sides loads the one before first), the chunk pinned meanwhile."""
        ext = False
        if part is None:
            lo, hi = 0, CHUNK_BYTES
        else:
            lo = part[0] // LOAD_ALIGN * LOAD_ALIGN
            hi = min(CHUNK_BYTES, -(-part[1] // LOAD_ALIGN) * LOAD_ALIGN)
            ch = self.chunks.get(key)
            if ch is not None and (lo < ch.lo or not ch.short):  # (none lies past a short one)
                ext = True
                if lo < ch.lo:
                    hi = ch.lo  # (and the part after, if any, at the next look)
                else:
                    lo = ch.length
        self._start_threads()
        if ext:
            buf = ch.buf
            self._pin((key,))  # (its buffer stays the chunk's: not reused meanwhile)
        else:
            buf = self._buffer()
        ld = self.loading[key] = _Load()
        job = (key, buf, self.gen.get(key[:2], 0), ld, lo, hi, ext)
        with self.cond:
            self.jobs.append(job)
            self.cond.notify()
        return ld

    async def _wait_loads(self, missing: dict, plan: bool = False) -> None:
        """Load the chunks `missing` (key -> the bytes needed of it: those not cached; the
        whole chunk, or for a READ under a read `plan` those bytes, a load the plan did not
        foresee: counted) and wait for them here (a load in flight
        is waited for as it is: the caller looks again). This wait can be cancelled (the
        READ's caller is being killed) while a disk read cannot; the loads go on without it.
        Raises the first load's error."""
        loads = []
        for k, ab in missing.items():
            ld = self.loading.get(k)
            if ld is None:
                if self._holds(k, *ab):
                    continue
                ld = self._start_load(k, ab if plan else None)
                self.plan_misses += plan
            loads.append(ld)
        with self.cond:  # (a load that completes from now on is handed over at once)
            for ld in loads:
                ld.waited = True
        self.land()  # (one completed before: not handed over yet with `lazy`)
        for ld in loads:
            await ld.done.wait()
        for ld in loads:
            err = ld.error
            if err is not None:  # (a copy: several READs may raise it)
                if isinstance(err, RunError):
                    raise RunError(err.strerror)
                if isinstance(err, OSError) and err.errno:
                    raise OSError(err.errno, err.strerror)
                raise RunError(f"reading the data log: {err}")

    def _start_threads(self) -> None:
        token = trio.lowlevel.current_trio_token()  # (the run that gets the results)
        if token is not self.token:
            self.token = token
            self.land()  # (results a run that ended left behind: their loads are still listed)
        if not self.threads and not self.stopping:
            self.threads = [threading.Thread(target=self._loader, name=f"ckptfs-load-{i}",
                                             daemon=True) for i in range(LOAD_THREADS)]
            for t in self.threads:
                t.start()

    def _loader(self) -> None:
        """A loader thread (_serve_loads) that says so when it ends on a defect: the mount
        is failed then (on_fatal), and the loads no thread will take fail with EIO."""
        held: list = []  # (the job the thread works on: its waiters are told too)
        try:
            self._serve_loads(held)
        except BaseException as exc:
            log.critical("a loader thread of the read path failed", exc_info=True)
            try:
                self.token.run_sync_soon(self._loader_failed, exc, held)
            except trio.RunFinishedError:
                pass

    def _loader_failed(self, exc: BaseException, held: list) -> None:
        """Trio thread: a loader thread is gone; the load it held and those queued fail (the
        threads left take the next ones), and the mount is failed (on_fatal)."""
        with self.cond:
            dropped = [j for j in [*held, *self.jobs] if j is not _CHECK]
            self.jobs.clear()
        for _, _, _, ld, *_ in dropped:
            ld.error = OSError(errno.EIO, f"the read path failed: {exc!r}")
            ld.done.set()
        if self.on_fatal is not None:
            self.on_fatal(exc, "a loader thread of the read path")

    def _serve_loads(self, held: list) -> None:
        """Jobs until the reader closes; each result goes into `done`, and the trio thread is
        called (_landed) unless a call is on its way already, or, with `lazy`, unless no READ
        waits for it (it lands at the fast path's next settle)."""
        cond, jobs = self.cond, self.jobs
        while True:
            with cond:
                while not jobs and not self.stopping:
                    cond.wait()
                if self.stopping:
                    return
                job = jobs.popleft()
                held[:] = [job]
                failpoints.hit("loader")
                if job is _CHECK:
                    batch, self.checks, self.check_queued = self.checks, [], False
            if job is _CHECK:
                runs = [r for rs, _ in batch for r in rs]
                try:
                    result = (_CHECK, batch, self._verify_quietly(runs))
                except BaseException:  # (a defect: the pins still go)
                    log.exception("checking runs ahead")
                    result = (_CHECK, batch, 0)
            else:
                key, buf, gen, ld, lo, hi, ext = job
                try:
                    result = (key, buf, gen, ld, lo, hi, ext, self._pread(key, buf, lo, hi),
                              None)
                except Exception as exc:
                    result = (key, buf, gen, ld, lo, hi, ext, 0, exc)
            with cond:
                self.done.append(result)
                held.clear()
                if self.posted or (self.lazy and (job is _CHECK or not job[3].waited)):
                    continue
                self.posted = True
            try:
                self.token.run_sync_soon(self._landed)
            except trio.RunFinishedError:  # (the run ended: the next one lands them)
                with cond:
                    self.posted = False

    def land_lazily(self, on: bool) -> None:
        """Trio thread: set `lazy` (off: what it left completed lands now, and from then on
        every result calls the trio thread, one call for all that completed meanwhile)."""
        with self.cond:
            self.lazy = on
        if not on:
            self.land()

    def land(self) -> None:
        """Trio thread: land the loads and checks completed and not handed over yet (with
        `lazy`, those no READ waits for)."""
        if self.done:  # (read without the lock: a result appended meanwhile lands later)
            self._landed()

    def _landed(self) -> None:
        """Trio thread: what the loader threads completed since the last call. A chunk goes
        into the cache unless its log range was written meanwhile; its load's waiters are
        woken; the runs now whole in the cache are checked ahead. Failed loads are the
        waiters' errors (readahead's are not errors: a READ that needs the chunk reports
        its own)."""
        with self.cond:
            done, self.done = self.done, []
            self.posted = False
        if self.stopping:  # (closed: only the waiters are let go)
            for item in done:
                if item[0] is not _CHECK:
                    item[3].done.set()
            return
        for item in done:
            try:
                if item[0] is _CHECK:
                    self.verified_ahead += item[2]
                    self._checked(item[1])
                else:
                    self._chunk_landed(*item)
            except Exception:  # (a defect; the other results still land)
                log.exception("a chunk load's result")

    def _chunk_landed(self, key, buf, gen: int, ld: _Load, lo: int, hi: int, ext: bool,
                      n: int, exc) -> None:
        try:
            if ext:  # (more of a cached chunk, in its own buffer: _start_load)
                self._unpin((key,))
                ch = self.chunks.get(key)
                if exc is not None:
                    ld.error = exc
                elif self.gen.get(key[:2], 0) == gen and ch is not None and ch.buf is buf:
                    if lo < ch.lo and lo + n >= ch.lo:
                        ch.lo = lo
                    elif lo == ch.length:
                        ch.length = lo + n
                        ch.short = n < hi - lo
                    if key in self.chunk_runs:
                        self._verify_ahead(key)
                # (else the chunk went, invalidated: its buffer was let go then)
            elif self.gen.get(key[:2], 0) != gen:  # (its log range was written meanwhile)
                self.spare.append(buf)
            elif exc is not None:
                self.spare.append(buf)
                ld.error = exc
                log.debug("loading chunk %s failed: %s", key, exc)
            else:
                self._let_go(key)  # (a part of it: this load holds that too)
                self.chunks[key] = _Chunk(buf, lo, lo + n, n < hi - lo)
                self.served.pop(key, None)  # consumption counts per stay in the cache
                self.consumed.pop(key, None)
                while len(self.chunks) > self.max_chunks:
                    victim = next((k for k in self.chunks if k not in self.pins), None)
                    if victim is None:
                        break
                    self.spare.append(self.chunks.pop(victim).buf)
                if key in self.chunk_runs:
                    self._verify_ahead(key)
        finally:
            if self.loading.get(key) is ld:
                del self.loading[key]
            ld.done.set()

    def _pread(self, key: tuple[int, int, int], buf, lo: int, hi: int) -> int:
        """Loader thread: bytes [lo, hi) of a chunk from the log into the same bytes of
        `buf` (short at the log's end)."""
        layer, logno, idx = key
        t0 = time.perf_counter()
        n = self.logs.read_into(layer, logno, memoryview(buf)[lo:hi], idx * CHUNK_BYTES + lo)
        self.disk_reads += 1
        self.disk_bytes += n
        self.load_seconds += time.perf_counter() - t0
        return n

    def _window_of(self, ahead):
        """read()'s `ahead` (bytes, None for the most, or a ReadPlan) as _ahead_of takes it:
        whole chunks, at most the window, or the plan."""
        if isinstance(ahead, ReadPlan):
            return ahead
        return self.window if ahead is None else min(self.window, ahead // CHUNK_BYTES)

    def _ahead_of(self, emap: ExtentMap, keys, off: int, hi: int, ahead) -> None:
        """Readahead after a READ of [off, hi) of a file (its chunks: `keys`): by the file's
        read plan (`ahead` a ReadPlan), else `ahead` chunks on in log order."""
        if not isinstance(ahead, ReadPlan):
            self._readahead(keys, ahead)
            return
        try:
            self._plan_ahead(emap, keys, off, hi, ahead)
        except Exception:  # (a defect in a guess must not fail the READ: no plan from now)
            log.exception("read plan: dropped")
            self.drop_plan(ahead)
            ahead.clear()

    def _plan_ahead(self, emap: ExtentMap, keys, off: int, hi: int, plan: ReadPlan) -> None:
        """Load what the file's read plan says comes after [off, hi), in that order, up to the
        readahead window (--prefetch): the rest of the item read, then the next items, each
        its last chunk first (DCP reads an item's zip directory, at its end, first); of each
        chunk only the bytes those items need (their runs: the rest of the chunk holds items
        read much later, or earlier, which the cache would keep or load in vain); what is
        cached of it already becomes the most recently used (kept over chunks read before)."""
        if not self.background or not self.window:
            return
        p = plan.locate(off)
        if p is None:
            return
        if plan.parts is None:
            self._map_plan(emap, plan)
            self.plans[plan] = None
        chunks, loading, window = self.chunks, self.loading, self.window
        need: dict[tuple[int, int, int], tuple[int, int]] = {}  # (the bytes of each chunk)

        def add(ks, spans) -> None:
            for k, (a, b) in zip(ks, spans):
                _widen(need, k, a, b)

        ends, ks, spans = plan.parts[p]
        if p != plan.cur:  # (an item's first READ: DCP's is at its end, its start comes next)
            plan.cur = p
            order = ks[-1:] + ks
            add(ks, spans)
        else:
            i = bisect_right(ends, hi)
            order = ks[i:]
            add(order, spans[i:])
        for q in plan.after(p):
            _, ks, spans = plan.parts[q]
            if ks:
                order.append(ks[-1])
                order.extend(ks)
                add(ks, spans)
            if len(order) >= 2 * window:
                break
        wanted: dict[tuple[int, int, int], tuple[int, int]] = {}
        seen: dict[tuple[int, int, int], None] = {}
        for k in order:
            if k in seen:
                continue
            seen[k] = None
            ch = chunks.get(k)
            if ch is not None and ch.holds(*need[k]):
                chunks.move_to_end(k)
            elif k not in loading and not self._kept(k):
                wanted[k] = need[k]
            if len(seen) >= window:
                break
        plan.soon = seen
        if wanted:
            self.plan_loads += len(wanted)
            self._start_loads(wanted, keys, seen)

    def _kept(self, key: tuple[int, int, int]) -> bool:
        """Whether the runs of chunk `key` are all in staging memory: nothing to load."""
        layer, logno, idx = key
        if layer or self.in_memory is None:
            return False
        lo = idx * CHUNK_BYTES
        return self.in_memory(logno, lo, min(lo + CHUNK_BYTES,
                                             self.log_end.get((layer, logno), lo + CHUNK_BYTES)))

    def _start_loads(self, wanted: dict, *keep) -> None:
        """Start loading the chunks `wanted` (key -> the part to load, None: all of it), those
        in each of `keep` pinned meanwhile (a load's buffer may be a cached chunk's: not one
        being served or about to be read)."""
        for ks in keep:
            self._pin(ks)
        try:
            for k, part in wanted.items():
                self._start_load(k, part)
        finally:
            for ks in keep:
                self._unpin(ks)

    def _readahead(self, keys, ahead: int) -> None:
        """Start loading the `ahead` chunks after the last of `keys` in each log, except
        those asked for before in the log's window (ra_window), cached or being loaded."""
        if not self.background:
            return
        last: dict[tuple[int, int], int] = {}
        for layer, logno, idx in keys:
            if idx > last.get((layer, logno), -1):
                last[(layer, logno)] = idx
        wanted: dict[tuple[int, int, int], None] = {}
        for (layer, logno), idx in last.items():
            # (up to the end of the log's known runs: a log still growing is asked again)
            end = -(-self.log_end.get((layer, logno), 0) // CHUNK_BYTES)
            first, stop = idx + 1, min(idx + 1 + ahead, end)
            prev, hi = self.ra_window.get((layer, logno), (0, 0))
            if prev <= idx < hi:  # on from the last READ, inside the window: only what is new
                self.ra_window[(layer, logno)] = (idx, max(hi, stop))
                if stop <= hi:
                    continue
                first = hi
            else:
                self.ra_window[(layer, logno)] = (idx, stop)
            for i in range(first, stop):
                k = (layer, logno, i)
                if k not in self.chunks and k not in self.loading and not self._kept(k):
                    wanted[k] = None
        if wanted:
            self._start_loads(wanted, keys)
