"""Space and history of a mount: the task that gives space back and keeps the index small.

Once a second, on the trio thread, `Maintainer.tick`:

1. retires the data logs that hold no live byte and no segment is being placed in (a RETIRE
   record, committed, then the file removed: datapath/reclaim.py); at mount this finishes
   the logs a crash left dead or half retired;
2. writes an index snapshot when the index has grown to --index-snapshot-ratio times the
   size a fresh index of the tree would have, once writers have been idle for --clean-idle
   seconds (at once for a small tree: datapath/snapshotter.py);
3. punches the dead ranges out of the logs, once writers have been idle (reclaim.py);
4. gives the cleaner its turn, once writers have been idle: the mostly dead log with the best
   cost-benefit ratio has its live pieces moved into the current log (datapath/cleaner.py),
   and step 1 retires it once the moves are committed.

The live bytes of each log it works from are counted by cleaner.LogSpace. A backing store
that refuses (OSError) is tried again, less often while it keeps failing; a fault of the
maintenance itself fails the mount.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import trio

from ckptfs import failpoints
from ckptfs.datapath.cleaner import Cleaner, LogSpace
from ckptfs.datapath.reclaim import Reclaimer
from ckptfs.datapath.snapshotter import Snapshotter
from ckptfs.format import backingdir

log = logging.getLogger("ckptfs.cleaner")

TICK_S = 1.0  # how often the maintainer looks
DISK_USAGE_S = 5.0  # how often it asks the backing store how much the logs take up


class Maintainer:
    """The task that gives space back while mounted (see the module docstring). `where`:
    the writer's directory, held open (backingdir.Dir); `cfg`: the mount's options. With
    the node tier (datapath/tier.py), `tier` and `mirror` (the backing copy of the writer's
    directory): files are removed and punched in both copies, and only once the drain has
    passed the commit that made it safe. `others_use()`: the own logs other writers' trees
    point into (their XEXTENT records: a file they took over without copying its bytes),
    kept while named; `shared()`: whether other writers share the backing directory (then
    dead bytes wait, reclaim.Reclaimer.grace); `settled()`: the own whiteouts whose entries
    their writers have removed (snapshotter.Snapshotter)."""

    def __init__(self, ns, journal, flusher, cache, staging, space: LogSpace, where, cfg, *,
                 tier=None, mirror=None,
                 others_use: Callable[[], set[int]] = lambda: set(),
                 shared: Callable[[], bool] = lambda: False,
                 settled: Callable[[], set[tuple[str, int]]] = lambda: set()) -> None:
        self.flusher = flusher
        self.staging = staging
        self.space = space
        self.writer_dir = where.path
        self.idle_s = cfg.clean_idle_s
        self.reclaimer = Reclaimer(ns, journal, flusher, cache, staging, space, where,
                                   mirror=mirror, tier=tier, others_use=others_use,
                                   shared=shared)
        self.snapshotter = Snapshotter(ns, flusher, os.path.basename(where.path),
                                       ratio=cfg.index_snapshot_ratio,
                                       min_bytes=cfg.index_snapshot_min_bytes, settled=settled)
        self.cleaner = Cleaner(ns, journal, flusher, staging, space, where.path,
                               mirror_dir=mirror.path if mirror is not None else None,
                               checksum_block=cfg.checksum_block_bytes,
                               clean_below=cfg.clean_below, idle=self.idle,
                               others_use=others_use)
        self.errors = 0
        self.last_error = ""
        self.cleaner_turns = 0  # ticks that found the writers idle: the cleaner's turn
        self.disk_bytes = 0  # the data logs' allocated blocks (st_blocks), looked up every 5 s
        self._disk_checked = -DISK_USAGE_S
        self._disk_key: tuple = ()  # what had happened at the last look (tick)

    def idle(self) -> bool:
        """Writers have written nothing for --clean-idle seconds."""
        return trio.current_time() - self.staging.last_write >= self.idle_s

    @property
    def doing(self) -> str:
        """What the maintenance is doing now (one step at a time)."""
        for part in (self.reclaimer, self.snapshotter, self.cleaner):
            if part.doing != "idle":
                return part.doing
        return "idle"

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
                if not isinstance(exc, OSError):
                    log.critical("maintenance failed", exc_info=True)
                    self.flusher.fail(exc, "the cleaner")
                    return
                log.warning("maintenance: %s (retried)", exc)
                backoff = min(backoff * 2, 60.0)
            await trio.sleep(backoff)

    async def tick(self) -> None:
        reclaimer, snapshotter, cleaner = self.reclaimer, self.snapshotter, self.cleaner
        reclaimer.release_held()
        dead = reclaimer.retirable()
        if dead:
            await reclaimer.retire(dead)
        if (self.idle() or snapshotter.anytime()) and await snapshotter.due():
            await snapshotter.snapshot()
        if self.idle() and reclaimer.punch_ok:
            await reclaimer.punch()
        if self.idle():  # (the cleaner's turn, also when --clean-below 0 turns it off)
            if cleaner.clean_below > 0:
                victim = cleaner.victim()
                if victim is not None:
                    await cleaner.clean(victim)
            self.cleaner_turns += 1
        now = trio.current_time()
        if now - self._disk_checked >= DISK_USAGE_S:
            # Only what writes, retires, punches or moves changes the logs' blocks: an idle
            # mount asks the backing store nothing (on a parallel file system every stat is
            # a request to a server).
            fl = self.flusher.stats
            key = (fl.segments, fl.bytes_written, reclaimer.logs_retired,
                   reclaimer.bytes_punched, cleaner.logs_cleaned, cleaner.bytes_moved,
                   snapshotter.snapshots)
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

    # ------------------------------------------------------------ figures
    def status(self) -> dict:
        space, reclaimer = self.space, self.reclaimer
        snapshotter, cleaner = self.snapshotter, self.cleaner
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
            "logs_retired": reclaimer.logs_retired,
            "bytes_reclaimed": reclaimer.bytes_reclaimed,
            "bytes_punched": reclaimer.bytes_punched,
            "index_size_bytes": self.flusher.index.size if self.flusher.index else 0,
            "index_fresh_bytes": snapshotter.fresh_bytes or 0,
            "index_snapshots": snapshotter.snapshots,
            "index_snapshot_seconds": round(snapshotter.seconds, 3),
            "index_snapshot_peak_rss_bytes": snapshotter.peak_rss,
            "logs_cleaned": cleaner.logs_cleaned,
            "cleaner_turns": self.cleaner_turns,
            "bytes_moved": cleaner.bytes_moved,
            "clean_seconds": round(cleaner.seconds, 3),
            "maintenance": self.doing,
            "maintenance_errors": self.errors,
        }
