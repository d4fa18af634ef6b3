"""The node tier: this writer's directory on node-local storage, drained to the backing directory.

With `--local-dir LOCAL`, the flusher writes its data logs and commits its index in
LOCAL/writers/<id>/ (the same aligned writes, the same format) instead of in the backing
directory: a change committed there is *node-durable* (it survives a killed daemon and a reboot
of the node). The drain thread then copies that directory into BACKING/writers/<id>/, commit
by commit and byte for byte: first the data logs up to where they were written when the commit
was made (large aligned writes, fdatasync), then the index up to that commit (fdatasync). So
the backing copy is always the local one as it was at some commit: an ordinary writer
directory that other mounts, the offline tools and a mount without the tier read as today, and
every offset the index names is the same in both copies. A change is *backing-durable* once
the drain has passed its commit.

    LOCAL/ckptfs-tier.json              which backing directory and writer this tier serves
    LOCAL/writers/<id>/index.log        the index (the backing index is a prefix of it)
    LOCAL/writers/<id>/data-NNNNNN.log  data logs (drained ones stay as a read copy)
    LOCAL/writers/<id>/drain.json       how far each data log is drained (written after the
                                        backing copy is synced: never ahead of it)
    LOCAL/writers/<id>/index.pre-swap   the index as it was before an index snapshot took its
                                        place, kept until the snapshot replaced the backing
                                        index too (the backing index is a prefix of this one
                                        meanwhile)

An index snapshot (datapath/cleaner.py) replaces the local index at once; the drain replaces
the backing index whole with a copy of the new one once it reaches that commit (written beside
it, synced, renamed into place), and appends again after that.

Local space is bounded (`--local-size`): the flusher asks for room before it writes a segment
(`reserve`); drained data logs no segment goes to any more are removed, oldest first, when room
is needed (reads then come from the backing copy: format/logs.RunReader's fallback); when the
space is full of undrained data the flusher waits, and so do writers once staging is full:
nothing fails. What the cleaner does to files (removing a retired log, punching dead bytes)
waits until the drain has passed the commit that made it safe, and is done to both copies.

Threads: `reserve`/`wait_room`/`committed` are called by the flusher thread; the drain thread
owns the copying; everything else runs on the trio thread.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import shutil
import socket
import threading
import time

import trio

from ckptfs import failpoints
from ckptfs.datapath.flusher import take_queued
from ckptfs.format import records
from ckptfs.format.backingdir import (
    BACKING_MARKER,
    INDEX_NAME,
    NOFOLLOW,
    Dir,
    WriterDir,
    data_log_name,
    data_logs,
    write_atomic,
)
from ckptfs.format.logs import punch_hole
from ckptfs.format.records import INDEX_HEADER, FormatError
from ckptfs.io import alloc_aligned, open_engine

log = logging.getLogger("ckptfs.tier")

TIER_MARKER = "ckptfs-tier.json"
DRAIN_STATE = "drain.json"
PRE_SWAP = "index.pre-swap"
FRESH_COPY = INDEX_NAME + ".drain"  # (the backing index's replacement, written beside it)
RETRY_S = 1.0  # a failing backing store is tried again this often
# Read from the local log (O_DIRECT where the local file system allows: the bytes were written
# past the page cache and are not read again here, so they do not go through it) into one
# half of this buffer while the other half is written to the backing copy in --io-chunk
# requests, all in flight at once
DRAIN_CHUNK_BYTES = 64 << 20
EVICT_AT = 0.9  # drained logs are removed once the local logs take up this share of the space
LEVELS = ("staged", "node", "backing")
_STOP = "stop"


class TierError(FormatError):
    """A local directory that cannot serve this mount (foreign, damaged, too small)."""


# ---------------------------------------------------------------- opening the local directory
def backing_identity(backing: str) -> dict:
    """What names a backing directory wherever it is mounted: its ckptfs.json's creation."""
    fd = os.open(os.path.join(backing, BACKING_MARKER), os.O_RDONLY | NOFOLLOW)
    with open(fd) as f:
        meta = json.load(f)
    return {"created": meta.get("created"), "host": meta.get("host")}


def open_local(local: str, backing: str, writer_id: str) -> WriterDir:
    """The tier's writer directory in `local`, locked: LOCAL/writers/<writer_id>/. A local
    directory that serves another backing directory or another writer is refused (TierError),
    never mixed in."""
    if not os.path.isdir(local):
        raise TierError(f"local directory {local} does not exist or is not a directory")
    ident = backing_identity(backing)
    top = Dir(local)
    try:
        try:
            fd = top.open(TIER_MARKER, os.O_RDONLY)
        except FileNotFoundError:
            if os.path.isdir(os.path.join(local, "writers")) and os.listdir(
                    os.path.join(local, "writers")):
                raise TierError(f"{local} holds writers but no {TIER_MARKER}: not a ckptfs node "
                                "tier (give the mount an empty --local-dir)") from None
            write_atomic(top, TIER_MARKER, json.dumps({
                "format": "ckptfs-tier", "version": 1, "backing": ident,
                "backing_path": os.path.abspath(backing), "writer": writer_id,
                "host": socket.gethostname(), "created": time.time()}).encode() + b"\n")
        else:
            with open(fd) as f:
                try:
                    meta = json.load(f)
                except ValueError as exc:
                    raise TierError(f"{os.path.join(local, TIER_MARKER)} is unreadable: {exc}") \
                        from None
            if meta.get("format") != "ckptfs-tier":
                raise TierError(f"{os.path.join(local, TIER_MARKER)} does not describe a ckptfs "
                                "node tier")
            if meta.get("backing") != ident or meta.get("writer") != writer_id:
                raise TierError(
                    f"local directory {local} is the node tier of another backing directory or "
                    f"writer ({meta.get('backing_path')}, writer {meta.get('writer')!r}); give "
                    "this mount its own --local-dir (or remove that one once its data is "
                    "drained)")
    finally:
        top.close()
    wd = WriterDir(local, writer_id)
    wd.open()
    return wd


def _read_all(fd: int, start: int, end: int) -> bytes:
    parts, off = [], start
    while off < end:
        b = os.pread(fd, min(8 << 20, end - off), off)
        if not b:
            break
        parts.append(b)
        off += len(b)
    return b"".join(parts)


def _begins(fd: int, size: int, records_part: bytes) -> bool:
    """Whether the index open as `fd` (`size` bytes) holds `records_part` after its header."""
    end = INDEX_HEADER.size + len(records_part)
    return end <= size and _read_all(fd, INDEX_HEADER.size, end) == records_part


def reconcile(local: Dir, backing: Dir) -> int:
    """Before replay: make the local index the one to replay, and return how many bytes of it
    the backing index already holds (where the drain goes on); -1 when the backing index is
    a prefix of the index an index snapshot replaced (PRE_SWAP): the drain replaces it whole.
    A node that lost its local directory (or a first mount with the tier) starts from a copy
    of the backing index. A backing index that is not a prefix of the local one (beyond a
    torn group the drain was writing) is refused: the local directory does not continue it."""
    bsize = lsize = 0
    try:
        bfd = backing.open(INDEX_NAME, os.O_RDONLY)
    except FileNotFoundError:
        bfd = -1
    try:
        if bfd >= 0:
            bsize = os.fstat(bfd).st_size
        try:
            lfd = local.open(INDEX_NAME, os.O_RDONLY)
        except FileNotFoundError:
            lfd = -1
        if lfd < 0 or os.fstat(lfd).st_size < INDEX_HEADER.size:
            if lfd >= 0:
                os.close(lfd)
            if data_logs(local.path):
                # (logs whose index is gone: what they hold beyond the backing copy is
                # unknown, and their numbers may be ones the backing directory uses otherwise)
                raise TierError(f"{local.path} holds data logs but no index: move the local "
                                "directory away to mount from the backing directory")
            if bfd < 0 or bsize < INDEX_HEADER.size:
                return 0
            scan = records.scan_index(backing.join(INDEX_NAME), _read_all(bfd, 0, bsize))
            data = _read_all(bfd, 0, scan.valid_bytes)
            write_atomic(local, INDEX_NAME, data)
            log.info("node tier: started from the backing index (%d bytes)", len(data))
            return len(data)
        try:
            lsize = os.fstat(lfd).st_size
            if bfd < 0 or bsize < INDEX_HEADER.size:
                local.unlink(PRE_SWAP, missing_ok=True)
                return 0
            bdata = _read_all(bfd, 0, bsize)
            valid = records.scan_index(backing.join(INDEX_NAME), bdata).valid_bytes
            backing.unlink(FRESH_COPY, missing_ok=True)
            if _begins(lfd, lsize, bdata[INDEX_HEADER.size:valid]):
                local.unlink(PRE_SWAP, missing_ok=True)  # (a snapshot's replacement got there)
                return valid
            try:
                pfd = local.open(PRE_SWAP, os.O_RDONLY)
            except FileNotFoundError:
                pfd = -1
            if pfd >= 0:
                try:
                    if _begins(pfd, os.fstat(pfd).st_size, bdata[INDEX_HEADER.size:valid]):
                        log.info("node tier: an index snapshot not yet in the backing "
                                 "directory replaces its index at the first drain")
                        return -1
                finally:
                    os.close(pfd)
            raise TierError(
                f"the backing index {backing.join(INDEX_NAME)} is not a prefix of the node "
                f"tier's {local.join(INDEX_NAME)}: the backing directory changed without "
                "this tier (compact, fsck, another mount with the same writer id); move "
                "the local directory away to mount from the backing directory")
        finally:
            os.close(lfd)
    finally:
        if bfd >= 0:
            os.close(bfd)


# ---------------------------------------------------------------- the drain
class _Note:
    """The flusher committed: the local index ends at `index_end`, covering changes up to
    `seq`; the data logs this mount made are written up to `ends` (log -> offset; None: closed,
    its size is final)."""

    __slots__ = ("seq", "index_end", "ends", "when", "swapped")

    def __init__(self, seq: int, index_end: int, ends: dict[int, int],
                 swapped: bool = False) -> None:
        self.seq, self.index_end, self.ends, self.when = seq, index_end, ends, time.monotonic()
        self.swapped = swapped  # (an index snapshot took the local index's place)


class DrainStats:
    def __init__(self) -> None:
        self.bytes = 0  # data log and index bytes copied to the backing directory
        self.seconds = 0.0  # spent copying them
        self.cycles = 0
        self.rate = 0.0  # bytes/s of the last cycle that copied at least 8 MiB
        self.errors = 0
        self.last_error = ""
        self.evicted_logs = 0
        self.evicted_bytes = 0


class Tier:
    """The node tier of a mount: the drain thread, local space, and the levels (trio side)."""

    def __init__(self, local: WriterDir, backing: Dir, *, drained_index: int, limit_bytes: int,
                 open_log_bytes: int, engine: str, depth: int, direct: bool,
                 io_chunk_bytes: int, local_direct: bool = False) -> None:
        self.local = local  # (LOCAL/writers/<id>/, locked)
        self.backing = backing  # (BACKING/writers/<id>/, held open)
        self.limit = limit_bytes
        # Segments are given room up to this: a data log started takes its preallocation
        # (up to a log's size) at once, so the logs being written keep that much headroom
        self.segment_limit = limit_bytes - open_log_bytes
        self.engine_kind, self.depth, self.direct = engine, depth, direct
        self.local_direct = local_direct
        self.io_chunk = io_chunk_bytes
        self.stats = DrainStats()
        # drain thread
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        # An index snapshot's swap and its note are one step for the drain: it looks at the
        # local index by name only holding this, after taking every note queued
        self.swap_lock = threading.Lock()
        self.replace_index = drained_index < 0  # (the backing index is replaced whole next)
        self.drained_index = max(drained_index, 0)
        self.lfd_index = -1
        self.drained = self._load_state()  # log -> bytes of it in the backing copy
        self.lost: dict[int, int] = {}  # log -> where a range whose writeback failed starts
        self.ends: dict[int, int | None] = {n: None for n in data_logs(local.path)}
        self.final: set[int] = set()  # closed logs wholly in the backing copy, or gone
        self.bfds: dict[int, int] = {}
        self.thread: threading.Thread | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        # flusher thread and evictions: local space
        self.cv = threading.Condition()
        self.usage = self._local_usage()
        self.waiting = 0  # (flusher thread waiting for room)
        self.noted_ends: dict[int, int | None] = {}  # (the last commit's, for the status)
        # trio side
        self.node_seq = 0  # (the flusher's committed sequence number, as last noted)
        self.backing_seq = 0
        self.backlog_since = 0.0  # when the oldest commit not drained was made (0: none)
        self.error: OSError | None = None
        self.on_fatal = None  # (exception, where): a defect in the drain thread
        self.open_logs = lambda: set()  # (the flusher's: a log segments still go to stays)
        self.reader = None  # (the mount's Reader: a log it holds is not removed)
        self.drained_event = trio.Event()
        self.room_event = trio.Event()

    # ------------------------------------------------------------ set up
    def start(self, committed_seq: int) -> None:
        """Trio thread, after replay: changes up to `committed_seq` are in the local index;
        the drain starts with everything the backing copy lacks."""
        self.node_seq = committed_seq
        self.backing_seq = committed_seq if self.drained_index >= self._local_index_size() \
            else 0
        self.token = trio.lowlevel.current_trio_token()
        with self.swap_lock:
            self._open_local_index()
        self.thread = threading.Thread(target=self._main, name="ckptfs-drain")
        self.thread.start()
        if self.backing_seq < committed_seq:
            self.backlog_since = time.monotonic()
            self.q.put(_Note(committed_seq, self._local_index_size(), {}))

    def _open_local_index(self) -> None:
        """(holding swap_lock) The local index the notes taken so far speak of."""
        if self.lfd_index >= 0:
            os.close(self.lfd_index)
            self.lfd_index = -1
        try:
            self.lfd_index = self.local.dir.open(INDEX_NAME, os.O_RDONLY)
        except FileNotFoundError:
            pass

    def _local_index_size(self) -> int:
        try:
            return self.local.dir.stat(INDEX_NAME).st_size
        except FileNotFoundError:
            return 0

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

    def _local_usage(self) -> int:
        used = 0
        for name in os.listdir(self.local.path):
            if name.startswith("data-") and name.endswith(".log"):
                try:
                    used += self.local.dir.stat(name).st_blocks * 512
                except FileNotFoundError:
                    pass
        return used

    # ------------------------------------------------------------ flusher thread
    def committed(self, seq: int, index_end: int, ends: dict[int, int | None]) -> None:
        """The flusher committed changes up to `seq` to the local index (now `index_end`
        bytes); `ends`: how far the logs it made are written (LogWriter.ends)."""
        self.q.put(_Note(seq, index_end, ends))
        self.noted_ends = ends

    def swap(self, replace, seq: int, ends: dict[int, int | None]) -> None:
        """Flusher thread: an index snapshot takes the local index's place: `replace()` does
        it and returns the new index's size. The index it replaces stays (PRE_SWAP) until the
        drain has replaced the backing index, which is a prefix of that one meanwhile."""
        with self.swap_lock:
            if not self.local.dir.exists(PRE_SWAP):
                self.local.dir.link(INDEX_NAME, PRE_SWAP)
                self.local.dir.sync()
            size = replace()
            self.q.put(_Note(seq, size, ends, swapped=True))
            self.noted_ends = ends

    def reserve(self, sizes: list[int]) -> int:
        """Room in the local logs for the first segments of `sizes` (bytes each): how many
        fit, their room taken. When not all fit, the trio side is asked to make room
        (removing drained logs); a caller that got none waits (wait_room)."""
        n = 0
        with self.cv:
            total = 0
            for size in sizes:
                if self.usage + total + size > self.segment_limit:
                    break
                total += size
                n += 1
            self.usage += total
        if n < len(sizes):
            self._call_soon(self._room_wanted)
        return n

    def wait_room(self, timeout: float) -> None:
        with self.cv:
            self.waiting += 1
            try:
                self.cv.wait(timeout)
            finally:
                self.waiting -= 1

    def _call_soon(self, fn, *args) -> None:
        try:
            self.token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass

    # ------------------------------------------------------------ drain thread
    def _main(self) -> None:
        try:
            self.engine = open_engine(self.engine_kind, depth=self.depth)
            self.buf = alloc_aligned(DRAIN_CHUNK_BYTES, populate=False)
            self._loop()
        except BaseException as exc:  # a defect: the mount fails, said to every waiter
            log.critical("the drain thread failed; nothing more reaches the backing directory",
                         exc_info=True)
            if self.on_fatal is not None:
                self._call_soon(self.on_fatal, exc, "the drain thread")
            self._call_soon(self._failed, OSError(errno.EIO, f"the drain thread failed: {exc!r}"))
        finally:
            for fd in self.bfds.values():
                os.close(fd)
            self.bfds.clear()
            if getattr(self, "lfd_index", -1) >= 0:
                os.close(self.lfd_index)
            if hasattr(self, "engine"):
                self.engine.close()
            if hasattr(self, "buf"):
                self.buf.close()

    def _loop(self) -> None:
        note: _Note | None = None
        stopping = False
        attempts = 0
        while True:
            items = take_queued(self.q, RETRY_S if note is not None else None)
            with self.swap_lock:  # (a swap's note is queued with the swap: none is half seen)
                items += take_queued(self.q, 0)
                if any(it is not _STOP and it.swapped for it in items):
                    self.replace_index = True
                    self._open_local_index()
            for it in items:
                if it is _STOP:
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
                self._call_soon(self._on_error, exc)
                attempts += 1
                if stopping and attempts > 3:
                    return
                time.sleep(RETRY_S)
                continue
            attempts = 0
            self._call_soon(self._on_drained, note.seq)
            note = None
            if stopping and self.q.empty():
                return

    def _drain(self, note: _Note) -> None:
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
        copied += self._copy_index(note.index_end)
        self.stats.cycles += 1
        self.stats.bytes += copied
        dt = time.perf_counter() - t0
        self.stats.seconds += dt
        if copied >= 8 << 20 and dt > 0:
            self.stats.rate = copied / dt

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
        DRAIN_CHUNK_BYTES pieces (all aligned: segments and copy blocks end on the alignment,
        and so does `start`). The buffer's two halves take turns: the next piece is read
        from the node while the writes of this one are in flight to the backing store, so
        the copy takes about as long as the slower of the two, not their sum."""
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
                    self._write(dst, reqs)
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

    def _write(self, fd: int, reqs) -> None:
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

    def _copy_index(self, end: int) -> int:
        """The local index's bytes from where the backing copy ends to `end` (a commit's end),
        appended to the backing index and synced; the header first when it changed (an index
        version raised)."""
        if self.lfd_index < 0:
            with self.swap_lock:
                self._open_local_index()
        if self.replace_index:
            return self._replace_index(end)
        head = os.pread(self.lfd_index, INDEX_HEADER.size, 0)
        bfd = self.backing.open(INDEX_NAME, os.O_RDWR | os.O_CREAT)
        try:
            created = os.fstat(bfd).st_size == 0
            if os.pread(bfd, INDEX_HEADER.size, 0) != head:
                os.pwrite(bfd, head, 0)
                if created:
                    self.drained_index = INDEX_HEADER.size
                    self.backing.sync()
            if os.fstat(bfd).st_size > self.drained_index:  # a group torn by a crash: cut
                os.ftruncate(bfd, self.drained_index)
            copied = self._copy_index_range(bfd, self.drained_index, end)
            os.fdatasync(bfd)
            self.drained_index = max(self.drained_index, end)
            return copied
        finally:
            os.close(bfd)

    def _copy_index_range(self, bfd: int, start: int, end: int) -> int:
        """Bytes [start, end) of the local index to the same place in `bfd`, 8 MiB at a time
        (an index can be large; the memory held stays small). Returns the bytes copied."""
        off = start
        while off < end:
            chunk = os.pread(self.lfd_index, min(8 << 20, end - off), off)
            if not chunk:
                raise OSError(errno.EIO, f"node tier: {self.local.dir.join(INDEX_NAME)} "
                              f"ends at {off}, before {end}")
            view = memoryview(chunk)
            while view:
                k = os.pwrite(bfd, view, off)
                off += k
                view = view[k:]
        return off - start

    def _replace_index(self, end: int) -> int:
        """After an index snapshot: the backing index replaced whole by the local index's
        first `end` bytes (written beside it, synced, renamed into place, the name synced);
        the local PRE_SWAP is not needed any more then."""
        bfd = self.backing.open(FRESH_COPY, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            self._copy_index_range(bfd, 0, end)
            os.fdatasync(bfd)
        finally:
            os.close(bfd)
        self.backing.rename(FRESH_COPY, INDEX_NAME)
        self.backing.sync()
        self.drained_index, self.replace_index = end, False
        self.local.dir.unlink(PRE_SWAP, missing_ok=True)
        log.info("node tier: the backing index replaced by the index snapshot (%d bytes)", end)
        return end

    # ------------------------------------------------------------ trio side
    def note_committed(self, seq: int) -> None:
        """Trio thread: the flusher's commit up to `seq` is durable in the local index."""
        if seq > self.node_seq:
            if self.backlog_since == 0.0 and seq > self.backing_seq:
                self.backlog_since = time.monotonic()
            self.node_seq = seq

    def _on_drained(self, seq: int) -> None:
        if seq > self.backing_seq:
            self.backing_seq = seq
        self.backlog_since = 0.0 if self.backing_seq >= self.node_seq else time.monotonic()
        self.error = None
        ev, self.drained_event = self.drained_event, trio.Event()
        ev.set()

    def _on_error(self, exc: OSError) -> None:
        self.error = exc
        self.stats.errors += 1
        self.stats.last_error = f"{exc.__class__.__name__}: {exc}"
        ev, self.drained_event = self.drained_event, trio.Event()
        ev.set()

    def _failed(self, exc: OSError) -> None:
        self.failed = exc
        self._on_error(exc)

    failed: OSError | None = None

    async def wait_backing(self, seq: int) -> None:
        """Return once changes up to `seq` are in the backing directory; raise the drain's
        error (ENOSPC, EIO, ...) while it fails."""
        while self.backing_seq < seq:
            if self.failed is not None:
                raise self.failed
            if self.error is not None:
                raise self.error
            await self.drained_event.wait()

    def level(self, seq: int, committed_seq: int) -> str:
        """The level of a change with sequence number `seq` (0: none pending)."""
        if seq > committed_seq:
            return "staged"
        return "node" if seq > self.backing_seq else "backing"

    async def stop(self) -> None:
        """Unmount: drain everything committed, then end the thread. Raises OSError when the
        backing directory did not take it (the local copy holds it; the next mount with the
        same --local-dir drains it)."""
        if self.thread is None:
            return
        self.q.put(_STOP)
        await trio.to_thread.run_sync(self.thread.join)
        self.thread = None
        if self.backing_seq < self.node_seq:
            raise OSError(errno.EIO, f"the node tier holds changes the backing directory did "
                          f"not take ({self.error or 'drain stopped'}); they are node-durable "
                          "in the local directory, and the next mount with the same --local-dir "
                          "drains them")

    # ------------------------------------------------------------ local space (trio side)
    def _room_wanted(self) -> None:
        self.room_event.set()

    async def run(self) -> None:
        """Trio task: keep the local logs within the limit by removing drained ones, when the
        flusher waits for room or they take up more than EVICT_AT of it."""
        while True:
            with trio.move_on_after(1.0):
                await self.room_event.wait()
            self.room_event = trio.Event()
            usage = await trio.to_thread.run_sync(self._local_usage)
            with self.cv:
                self.usage = usage
            if usage > EVICT_AT * self.limit or self.waiting:
                await self.evict()
            with self.cv:
                self.cv.notify_all()

    def evictable(self) -> list[int]:
        """Drained data logs no segment goes to any more, oldest first, that no read holds."""
        busy = self.open_logs()
        out = []
        for lg, end in sorted(list(self.ends.items())):
            if lg in busy or end is not None:
                continue
            try:
                size = self.local.dir.stat(data_log_name(lg)).st_size
            except FileNotFoundError:
                continue
            if self.drained.get(lg, -1) < size:
                continue
            if self.reader is not None and self.reader.log_in_use(0, lg):
                continue
            out.append(lg)
        return out

    async def evict(self) -> None:
        for lg in self.evictable():
            with self.cv:
                if self.usage <= EVICT_AT * self.limit and not self.waiting:
                    return
            if self.reader is not None:
                self.reader.forget_log(0, lg)
            freed = await trio.to_thread.run_sync(self._remove_local, lg)
            self.stats.evicted_logs += 1
            self.stats.evicted_bytes += freed
            with self.cv:
                self.usage = max(0, self.usage - freed)
                self.cv.notify_all()

    def _remove_local(self, lg: int) -> int:
        name = data_log_name(lg)
        try:
            freed = self.local.dir.stat(name).st_blocks * 512
            self.local.dir.unlink(name)
        except FileNotFoundError:
            return 0
        self.local.dir.sync()
        return freed

    def status(self) -> dict:
        backlog, ends, drained = 0, dict(self.noted_ends), dict(self.drained)
        for lg in data_logs(self.local.path):
            end = ends.get(lg)
            if end is None:  # (closed: its size is final)
                try:
                    end = self.local.dir.stat(data_log_name(lg)).st_size
                except FileNotFoundError:
                    continue
            backlog += max(0, end - drained.get(lg, 0))
        return {
            "tier_local_dir": self.local.backing, "tier_local_size": self.limit,
            "tier_local_bytes": self.usage, "tier_node_seq": self.node_seq,
            "tier_backing_seq": self.backing_seq, "tier_backlog_bytes": backlog,
            "tier_backlog_age_s": round(time.monotonic() - self.backlog_since, 3)
            if self.backlog_since else 0.0,
            "tier_drained_bytes": self.stats.bytes,
            "tier_drain_seconds": round(self.stats.seconds, 3),
            "tier_drain_rate": round(self.stats.rate), "tier_drain_errors": self.stats.errors,
            "tier_drain_last_error": self.stats.last_error,
            "tier_evicted_logs": self.stats.evicted_logs,
            "tier_evicted_bytes": self.stats.evicted_bytes,
        }


def local_size_default(local: str) -> int:
    """Half of the local file system's free space: the tier's default size."""
    return shutil.disk_usage(local).free // 2
