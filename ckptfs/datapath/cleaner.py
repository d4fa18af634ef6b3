"""Space and history of a mount: the live bytes of each data log, retiring logs that hold no
live byte, cleaning logs that are mostly dead, and the index snapshot.

- `LogSpace` counts, per data log of this writer, the bytes that extent maps still point at.
  Replay gives the start (every piece of the replayed tree); then every byte an overwrite,
  truncate, unlink or move kills is taken off its log (`dead`, every own extent map's
  on_dead: namespace.Namespace gives it to the maps of the tree), and every segment
  the flusher makes durable adds its runs' surviving bytes to its log.
- `Maintainer` is the task that acts on it, on the trio thread, once a second:
  1. retire: a log with no live byte that no segment is being placed in gets a RETIRE record;
     once that is committed, its file is removed (a reader still using it keeps its open
     descriptor until done). At mount this finishes the logs a crash left dead or half retired.
  2. the index snapshot, once writers have been idle for --clean-idle seconds (at once for a
     tree whose fresh index is under SNAPSHOT_ANYTIME_BYTES) and the index is
     --index-snapshot-ratio times the size a fresh index of the tree would have: a process
     of its own (mover.snapshot_main) replays the index's committed bytes into a second tree
     and writes that tree's records into a fresh index beside it; the flusher puts it in
     place between two commits (format/index.py: the groups committed meanwhile are copied
     after it). Writers never wait for it; commits wait for the copy and rename
     (milliseconds).
  3. punching, once writers have been idle for --clean-idle seconds: in logs with a segment's
     worth of dead bytes (the one being appended to too, below its last durable segment), the
     dead ranges of at least PUNCH_MIN_BYTES that no reader is using are given back to the
     file system (fallocate PUNCH_HOLE), after everything that killed them is committed (so no
     committed extent points there, whatever a crash cuts off). A log keeps its number and
     its live bytes; most dead space of a checkpoint workload (whole deleted checkpoints) comes
     back this way without moving a byte: punching the 680 MB of dead checkpoints out of a
     1 GiB log took 0.11 s here, copying its 340 MB of live ones into a new log 0.5 s of
     the disk's full bandwidth (docs/benchmarks.md).
  4. the cleaner, once writers have been idle for --clean-idle seconds: of the closed logs
     whose live share of the bytes they still take up (after punching) is below --clean-below,
     the one with the best cost-benefit ratio ((1 - u) * age / (1 + u), u that share: the LFS
     cleaner's policy) has its live pieces
     read back (worker thread, each run's checksum checked) and written into staging like a
     write: new runs, EXTENT records journaled in order with everything else, so the flusher
     writes them into the current log with the io engine's large aligned writes. Each piece is
     moved only if the file still points at those bytes at that moment (on the trio thread,
     without an await between the look and the copy); a later overwrite simply comes later in
     the journal. The log's live bytes then reach zero and step 1 retires it once the moves are
     committed. It stops between batches (CLEAN_BATCH_BYTES) as soon as a writer writes, so a
     save in progress has the disk to itself; a reader meanwhile reads the old copy (the log
     stays until the RETIRE record is committed and no reader holds it) or the new one.

Trio thread, except where a function says it runs in a worker thread.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable

import trio

from crc32c import crc32c

from ckptfs import failpoints
from ckptfs.datapath import mover
from ckptfs.datapath.journal import ExtentEntry
from ckptfs.datapath.staging import (
    CHECKSUM_BLOCK_BYTES,
    NO_LOG,
    Run,
    Segment,
    round_up,
)
from ckptfs.format import backingdir, records
from ckptfs.format.index import discard_fresh
from ckptfs.format.logs import RunReader, punch_hole
from ckptfs.format.records import RetireRec
from ckptfs.namespace import ROOT_INO, Inode

log = logging.getLogger("ckptfs.cleaner")

TICK_S = 1.0  # how often the maintainer looks
ESTIMATE_SLICE = 2000  # inodes per slice of the fresh-index estimate (then other tasks run)
DISK_USAGE_S = 5.0  # how often it asks the backing store how much the logs take up
# With other writers in the backing directory: how long a log stays dead before it is retired
# (longer than another mount's view of this tree lags behind it: refresh.py).
SHARED_GRACE_S = 60.0
CLEAN_BATCH_BYTES = 16 << 20  # runs read back at once; between batches the cleaner looks up
# An index snapshot of a tree this small (its fresh index) takes milliseconds: it does not
# wait for the writers to be idle.
SNAPSHOT_ANYTIME_BYTES = 1 << 20
# More than a fresh index holds per inode (an INODE record with its name and an EXTENT): before
# the first estimate, what says a tree is that small
FRESH_BYTES_PER_INODE = 160
KILL_WAIT_S = 5.0  # how long a cancelled snapshot's process is given to end after SIGKILL
PUNCH_MIN_BYTES = 64 << 10  # a smaller dead range is left (the cleaner may move its neighbours)


class LogSpace:
    """Live and written bytes per data log of this writer (layer 0)."""

    def __init__(self, align: int) -> None:
        self.align = align
        self.live: dict[int, int] = {}  # log -> bytes extent maps point at
        self.ends: dict[int, int] = {}  # log -> end of its last segment (its size)
        self.ages: dict[int, float] = {}  # log -> when a segment last landed in it (monotonic)
        self.punched: dict[int, int] = {}  # log -> bytes punched out of it
        self.killed_at: dict[int, float] = {}  # log -> when a byte of it last died (monotonic)

    def count(self, ns, logs: dict[int, str]) -> None:
        """The start: the replayed tree's pieces, the existing logs' sizes. (What replay
        itself clipped or dropped before it is not in the tree, so not counted.)"""
        for n, path in logs.items():
            self.ends[n] = os.path.getsize(path)
            self.live.setdefault(n, 0)
            self.ages[n] = 0.0
        live = self.live
        for x in ns.inodes.values():
            emap = x.emap
            if emap is None:
                continue
            for p in emap.pieces:
                run = p.run
                if run.layer == 0 and run.log != NO_LOG:
                    live[run.log] = live.get(run.log, 0) + p.length

    def dead(self, run: Run, n: int) -> None:
        """An own extent map's on_dead: `n` bytes of `run` are no longer pointed at."""
        if run.layer:
            return
        run.dead += n
        seg = run.seg
        if (seg is None or seg.durable) and run.log in self.live:  # counted already (replayed,
            self.live[run.log] -= n  # or its segment durable; a retired log counts no more)
            self.killed_at[run.log] = time.monotonic()

    def durable(self, seg: Segment) -> None:
        """Flusher.durable_hook: the segment's runs count for its log from now on."""
        lg = seg.log
        live = self.live.get(lg, 0)
        for run in seg.runs:
            live += run.length - run.dead
        self.live[lg] = live
        end = seg.loff + round_up(seg.used, self.align)
        if end > self.ends.get(lg, 0):
            self.ends[lg] = end
        self.ages[lg] = time.monotonic()

    def held(self, lg: int) -> int:
        """Bytes log `lg` still takes up: its size less what was punched out."""
        return self.ends.get(lg, 0) - self.punched.get(lg, 0)

    def live_bytes(self) -> int:
        return sum(self.live.values())

    def log_bytes(self) -> int:
        return sum(self.ends.values())

    def forget(self, lg: int) -> int:
        """The log is retired: its size."""
        self.live.pop(lg, None)
        self.ages.pop(lg, None)
        self.punched.pop(lg, None)
        return self.ends.pop(lg, 0)


class Maintainer:
    """The task that gives space back while mounted (see the module docstring)."""

    def __init__(self, ns, journal, flusher, reader, space: LogSpace, where) -> None:
        self.ns = ns
        self.journal = journal
        self.flusher = flusher
        self.reader = reader
        self.space = space
        self.where = where  # the writer's directory, held open (backingdir.Dir)
        self.writer_dir = where.path
        self.logs_retired = 0
        self.bytes_reclaimed = 0
        self.disk_bytes = 0  # the data logs' allocated blocks (st_blocks), looked up every 5 s
        self.doing = "idle"
        self.errors = 0
        self.last_error = ""
        self._held: set[int] = set()  # retired logs a reader still held open when removed
        self.staging = None
        self.writer_id = os.path.basename(where.path)
        self.idle_s = 1.0
        self.snapshot_ratio = 2.0
        self.snapshot_min = 64 << 10
        self.clean_below = 0.5
        self.fresh_bytes: int | None = None  # a fresh index's size: estimated, or the last
        self.snapshots = 0
        self.snapshot_seconds = 0.0  # the last one's
        self.snapshot_peak_rss = 0  # the last one's process: its peak resident memory
        self.checksum_block = CHECKSUM_BLOCK_BYTES
        self.logs_cleaned = 0
        self.cleaner_turns = 0  # ticks that found the writers idle: the cleaner's turn
        self.bytes_moved = 0
        self.clean_seconds = 0.0
        self.damaged_runs: set[tuple[int, int]] = set()  # (log, offset): not moved, reported
        self.punch_ok = True  # until the file system refuses PUNCH_HOLE
        self.bytes_punched = 0
        self._punched_ranges: dict[int, list[tuple[int, int]]] = {}
        self._logs: RunReader | None = None
        # The own logs other writers' trees point into (their XEXTENT records: a file they
        # took over without copying its bytes): kept while named, whatever the own tree says.
        self.others_use = lambda: set()
        self.dead_since: dict[int, float] = {}  # log -> when its last live byte died
        # The own whiteouts (XUNLINK records) whose entries their writers have removed, as
        # (writer, ino), and since when this mount knows it: a snapshot leaves out those
        # known longer than another mount's view can lag (the daemon sets the hook)
        self.settled: Callable[[], set[tuple[str, int]]] = lambda: set()
        # Logs whose live bytes all belong to unlinked files still open (nothing to move:
        # they go when the files close), with their live bytes when that was found: not
        # looked at again while the count stays so
        self.unmovable: dict[int, int] = {}
        self.settled_since: dict[tuple[str, int], float] = {}
        # Whether other writers share the backing directory (the daemon sets it; looked at
        # on every tick, as writers may join while mounted): then dead bytes wait grace().
        self.shared: Callable[[], bool] = lambda: False
        # With the node tier (datapath/tier.py): the backing copy of the writer's directory.
        # Files are removed and punched in both copies, and only once the drain has passed
        # the commit that made it safe; no index snapshot (the backing index must stay a
        # prefix of the local one).
        self.tier = None
        self.mirror = None
        self._disk_checked = -DISK_USAGE_S
        self._disk_key: tuple = ()  # what had happened at the last look (tick)

    def configure(self, staging, cfg) -> None:
        self.staging = staging
        self.idle_s = cfg.clean_idle_s
        self.snapshot_ratio = cfg.index_snapshot_ratio
        self.snapshot_min = cfg.index_snapshot_min_bytes
        self.clean_below = cfg.clean_below
        self.checksum_block = cfg.checksum_block_bytes

    def grace(self) -> float:
        """How long dead bytes wait before their space is given back: longer than another
        mount's view of this tree can lag (SHARED_GRACE_S) when other writers share the
        backing directory, else not at all."""
        return SHARED_GRACE_S if self.shared() else 0.0

    def idle(self) -> bool:
        """Writers have written nothing for --clean-idle seconds."""
        st = self.staging
        return st is not None and trio.current_time() - st.last_write >= self.idle_s

    # ------------------------------------------------------------ the task
    async def run(self) -> None:
        backoff = TICK_S
        while True:
            try:
                failpoints.hit("cleaner")
                await self.tick()
                backoff = TICK_S
            except Exception as exc:  # noqa: BLE001 - said to every waiter, never swallowed
                # The backing store refused (OSError): tried again, less often while it keeps
                # failing. A fault of the maintenance itself (a defect) fails the mount: what
                # it was doing may be half done, and nothing may pretend otherwise.
                self.errors += 1
                self.last_error = f"{exc.__class__.__name__}: {exc}"
                self.doing = "idle"
                if not isinstance(exc, OSError):
                    log.critical("maintenance failed", exc_info=True)
                    self.flusher.fail(exc, "the cleaner")
                    return
                log.warning("maintenance: %s (retried)", exc)
                backoff = min(backoff * 2, 60.0)
            await trio.sleep(backoff)

    async def tick(self) -> None:
        self._release_held()
        dead = self.retirable()
        if dead:
            await self.retire(dead)
        # (a job that saves every few seconds may never leave the writers idle for long: a
        # small tree does not wait for that, not even for its first estimate)
        fresh = self.fresh_bytes if self.fresh_bytes is not None else \
            len(self.ns.inodes) * FRESH_BYTES_PER_INODE
        small = fresh < SNAPSHOT_ANYTIME_BYTES
        if (self.idle() or small) and await self.snapshot_due():
            await self.snapshot()
        if self.idle() and self.punch_ok:
            await self.punch()
        if self.idle():  # (the cleaner's turn, also when --clean-below 0 turns it off)
            if self.clean_below > 0:
                victim = self.victim()
                if victim is not None:
                    await self.clean(victim)
            self.cleaner_turns += 1
        now = trio.current_time()
        if now - self._disk_checked >= DISK_USAGE_S:
            # Only what writes, retires, punches or moves changes the logs' blocks: an idle
            # mount asks the backing store nothing (on a parallel file system every stat is
            # a request to a server).
            fl = self.flusher.stats
            key = (fl.segments, fl.bytes_written, self.logs_retired, self.bytes_punched,
                   self.logs_cleaned, self.bytes_moved, self.snapshots)
            if key != self._disk_key:
                self._disk_checked, self._disk_key = now, key
                self.disk_bytes = await trio.to_thread.run_sync(self._disk_usage)

    def _disk_usage(self) -> int:
        """Worker thread: the blocks the data logs take up on the backing store."""
        total = 0
        for path in backingdir.data_logs(self.writer_dir).values():
            try:
                total += os.stat(path).st_blocks * 512
            except FileNotFoundError:
                pass
        return total

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
        await self.flusher.wait_committed(self.journal.last_seq)
        await self._drained(self.journal.last_seq)
        for lg in logs:
            space.forget(lg)
            self.dead_since.pop(lg, None)
            self._punched_ranges.pop(lg, None)
        # A log a reader is using right now is opened by the reader before it goes: the reader
        # reads on through that descriptor, and the space comes back when it lets go
        # (_release_held). (Reader state is the trio thread's; the opens run in the worker.)
        held = [lg for lg in logs if self.reader.log_in_use(0, lg)]
        freed = await trio.to_thread.run_sync(self._remove, logs, held)
        self._held.update(held)
        for lg in logs:
            if lg not in self._held:
                self.reader.forget_log(0, lg)
        self.logs_retired += len(logs)
        self.bytes_reclaimed += freed
        log.info("retired data logs %s (%d bytes freed)", ", ".join(map(str, logs)), freed)
        self.doing = "idle"

    def _remove(self, logs: list[int], held: list[int]) -> int:
        """Worker thread: remove the retired logs' files (those in `held` opened by the reader
        first). Returns the bytes they took up."""
        for lg in held:
            try:
                self.reader.hold(0, lg)
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

    def _release_held(self) -> None:
        for lg in list(self._held):
            if not self.reader.log_in_use(0, lg):
                self.reader.forget_log(0, lg)
                self._held.discard(lg)

    # ------------------------------------------------------------ the index snapshot
    async def snapshot_due(self) -> bool:
        idx = self.flusher.index
        ratio = self.snapshot_ratio
        if not ratio or idx.size < self.snapshot_min:
            return False
        if self.fresh_bytes is None or idx.size > ratio * self.fresh_bytes:
            self.fresh_bytes = await self.estimate()  # (the tree may have grown: look again)
        return idx.size > ratio * self.fresh_bytes

    async def estimate(self) -> int:
        """About the size of a fresh index of the own tree, in slices (other tasks run in
        between: a slice of 2,000 inodes takes ~1 ms)."""
        ns = self.ns
        xs = list(ns.inodes.values())
        total = 0
        for i in range(0, len(xs), ESTIMATE_SLICE):
            total += mover.fresh_index_bytes(xs[i:i + ESTIMATE_SLICE], ns)
            await trio.sleep(0)
        return total

    async def snapshot(self) -> None:
        """Write an index snapshot and have the flusher put it in place."""
        idx = self.flusher.index
        upto, before = idx.size, idx.size
        root = self.ns.inodes[ROOT_INO]
        now, since = time.monotonic(), self.settled_since
        settled = self.settled()
        for key in list(since):
            if key not in settled:
                del since[key]
        for key in settled:
            since.setdefault(key, now)
        drop = frozenset(k for k, t in since.items() if now - t >= SHARED_GRACE_S)
        self.doing = "writing an index snapshot"
        t0 = time.perf_counter()
        try:
            fresh, size, version = await self._snapshot_process(mover.snapshot_args(
                idx.path, upto, self.writer_id, os.getuid(), os.getgid(), root.atime_ns, drop,
                os.getpid(), idx.where.fd), idx.where.fd)
        except BaseException:  # (failed, or cancelled at unmount: no stray fresh index left;
            # the process is gone by now)
            discard_fresh(idx.where, idx.name)
            raise
        finally:
            self.doing = "idle"
        self.snapshot_seconds = time.perf_counter() - t0
        done = trio.Event()
        result: list = []

        def swapped(err) -> None:
            result.append(err)
            done.set()
        self.doing = "putting an index snapshot in place"
        self.flusher.swap_index(os.path.basename(fresh), upto, version, swapped)
        try:
            await done.wait()
        finally:
            self.doing = "idle"
        if result[0] is not None:
            raise result[0]
        if drop:  # (gone from the index: from memory too)
            self.ns.xunlinks = [r for r in self.ns.xunlinks if (r.writer, r.ino) not in drop]
            for key in drop:
                del since[key]
        self.snapshots += 1
        self.fresh_bytes = size
        log.info("index snapshot: %d -> %d bytes (%.3f s to write, commits held %.3f s)",
                 before, idx.size, self.snapshot_seconds, self.flusher.stats.swap_seconds)

    async def _snapshot_process(self, args: bytes, dir_fd: int) -> tuple[str, int, int]:
        """mover.build_snapshot in a process of its own (mover.py says why), started from
        this thread: the process dies with the thread that started it (PR_SET_PDEATHSIG),
        and the trio thread lives as long as the daemon (a worker thread may end first).
        Waited for in a worker thread; cancelled, the process is killed."""
        cmd, env, cwd = mover.snapshot_command()
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, cwd=cwd, close_fds=True,
                                pass_fds=(dir_fd,))
        try:
            pidfd = os.pidfd_open(proc.pid)
        except OSError:  # (out of descriptors, say: no snapshot this time)
            proc.kill()
            proc.communicate()
            raise

        def wait() -> tuple[bytes, int]:
            try:
                proc.stdin.write(args)
                proc.stdin.close()
            except BrokenPipeError:  # (it ended before it read them: its output says why)
                pass
            out = proc.stdout.read()
            proc.stdout.close()
            proc.wait()
            return out, proc.returncode
        try:
            out, rc = await trio.to_thread.run_sync(wait, abandon_on_cancel=True)
        finally:
            if proc.returncode is None:  # (cancelled: the waiting thread reaps it; a pidfd
                # names this process even once it is reaped, never one with its number since)
                try:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                # Gone before the caller removes what it wrote (the pidfd turns readable
                # when the process has ended): else its fresh index could come after.
                with trio.CancelScope(shield=True, deadline=trio.current_time() + KILL_WAIT_S):
                    await trio.lowlevel.wait_readable(pidfd)
            os.close(pidfd)
        fresh, size, version, self.snapshot_peak_rss = mover.snapshot_result(out, rc)
        return fresh, size, version

    # ------------------------------------------------------------ punching
    async def punch(self) -> None:
        """Give the dead ranges of closed logs back (step 3 of the module docstring)."""
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
                          if not self.reader.range_in_use(0, lg, r[0], r[1])]
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

    # ------------------------------------------------------------ the cleaner
    def victim(self) -> int | None:
        """The closed log to clean next (cost-benefit), or None."""
        space = self.space
        busy = self.flusher.open_logs() | {seg.log for seg in self.flusher.in_flight}
        now = time.monotonic()
        best, score = None, 0.0
        named = None
        for lg, live in space.live.items():
            size = space.held(lg)
            if live <= 0 or size <= 0 or lg in busy:
                continue
            u = live / size
            if u >= self.clean_below or self.unmovable.get(lg) == live:
                continue
            if size - live < self.staging.segment_bytes:
                # (less than a segment to win: a mount's last log of a small tree would be
                # copied into a new log as large at every remount)
                continue
            if named is None:
                named = self.others_use()
            if lg in named or any(d[0] == lg for d in self.damaged_runs):
                continue  # (it could not be retired after all)
            s = (1 - u) * max(1.0, now - space.ages.get(lg, 0.0)) / (1 + u)
            if s > score:
                best, score = lg, s
        return best

    async def live_pieces(self, lg: int) -> list[tuple[Inode, int, int, Run, int]]:
        """The own tree's pieces in data log `lg`, in log order (a pass over the tree in
        slices, other tasks running in between)."""
        xs = list({id(x): x for x in self.ns.inodes.values()}.values())
        out = []
        for i in range(0, len(xs), ESTIMATE_SLICE):
            for x in xs[i:i + ESTIMATE_SLICE]:
                if x.emap is None or x.layer != 0 or x.nlink <= 0:
                    continue  # (an unlinked file's bytes go with it: no record moves them)
                for s, n, run, roff in x.emap.pieces:
                    if run.log == lg and run.layer == 0 and (run.seg is None or
                                                              run.seg.durable):
                        out.append((x, s, n, run, roff))
            await trio.sleep(0)
        out.sort(key=lambda p: p[3].loff + p[4])
        return out

    async def clean(self, lg: int) -> None:
        """Move the live pieces out of data log `lg` (step 3 of the module docstring)."""
        pieces = await self.live_pieces(lg)
        total = sum(p[2] for p in pieces)
        if not pieces:
            self.unmovable[lg] = self.space.live.get(lg, 0)
            return
        self.unmovable.pop(lg, None)
        t0 = time.perf_counter()
        moved = 0
        if self._logs is None:
            self._logs = RunReader({0: self.writer_dir}, fallback=None if self.mirror is None
                                   else {0: self.mirror.path})
        try:
            i = 0
            while i < len(pieces):
                if not self.idle():
                    log.info("cleaning data log %d: a writer is busy, %d of %d bytes moved; "
                             "goes on when it is idle", lg, moved, total)
                    return
                batch, runs, nbytes = [], {}, 0
                while i < len(pieces) and (not batch or nbytes < CLEAN_BATCH_BYTES):
                    p = pieces[i]
                    if p[3] not in runs:
                        runs[p[3]] = None
                        nbytes += p[3].length
                    batch.append(p)
                    i += 1
                self.doing = f"cleaning data log {lg} ({moved >> 20} of {total >> 20} MiB moved)"
                data = await trio.to_thread.run_sync(self._read_runs, list(runs))
                for x, s, chunk, run, roff in mover.chunks(batch, data.get,
                                                           self.checksum_block):
                    moved += await self._move(x, s, run, roff, chunk)
        finally:
            self._logs.close()  # (its descriptors would keep the log's blocks allocated)
            self.doing = "idle"
            self.bytes_moved += moved
            self.clean_seconds += time.perf_counter() - t0
        self.logs_cleaned += 1
        log.info("cleaned data log %d: %d bytes moved in %.3f s", lg, moved,
                 time.perf_counter() - t0)

    def _read_runs(self, runs: list[Run]) -> dict[Run, bytes]:
        """Worker thread: the runs' bytes, each checked against its checksum. A run that fails
        is left where it is (its log then stays: a read of it reports the damage)."""
        out = {}
        for run in runs:
            try:
                out[run] = self._logs.read_run(run)
            except OSError as exc:
                log.error("cleaner: %s; those bytes stay where they are",
                          exc.strerror or exc)  # (RunError's message, without "[Errno 5]")
                self.damaged_runs.add((run.log, run.loff))
        return out

    async def _move(self, x: Inode, s: int, run: Run, roff: int, data: memoryview) -> int:
        """Copy the part of file bytes [s, s + len(data)) (bytes `roff`... of `run`, whose
        bytes `data` are) that the file still points at into staging; the bytes moved."""
        staging, journal = self.staging, self.journal
        pos, end, moved = s, s + len(data), 0
        while pos < end:
            staging.claim()
            seg = staging.open
            if seg is None:
                seg = await staging._open_segment()  # (may wait for a free segment)
            if x.emap is None or x.nlink <= 0:
                return moved
            # From here to the copy no other task runs: what the file points at now is what
            # the journal records the move after.
            found = [p for p in x.emap.find(pos, end)
                     if p.run is run and p.roff == roff + (p.start - s)]
            if not found:
                return moved
            a, m = found[0].start, found[0].length
            k = min(m, staging.segment_bytes - seg.used)
            soff = seg.used
            src = data[a - s:a - s + k]
            seg.view[soff:soff + k] = src
            seg.used = soff + k
            new = Run(seg, soff, k, crc=crc32c(src))
            seg.runs.append(new)
            journal.add(ExtentEntry(x.ino, a, new))
            x.emap.insert(a, k, new, 0)
            if seg.used == staging.segment_bytes:
                staging.seal()
            moved += k
            pos = a + k
        return moved

    # ------------------------------------------------------------ figures
    def status(self) -> dict:
        space = self.space
        live = space.live_bytes()
        logs = space.log_bytes()
        held = logs - sum(space.punched.values())
        return {
            "data_logs": len(space.ends),
            "data_logs_dead": sum(1 for n in space.live.values() if n <= 0),
            "live_bytes": live,
            "dead_bytes": max(0, held - live),  # dead and still taking up space
            "data_log_bytes": logs,
            "data_log_disk_bytes": self.disk_bytes,
            "logs_retired": self.logs_retired,
            "bytes_reclaimed": self.bytes_reclaimed,
            "bytes_punched": self.bytes_punched,
            "index_size_bytes": self.flusher.index.size if self.flusher.index else 0,
            "index_fresh_bytes": self.fresh_bytes or 0,
            "index_snapshots": self.snapshots,
            "index_snapshot_seconds": round(self.snapshot_seconds, 3),
            "index_snapshot_peak_rss_bytes": self.snapshot_peak_rss,
            "logs_cleaned": self.logs_cleaned,
            "cleaner_turns": self.cleaner_turns,
            "bytes_moved": self.bytes_moved,
            "clean_seconds": round(self.clean_seconds, 3),
            "maintenance": self.doing,
            "maintenance_errors": self.errors,
        }


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


def logs_named_by_others(peers, own_logs=()) -> set[int]:
    """The own data logs that other writers' trees (peers.Peers) point into; all of
    `own_logs` while another writer's tree could not be read (it may point into any)."""
    if peers.unloaded():
        return set(own_logs)
    alias = peers.own_alias
    if alias is None:
        return set()
    out = set()
    for tree in peers.trees.values():
        for ino in list(tree.cross_files):
            x = tree.inodes.get(ino)
            foreign = [p.run for p in x.emap.pieces if p.run.layer != tree.layer] \
                if x is not None and x.emap is not None else []
            if not foreign:
                tree.cross_files.discard(ino)  # (overwritten, truncated or gone since)
            out.update(run.log for run in foreign if run.layer == alias)
    return out

