"""Sealed segments to durable data logs, then the index records that describe them.

`Flusher` runs a thread that owns the io engine. It takes sealed segments in order (their runs'
CRC32C are taken on the trio thread before a segment's buffer goes back to the pool:
staging.Checksums), writes each segment whole (tail padded to the alignment) at the next
aligned offset of the current data log (format/logs.LogWriter), fdatasyncs, reports the
segments durable to the trio thread, then appends the journal's committable prefix
(datapath/journal.py: only extents whose segments are durable) to the index and fdatasyncs it
(group commit). Where each segment goes and how it is written: datapath/segwriter.py; the
staging pool faulted in and registered with the io engine: datapath/faultin.py.

Barriers (`fsync`, `ckptfs sync`, unmount) seal the open segment and wait until everything
journaled before them is committed. A failed write (ENOSPC, EIO) keeps the segments staged, is
reported to waiting barriers and writers as that errno, and is retried every RETRY_S.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import trio

from ckptfs import failpoints
from ckptfs.datapath.faultin import FaultIn
from ckptfs.datapath.journal import Journal
from ckptfs.datapath.segwriter import SegmentWriter
from ckptfs.datapath.staging import NO_LOG, Segment, Staging, round_up
from ckptfs.format.index import IndexWriter
from ckptfs.format.logs import LogWriter
from ckptfs.io import open_engine

log = logging.getLogger("ckptfs.flusher")

RETRY_S = 1.0
SYNC_INTERVAL_S = 1.0  # the longest a written segment waits for its fdatasync + commit
SYNC_BYTES = 1 << 30
# Copies of commit groups waiting for a segment to go with are written alone past this
COPY_FLUSH_BYTES = 1 << 20
_COMMIT = "commit"
_STOP = "stop"
_REGISTER = "register"  # (the staging pool is faulted in: register it with the io engine)


class _Swap:
    """Put a fresh index in place of the live one (Flusher.swap_index)."""

    __slots__ = ("fresh", "upto", "version", "done")

    def __init__(self, fresh: str, upto: int, version: int, done) -> None:
        self.fresh, self.upto, self.version, self.done = fresh, upto, version, done


def take_queued(q: queue.SimpleQueue, timeout: float | None) -> list:
    """What a worker thread's queue holds: the first item waited for up to `timeout` seconds
    (None: until one comes; 0: not at all), then every item queued behind it."""
    items = []
    try:
        items.append(q.get(timeout=timeout) if timeout != 0.0 else q.get_nowait())
    except queue.Empty:
        pass
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items


class FlushStats:
    def __init__(self) -> None:
        self.segments = 0
        self.bytes_written = 0  # to data logs, padding included
        self.payload_bytes = 0  # file bytes of the segments whose logs are synced
        self.index_bytes = 0
        self.index_commits = 0
        self.data_syncs = 0
        self.flush_seconds = 0.0
        self.errors = 0
        self.last_error = ""
        self.swap_seconds = 0.0  # how long the last index snapshot held the commits up


class ErrorNotices:
    """Whether the flusher has an error now (a failed write or sync, not yet healed), told by
    the flusher as it changes to who listens: the queue threads while they run (they answer
    FLUSH themselves only while there is none: fuse/ring.py, Ring.flush_fails). The mount
    makes one and gives it to the flusher and to the queue threads' owner (fuse/queues.py).
    Trio thread."""

    def __init__(self) -> None:
        self.failing = False
        self._listener: Callable[[bool], None] | None = None

    def report(self, failing: bool) -> None:
        """The flusher: it has an error from now on (True), or no more (False)."""
        self.failing = failing
        if self._listener is not None:
            self._listener(failing)

    def attach(self, listener: Callable[[bool], None]) -> None:
        """`listener(failing)` is told the state now, then every change of it."""
        self._listener = listener
        listener(self.failing)

    def detach(self) -> None:
        self._listener = None


class Flusher:
    """Owns the flusher thread and the barrier logic. Create and use from the trio thread."""

    def __init__(self, where, writer_id: str, staging: Staging, journal: Journal,
                 *, engine: str, depth: int, direct: bool, align: int, log_bytes: int,
                 next_log: int, index: IndexWriter | None, io_chunk_bytes: int,
                 data_logs: int = 1, stripe_bytes: int = 0, fixed_buffers: bool = True,
                 flush_errors: ErrorNotices, tier=None, durability: str = "backing",
                 written_hook: Callable[[Segment], None] | None = None,
                 durable_hook: Callable[[Segment], None] | None = None) -> None:
        """`flush_errors`: told when `error` is set and when it clears; `tier`: the node tier
        (datapath/tier.py; None without --local-dir), told each commit, asked for local room
        before segments are written; `durability`: the level fsync and a barrier without one
        wait for ("backing" or "node"); `written_hook(seg)` and `durable_hook(seg)`: called
        (trio thread) with each segment once it is on disk, once it is durable."""
        self.where = where  # the writer's directory, held open (backingdir.Dir; None: read-only)
        self.writer_id = writer_id
        self.staging = staging
        self.journal = journal
        self.engine_kind = engine
        self.depth = depth
        self.direct = direct
        self.align = align
        self.log_bytes = log_bytes
        self.next_log = next_log
        self.index = index  # the live index (None: a read-only mount)
        self.io_chunk_bytes = io_chunk_bytes
        # With O_DIRECT a completed write is on the device (not in the page cache): its buffer
        # can be reused before the fdatasync. Buffered writes can still fail at fdatasync
        # (ENOSPC at writeback), so their buffers are kept until then.
        self.release_early = direct
        self.written_hook = written_hook
        self.durable_hook = durable_hook
        self.in_flight: set[Segment] = set()  # sealed, not yet durable (trio thread)
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.error: OSError | None = None
        # Set once for good when the flusher thread ends on an unexpected exception (a
        # defect): every barrier, fsync, sync and the unmount fail with it (EIO) from then on,
        # and nothing waits for a commit that cannot come.
        self.failed: OSError | None = None
        self.flush_errors = flush_errors
        self.committed = trio.Event()
        self.stats = FlushStats()
        self.engine_name = "?"
        self.thread: threading.Thread | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self.inflight_segments = 0
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self.data_logs = data_logs
        self.stripe_bytes = stripe_bytes
        # The staging buffers faulted in and registered with the io engine once the mount
        # serves (datapath/faultin.py); off with --no-populate, which leaves them unfaulted
        self.fault_in = FaultIn(staging, fixed_buffers, lambda: self.q.put(_REGISTER))
        # (flusher thread; made with its io engine)
        self.logs: LogWriter | None = None
        self.writer: SegmentWriter | None = None
        self._committed_upto = 0  # (the flusher thread's own count: the last upto appended)
        self.tier = tier
        self.durability = durability

    # ------------------------------------------------------------ trio side
    def start(self) -> None:
        self._committed_upto = self.journal.committed_seq
        self.token = trio.lowlevel.current_trio_token()
        self.thread = threading.Thread(target=self._thread_main, name="ckptfs-flusher")
        self.thread.start()
        self._started.wait()
        if self._start_error is not None:
            self.thread.join()
            raise self._start_error

    def seal_hook(self, seg: Segment) -> None:
        self.inflight_segments += 1
        self.in_flight.add(seg)
        self.q.put(seg)

    def open_logs(self) -> set[int]:
        """The data logs segments are being placed in (read from the trio thread: a log
        missing here takes no new segment; those placed in it before are in `in_flight`
        until durable, with their `log` set)."""
        return self.logs.open_numbers() if self.logs is not None else set()

    async def wait_committed(self, seq: int) -> None:
        """Return when the journal is committed up to `seq` (without sealing the open segment,
        as a barrier does: a commit follows the next flush, or the idle flush)."""
        if self.failed is not None:
            raise self.failed
        while self.journal.committed_seq < seq:
            if self.error is not None:
                raise self.error
            self.q.put(_COMMIT)
            await self.committed.wait()

    def kick(self) -> None:
        """Ask for a commit of whatever is committable (namespace-only changes)."""
        self.q.put(_COMMIT)

    async def barrier(self, level: str | None = None) -> None:
        """Return when every change made before the call is durable at `level` ("node": in
        the index; "backing": in the backing directory, which with the node tier is later;
        None: the mount's --durability)."""
        if self.failed is not None:
            raise self.failed
        self.staging.seal()
        target = self.journal.last_seq
        if self.journal.committed_seq < target:
            self.q.put(_COMMIT)
            while self.journal.committed_seq < target:
                if self.error is not None:
                    raise self.error
                await self.committed.wait()
        if self.tier is not None and (level or self.durability) == "backing":
            await self.tier.wait_backing(target)

    def tier_status(self) -> dict:
        """The node tier's figures and the level barriers wait for ({} without the tier)."""
        if self.tier is None:
            return {}
        return {"durability": self.durability, **self.tier.status()}

    def level(self, seq: int) -> str:
        """Where a change with sequence number `seq` is durable: "staged" (not yet), "node"
        (in the node tier's index), "backing" (in the backing directory)."""
        if seq > self.journal.committed_seq:
            return "staged"
        if self.tier is not None and seq > self.tier.backing_seq:
            return "node"
        return "backing"

    async def stop(self) -> None:
        """Unmount: seal, drain, commit and join the thread. Raises if data could not be made
        durable (after the thread gave up retrying at shutdown)."""
        if self.thread is None:  # read-only mount: never started
            return
        self.staging.seal()
        self.q.put(_STOP)
        await trio.to_thread.run_sync(self.thread.join)
        lost = self.journal.pending() or self.inflight_segments
        if self.failed is not None:
            raise OSError(5, f"{self.failed.strerror}; " + (
                "changes staged before it were NOT all made durable" if lost
                else "everything staged was made durable before the unmount"))
        if lost:
            raise self.error or OSError(5, "flusher stopped with changes not committed")

    def _wake(self) -> None:
        ev, self.committed = self.committed, trio.Event()
        ev.set()

    def _on_written(self, segs: list[Segment]) -> None:
        """O_DIRECT writes completed: the bytes are readable from the data log, so the
        buffers go back to the pool before the (later, shared) fdatasync."""
        for seg in segs:
            if not seg.released:
                self._written(seg)
                self.staging.release(seg)

    def _written(self, seg: Segment) -> None:
        if self.written_hook is not None:
            self.written_hook(seg)

    def _on_durable(self, segs: list[Segment]) -> None:
        hook = self.durable_hook
        for seg in segs:
            seg.durable = True
            self.stats.payload_bytes += seg.used  # (its log synced)
            if hook is not None:
                hook(seg)
            if not seg.released:
                self._written(seg)
                self.staging.release(seg)
            self.inflight_segments -= 1
            self.in_flight.discard(seg)
        if self.error is not None and self.failed is None:
            self.error = None
            self.staging.error = None
            self.flush_errors.report(False)

    def _on_error(self, exc: OSError) -> None:
        self.error = exc
        self.staging.error = exc
        self.flush_errors.report(True)
        self.stats.errors += 1
        self.stats.last_error = f"{exc.__class__.__name__}: {exc}"
        self.staging.free_event.set()  # wake writers waiting for a segment: they see the error
        self._wake()

    def fail(self, exc: BaseException, where: str) -> None:
        """Trio thread: a defect in `where` (a thread or task of the mount) ended it on `exc`:
        the mount is failed from now on (every barrier, fsync, sync and the unmount fail with
        EIO and the cause). The first cause stays."""
        if self.failed is not None:
            return
        err = OSError(5, f"{where} failed ({exc.__class__.__name__}: {exc}): the mount is "
                         "failed, unmount it and mount again")
        self.failed = err
        self._on_error(err)

    def _on_failed(self, exc: BaseException) -> None:
        self.fail(exc, "the flusher thread")

    def _on_committed(self, upto: int) -> None:
        self.journal.confirm(upto)
        if self.tier is not None:
            self.tier.note_committed(upto)
        self.journal.prune(self.tier.backing_seq if self.tier is not None else upto)
        self._wake()

    def _call(self, fn, *args):
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)

    # ------------------------------------------------------------ flusher thread
    def _thread_main(self) -> None:
        try:
            self.engine = open_engine(self.engine_kind, depth=self.depth)
            self.engine_name = self.engine.name
            self.logs = LogWriter(self.where, self.writer_id, self.engine,
                                  direct=self.direct, align=self.align,
                                  log_bytes=self.log_bytes, next_log=self.next_log,
                                  data_logs=self.data_logs, stripe_bytes=self.stripe_bytes)
            self.writer = SegmentWriter(self.engine, self.logs, self.stats, align=self.align,
                                        io_chunk_bytes=self.io_chunk_bytes)
        except BaseException as exc:
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        self.fault_in.start()
        try:
            self._loop()
        except BaseException as exc:  # (a defect: said to every waiter, never swallowed)
            log.critical("the flusher thread failed; this mount can make nothing durable "
                         "any more", exc_info=True)
            try:
                self._call(self._on_failed, exc)
            except trio.RunFinishedError:  # (the mount's loop has ended: stop() reports it)
                self.failed = OSError(5, f"the flusher thread failed: {exc!r}")
                self.error = self.failed
        finally:
            self.fault_in.stop()
            self.logs.close()
            self.stats.data_syncs = self.logs.syncs
            self.engine.close()
            self.writer.close()

    def _loop(self) -> None:
        pending: list[Segment] = []  # sealed, not yet written (or failed: retried)
        written: list[Segment] = []  # written, not yet fdatasync'ed
        written_bytes = 0
        first_written = 0.0
        commit_now = False
        stopping = False
        stop_attempts = 0
        while True:
            timeout = 0.0
            if stopping and self.error is not None:
                # Unmount with a failing backing store: a few more tries, then give up (stop()
                # reports what could not be made durable).
                stop_attempts += 1
                if stop_attempts > 3:
                    return
                time.sleep(RETRY_S)
            else:
                if self.error is not None and (pending or written or commit_now):
                    timeout = RETRY_S  # failing store: retry at a steady pace
                elif pending:  # (waiting for the node tier's room)
                    timeout = 0.0
                elif written:
                    timeout = max(0.0, first_written + SYNC_INTERVAL_S - time.monotonic())
                else:
                    timeout = None
            for it in take_queued(self.q, timeout):
                if it is _STOP:
                    stopping = True
                elif it is _COMMIT:
                    commit_now = True
                elif it is _REGISTER:
                    self.fault_in.register(self.engine)
                elif type(it) is _Swap:
                    self._swap(it)
                elif type(it) is Segment:
                    pending.append(it)
            hold = False
            batch = pending
            if pending and self.tier is not None:
                # The node tier's local space: segments wait for room (those that fit go
                # first), and what is written is committed before waiting (the drain takes
                # only what is committed).
                batch = pending[:self.tier.reserve(
                    [round_up(s.used, self.align) if s.log == NO_LOG else 0 for s in pending])]
                if not batch:
                    if not (written or commit_now):
                        if stopping and self.tier.error is not None:
                            stop_attempts += 1  # (the backing store fails: the unmount ends)
                            if stop_attempts > 3:
                                return
                        self.tier.wait_room(RETRY_S)
                        continue
                    hold = True
            if batch:
                try:
                    self.writer.write(batch)
                except OSError as exc:
                    log.error("flush of %d segments failed: %s (will retry)", len(batch), exc)
                    self._call(self._on_error, exc)
                    continue
                if not written:
                    first_written = time.monotonic()
                written += batch
                written_bytes += sum(seg.used for seg in batch)
                if self.release_early:
                    self._call(self._on_written, batch)
                pending = pending[len(batch):]
            # Group commit: one fdatasync of the data logs and one index commit cover all
            # segments written since the last one. Now when asked (a barrier, unmount, a
            # namespace change waiting), else every SYNC_INTERVAL_S or SYNC_BYTES.
            due = (commit_now or stopping or hold or written_bytes >= SYNC_BYTES
                   or (written and time.monotonic() - first_written >= SYNC_INTERVAL_S))
            if not due:
                continue
            if written:
                try:
                    self.logs.sync()
                except OSError as exc:
                    log.error("fdatasync of the data logs failed: %s (will retry)", exc)
                    if not self.release_early:
                        # Buffered writes: the kernel may have dropped the pages whose
                        # writeback failed, and it reports that once: a second fdatasync
                        # would succeed over lost bytes. So the segments (still staged) are
                        # written again, to the same places, before the next one.
                        self.writer.lost_writeback(written)
                        pending = written + pending
                        written, written_bytes = [], 0
                    self._call(self._on_error, exc)
                    continue
                self.stats.data_syncs = self.logs.syncs
                self._call(self._on_durable, written)
                written, written_bytes = [], 0
            try:
                self._commit()
            except OSError as exc:
                log.error("commit failed: %s (will retry)", exc)
                self._call(self._on_error, exc)
                continue
            commit_now = False
            if stopping or self.writer.copies_bytes >= COPY_FLUSH_BYTES:
                try:
                    self.writer.write_copies()
                except OSError as exc:  # (the groups are in the index: only a copy is late)
                    log.warning("writing the copies of %d commit groups into a data log "
                                "failed: %s", len(self.writer.copies), exc)
                if stopping and self.tier is not None:  # (the copies go to the backing too)
                    self.tier.committed(self._committed_upto, self.index.size, self.logs.ends())
            if stopping:
                return

    # ------------------------------------------------------------ the index
    def swap_index(self, fresh: str, upto: int, version: int, done) -> None:
        """Trio thread: have the flusher put the fresh index `fresh` (a name beside the live
        index, equivalent to its first `upto` bytes) in place, between two commits, with the
        groups committed since; `done(error or None)` is called on the trio thread after."""
        self.q.put(_Swap(fresh, upto, version, done))

    def _swap(self, sw: _Swap) -> None:
        err = None
        t0 = time.perf_counter()
        try:
            if self.tier is None:
                self.index.replace(sw.fresh, sw.upto, sw.version)
            else:  # (the drain replaces the backing index with it in turn)
                def replace() -> int:
                    self.index.replace(sw.fresh, sw.upto, sw.version)
                    return self.index.size
                self.tier.swap(replace, self._committed_upto, self.logs.ends())
        except OSError as exc:
            err = exc
            try:
                self.index.where.unlink(sw.fresh)
            except OSError:
                pass
        self.stats.swap_seconds = time.perf_counter() - t0
        self._call(sw.done, err)

    def _commit(self) -> None:
        failpoints.hit("flusher-commit")
        blob, upto = self._call(self.journal.take_committable)
        if blob:
            # A failed write is cut off again (IndexWriter.append), so that later appends stay
            # reachable on replay; the journal keeps the records and writes them first next time.
            self.index.append(blob, self.journal.unsent_version)
            self.stats.index_bytes += len(blob)
            self.stats.index_commits += 1
            self.writer.copy_later(blob, self._committed_upto)
            self._committed_upto = upto
            if self.tier is not None:
                self.tier.committed(upto, self.index.size, self.logs.ends())
        self._call(self._on_committed, upto)
