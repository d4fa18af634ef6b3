"""The node tier's drain: the thread that copies the local writer directory to its backing copy.

The flusher tells the drain each commit of the local index (`Note`: the index's end, how far
every data log is written; datapath/tier.py passes it on). The drain copies the data logs up to
there into the backing copy (the same places, large aligned writes), fdatasyncs them, records
how far each log is drained (drain.json), then appends the local index's bytes up to that
commit to the backing index (fdatasync). So the backing index never names a byte the backing
logs do not hold durably, and the backing copy is always the local one as it was at some
commit. The newest note covers the older ones: while a copy runs, the commits made meanwhile
become one cycle.

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
# requests, all in flight at once
DRAIN_CHUNK_BYTES = 64 << 20
STOP = "stop"
class Note:
    """The flusher committed: the local index ends at `index_end`, covering changes up to
    `seq`; the data logs this mount made are written up to `ends` (log -> offset; None: closed,
    its size is final)."""

    __slots__ = ("seq", "index_end", "ends", "when", "swapped")

    def __init__(self, seq: int, index_end: int, ends: dict[int, int | None],
                 swapped: bool = False) -> None:
        self.seq, self.index_end, self.ends, self.when = seq, index_end, ends, time.monotonic()
        self.swapped = swapped  # (an index snapshot took the local index's place)


class DrainStats:
    def __init__(self) -> None:
        self.bytes = 0  # data log and index bytes copied to the backing directory (so far)
        self.seconds = 0.0  # spent copying them
        self.cycles = 0
        self.rate = 0.0  # bytes/s of the last cycle that copied at least 8 MiB
        self.errors = 0
        self.last_error = ""
        self.evicted_logs = 0
        self.evicted_bytes = 0


class Drain:
    """The drain thread of a node tier: `local` (LOCAL/writers/<id>/) copied into `backing`
    (BACKING/writers/<id>/). `call_soon(fn, *args)` runs fn on the trio thread;
    `on_drained(seq)`, `on_error(exc)` and `on_fatal(exc, where)` are called that way."""

    def __init__(self, local: WriterDir, backing: Dir, stats: DrainStats, *, drained_index: int,
                 logs: list[int], engine: str, depth: int, direct: bool, io_chunk_bytes: int,
                 local_direct: bool, call_soon, on_drained, on_error, on_fatal) -> None:
        self.local, self.backing, self.stats = local, backing, stats
        self.engine_kind, self.depth, self.direct = engine, depth, direct
        self.local_direct = local_direct
        self.io_chunk = io_chunk_bytes
        self.call_soon = call_soon
        self.on_drained, self.on_error, self.on_fatal = on_drained, on_error, on_fatal
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        # An index snapshot's swap and its note are one step for the drain: it looks at the
        # local index by name only holding this, after taking every note queued
        self.swap_lock = threading.Lock()
        self.index = BackingIndex(local, backing, drained_index)
        self.drained = self._load_state()  # log -> bytes of it durable in the backing copy
        self.lost: dict[int, int] = {}  # log -> where a range whose writeback failed starts
        self.ends: dict[int, int | None] = {n: None for n in logs}  # (as of the newest note)
        self.final: set[int] = set()  # closed logs wholly in the backing copy, or gone
        self.bfds: dict[int, int] = {}
        self.thread: threading.Thread | None = None

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
        try:
            self.engine = open_engine(self.engine_kind, depth=self.depth)
            self.buf = alloc_aligned(DRAIN_CHUNK_BYTES, populate=False)
            self._loop()
        except BaseException as exc:  # a defect: the mount fails, said to every waiter
            log.critical("the drain thread failed; nothing more reaches the backing directory",
                         exc_info=True)
            self.call_soon(self.on_fatal, exc, "the drain thread")
        finally:
            for fd in self.bfds.values():
                os.close(fd)
            self.bfds.clear()
            self.index.close()
            if hasattr(self, "engine"):
                self.engine.close()
            if hasattr(self, "buf"):
                self.buf.close()

    def _loop(self) -> None:
        note: Note | None = None
        stopping = False
        attempts = 0
        while True:
            items = take_queued(self.q, RETRY_S if note is not None else None)
            with self.swap_lock:  # (a swap's note is queued with the swap: none is half seen)
                items += take_queued(self.q, 0)
                if any(it is not STOP and it.swapped for it in items):
                    self.index.replace = True
                    self.index.open_local()
            for it in items:
                if it is STOP:
                    stopping = True
                else:  # (the newest note covers the older ones)
                    self.ends.update(it.ends)
                    note = it if note is None or it.seq >= note.seq else note
            if note is None:
                if stopping:
                    return
                continue
            while failpoints.held("drain"):
                time.sleep(0.05)
            try:
                self._drain(note)
            except OSError as exc:
                log.error("draining to the backing directory failed: %s (will retry)", exc)
                self.call_soon(self.on_error, exc)
                attempts += 1
                if stopping and attempts > 3:
                    return
                time.sleep(RETRY_S)
                continue
            attempts = 0
            self.call_soon(self.on_drained, note.seq)
            note = None
            if stopping and self.q.empty():
                return

    def _drain(self, note: Note) -> None:
        """Copy what `note` covers: the data logs first (synced, drain.json written), then
        the index up to the note's commit (synced)."""
        failpoints.hit("drain")
        t0 = time.perf_counter()
        copied = 0
        synced: dict[int, tuple[int, int]] = {}  # log -> the range copied now
        for lg in sorted(self.ends):
            end = self.ends[lg]
            if lg in self.final:
                continue
            if end is None:  # a closed log: its size is final
                try:
                    end = self.local.dir.stat(data_log_name(lg)).st_size
                except FileNotFoundError:  # removed (retired and removed from both)
                    self.final.add(lg)
                    self._close_backing(lg)
                    continue
            start = self.drained.get(lg, 0)
            if end <= start:
                if self.ends[lg] is None:
                    self.final.add(lg)
                    self._close_backing(lg)
                continue
            copied += self._copy_log(lg, start, end)
            synced[lg] = (start, end)
        for lg, (start, end) in synced.items():
            try:
                self.engine.fsync(self.bfds[lg], datasync=True)
            except OSError:
                if not self.direct:
                    # Buffered: the pages whose writeback failed are dropped and the error
                    # is reported once, so the range is copied again, punched first
                    # (ext4 keeps a failed range unwritten under a rewrite that succeeds)
                    for lg2, (start2, _) in synced.items():
                        self.lost[lg2] = min(start2, self.lost.get(lg2, start2))
                raise
        for lg, (_, end) in synced.items():
            self.drained[lg] = end
        if synced:
            write_atomic(self.local.dir, DRAIN_STATE, json.dumps(
                {"logs": {str(k): v for k, v in self.drained.items()}}).encode())
            for lg in synced:
                if self.ends.get(lg, 0) is None:
                    self._close_backing(lg)
        if self.index.lfd < 0:
            with self.swap_lock:
                self.index.open_local()
        index_bytes = self.index.copy(note.index_end)
        copied += index_bytes
        self.stats.cycles += 1
        self.stats.bytes += index_bytes  # (the data logs' bytes are counted as they go)
        dt = time.perf_counter() - t0
        self.stats.seconds += dt
        if copied >= 8 << 20 and dt > 0:
            self.stats.rate = copied / dt

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
                self.stats.bytes += nxt - off  # (as it goes: the status shows the progress)
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
