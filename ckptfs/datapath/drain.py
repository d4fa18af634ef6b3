"""The node tier's drain: the thread that copies the local writer directory to its backing copy.

The flusher tells the drain two things (datapath/tier.py passes them on): which ranges of the
local data logs a batch of segments has just written (`Written`), and each commit of the local
index (`Note`: the index's end, how far every log is written). The drain copies the written
ranges to the same places in the backing copy as soon as they are written, commit or not: bytes
beyond what the backing index names are what a crash between a data write and its commit
leaves in any data log, and no reader looks at them. When everything a commit covers is
copied, the backing logs are synced (fdatasync, in a second thread: meanwhile the copying of
what comes after goes on), then drain.json records how far each log is drained, then the
backing index gets the local index's bytes up to that commit (synced). So the backing index
never names a byte the backing logs do not hold durably, and the backing copy is always the
local one as it was at some commit.

A failed copy or sync (ENOSPC, EIO from the parallel file system) is retried every RETRY_S from
the last drained point; with buffered backing writes the range is punched before it is copied
again (a failed writeback's pages are dropped and ext4 keeps their blocks unwritten under a
rewrite: flusher.py, the same case).

Everything here runs on the drain thread except `put` (any thread) and the reads of `drained`
and `stats` for the status (trio thread; plain dict and int reads)."""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from ckptfs import failpoints
from ckptfs.datapath.flusher import take_queued
from ckptfs.format.backingdir import INDEX_NAME, Dir, WriterDir, data_log_name, write_atomic
from ckptfs.format.logs import punch_hole
from ckptfs.format.records import INDEX_HEADER
from ckptfs.io import alloc_aligned, open_engine

log = logging.getLogger("ckptfs.tier")

DRAIN_STATE = "drain.json"
PRE_SWAP = "index.pre-swap"
FRESH_COPY = INDEX_NAME + ".drain"  # (the backing index's replacement, written beside it)
RETRY_S = 1.0  # a failing backing store is tried again this often
# Read from the local log (O_DIRECT where the local file system allows: the bytes were written
# past the page cache and are not read again here, so they do not go through it) into one
# half of this buffer while the other half is written to the backing copy in --io-chunk
# requests, all in flight at once. One piece of copying is this much: between pieces the
# drain looks at its queue and at the sync in flight.
DRAIN_CHUNK_BYTES = 64 << 20
STOP = "stop"
_SYNCED = "synced"  # (wakes the loop: the sync in flight is done)
STEP_ASIDE_S = 0.05  # how often a drain stepping aside for the writers looks again
MAX_NOTES = 256  # commits waiting for the drain (older ones are merged: memory stays bounded)


def _union(a: dict[int, int | None], b: dict[int, int | None]) -> dict[int, int | None]:
    """Two notes' ends as one: a log closed in either is closed, else the larger end."""
    out = dict(a)
    for lg, end in b.items():
        out[lg] = None if end is None or out.get(lg, 0) is None else max(out.get(lg, 0), end)
    return out


class Note:
    """The flusher committed: the local index ends at `index_end`, covering changes up to
    `seq`; the data logs this mount made are written up to `ends` (log -> offset; None: closed,
    its size is final)."""

    __slots__ = ("seq", "index_end", "ends", "when", "swapped")

    def __init__(self, seq: int, index_end: int, ends: dict[int, int | None],
                 swapped: bool = False) -> None:
        self.seq, self.index_end, self.ends, self.when = seq, index_end, ends, time.monotonic()
        self.swapped = swapped  # (an index snapshot took the local index's place)


class Written:
    """A flusher batch wrote `ranges` (log -> (start, end)) of the local data logs: they may be
    copied now. A start below what was copied of the log is a range written again (after a
    failed fdatasync): it is copied again."""

    __slots__ = ("ranges",)

    def __init__(self, ranges: dict[int, tuple[int, int]]) -> None:
        self.ranges = ranges


class DrainStats:
    def __init__(self) -> None:
        self.bytes = 0  # data log and index bytes copied to the backing directory
        self.seconds = 0.0  # spent copying them (a sync overlapped with copying counts once)
        self.yielded_seconds = 0.0  # copying waited for writers waiting for staging room
        self.cycles = 0  # commits drained
        self.rate = 0.0  # bytes/s between the last two commits drained, when >= 8 MiB
        self.errors = 0
        self.last_error = ""
        self.evicted_logs = 0
        self.evicted_bytes = 0


class _Sync:
    """A sync in flight: the backing logs of `ranges` (log -> (start, end) copied since the
    last drained point) fdatasynced for `note`, in the sync thread."""

    __slots__ = ("note", "ranges", "future", "superseded")

    def __init__(self, note: Note, ranges: dict[int, tuple[int, int]], future: Future) -> None:
        self.note, self.ranges, self.future = note, ranges, future
        self.superseded = False  # (an index snapshot came meanwhile: no index copy for it)


class Drain:
    """The drain thread of a node tier: `local` (LOCAL/writers/<id>/) copied into `backing`
    (BACKING/writers/<id>/). `call_soon(fn, *args)` runs fn on the trio thread;
    `on_drained(seq)`, `on_error(exc)` and `on_fatal(exc, where)` are called that way."""

    def __init__(self, local: WriterDir, backing: Dir, stats: DrainStats, *, drained_index: int,
                 logs: list[int], engine: str, depth: int, direct: bool, io_chunk_bytes: int,
                 local_direct: bool, call_soon, on_drained, on_error, on_fatal,
                 step_aside=lambda: False) -> None:
        self.local, self.backing, self.stats = local, backing, stats
        self.engine_kind, self.depth, self.direct = engine, depth, direct
        self.local_direct = local_direct
        self.io_chunk = io_chunk_bytes
        self.call_soon = call_soon
        self.on_drained, self.on_error, self.on_fatal = on_drained, on_error, on_fatal
        self.step_aside = step_aside  # (any thread: whether the copying waits now)
        self.aside_since = 0.0
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        # An index snapshot's swap and its note are one step for the drain: it looks at the
        # local index by name only holding this, after taking every note queued
        self.swap_lock = threading.Lock()
        self.index = BackingIndex(local, backing, drained_index)
        self.drained = self._load_state()  # log -> bytes of it durable in the backing copy
        self.copied = dict(self.drained)  # log -> bytes of it written to the backing copy
        self.written: dict[int, int] = {}  # log -> how far batches wrote it (copy ahead)
        self.lost: dict[int, int] = {}  # log -> where a range whose writeback failed starts
        self.rewound: dict[int, int] = {}  # log -> lowest start written again since a sync
        self.ends: dict[int, int | None] = {n: None for n in logs}  # (as of the newest note)
        self.notes: list[Note] = []  # commits to drain, oldest first
        self.final: set[int] = set()  # closed logs wholly in the backing copy, or gone
        self.bfds: dict[int, int] = {}
        self.thread: threading.Thread | None = None
        self.busy_since = 0.0
        self.last_drained = (time.perf_counter(), 0)  # (when, stats.bytes): for the rate

    def start(self) -> None:
        with self.swap_lock:
            self.index.open_local()
        self.thread = threading.Thread(target=self._main, name="ckptfs-drain")
        self.thread.start()

    def put(self, item) -> None:
        self.q.put(item)

    def join(self) -> None:
        self.q.put(STOP)
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def _load_state(self) -> dict[int, int]:
        try:
            fd = self.local.dir.open(DRAIN_STATE, os.O_RDONLY)
        except FileNotFoundError:
            return {}
        try:
            with open(fd) as f:
                return {int(k): int(v) for k, v in json.load(f)["logs"].items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("%s unreadable: every local data log is copied again",
                        self.local.dir.join(DRAIN_STATE))
            return {}

    # ------------------------------------------------------------ the thread
    def _main(self) -> None:
        syncer = ThreadPoolExecutor(1, thread_name_prefix="ckptfs-drain-sync")
        try:
            self.engine = open_engine(self.engine_kind, depth=self.depth)
            self.buf = alloc_aligned(DRAIN_CHUNK_BYTES, populate=False)
            self._loop(syncer)
        except BaseException as exc:  # a defect: the mount fails, said to every waiter
            log.critical("the drain thread failed; nothing more reaches the backing directory",
                         exc_info=True)
            self.call_soon(self.on_fatal, exc, "the drain thread")
        finally:
            syncer.shutdown(wait=True)
            for fd in self.bfds.values():
                os.close(fd)
            self.bfds.clear()
            self.index.close()
            if hasattr(self, "engine"):
                self.engine.close()
            if hasattr(self, "buf"):
                self.buf.close()

    def _loop(self, syncer: ThreadPoolExecutor) -> None:
        syncing: _Sync | None = None
        stopping = False
        attempts = 0
        retry_at = 0.0
        while True:
            now = time.monotonic()
            if now < retry_at:
                timeout = retry_at - now
            elif syncing is None and self._due(take=False):
                timeout = 0.0
            elif self._next_piece() is not None:
                timeout = STEP_ASIDE_S if self._stepping_aside() else 0.0
            else:
                timeout = None  # (a commit, a written batch, the sync's end or the stop)
            items = take_queued(self.q, timeout)
            with self.swap_lock:  # (a swap's note is queued with the swap: none is half seen)
                items += take_queued(self.q, 0)
                if any(type(it) is Note and it.swapped for it in items):
                    self.index.replace = True
                    self.index.open_local()
                    if syncing is not None:  # (its commit's index bytes are gone: the
                        syncing.superseded = True  # snapshot's note covers it)
            for it in items:
                if it is STOP:
                    stopping = True
                elif type(it) is Written:
                    self._note_written(it)
                elif type(it) is Note:
                    self._add_note(it)
            if syncing is not None and syncing.future.done():
                done, syncing = syncing, None
                try:
                    self._synced(done)
                except OSError as exc:
                    self._failed(exc, done.ranges)
                    if not done.superseded:
                        self._add_note(done.note, first=True)
                    attempts += 1
                    retry_at = time.monotonic() + RETRY_S
                    if stopping and attempts > 3:
                        return
                    continue
                attempts = 0
            if time.monotonic() < retry_at:
                continue
            while failpoints.held("drain"):
                time.sleep(0.05)
            try:
                note = self._due() if syncing is None else None
                if note is not None:
                    failpoints.hit("drain")
                    syncing = self._sync(note, syncer)
                    continue
                piece = None if self._stepping_aside() else self._next_piece()
                if piece is not None:
                    self._copy_piece(*piece)
                    continue
            except OSError as exc:
                self._failed(exc, {})
                attempts += 1
                retry_at = time.monotonic() + RETRY_S
                if stopping and attempts > 3:
                    return
                continue
            if syncing is None:
                self._idle()
            if stopping and not self.notes and syncing is None and self.q.empty():
                return

    def _stepping_aside(self) -> bool:
        """Whether the copying waits for the writers: while they wait for staging room, the
        node's CPU and disk go to the flusher (training is blocked on it), unless the flusher
        itself waits for local room (then only the drain can give it some)."""
        if not self.step_aside():
            if self.aside_since:
                self.stats.yielded_seconds += time.perf_counter() - self.aside_since
                self.aside_since = 0.0
            return False
        if not self.aside_since:
            self.aside_since = time.perf_counter()
        return True

    def _add_note(self, note: Note, first: bool = False) -> None:
        """A commit to drain, in order. An index snapshot's note takes the place of every
        note before it (their index bytes are not in the local index any more); past
        MAX_NOTES the two oldest become one (the newer, with both ends)."""
        self.ends.update(note.ends)
        if note.swapped:
            for old in self.notes:
                note.ends = _union(old.ends, note.ends)
            self.notes.clear()
        if first:
            self.notes.insert(0, note)
        else:
            self.notes.append(note)
        if len(self.notes) > MAX_NOTES:
            a, b = self.notes.pop(0), self.notes[0]
            b.ends = _union(a.ends, b.ends)

    def _due(self, take: bool = True) -> Note | None:
        """The newest commit whose bytes, and those of every commit before it, are all
        copied (with `take`, it and those before it are taken off the list), or None."""
        n = 0
        while n < len(self.notes) and self._covers(self.notes[n]):
            n += 1
        if not n:
            return None
        due = self.notes[n - 1]
        if take:
            del self.notes[:n]
        return due

    def _note_written(self, it: Written) -> None:
        back = False
        for lg, (start, end) in it.ranges.items():
            if start < self.copied.get(lg, 0):  # (written again: copied again)
                self.copied[lg] = start
                self.rewound[lg] = min(start, self.rewound.get(lg, start))
            if start < self.drained.get(lg, 0):
                # (a range a commit without data named while its write had failed: a
                # restart must not take it for drained either)
                self.drained[lg] = start
                back = True
            self.written[lg] = max(self.written.get(lg, 0), end)
        if back:
            self._save_state()

    def _save_state(self) -> None:
        write_atomic(self.local.dir, DRAIN_STATE, json.dumps(
            {"logs": {str(k): v for k, v in self.drained.items()}}).encode())

    def _end(self, lg: int) -> int | None:
        """Where log `lg` ends as far as the drain knows: its size when closed (None when it
        is gone: removed from both copies), else the newest note's or batch's end."""
        end = self.ends.get(lg, 0)
        if end is None:
            try:
                return self.local.dir.stat(data_log_name(lg)).st_size
            except FileNotFoundError:
                return None
        return max(end, self.written.get(lg, 0))

    def _covers(self, note: Note) -> bool:
        """Whether every byte `note` speaks of is copied (a closed log: wholly)."""
        for lg, end in note.ends.items():
            if lg in self.final:
                continue
            if end is None:
                end = self._end(lg)
                if end is None:
                    continue
            if self.copied.get(lg, 0) < end:
                return False
        return True

    def _next_piece(self) -> tuple[int, int, int] | None:
        """The next range to copy, (log, start, end), at most DRAIN_CHUNK_BYTES: what the
        oldest commit not drained covers first, then everything batches wrote."""
        first = self.notes[0].ends if self.notes else {}
        for ends in (first, self.ends):
            for lg in sorted(ends):
                if lg in self.final:
                    continue
                end = ends[lg] if ends is first else None
                end = self._end(lg) if end is None else end
                if end is None:
                    if ends is not first:  # (gone: removed from both copies)
                        self.final.add(lg)
                        self._close_backing(lg)
                    continue
                start = self.copied.get(lg, 0)
                if start < end:
                    return lg, start, min(end, start + DRAIN_CHUNK_BYTES)
        for lg in sorted(set(self.written) - set(self.ends)):  # (a log no commit names yet)
            start, end = self.copied.get(lg, 0), self.written[lg]
            if start < end:
                return lg, start, min(end, start + DRAIN_CHUNK_BYTES)
        return None

    def _busy(self) -> None:
        if not self.busy_since:
            self.busy_since = time.perf_counter()

    def _idle(self) -> None:
        if self.busy_since:
            self.stats.seconds += time.perf_counter() - self.busy_since
            self.busy_since = 0.0

    def _copy_piece(self, lg: int, start: int, end: int) -> None:
        self._busy()
        self.stats.bytes += self._copy_log(lg, start, end)
        self.copied[lg] = end

    def _sync(self, note: Note, syncer: ThreadPoolExecutor) -> _Sync:
        """Start the fdatasync of every backing log copied past its drained point, for
        `note`; the copying goes on meanwhile."""
        self._busy()
        ranges = {lg: (self.drained.get(lg, 0), end) for lg, end in self.copied.items()
                  if end > self.drained.get(lg, 0) and lg in self.bfds}
        fds = [os.dup(self.bfds[lg]) for lg in ranges]  # (the copy may close its own)
        self.rewound.clear()

        def sync() -> None:
            try:
                for fd in fds:
                    os.fdatasync(fd)
            finally:
                for fd in fds:
                    os.close(fd)

        fut = syncer.submit(sync)
        fut.add_done_callback(lambda _: self.q.put(_SYNCED))
        return _Sync(note, ranges, fut)

    def _synced(self, s: _Sync) -> None:
        """A sync is done: the ranges it covered are drained (drain.json, then the backing
        index up to its commit). Raises the sync's OSError."""
        s.future.result()
        for lg, (_, end) in s.ranges.items():
            # (a range written again since the sync began is not drained: copied again)
            self.drained[lg] = min(end, self.rewound.get(lg, end))
        self.rewound.clear()
        if s.ranges:
            self._save_state()
        for lg, end in list(self.ends.items()):
            if end is None and lg not in self.final:
                size = self._end(lg)
                if size is None or self.drained.get(lg, 0) >= size:
                    self.final.add(lg)
                    self._close_backing(lg)
        if s.superseded:
            return
        if self.index.lfd < 0:
            with self.swap_lock:
                self.index.open_local()
        self.stats.bytes += self.index.copy(s.note.index_end)
        self.stats.cycles += 1
        now, done = time.perf_counter(), self.stats.bytes
        then, before = self.last_drained
        if done - before >= 8 << 20 and now > then:
            self.stats.rate = (done - before) / (now - then)
        self.last_drained = (now, done)
        self.call_soon(self.on_drained, s.note.seq)

    def _failed(self, exc: OSError, ranges: dict[int, tuple[int, int]]) -> None:
        """A copy or a sync failed: everything past the drained points is copied again after
        RETRY_S (with buffered writes, punched first)."""
        log.error("draining to the backing directory failed: %s (will retry)", exc)
        for lg, end in list(self.copied.items()):
            start = self.drained.get(lg, 0)
            if end > start or lg in ranges:
                if not self.direct:
                    self.lost[lg] = min(start, self.lost.get(lg, start))
                self.copied[lg] = start
        self._idle()
        self.call_soon(self.on_error, exc)

    # ------------------------------------------------------------ copying
    def _backing_fd(self, lg: int) -> int:
        fd = self.bfds.get(lg)
        if fd is None:
            name = data_log_name(lg)
            flags = os.O_WRONLY | os.O_CREAT
            try:
                fd = self.backing.open(name, flags | (os.O_DIRECT if self.direct else 0))
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                fd = self.backing.open(name, flags)
            self.bfds[lg] = fd
            self.backing.sync()  # (the name is durable before the index names the log)
        return fd

    def _close_backing(self, lg: int) -> None:
        fd = self.bfds.pop(lg, None)
        if fd is not None:
            os.close(fd)

    def _copy_log(self, lg: int, start: int, end: int) -> int:
        """Bytes [start, end) of local log `lg` to the same place in its backing copy, in
        halves of DRAIN_CHUNK_BYTES (all aligned: segments and copy blocks end on the
        alignment, and so does `start`). The buffer's two halves take turns: the next half
        is read from the node while the writes of this one are in flight to the backing
        store, so the copy takes about as long as the slower of the two, not their sum."""
        src = self.local.dir.open(data_log_name(lg),
                                  os.O_RDONLY | (os.O_DIRECT if self.local_direct else 0))
        dst = self._backing_fd(lg)
        lost = self.lost.pop(lg, None)
        if lost is not None:
            try:
                punch_hole(dst, lost, max(0, end - lost))
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    self.lost[lg] = lost
                    raise
        half = DRAIN_CHUNK_BYTES // 2
        whole = memoryview(self.buf)
        halves = [whole[:half], whole[half:]]
        ahead = None  # (offset, length, half) of the read in flight
        try:
            off, turn = start, 0
            n = self._read_piece(src, lg, halves[turn], off, min(half, end - off))
            while off < end:
                buf = halves[turn]
                nxt = off + n
                if nxt < end:  # the next piece into the other half, while this one is written
                    want = min(half, end - nxt)
                    self.engine.submit_read(src, halves[turn ^ 1][:want], nxt, ("drain", nxt))
                    ahead = (nxt, want)
                if n % 4096:  # (a log's end is aligned; the write must be too)
                    up = -(-n // 4096) * 4096
                    buf[n:up] = bytes(up - n)
                    n = up
                reqs = [(dst, buf[o:min(n, o + self.io_chunk)], off + o)
                        for o in range(0, n, self.io_chunk)]
                try:
                    self._write(reqs)
                finally:
                    for _, v, _ in reqs:
                        v.release()
                off, turn = nxt, turn ^ 1
                if ahead is not None:
                    res = self._reap_ahead()
                    got, want = ahead
                    ahead = None
                    if res < want:  # an error or a short read: again, the plain way
                        res = self._read_piece(src, lg, halves[turn], got, want)
                    n = res
        finally:
            if ahead is not None:  # never let the buffer go while the kernel may fill it
                self._reap_ahead()
            os.close(src)
            for v in halves:
                v.release()
            whole.release()
        return end - start

    def _reap_ahead(self) -> int:
        """The result of the one read submitted ahead (negative: an errno)."""
        while True:
            for tag, res in self.engine.reap(1):
                if isinstance(tag, tuple) and tag[0] == "drain":
                    return res
                log.warning("drain: an unexpected completion %r (%d)", tag, res)

    def _read_piece(self, src: int, lg: int, buf: memoryview, off: int, want: int) -> int:
        """`want` bytes of local log `lg` at `off` into `buf`, synchronously (O_DIRECT given
        up where the local file system refuses it after all)."""
        try:
            n = os.preadv(src, [buf[:want]], off)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not self.local_direct:
                raise
            self.local_direct = False  # (O_DIRECT refused after all: buffered reads)
            fd = self.local.dir.open(data_log_name(lg), os.O_RDONLY)
            try:
                os.dup2(fd, src)  # (the same descriptor number, now without O_DIRECT)
            finally:
                os.close(fd)
            n = os.preadv(src, [buf[:want]], off)
        if n <= 0:
            raise OSError(errno.EIO, f"node tier: {self.local.dir.join(data_log_name(lg))}"
                          f" ends at {off}, before {off + want}")
        return n

    def _write(self, reqs) -> None:
        try:
            self.engine.write_all(reqs)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not self.direct:
                raise
            # O_DIRECT refused after all (a file system that accepts the flag, not the I/O):
            # buffered from now on
            self.direct = False
            for lg in list(self.bfds):
                self._close_backing(lg)
            raise OSError(errno.EAGAIN, "O_DIRECT writes refused by the backing directory; "
                          "buffered from now on") from None


class BackingIndex:
    """The backing copy's index, kept a prefix of the local one: appended to up to each commit
    drained, or, after an index snapshot, replaced whole. Drain thread only (the local index
    is opened by name holding the drain's swap_lock)."""

    def __init__(self, local: WriterDir, backing: Dir, drained: int) -> None:
        self.local, self.backing = local, backing
        self.replace = drained < 0  # (the backing index is replaced whole next)
        self.drained = max(drained, 0)  # bytes of the local index the backing one holds
        self.lfd = -1

    def open_local(self) -> None:
        """(holding the swap lock) The local index the notes taken so far speak of."""
        self.close()
        try:
            self.lfd = self.local.dir.open(INDEX_NAME, os.O_RDONLY)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self.lfd >= 0:
            os.close(self.lfd)
            self.lfd = -1

    def copy(self, end: int) -> int:
        """The local index's bytes from where the backing copy ends to `end` (a commit's end),
        appended to the backing index and synced; the header first when it changed (an index
        version raised)."""
        if self.replace:
            return self._replace(end)
        head = os.pread(self.lfd, INDEX_HEADER.size, 0)
        bfd = self.backing.open(INDEX_NAME, os.O_RDWR | os.O_CREAT)
        try:
            created = os.fstat(bfd).st_size == 0
            if os.pread(bfd, INDEX_HEADER.size, 0) != head:
                os.pwrite(bfd, head, 0)
                if created:
                    self.drained = INDEX_HEADER.size
                    self.backing.sync()
            if os.fstat(bfd).st_size > self.drained:  # a group torn by a crash: cut
                os.ftruncate(bfd, self.drained)
            copied = self._copy_range(bfd, self.drained, end)
            os.fdatasync(bfd)
            self.drained = max(self.drained, end)
            return copied
        finally:
            os.close(bfd)

    def _copy_range(self, bfd: int, start: int, end: int) -> int:
        """Bytes [start, end) of the local index to the same place in `bfd`, 8 MiB at a time
        (an index can be large; the memory held stays small). Returns the bytes copied."""
        off = start
        while off < end:
            chunk = os.pread(self.lfd, min(8 << 20, end - off), off)
            if not chunk:
                raise OSError(errno.EIO, f"node tier: {self.local.dir.join(INDEX_NAME)} "
                              f"ends at {off}, before {end}")
            view = memoryview(chunk)
            while view:
                k = os.pwrite(bfd, view, off)
                off += k
                view = view[k:]
        return off - start

    def _replace(self, end: int) -> int:
        """After an index snapshot: the backing index replaced whole by the local index's
        first `end` bytes (written beside it, synced, renamed into place, the name synced);
        the local PRE_SWAP is not needed any more then."""
        bfd = self.backing.open(FRESH_COPY, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            self._copy_range(bfd, 0, end)
            os.fdatasync(bfd)
        finally:
            os.close(bfd)
        self.backing.rename(FRESH_COPY, INDEX_NAME)
        self.backing.sync()
        self.drained, self.replace = end, False
        self.local.dir.unlink(PRE_SWAP, missing_ok=True)
        log.info("node tier: the backing index replaced by the index snapshot (%d bytes)", end)
        return end
