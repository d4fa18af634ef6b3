"""The read path: file range -> pieces of runs -> staging memory, or the read cache; and what
the read cache loads ahead of the READs.

Bytes in staging memory are served from there: a segment not written yet, or one written whose
buffer the pool has not handed out again (staging.Staging.kept: a checkpoint read back right
after it was saved does not wait for the disk). Their CRC32C is not checked: it was taken of
these very bytes. Other bytes are read through the read cache (readcache.py: chunks of the data
logs, checked once, loaded by its loader threads).

Files of a checkpoint are written one after another, so they lie one after another in the logs,
and a restore reads them in about that order. A sequential reader therefore triggers readahead
in log order (up to --prefetch bytes ahead: from a file's start the whole window, after a jump as
much as it has read in a row): the next files are on their way while the current one is being
deserialised. A DCP data file's handle follows its read plan instead (readplan.py): the rest of
the item being read and the next items in DCP's order, of each chunk only the part they need.
Readahead and plans skip chunks whose runs are all in staging memory.
"""

from __future__ import annotations

import errno
import logging
import time
from bisect import bisect_right

import trio

from ckptfs.datapath.readcache import CHUNK_BYTES, ReadCache, need_range, widen
from ckptfs.datapath.readplan import ReadPlan
from ckptfs.datapath.staging import ExtentMap, Run
from ckptfs.format.logs import RunError
from ckptfs.io import alloc_aligned

log = logging.getLogger("ckptfs.reader")

SCRATCH_BYTES = 2 << 20  # a huge page: holds any READ (max 1 MiB)
GATHER_MAX_PARTS = 128  # a READ of more parts is assembled in scratch (writev: IOV_MAX 1024)
_ZEROS = memoryview(bytes(SCRATCH_BYTES))


def _zeros(n: int) -> list:
    return [_ZEROS[:min(n - i, SCRATCH_BYTES)] for i in range(0, n, SCRATCH_BYTES)]


class Reader:
    """READs of files (trio thread) through `cache` (a ReadCache), and what it loads ahead:
    `prefetch_bytes` in log order (--prefetch), or a handle's read plan. `in_memory(log, lo,
    hi)`: whether every run byte of this mount's data log `log` in [lo, hi) is in staging
    memory (staging.Staging.in_memory): readahead skips it. `interruptible`: a wait for the
    disk, as a context manager yielding its CancelScope: the daemon's is cancelled when the
    READ's caller is being killed (fuse/interrupts.py), so that the READ is answered while the
    loader thread's disk read goes on."""

    def __init__(self, cache: ReadCache, prefetch_bytes: int,
                 interruptible=trio.CancelScope, in_memory=None) -> None:
        self.cache = cache
        # readahead window in chunks (--prefetch; at least one unless it is 0)
        self.window = max(1, prefetch_bytes // CHUNK_BYTES) if prefetch_bytes > 0 else 0
        self.interruptible = interruptible
        self.in_memory = in_memory
        self.plan_loads = 0  # chunks loaded ahead by a read plan (readplan.py)
        self.plan_misses = 0  # loads a READ under a plan started itself (it did not foresee)
        self.scratch = None  # reply assembly buffer for reads spanning several pieces
        self.memory_bytes = 0  # bytes READs were served from staging memory
        self.wait_seconds = 0.0  # time READ handlers waited for disk reads

    # ------------------------------------------------------------ reads
    async def read(self, emap: ExtentMap, off: int, size: int, file_size: int,
                   ahead: int | None = None, seen: list | None = None, gather: bool = False):
        """Bytes [off, off+size) of a file. `ahead`: bytes to read ahead in log order (None:
        the configured --prefetch, the most; in whole chunks, so less than one is none), or
        the handle's ReadPlan: worth it for a reader that continues where it stopped; random
        readers get only the chunks they touch. `seen`: the reading handle's served ranges
        (for recycling consumed chunks), updated here. `gather`: return a list of buffers
        (views into chunks and segments, valid until the next await) instead of one, so a
        reply can be written with writev and no copy."""
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
            self.cache.account(emap, off, hi, seen)
        return out

    def _cached(self, emap: ExtentMap, off: int, hi: int, ahead) -> memoryview | None:
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
        ch = self.cache.chunks.get(key)
        a = lo % CHUNK_BYTES
        if ch is None or not ch.serves(a, a + n):
            return None
        if ahead:
            self._ahead_of(emap, (key,), off, hi, ahead)
        return self.cache.serve(key, ch, a, n)

    def read_window(self, emap: ExtentMap, start: int, file_size: int, limit: int,
                    max_parts: int, max_chunks: int, pinned=()):
        """The file's bytes from `start` on, as far as they lie in checked runs in cached chunks
        (up to `limit` bytes, `max_parts` views, `max_chunks` chunks): (the views, end to end,
        the chunks' keys, whether they reach the file's end), the chunks pinned (unpin them,
        ReadCache.unpin, once the views are no longer used: the chunks are neither reused nor
        dropped before); None when not one byte is there. Chunks in `pinned` (other windows'
        already) do not count in `max_chunks`. A read window of the queue threads
        (fuse/ring.c), which answer a handle's next READs from it."""
        cache = self.cache
        hi = min(file_size, start + limit)
        parts: list = []
        keys: dict[tuple[int, int, int], None] = {}
        new = 0  # (keys not in pinned)
        pos = start
        last = None  # (the last part: its chunk and where in it it starts and ends)
        for s, n, run, roff in emap.find(start, hi):
            if (s != pos or not run.verified or run.log < 0 or run.memory() is not None
                    or run in cache.bad):
                break  # (a hole, a run not checked yet, or bytes still in staging)
            lo = run.loff + roff
            while n > 0:
                key = (run.layer, run.log, lo // CHUNK_BYTES)
                ch = cache.chunks.get(key)
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
        cache.pin(keys)
        return parts, list(keys), pos == file_size

    def has(self, emap: ExtentMap, off: int) -> bool:
        """Whether byte `off` of a file is in a checked run in a cached chunk (read_window
        would reach it)."""
        chunks = self.cache.chunks
        for _, _, run, roff in emap.find(off, off + 1):
            if not run.verified or run.log < 0 or run.memory() is not None:
                return False
            lo = run.loff + roff
            ch = chunks.get((run.layer, run.log, lo // CHUNK_BYTES))
            return ch is not None and ch.serves(lo % CHUNK_BYTES, lo % CHUNK_BYTES + 1)
        return False

    def window_served(self, emap: ExtentMap, off: int, hi: int, ahead: int | None,
                      seen: list | None) -> None:
        """Bytes [off, hi) of a file were served from a read window (read_window, fuse/ring.c):
        what read() does besides the bytes (the chunks become the most recently used,
        readahead as `ahead` says, the handle's `seen` for recycling)."""
        cache = self.cache
        ahead = self._window_of(ahead)
        keys: dict[tuple[int, int, int], None] = {}
        for _, n, run, roff in emap.find(off, hi):
            if run.log < 0 or run.memory() is not None:
                continue
            lo = run.loff + roff
            for idx in range(lo // CHUNK_BYTES, (lo + n - 1) // CHUNK_BYTES + 1):
                keys[(run.layer, run.log, idx)] = None
        for key in keys:
            ch = cache.chunks.get(key)
            if ch is not None:
                cache.serve(key, ch, 0, 0)
        if ahead and keys:
            self._ahead_of(emap, keys, off, hi, ahead)
        if seen is not None:
            cache.account(emap, off, hi, seen)

    async def _read(self, emap: ExtentMap, off: int, hi: int, ahead, gather: bool):
        cache = self.cache
        while True:
            pieces = emap.find(off, hi)
            keys: dict[tuple[int, int, int], tuple[int, int]] = {}  # -> the bytes needed
            verify = []
            staged = []
            for _, n, run, roff in pieces:
                if run.memory() is not None:
                    staged.append(run)
                    continue
                if run in cache.bad:
                    raise RunError(cache.bad[run])
                if run.log < 0:
                    raise RunError("run lost: neither in staging nor in a data log")
                if run.verified:
                    lo, ln = run.loff + roff, n
                else:
                    lo, ln = run.loff, run.length
                    verify.append(run)
                need_range(keys, run.layer, run.log, lo, lo + ln)
            if keys:
                if ahead:
                    self._ahead_of(emap, keys, off, hi, ahead)
                cache.pin(keys)
                mine = [r for r in verify if r not in cache.verifying]
                cache.verifying.update(mine)  # checked below: not again by the loader threads
                try:
                    missing = {k: ab for k, ab in keys.items() if not cache.holds(k, *ab)}
                    if missing:
                        t0 = time.perf_counter()
                        plan = isinstance(ahead, ReadPlan)
                        with self.interruptible() as scope:
                            # (a plan's READ loads the part it needs, like its look ahead;
                            # a load it starts is one the plan did not foresee)
                            loads, started = cache.load(missing, plan)
                            self.plan_misses += plan * started
                            await cache.wait_for_loads(loads)
                        if scope.cancelled_caught:
                            raise InterruptedError(errno.EINTR, "the reader is being killed")
                        self.wait_seconds += time.perf_counter() - t0
                    if any(not cache.holds(k, *ab) for k, ab in keys.items()):
                        continue  # invalidated, or a part loaded, meanwhile: look again
                    if any(r.memory() is None for r in staged):
                        continue  # flushed and released while we waited: look again
                    for run in verify:
                        if not run.verified:
                            cache.verify(run)
                    return self._copy(pieces, off, hi, gather)
                finally:
                    cache.unpin(keys)
                    cache.verifying.difference_update(mine)
            return self._copy(pieces, off, hi, gather)

    def _copy(self, pieces: list, off: int, hi: int, gather: bool = False):
        """The bytes of [off, hi): a view into the chunk or segment when one piece covers it
        (pyfuse3 takes any contiguous buffer and copies it into the reply before the next task
        runs, so no copy here), else a view of the scratch buffer. With `gather`, a list: the
        views of each piece in each chunk (zeros for holes), which the fast path's writev
        gathers (up to GATHER_MAX_PARTS of them, else [the scratch view])."""
        cache = self.cache

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
                parts.append(cache.serve(key, cache.chunks[key], a, k))
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

    # ------------------------------------------------------------ ahead of the READs
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
        cache = self.cache
        if not cache.background or not self.window:
            return
        p = plan.locate(off)
        if p is None:
            return
        if plan.parts is None:
            self._map_plan(emap, plan)
            cache.plans[plan] = None
        chunks, loading, window = cache.chunks, cache.loading, self.window
        need: dict[tuple[int, int, int], tuple[int, int]] = {}  # (the bytes of each chunk)

        def add(ks, spans) -> None:
            for k, (a, b) in zip(ks, spans):
                widen(need, k, a, b)

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
        end = self.cache.log_end.get((layer, logno), lo + CHUNK_BYTES)
        return self.in_memory(logno, lo, min(lo + CHUNK_BYTES, end))

    def _start_loads(self, wanted: dict, *keep) -> None:
        """Start loading the chunks `wanted` (key -> the part to load, None: all of it), those
        in each of `keep` pinned meanwhile (a load's buffer may be a cached chunk's: not one
        being served or about to be read)."""
        cache = self.cache
        for ks in keep:
            cache.pin(ks)
        try:
            for k, part in wanted.items():
                cache.start_load(k, part)
        finally:
            for ks in keep:
                cache.unpin(ks)

    def _readahead(self, keys, ahead: int) -> None:
        """Start loading the `ahead` chunks after the last of `keys` in each log, except
        those asked for before in the log's window (ReadCache.ra_window: a READ between the
        last chunk a sequential READ touched and the end of what readahead asked for only
        asks for the chunks past that end; a READ before it, a second pass, or at or past
        the end starts anew, and so does the log's next write), cached or being loaded.
        Chunks asked for and evicted before use are not asked for again while in the
        window."""
        cache = self.cache
        if not cache.background:
            return
        last: dict[tuple[int, int], int] = {}
        for layer, logno, idx in keys:
            if idx > last.get((layer, logno), -1):
                last[(layer, logno)] = idx
        ra_window, chunks, loading = cache.ra_window, cache.chunks, cache.loading
        wanted: dict[tuple[int, int, int], None] = {}
        for (layer, logno), idx in last.items():
            # (up to the end of the log's known runs: a log still growing is asked again)
            end = -(-cache.log_end.get((layer, logno), 0) // CHUNK_BYTES)
            first, stop = idx + 1, min(idx + 1 + ahead, end)
            prev, hi = ra_window.get((layer, logno), (0, 0))
            if prev <= idx < hi:  # on from the last READ, inside the window: only what is new
                ra_window[(layer, logno)] = (idx, max(hi, stop))
                if stop <= hi:
                    continue
                first = hi
            else:
                ra_window[(layer, logno)] = (idx, stop)
            for i in range(first, stop):
                k = (layer, logno, i)
                if k not in chunks and k not in loading and not self._kept(k):
                    wanted[k] = None
        if wanted:
            self._start_loads(wanted, keys)

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
        self.cache.plans.pop(plan, None)
