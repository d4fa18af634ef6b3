"""The space of this writer's data logs, and the cleaner that empties mostly dead ones.

- `LogSpace` counts, per data log of this writer, the bytes that extent maps still point at.
  Replay gives the start (every piece of the replayed tree); then every byte an overwrite,
  truncate, unlink or move kills is taken off its log (`dead`, every own extent map's
  on_dead: namespace.Namespace gives it to the maps of the tree), and every segment
  the flusher makes durable adds its runs' surviving bytes to its log.
- `Cleaner`, once writers have been idle for --clean-idle seconds: of the closed logs whose
  live share of the bytes they still take up (after punching: datapath/reclaim.py) is below
  --clean-below, the one with the best cost-benefit ratio ((1 - u) * age / (1 + u), u that
  share: the LFS cleaner's policy) has its live pieces read back (worker thread, each run's
  checksum checked) and written into staging like a write: new runs, EXTENT records
  journaled in order with everything else, so the flusher writes them into the current log
  with the io engine's large aligned writes. Each piece is moved only if the file still
  points at those bytes at that moment (on the trio thread, without an await between the
  look and the copy); a later overwrite simply comes later in the journal. The log's live
  bytes then reach zero and it is retired (datapath/reclaim.py) once the moves are
  committed. It stops between batches (CLEAN_BATCH_BYTES) as soon as a writer writes, so a
  save in progress has the disk to itself; a reader meanwhile reads the old copy (the log
  stays until the RETIRE record is committed and no reader holds it) or the new one.

The maintainer (datapath/maintainer.py) runs the cleaner, the retiring and punching and the
index snapshot (datapath/snapshotter.py). Trio thread, except where a function says it runs
in a worker thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import trio

from crc32c import crc32c

from ckptfs.datapath import mover
from ckptfs.datapath.journal import ExtentEntry
from ckptfs.datapath.staging import (
    CHECKSUM_BLOCK_BYTES,
    NO_LOG,
    Run,
    Segment,
    round_up,
)
from ckptfs.format.logs import RunReader
from ckptfs.namespace import Inode

log = logging.getLogger("ckptfs.cleaner")

# inodes per slice of a pass over the tree (the fresh-index estimate, the live ranges and
# pieces of logs); other tasks run between slices
ESTIMATE_SLICE = 2000
# With other writers in the backing directory: how long dead bytes wait before their space is
# given back, and whiteouts settled before a snapshot leaves them out (longer than another
# mount's view of this tree lags behind it: refresh.py).
SHARED_GRACE_S = 60.0
CLEAN_BATCH_BYTES = 16 << 20  # runs read back at once; between batches the cleaner looks up


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



class Cleaner:
    """Moves the live pieces out of mostly dead closed logs (see the module docstring).
    `idle()`: whether writers have written nothing for --clean-idle seconds (the cleaner
    stops between batches when they have); `others_use()`: the own logs other writers'
    trees point into (never cleaned: they could not be retired after all); `mirror_dir`:
    with the node tier, the backing copy of the writer's directory (read from when a log
    is no longer in the local one)."""

    def __init__(self, ns, journal, flusher, staging, space: LogSpace, writer_dir: str, *,
                 mirror_dir: str | None = None, checksum_block: int = CHECKSUM_BLOCK_BYTES,
                 clean_below: float = 0.5, idle: Callable[[], bool] = lambda: False,
                 others_use: Callable[[], set[int]] = lambda: set()) -> None:
        self.ns = ns
        self.journal = journal
        self.flusher = flusher
        self.staging = staging
        self.space = space
        self.writer_dir = writer_dir
        self.mirror_dir = mirror_dir
        self.checksum_block = checksum_block
        self.clean_below = clean_below
        self.idle = idle
        self.others_use = others_use
        self.doing = "idle"
        self.logs_cleaned = 0
        self.bytes_moved = 0
        self.seconds = 0.0
        self.damaged_runs: set[tuple[int, int]] = set()  # (log, offset): not moved, reported
        # Logs whose live bytes all belong to unlinked files still open (nothing to move:
        # they go when the files close), with their live bytes when that was found: not
        # looked at again while the count stays so
        self.unmovable: dict[int, int] = {}
        self._logs: RunReader | None = None

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
        """Move the live pieces out of data log `lg` (see the module docstring)."""
        pieces = await self.live_pieces(lg)
        total = sum(p[2] for p in pieces)
        if not pieces:
            self.unmovable[lg] = self.space.live.get(lg, 0)
            return
        self.unmovable.pop(lg, None)
        t0 = time.perf_counter()
        moved = 0
        if self._logs is None:
            self._logs = RunReader({0: self.writer_dir}, fallback=None if self.mirror_dir is None
                                   else {0: self.mirror_dir})
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
            self.seconds += time.perf_counter() - t0
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

