"""The data logs: reading runs back (RunReader: the one run reader, of the mount's chunk cache,
datapath/readcache.py, the offline tools, compaction and the cleaner), and writing segments into
them (LogWriter: the flusher's and compaction's)."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading

from crc32c import crc32c

from ckptfs.format import records
from ckptfs.format.backingdir import NOFOLLOW, Dir, data_log_name
from ckptfs.io import alloc_aligned
from ckptfs.system import libc

log = logging.getLogger("ckptfs.logs")


def read_copies(path: str, log: int, chunk_bytes: int = 4 << 20):
    """The copy blocks of data log `path` (number `log`; records.copy_block), in log order:
    (offset, the sequence number before its first group, its body). A block is looked for at
    every 4 KiB boundary; one whose header does not name this place, or whose checksum fails,
    is not one (or is damaged): skipped."""
    fd = os.open(path, os.O_RDONLY | NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        off = records.DATA_HEADER_BYTES
        while off < size:
            data = os.pread(fd, min(chunk_bytes, size - off), off)
            if not data:
                break
            for at in range(0, len(data), 4096):
                if data[at:at + 8] != records.COPY_MAGIC:
                    continue
                head = data[at:at + records.COPY_HEADER.size]
                if len(head) < records.COPY_HEADER.size:
                    head = os.pread(fd, records.COPY_HEADER.size, off + at)
                found = records.parse_copy_header(head, log, off + at)
                if found is None:
                    continue
                blen, from_seq, crc = found
                body = os.pread(fd, blen, off + at + records.COPY_HEADER.size)
                if len(body) == blen and records.copy_body_ok(head, body, crc):
                    yield off + at, from_seq, body
            off += len(data)
    finally:
        os.close(fd)


class RunError(OSError):
    """A run cannot be read back as it was written: its data log is missing, ends before the
    run does (short read), or the run's bytes fail their checksum. errno EIO, so a mount answers
    the application's READ with EIO; strerror names the log, the run and the problem, which the
    mount logs and the offline tools print."""

    def __init__(self, msg: str) -> None:
        super().__init__(errno.EIO, msg)


class RunReader:
    """The writers' data logs, for reading runs back: which file holds a run (its layer's
    writer directory, its log number), a cached descriptor per log, reads of runs or of log
    ranges, the check of a run's CRC32C, and RunError for what fails. Worker threads may share
    one (the descriptor table is locked).

    `writer_dirs` (layer -> writer directory) is read when a log is first opened, so a dict a
    mount's view fills in later (view.Union.writer_dirs) serves its new writers too. With
    `direct`, logs are opened O_DIRECT (the mount's chunk reads: whole aligned chunks into
    aligned buffers); a log whose file system refuses O_DIRECT, at the open or at the first
    read, is read buffered from then on. read_run is for buffered readers (a run's offset is
    not aligned)."""

    def __init__(self, writer_dirs: dict[int, str], *, direct: bool = False,
                 fallback: dict[int, str] | None = None) -> None:
        self.writer_dirs = writer_dirs
        # layer -> a second directory holding the same logs, for a log missing from the first
        # (the node tier's backing copy: datapath/tier.py)
        self.fallback = fallback or {}
        self.direct = direct
        self.fds: dict[tuple[int, int], int] = {}  # (layer, log) -> descriptor
        self.stale: list[int] = []  # replaced O_DIRECT descriptors, closed with the reader
        self.lock = threading.Lock()

    # ------------------------------------------------------------ names
    def path(self, layer: int, number: int) -> str:
        return os.path.join(self.writer_dirs[layer], data_log_name(number))

    def where(self, layer: int, number: int) -> str:
        """writer/data-NNNNNN.log: what an error message names."""
        return f"{os.path.basename(self.writer_dirs.get(layer, f'layer {layer}'))}/" \
               f"{data_log_name(number)}"

    def error(self, run, problem: str) -> RunError:
        """The error for `run`: data log W/data-N.log offset O length L: PROBLEM."""
        return RunError(f"data log {self.where(run.layer, run.log)} offset {run.loff} length "
                        f"{run.length}: {problem}")

    # ------------------------------------------------------------ descriptors
    def fd(self, layer: int, number: int) -> int:
        """The log's descriptor, opened on first use (RunError if the file is missing)."""
        with self.lock:
            fd = self.fds.get((layer, number))
            if fd is None:
                path = self.path(layer, number)
                flags = os.O_RDONLY | NOFOLLOW
                try:
                    try:
                        fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0))
                    except OSError as exc:
                        if not self.direct or exc.errno == errno.ENOENT:
                            raise
                        fd = os.open(path, flags)  # O_DIRECT refused: buffered
                except FileNotFoundError:
                    fd = self._open_fallback(layer, number, flags)
                self.fds[(layer, number)] = fd
            return fd

    def _open_fallback(self, layer: int, number: int, flags: int) -> int:
        """The log from the layer's second directory (buffered: the other file system's
        O_DIRECT was not probed); RunError if it is missing there too."""
        other = self.fallback.get(layer)
        if other is not None:
            try:
                return os.open(os.path.join(other, data_log_name(number)), flags)
            except FileNotFoundError:
                pass
        raise RunError(f"data log {self.where(layer, number)}: missing")

    def _buffered(self, layer: int, number: int, bad: int) -> int:
        """A buffered descriptor in place of `bad`, an O_DIRECT one whose reads were refused."""
        with self.lock:
            fd = self.fds.get((layer, number))
            if fd == bad:
                path = self.path(layer, number)
                fd = self.fds[(layer, number)] = os.open(path, os.O_RDONLY | NOFOLLOW)
                self.stale.append(bad)  # another thread may still be reading through it
                log.info("data log %s: O_DIRECT reads refused, reading it buffered", path)
            return fd

    def logs_of(self, layer: int) -> set[int]:
        """The logs of `layer` with a descriptor open."""
        return {k[1] for k in list(self.fds) if k[0] == layer}

    def forget(self, layer: int, number: int) -> None:
        """Close the log's descriptor (the log is gone, or its blocks should be given back)."""
        with self.lock:
            fd = self.fds.pop((layer, number), None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        with self.lock:
            for fd in [*self.fds.values(), *self.stale]:
                os.close(fd)
            self.fds.clear()
            self.stale.clear()

    # ------------------------------------------------------------ reads
    def read_into(self, layer: int, number: int, buf, offset: int) -> int:
        """Bytes of the log from `offset` (aligned, as the mount's chunks are) into `buf`: the
        bytes read, fewer than len(buf) only at the log's end. An O_DIRECT read refused
        (EINVAL) is retried buffered."""
        fd = self.fd(layer, number)
        try:
            n = os.preadv(fd, [buf], offset)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not self.direct:
                raise
            fd = self._buffered(layer, number, fd)
            n = os.preadv(fd, [buf], offset)
        want = len(buf)
        # Short at an aligned point (a signal, a network file system), not at the end: read
        # on. (A log ends aligned, so a read reaching its end costs one more call.)
        while 0 < n < want and n % 4096 == 0:
            k = os.preadv(fd, [memoryview(buf)[n:]], offset + n)
            if k <= 0:
                break
            n += k
        return n

    def read_run(self, run) -> bytes:
        """The run's bytes, checked against its checksum (RunError). For buffered readers."""
        fd = self.fd(run.layer, run.log)
        data = os.pread(fd, run.length, run.loff)
        while 0 < len(data) < run.length:  # short, not at the end: read on
            more = os.pread(fd, run.length - len(data), run.loff + len(data))
            if not more:
                break
            data += more
        self.check(run, (data,))
        return data

    def check(self, run, parts) -> None:
        """Raise RunError unless the buffers `parts`, in order, are the run's bytes: all
        `run.length` of them, with the run's CRC32C."""
        crc = n = 0
        for p in parts:
            crc = crc32c(p, crc)
            n += len(p)
        if n != run.length:
            raise self.error(run, f"short read (the log ends {n} bytes into the run)")
        if crc != run.crc:
            raise self.error(run, "checksum mismatch")


# ---------------------------------------------------------------- writing
PREALLOC_BYTES = 256 << 20  # a data log is allocated this far ahead of its write position
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def fallocate(fd: int, offset: int, length: int, mode: int = 0) -> None:
    """fallocate(2) itself: glibc's posix_fallocate emulates a refused fallocate with a write
    per 4 KiB block (65,536 writes for 256 MiB on a FUSE or NFS store); this one fails with
    EOPNOTSUPP instead, and the writer then does without preallocation."""
    if libc.fallocate(fd, mode, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Give the blocks of [offset, offset+length) back (they read as zeros; the size stays).
    OSError(EOPNOTSUPP) where the file system cannot (the cleaner copies instead)."""
    fallocate(fd, offset, length, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)


class _OpenLog:
    """A data log being appended to."""

    __slots__ = ("number", "fd", "off", "alloc", "dirty", "seg_end")

    def __init__(self, number: int, fd: int, off: int) -> None:
        self.number = number
        self.fd = fd
        self.off = off  # next free byte
        self.seg_end = 0  # where the segment placed last ends (copy blocks not counted)
        self.alloc = off  # preallocated up to here
        self.dirty = False  # written since the last fdatasync


class LogWriter:
    """The data logs a writer appends segments to, through an io engine: the one log writer
    (the flusher's, and `ckptfs compact`'s). One thread uses it.

    A segment goes to the next multiple of the stripe size (the I/O alignment, or
    --stripe-size) in the log whose turn it is: one log at a time, or --data-logs N round robin
    (on a parallel file system, N storage targets). A log starts with its header block, rolls
    over to the next number past `log_bytes`, is allocated PREALLOC_BYTES ahead of its write
    position (extending O_DIRECT writes are serialised by ext4, and a full disk shows before
    data is written), and is trimmed to its end when closed."""

    def __init__(self, where: Dir, writer_id: str, engine, *, direct: bool, align: int,
                 log_bytes: int, next_log: int, data_logs: int = 1,
                 stripe_bytes: int = 0) -> None:
        self.where = where  # (the writer's directory, held open: backingdir.Dir)
        self.writer_id = writer_id
        self.engine = engine
        self.direct = direct
        self.log_bytes = log_bytes
        self.next_log = next_log
        self.stripe = max(align, stripe_bytes)
        self.slots: list[_OpenLog | None] = [None] * max(1, data_logs)
        self.next_slot = 0
        # where the segment placed before the last one placed ended in its log (the bytes
        # from there to the last one's offset hold no run)
        self.placed_from = 0
        self.syncs = 0  # fdatasyncs of data logs
        self.opened: list[int] = []  # the numbers of the logs it created

    def path(self, number: int) -> str:
        return self.where.join(data_log_name(number))

    def open_numbers(self) -> set[int]:
        return {lg.number for lg in self.slots if lg is not None}

    def ends(self) -> dict[int, int | None]:
        """Every log this writer made: how far it is taken (written, once the segments placed
        are), log -> offset; None for a log closed (trimmed to its end: its size is final)."""
        out: dict[int, int | None] = dict.fromkeys(self.opened)
        out.update({lg.number: lg.off for lg in self.slots if lg is not None})
        return out

    def place(self, nbytes: int, copy: bool = False) -> tuple[int, int]:
        """Where the next segment of `nbytes` (aligned) goes: (log, offset). With `copy`, a
        copy block of commit groups (records.copy_block): right after the segment placed
        last, in its log (the next segment still starts on a stripe boundary)."""
        i = (self.next_slot - 1 if copy and self.next_slot else self.next_slot) % len(self.slots)
        lg = self.slots[i]
        start = (lambda o: o) if copy else (lambda o: round_up(o, self.stripe))
        if lg is None or start(lg.off) + nbytes > self.log_bytes:
            if lg is not None:
                self._close(lg)
                self.slots[i] = None
            lg = self.slots[i] = self._open()
        off = start(lg.off)  # segments start on stripe boundaries
        self._preallocate(lg, off + nbytes)
        lg.off = off + nbytes
        if not copy:
            self.next_slot += 1
            self.placed_from, lg.seg_end = lg.seg_end, off + nbytes
        return lg.number, off

    def fd(self, number: int) -> tuple[int, bool]:
        """A descriptor to write log `number` with, and whether it was opened here (a log
        closed since its segment was placed: rollover, retry; the caller syncs and closes
        it): never a stale descriptor number."""
        for lg in self.slots:
            if lg is not None and lg.number == number:
                return lg.fd, False
        return self.where.open(data_log_name(number),
                               os.O_WRONLY | (os.O_DIRECT if self.direct else 0)), True

    def written(self, numbers) -> None:
        for lg in self.slots:
            if lg is not None and lg.number in numbers:
                lg.dirty = True

    def sync(self) -> None:
        """fdatasync every log written since its last one."""
        for lg in self.slots:
            if lg is not None and lg.dirty:
                self.engine.fsync(lg.fd, datasync=True)
                self.syncs += 1
                lg.dirty = False

    def close(self) -> None:
        for i, lg in enumerate(self.slots):
            if lg is not None:
                self._close(lg)
                self.slots[i] = None

    def _open(self) -> _OpenLog:
        number = self.next_log
        name = data_log_name(number)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        if self.direct:
            flags |= os.O_DIRECT
        fd = self.where.open(name, flags, 0o600)
        try:
            hbuf = alloc_aligned(records.DATA_HEADER_BYTES, populate=False)
            hbuf[:] = records.data_log_header(self.writer_id, number)
            self.engine.write_all([(fd, hbuf, 0)])
            hbuf.close()
            self.where.sync()
        except BaseException:
            os.close(fd)
            self.where.unlink(name)
            raise
        self.next_log = number + 1
        self.opened.append(number)
        return _OpenLog(number, fd, round_up(records.DATA_HEADER_BYTES, self.stripe))

    def _close(self, lg: _OpenLog) -> None:
        """Sync a data log, give back its preallocated tail, close it."""
        if lg.dirty:
            self.engine.fsync(lg.fd, datasync=True)
            self.syncs += 1
            lg.dirty = False
        try:
            if lg.alloc > lg.off:
                os.ftruncate(lg.fd, lg.off)
        except OSError as exc:
            log.warning("could not trim data log %d: %s", lg.number, exc)
        os.close(lg.fd)

    def _preallocate(self, lg: _OpenLog, end: int) -> None:
        if end <= lg.alloc:
            return
        ahead = min(max(end, lg.alloc + PREALLOC_BYTES), self.log_bytes)
        for new in (ahead, end):  # a nearly full store: allocate just what this write needs
            try:
                fallocate(lg.fd, lg.alloc, new - lg.alloc)
            except OSError as exc:
                if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    lg.alloc = self.log_bytes  # not supported here: do not ask again
                    return
                if exc.errno == errno.ENOSPC and new != end:
                    continue
                raise
            lg.alloc = new
            return


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align
