"""The read cache: fixed-size chunks of the data logs, their buffers, the checks of the runs in
them, and what is in flight.

Chunks are CHUNK_BYTES of a log, aligned (so O_DIRECT reads work), in pre-faulted buffers
allocated on first use (up to --read-cache) and then reused, consumed chunks first: this VM's
memory is backed lazily, and reading into fresh buffers runs at first-touch speed. A run's
CRC32C is checked the first time it is read from disk (over the chunks it spans); a mismatch
makes reads of that file fail with EIO, other files are unaffected. Runs whose chunks all
came in ahead of the READs are checked in the loader threads (loaders.py), which also read
the chunks.

A chunk is cached whole, except where a read plan (readplan.py) loaded just the part of it its
next items need: a cached chunk holds bytes [lo, length) of the log's 4 MiB (Chunk.holds), and
every read asks whether the bytes it needs are there, not only the chunk.

What to load and when is the read policy's (reader.py): the cache loads what it is asked
for, keeps what READs and checks use (pinned chunks are never reused nor dropped), and when
full lets go of consumed chunks first, then of the least recently used one, or by the read
plan in use.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import trio

from ckptfs.datapath.loaders import Load, Loaders
from ckptfs.datapath.readplan import ReadPlan
from ckptfs.datapath.staging import ExtentMap, Run
from ckptfs.format.logs import RunError, RunReader
from ckptfs.io import alloc_aligned

log = logging.getLogger("ckptfs.reader")

CHUNK_BYTES = 4 << 20
NOTE_SLICE = 4096  # files note_replayed notes between two looks at the requests
EVICT_SCAN_MAX = 256  # chunks a plan's choice of what to let go looks at, oldest first
LOAD_ALIGN = 4096  # a part of a chunk is loaded from and to multiples of this (O_DIRECT)


def widen(need: dict, key: tuple[int, int, int], a: int, b: int) -> None:
    """Add bytes [a, b) of chunk `key` to `need`: chunk key -> the bytes of it needed (one
    range per chunk, from the first to the last byte needed)."""
    was = need.get(key)
    need[key] = (a, b) if was is None else (min(a, was[0]), max(b, was[1]))


def need_range(need: dict, layer: int, logno: int, lo: int, hi: int) -> None:
    """Add bytes [lo, hi) of a log to `need` (widen), chunk by chunk."""
    for idx in range(lo // CHUNK_BYTES, (hi - 1) // CHUNK_BYTES + 1):
        base = idx * CHUNK_BYTES
        widen(need, (layer, logno, idx), max(lo, base) - base, min(hi, base + CHUNK_BYTES) - base)


class Chunk:
    """A cached chunk: its bytes [lo, length) are the log's (all from 0 but where a read
    plan loaded only the part it needs); `short`: the log ends at `length`."""
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


class ReadCache:
    """The chunks (trio thread), read through `logs` (format/logs.RunReader: which file holds
    a run, descriptors, O_DIRECT where it works, chunk reads, checksum checks and their
    errors) by the loader threads. `cache_bytes`: --read-cache; `populate`: all buffers
    faulted in now, not on first use; `background`: runs are checked in the loader threads
    as soon as their chunks are in (a mount; without it a READ checks what it loaded), and
    the read policy loads ahead; `on_fatal(exc, where)`: told (trio thread) when a loader
    thread ends on a defect."""

    def __init__(self, logs: RunReader, cache_bytes: int, *, populate: bool = False,
                 background: bool = False, on_fatal=None) -> None:
        self.logs = logs
        self.background = background
        self.max_chunks = max(8, cache_bytes // CHUNK_BYTES)
        self.chunks: OrderedDict[tuple[int, int, int], Chunk] = OrderedDict()
        self.spare: list = []  # buffers of evicted chunks, reused before allocating
        self.allocated = 0
        if populate:  # like staging: fault the memory in once, at mount, not during a restore
            self.spare = [alloc_aligned(CHUNK_BYTES, populate=True, huge=True)
                          for _ in range(self.max_chunks)]
            self.allocated = self.max_chunks
        self.pins: dict[tuple[int, int, int], int] = {}
        self.loading: dict[tuple[int, int, int], Load] = {}
        self.gen: dict[tuple[int, int], int] = {}  # bumped when a log range is (re)written
        self.log_end: dict[tuple[int, int], int] = {}  # end of the known runs in each log
        # per log, shared by all readers: (the last chunk a sequential READ touched, the end of
        # the chunks readahead asked for): the read policy's (Reader._readahead) record of
        # what it asked of the cache, started anew at the log's next write (invalidate)
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
        # first loader thread free takes all those asked for meanwhile in one job.
        self.chunk_runs: dict[tuple[int, int, int], list[Run]] = {}
        self.verifying: set[Run] = set()
        self.verified_ahead = 0
        # The read plans READs follow (one per DCP data file being read: ranks restoring on
        # one node read one each); while there is one, the chunk to let go when the cache is
        # full is one it does not read again, else the one it reads again furthest ahead
        # (_evict, by the plan's chunk map: Reader._map_plan).
        self.plans: dict[ReadPlan, None] = {}
        self.loaders = Loaders(self._pread, self._verify_quietly, self._chunk_landed,
                               self._checked, on_fatal)
        self.disk_reads = 0
        self.disk_bytes = 0
        self.load_seconds = 0.0  # time spent in disk reads (loader threads)

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
        """The logs of `layer` the cache holds anything of (a descriptor, chunks, their
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
        self.loaders.close()
        self.logs.close()
        self.chunks.clear()
        self.spare.clear()

    def land(self) -> None:
        """Trio thread: land what the loader threads completed (Loaders.land)."""
        self.loaders.land()

    def land_lazily(self, on: bool) -> None:
        """Trio thread: only loads a READ waits for land by a call of their own (on), or
        every result (off) (Loaders.land_lazily)."""
        self.loaders.land_lazily(on)

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
            lg = r.log
            if lg < 0:
                continue
            layer, loff = r.layer, r.loff
            end = loff + r.length
            key = (layer, lg)
            if end > log_end.get(key, 0):
                log_end[key] = end
            first, last = loff // CHUNK_BYTES, (end - 1) // CHUNK_BYTES
            for idx in range(first, last + 1):
                k = (layer, lg, idx)
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

    # ------------------------------------------------------------ what is cached
    def holds(self, key: tuple[int, int, int], a: int, b: int) -> bool:
        """Whether bytes [a, b) of chunk `key` are cached."""
        ch = self.chunks.get(key)
        return ch is not None and ch.holds(a, b)

    def serve(self, key: tuple[int, int, int], ch: Chunk, a: int, n: int) -> memoryview:
        """Bytes [a, a+n) of cached chunk `key`, about to be served: it becomes the most
        recently used, and if it had been consumed, the last consumed one to be reused."""
        self.chunks.move_to_end(key)
        consumed = self.consumed
        if key in consumed:
            del consumed[key]
            consumed[key] = None
        return ch.view[a:a + n]

    def account(self, emap: ExtentMap, off: int, hi: int, seen: list) -> None:
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
        live, served = self.live, self.served
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
                        if k in self.chunks:
                            self.chunks.move_to_end(k, last=False)

    # ------------------------------------------------------------ checks
    def verify(self, run: Run) -> None:
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
            need_range(need, run.layer, run.log, run.loff, run.loff + run.length)
            if all(self.holds(k, *ab) for k, ab in need.items()):
                ready.append(run)
                pinned.update(dict.fromkeys(need))
        if keep:
            self.chunk_runs[key] = keep
        else:
            del self.chunk_runs[key]
        if ready:  # (a chunk may hold hundreds of small runs: one check for all of them)
            self.verifying.update(ready)
            self.pin(pinned)
            self.loaders.start()
            self.loaders.check_soon(ready, list(pinned))

    def _checked(self, batch: list, n: int) -> None:
        """Trio thread: a check job's result (`n` runs checked)."""
        self.verified_ahead += n
        for runs, keys in batch:
            self.unpin(keys)
            self.verifying.difference_update(runs)

    def _verify_quietly(self, runs: list[Run]) -> int:
        """Loader thread. A mismatch puts the run in self.bad (the READ reports EIO); a chunk
        dropped meanwhile (its log range rewritten) leaves the check to the READ path."""
        done = 0
        for run in runs:
            if run.verified:  # (a READ that could not wait checked it meanwhile)
                continue
            try:
                self.verify(run)
                done += 1
            except (RunError, KeyError):
                pass
        return done

    # ------------------------------------------------------------ buffers
    def pin(self, keys) -> None:
        """These chunks are used (a READ, a check, a load, a read window): neither reused
        nor dropped until unpinned."""
        for k in keys:
            self.pins[k] = self.pins.get(k, 0) + 1

    def unpin(self, keys) -> None:
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

    # ------------------------------------------------------------ loads
    def start_load(self, key: tuple[int, int, int], part: tuple[int, int] | None = None
                   ) -> Load:
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
        self.loaders.start()
        if ext:
            buf = ch.buf
            self.pin((key,))  # (its buffer stays the chunk's: not reused meanwhile)
        else:
            buf = self._buffer()
        ld = self.loading[key] = Load(key, buf, self.gen.get(key[:2], 0), lo, hi, ext)
        self.loaders.load(ld)
        return ld

    def load(self, missing: dict, part: bool = False) -> tuple[list[Load], int]:
        """Load the chunks `missing` (key -> the bytes needed of it: those not cached; the
        whole chunk, or with `part` those bytes): the loads to wait for (wait_for_loads; a
        load in flight is waited for as it is: the caller looks again), and how many of them
        it started."""
        loads, started = [], 0
        for k, ab in missing.items():
            ld = self.loading.get(k)
            if ld is None:
                if self.holds(k, *ab):
                    continue
                ld = self.start_load(k, ab if part else None)
                started += 1
            loads.append(ld)
        return loads, started

    async def wait_for_loads(self, loads: list[Load]) -> None:
        """Wait for these loads. The wait can be cancelled (the READ's caller is being
        killed) while a disk read cannot; the loads go on without it. Raises the first
        load's error."""
        self.loaders.wait_for(loads)  # (a load that completes from now on is handed over)
        self.loaders.land()  # (one completed before: not handed over yet with `lazy`)
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

    def _pread(self, ld: Load) -> int:
        """Loader thread: bytes [lo, hi) of a chunk from the log into the same bytes of
        its buffer (short at the log's end)."""
        layer, logno, idx = ld.key
        t0 = time.perf_counter()
        n = self.logs.read_into(layer, logno, memoryview(ld.buf)[ld.lo:ld.hi],
                                idx * CHUNK_BYTES + ld.lo)
        self.disk_reads += 1
        self.disk_bytes += n
        self.load_seconds += time.perf_counter() - t0
        return n

    def _chunk_landed(self, ld: Load) -> None:
        """Trio thread: a load completed. Its chunk goes into the cache unless its log range
        was written meanwhile; its waiters are woken; the runs now whole in the cache are
        checked ahead. A failed load is its waiters' error (readahead's are not errors: a
        READ that needs the chunk reports its own)."""
        key, buf, n, exc = ld.key, ld.buf, ld.got, ld.failed
        try:
            if ld.ext:  # (more of a cached chunk, in its own buffer: start_load)
                self.unpin((key,))
                ch = self.chunks.get(key)
                if exc is not None:
                    ld.error = exc
                elif self.gen.get(key[:2], 0) == ld.gen and ch is not None and ch.buf is buf:
                    if ld.lo < ch.lo and ld.lo + n >= ch.lo:
                        ch.lo = ld.lo
                    elif ld.lo == ch.length:
                        ch.length = ld.lo + n
                        ch.short = n < ld.hi - ld.lo
                    if key in self.chunk_runs:
                        self._verify_ahead(key)
                # (else the chunk went, invalidated: its buffer was let go then)
            elif self.gen.get(key[:2], 0) != ld.gen:  # (its log range was written meanwhile)
                self.spare.append(buf)
            elif exc is not None:
                self.spare.append(buf)
                ld.error = exc
                log.debug("loading chunk %s failed: %s", key, exc)
            else:
                self._let_go(key)  # (a part of it: this load holds that too)
                self.chunks[key] = Chunk(buf, ld.lo, ld.lo + n, n < ld.hi - ld.lo)
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
