"""Space given back without moving a byte: data logs retired, dead ranges punched out.

- Retiring: a log with no live byte that no segment is being placed in gets a RETIRE record;
  once that is committed, its file is removed (a reader still using it keeps its open
  descriptor until done). At mount this finishes the logs a crash left dead or half retired.
- Punching: in logs with a segment's worth of dead bytes (the one being appended to too,
  below its last durable segment), the dead ranges of at least PUNCH_MIN_BYTES that no reader
  is using are given back to the file system (fallocate PUNCH_HOLE), after everything that
  killed them is committed (so no committed extent points there, whatever a crash cuts off).
  A log keeps its number and its live bytes; most dead space of a checkpoint workload (whole
  deleted checkpoints) comes back this way: punching the 680 MB of dead checkpoints out of a
  1 GiB log took 0.11 s here, copying its 340 MB of live ones into a new log 0.5 s of the
  disk's full bandwidth (docs/benchmarks.md).

With other writers in the backing directory, dead bytes wait SHARED_GRACE_S first (another
mount's view of this tree may still read them). The maintainer (datapath/maintainer.py)
runs both; trio thread, except where a function says it runs in a worker thread.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable

import trio

from ckptfs.datapath.cleaner import ESTIMATE_SLICE, SHARED_GRACE_S, LogSpace
from ckptfs.datapath.staging import round_up
from ckptfs.format import backingdir, records
from ckptfs.format.logs import punch_hole
from ckptfs.format.records import RetireRec

log = logging.getLogger("ckptfs.cleaner")

PUNCH_MIN_BYTES = 64 << 10  # a smaller dead range is left (the cleaner may move its neighbours)


class Reclaimer:
    """Retires this writer's dead data logs and punches dead ranges out of the others (see
    the module docstring). `where` is the writer's directory, held open (backingdir.Dir);
    with the node tier, `mirror` is the backing copy of it and `tier` the drain to it: files
    are removed and punched in both copies, and only once the drain has passed the commit
    that made it safe. `others_use()`: the own logs other writers' trees point into (kept
    whatever the own tree says); `shared()`: whether other writers share the backing
    directory (looked at every time: a writer may join while mounted)."""

    def __init__(self, ns, journal, flusher, cache, staging, space: LogSpace, where, *,
                 mirror=None, tier=None,
                 others_use: Callable[[], set[int]] = lambda: set(),
                 shared: Callable[[], bool] = lambda: False) -> None:
        self.ns = ns
        self.journal = journal
        self.flusher = flusher
        self.cache = cache
        self.staging = staging
        self.space = space
        self.where = where
        self.mirror = mirror
        self.tier = tier
        self.others_use = others_use
        self.shared = shared
        self.doing = "idle"
        self.logs_retired = 0
        self.bytes_reclaimed = 0
        self.bytes_punched = 0
        self.punch_ok = True  # until the file system refuses PUNCH_HOLE
        self.dead_since: dict[int, float] = {}  # log -> when its last live byte died
        self._held: set[int] = set()  # retired logs a reader still held open when removed
        self._punched_ranges: dict[int, list[tuple[int, int]]] = {}

    def grace(self) -> float:
        """How long dead bytes wait before their space is given back: longer than another
        mount's view of this tree can lag (SHARED_GRACE_S) when other writers share the
        backing directory, else not at all."""
        return SHARED_GRACE_S if self.shared() else 0.0

    # ------------------------------------------------------------ retiring
    def retirable(self) -> list[int]:
        """Logs with no live byte that take no more segments: not open for placement, no
        segment in flight in them. (`open_logs` first: a log closed after that look has its
        in-flight segments' `log` set by then.)"""
        busy = self.flusher.open_logs()
        busy |= {seg.log for seg in self.flusher.in_flight}
        dead = [lg for lg, n in self.space.live.items() if n <= 0 and lg not in busy]
        if not dead:
            return []
        now = time.monotonic()
        since = self.dead_since
        for lg in list(since):
            if lg not in dead:
                del since[lg]
        for lg in dead:
            since.setdefault(lg, now)
        # Another writer may take a file over (XEXTENT) from a view of this tree a little
        # behind it: a log goes only when it has been dead longer than such a view can lag.
        ripe = [lg for lg in dead if now - since[lg] >= self.grace()]
        if ripe:
            named = self.others_use()
            ripe = [lg for lg in ripe if lg not in named]
        return sorted(ripe)

    async def retire(self, logs: list[int]) -> None:
        """RETIRE records for `logs`, committed, then their files removed."""
        ns, space = self.ns, self.space
        drifted = {lg for lg in logs if space.live.get(lg, 0) < 0}
        if drifted:  # the count went wrong somewhere: look at the tree itself before retiring
            log.error("data logs %s: live bytes counted below zero; counted again",
                      ", ".join(map(str, sorted(drifted))))
            still = {lg for lg, r in (await self.live_ranges(drifted)).items() if r}
            for lg in still:
                log.error("data log %d still holds live data: not retired", lg)
            logs = [lg for lg in logs if lg not in still]
            for lg in drifted - still:
                space.live[lg] = 0
            if not logs:
                return
        for lg in logs:
            if lg not in ns.retired:
                ns.change(RetireRec(lg))
        self.doing = f"retiring data logs {', '.join(map(str, logs))}"
        try:
            await self.flusher.wait_committed(self.journal.last_seq)
            await self._drained(self.journal.last_seq)
            for lg in logs:
                space.forget(lg)
                self.dead_since.pop(lg, None)
                self._punched_ranges.pop(lg, None)
            # A log a reader is using right now is opened by the reader before it goes: the
            # reader reads on through that descriptor, and the space comes back when it lets
            # go (release_held). (The read cache is the trio thread's; the opens run in the
            # worker.)
            held = [lg for lg in logs if self.cache.log_in_use(0, lg)]
            freed = await trio.to_thread.run_sync(self._remove, logs, held)
            self._held.update(held)
            for lg in logs:
                if lg not in self._held:
                    self.cache.forget_log(0, lg)
            self.logs_retired += len(logs)
            self.bytes_reclaimed += freed
            log.info("retired data logs %s (%d bytes freed)", ", ".join(map(str, logs)),
                     freed)
        finally:
            self.doing = "idle"

    def _remove(self, logs: list[int], held: list[int]) -> int:
        """Worker thread: remove the retired logs' files (those in `held` opened by the reader
        first). Returns the bytes they took up."""
        for lg in held:
            try:
                self.cache.hold(0, lg)
            except OSError:
                pass
        freed = 0
        for where in self._copies():
            for lg in logs:
                name = backingdir.data_log_name(lg)
                try:
                    blocks = where.stat(name).st_blocks * 512
                    where.unlink(name)
                except FileNotFoundError:
                    continue
                if where is self.where:
                    freed += blocks
            where.sync()
        return freed

    def _copies(self) -> list:
        """The writer's directory, and the node tier's backing copy of it when there is one."""
        return [self.where] if self.mirror is None else [self.where, self.mirror]

    async def _drained(self, seq: int) -> None:
        """With the node tier: wait until the drain has passed `seq` (what the caller does to
        the files is safe in the backing copy only then)."""
        if self.tier is not None:
            await self.tier.wait_backing(seq)

    def release_held(self) -> None:
        """The retired logs no reader uses any more are let go of (their space comes back)."""
        for lg in list(self._held):
            if not self.cache.log_in_use(0, lg):
                self.cache.forget_log(0, lg)
                self._held.discard(lg)

    # ------------------------------------------------------------ punching
    async def punch(self) -> None:
        """Give the dead ranges of closed logs back (see the module docstring)."""
        space = self.space
        after = self.staging.segment_bytes  # (dead bytes a log needs before a look: a segment)
        # (the log being appended to too: below its last durable segment nothing is written
        # again, and what is in flight lies beyond that)
        cands = [lg for lg in space.live if space.held(lg) - space.live[lg] >= after]
        # Another mount's view of this tree may lag behind it (by up to its --refresh) and
        # still read bytes this tree no longer points at: with other writers, a log's dead
        # bytes are punched only once its last byte died longer ago than that.
        grace, now = self.grace(), time.monotonic()
        cands = [lg for lg in cands if now - space.killed_at.get(lg, 0.0) >= grace]
        if not cands:
            return
        named = self.others_use()
        cands = [lg for lg in cands if lg not in named]
        if not cands:
            return
        self.doing = f"punching dead ranges out of data logs {', '.join(map(str, cands))}"
        # Where each log ended before its live ranges were taken: a segment made durable
        # while this awaits lies beyond, and its runs are not in `live`.
        ends = dict(space.ends)
        for seg in self.flusher.in_flight:  # placed, not durable: never a hole
            if seg.log in ends and seg.loff >= 0:
                ends[seg.log] = min(ends[seg.log], seg.loff)
        try:
            live = await self.live_ranges(set(cands))
            # everything that killed those bytes, committed first: no committed extent is
            # left pointing into a range punched
            await self.flusher.wait_committed(self.journal.last_seq)
            await self._drained(self.journal.last_seq)
            holes = {}
            for lg in cands:
                ranges = [r for r in self._dead_ranges(lg, live.get(lg, []), ends.get(lg, 0))
                          if not self.cache.range_in_use(0, lg, r[0], r[1])]
                if ranges:
                    holes[lg] = ranges
            if not holes:
                return
            freed = await trio.to_thread.run_sync(self._punch, holes)
        finally:
            self.doing = "idle"
        for lg, ranges in holes.items():
            if lg in space.ends:
                space.punched[lg] = space.punched.get(lg, 0) + sum(b - a for a, b in ranges)
                self._punched_ranges[lg] = _merge(self._punched_ranges.get(lg, []) + ranges)
        self.bytes_punched += freed
        self.bytes_reclaimed += freed
        log.info("punched %d dead bytes out of data logs %s", freed,
                 ", ".join(map(str, sorted(holes))))

    async def live_ranges(self, logs: set[int]) -> dict[int, list[tuple[int, int]]]:
        """The byte ranges of `logs` that the own tree's extent maps point at (any file,
        unlinked ones still open included), merged, per log: whole runs, since a read of any
        part of a run checks the checksum of all of it (a run a truncate or an overwrite left
        partly dead keeps its dead bytes)."""
        xs = list({id(x): x for x in self.ns.inodes.values()}.values())
        out: dict[int, list[tuple[int, int]]] = {lg: [] for lg in logs}
        for i in range(0, len(xs), ESTIMATE_SLICE):
            for x in xs[i:i + ESTIMATE_SLICE]:
                if x.emap is None:
                    continue
                for _, _, run, _ in x.emap.pieces:
                    if run.layer == 0 and run.log in out:
                        out[run.log].append((run.loff, run.loff + run.length))
            await trio.sleep(0)
        return {lg: _merge(r) for lg, r in out.items()}

    def _dead_ranges(self, lg: int, live: list[tuple[int, int]],
                     end: int) -> list[tuple[int, int]]:
        """The gaps between the live ranges of log `lg` (from its header to `end`, where it
        ended when `live` was taken), at least PUNCH_MIN_BYTES, cut to whole blocks, less
        what was punched before."""
        align = self.space.align
        out, pos = [], round_up(records.DATA_HEADER_BYTES, align)
        for a, b in live + [(end, 0)]:
            lo, hi = round_up(pos, align), a // align * align
            if hi - lo >= PUNCH_MIN_BYTES:
                out.append((lo, hi))
            pos = max(pos, b)
        return _subtract(out, self._punched_ranges.get(lg, []))

    def _punch(self, holes: dict[int, list[tuple[int, int]]]) -> int:
        """Worker thread: punch the holes; the blocks freed."""
        freed = 0
        for where in self._copies():
            for lg, ranges in holes.items():
                try:
                    fd = where.open(backingdir.data_log_name(lg), os.O_WRONLY)
                except FileNotFoundError:
                    continue
                try:
                    before = os.fstat(fd).st_blocks
                    for a, b in ranges:
                        try:
                            punch_hole(fd, a, b - a)
                        except OSError as exc:
                            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                                log.info("the backing store cannot punch holes (%s): the "
                                         "cleaner copies instead", exc.strerror)
                                self.punch_ok = False
                                break
                            raise
                    os.fsync(fd)
                    if where is self.where:
                        freed += (before - os.fstat(fd).st_blocks) * 512
                finally:
                    os.close(fd)
                if not self.punch_ok:
                    return freed
        return freed


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _subtract(ranges: list[tuple[int, int]], minus: list[tuple[int, int]]
              ) -> list[tuple[int, int]]:
    """`ranges` without the parts in `minus` (both sorted, disjoint), pieces of at least
    PUNCH_MIN_BYTES."""
    out = []
    for a, b in ranges:
        pos = a
        for c, d in minus:
            if d <= pos or c >= b:
                continue
            if c - pos >= PUNCH_MIN_BYTES:
                out.append((pos, c))
            pos = max(pos, d)
        if b - pos >= PUNCH_MIN_BYTES:
            out.append((pos, b))
    return out
