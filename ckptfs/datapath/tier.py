"""The node tier: this writer's directory on node-local storage, drained to the backing directory.

With `--local-dir LOCAL`, the flusher writes its data logs and commits its index in
LOCAL/writers/<id>/ (the same aligned writes, the same format) instead of in the backing
directory: a change committed there is *node-durable* (it survives a killed daemon and a reboot
of the node). The drain thread (datapath/drain.py) then copies that directory into
BACKING/writers/<id>/, commit by commit and byte for byte: first the data logs up to where they
were written when the commit was made (large aligned writes, fdatasync), then the index up to
that commit (fdatasync). So the backing index is always the local one as it was at some
commit, and never names a byte the backing logs lack: an ordinary writer
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

An index snapshot (datapath/snapshotter.py) replaces the local index at once; the drain
replaces the backing index whole with a copy of the new one once it reaches that commit
(written beside it, synced, renamed into place), and appends again after that.

Local space is bounded (`--local-size`): the flusher asks for room before it writes a segment
(`reserve`); drained data logs no segment goes to any more are removed, oldest first, when room
is needed (reads then come from the backing copy: format/logs.RunReader's fallback); when the
space is full of undrained data the flusher waits, and so do writers once staging is full:
nothing fails. What the cleaner does to files (removing a retired log, punching dead bytes)
waits until the drain has passed the commit that made it safe, and is done to both copies.

Threads: `reserve`/`wait_room`/`committed`/`swap` are called by the flusher thread;
the drain thread owns the copying; everything else runs on the trio thread.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import threading
import time

import trio

from ckptfs.datapath.drain import FRESH_COPY, PRE_SWAP, Drain, DrainStats, Note
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
from ckptfs.format.records import INDEX_HEADER, FormatError

log = logging.getLogger("ckptfs.tier")

TIER_MARKER = "ckptfs-tier.json"
EVICT_AT = 0.9  # drained logs are removed once the local logs take up this share of the space
LEVELS = ("staged", "node", "backing")


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


def _same_records(fd: int, size: int, bfd: int, bsize: int) -> bool:
    """Whether the index open as `fd` (`size` bytes) holds, after its header, what the one
    open as `bfd` (`bsize` bytes) does: compared 8 MiB at a time (an index can be large)."""
    if bsize > size:
        return False
    off = INDEX_HEADER.size
    while off < bsize:
        n = min(8 << 20, bsize - off)
        a = os.pread(bfd, n, off)
        if not a or os.pread(fd, len(a), off) != a:
            return False
        off += len(a)
    return True


def _mend_local(local: Dir, lfd: int, lsize: int, bdata: bytes, valid: int) -> tuple[bool, str]:
    """A local index damaged only where the drain had copied it (a bad sector, a stray
    write: commit groups that fail their checksums, all before `valid`, the end of the
    backing index's complete groups `bdata` holds) gets those bytes back from the backing
    copy, if every other byte before `valid` is the backing copy's (so it is this index's
    copy, not another's) and the result reads without damage. Returns (whether it was
    mended, the first damage the local index has: "" for none)."""
    path = local.join(INDEX_NAME)
    ldata = _read_all(lfd, 0, lsize)
    try:
        scan = records.scan_index(path, ldata)
    except FormatError as exc:  # (its header: nothing vouches for the rest)
        return False, str(exc)
    if not scan.damaged:
        return False, ""
    damage = next(w for w in scan.warnings if getattr(w, "kind", None) != records.TORN_TAIL)
    pos = INDEX_HEADER.size
    if any(end > valid for _, end in scan.damaged) or ldata[:pos] != bdata[:pos]:
        return False, damage
    for start, end in [*scan.damaged, (valid, valid)]:
        if ldata[pos:start] != bdata[pos:start]:
            return False, damage
        pos = max(pos, end)
    fixed = bdata[:valid] + ldata[valid:]
    if records.scan_index(path, fixed).damaged:
        return False, damage
    write_atomic(local, INDEX_NAME, fixed)
    log.warning("node tier: %s was damaged at bytes %s; repaired from the backing copy",
                path, ", ".join(f"{a}-{b}" for a, b in scan.damaged))
    return True, damage


def reconcile(local: Dir, backing: Dir) -> int:
    """Before replay: make the local index the one to replay, and return how many bytes of it
    the backing index already holds (where the drain goes on); -1 when the backing index is
    a prefix of the index an index snapshot replaced (PRE_SWAP): the drain replaces it whole.
    A node that lost its local directory (or a first mount with the tier) starts from a copy
    of the backing index. A backing index that is not a prefix of the local one (beyond a
    torn group the drain was writing) is refused: the local directory does not continue it,
    or its index is damaged (said so) where the backing copy cannot mend it."""
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
            backing.unlink(FRESH_COPY, missing_ok=True)
            # The backing index whole the local one's first bytes (a drain that stopped
            # between commits, or at a torn group it goes on copying) needs no parse of its
            # records: the replay parses the local index, and a large index takes seconds
            if _same_records(lfd, lsize, bfd, bsize):
                local.unlink(PRE_SWAP, missing_ok=True)
                return bsize
            bdata = _read_all(bfd, 0, bsize)
            valid = records.scan_index(backing.join(INDEX_NAME), bdata).valid_bytes
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
            mended, damage = _mend_local(local, lfd, lsize, bdata, valid)
            if mended:
                local.unlink(PRE_SWAP, missing_ok=True)
                return valid
            if damage:
                raise TierError(
                    f"the node tier's index {local.join(INDEX_NAME)} is damaged ({damage}) "
                    f"where the backing index {backing.join(INDEX_NAME)} holds other bytes: "
                    "move the local directory away to mount from the backing directory "
                    "(what was drained; changes that were node-durable only are lost then)")
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


class Tier:
    """The node tier of a mount: local space and the levels (trio side); the copying is the
    drain thread's (datapath/drain.py). `on_fatal(exc, where)`: a defect in the drain thread;
    `open_logs()`: the logs segments still go to (the flusher's: never removed); `cache`:
    the mount's ReadCache (a log it holds is not removed)."""

    def __init__(self, local: WriterDir, backing: Dir, *, drained_index: int, limit_bytes: int,
                 open_log_bytes: int, engine: str, depth: int, direct: bool,
                 io_chunk_bytes: int, local_direct: bool, on_fatal, open_logs,
                 cache) -> None:
        self.local = local  # (LOCAL/writers/<id>/, locked)
        self.backing = backing  # (BACKING/writers/<id>/, held open)
        self.limit = limit_bytes
        # Segments are given room up to this: a data log started takes its preallocation
        # (up to a log's size) at once, so the logs being written keep that much headroom
        self.segment_limit = limit_bytes - open_log_bytes
        self.stats = DrainStats()
        self.drain = Drain(local, backing, self.stats, drained_index=drained_index,
                           logs=data_logs(local.path), engine=engine, depth=depth,
                           direct=direct, io_chunk_bytes=io_chunk_bytes,
                           local_direct=local_direct, call_soon=self._call_soon,
                           on_drained=self._on_drained, on_error=self._on_error,
                           on_fatal=self._fatal)
        self.on_fatal = on_fatal
        self.open_logs = open_logs
        self.cache = cache
        self.token: trio.lowlevel.TrioToken | None = None
        self.started = False
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
        self.failed: OSError | None = None
        self.drained_event = trio.Event()
        self.room_event = trio.Event()

    # ------------------------------------------------------------ set up
    def start(self, committed_seq: int) -> None:
        """Trio thread, after replay: changes up to `committed_seq` are in the local index;
        the drain starts with everything the backing copy lacks."""
        self.node_seq = committed_seq
        self.backing_seq = committed_seq \
            if self.drain.index.drained >= self._local_index_size() else 0
        self.token = trio.lowlevel.current_trio_token()
        self.drain.start()
        self.started = True
        if self.backing_seq < committed_seq:
            self.backlog_since = time.monotonic()
            self.drain.put(Note(committed_seq, self._local_index_size(), {}))

    def _local_index_size(self) -> int:
        try:
            return self.local.dir.stat(INDEX_NAME).st_size
        except FileNotFoundError:
            return 0

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
        self.drain.put(Note(seq, index_end, ends))
        self.noted_ends = ends

    def swap(self, replace, seq: int, ends: dict[int, int | None]) -> None:
        """Flusher thread: an index snapshot takes the local index's place: `replace()` does
        it and returns the new index's size. The index it replaces stays (PRE_SWAP) until the
        drain has replaced the backing index, which is a prefix of that one meanwhile."""
        with self.drain.swap_lock:
            if not self.local.dir.exists(PRE_SWAP):
                self.local.dir.link(INDEX_NAME, PRE_SWAP)
                self.local.dir.sync()
            size = replace()
            self.drain.put(Note(seq, size, ends, swapped=True))
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

    def _fatal(self, exc: BaseException, where: str) -> None:
        if self.on_fatal is not None:
            self.on_fatal(exc, where)
        self.failed = OSError(errno.EIO, f"the drain thread failed: {exc!r}")
        self._on_error(self.failed)

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
        if not self.started:
            return
        self.started = False
        await trio.to_thread.run_sync(self.drain.join)
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
        for lg, end in sorted(list(self.drain.ends.items())):
            if lg in busy or end is not None:
                continue
            try:
                size = self.local.dir.stat(data_log_name(lg)).st_size
            except FileNotFoundError:
                continue
            if self.drain.drained.get(lg, -1) < size:
                continue
            if self.cache is not None and self.cache.log_in_use(0, lg):
                continue
            out.append(lg)
        return out

    async def evict(self) -> None:
        for lg in self.evictable():
            with self.cv:
                if self.usage <= EVICT_AT * self.limit and not self.waiting:
                    return
            if self.cache is not None:
                self.cache.forget_log(0, lg)
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
        backlog, ends, drained = 0, dict(self.noted_ends), dict(self.drain.drained)
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
