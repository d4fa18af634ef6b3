"""The io_uring engine (cffi API mode over the system liburing, see _uring_build.py).

Python keeps the bookkeeping (which buffer belongs to which user_data, what is queued); the C
layer preps and submits a whole batch of SQEs in one call and copies a batch of CQEs out in one
call.  Waiting for completions happens inside C (io_uring_submit_and_wait) with the GIL released,
so other Python threads (the FUSE trio loop) run meanwhile.
"""

from __future__ import annotations

import bisect
import errno
import itertools
import os
from collections import deque
from typing import Any, Iterable, Sequence

from .base import (
    MAX_IO,
    DirectCache,
    Engine,
    EngineError,
    check_direct_alignment,
    io_error,
    is_direct,
    log_once,
)

try:
    from ._uring_cffi import ffi, lib  # type: ignore[import-not-found]
    _IMPORT_ERROR = ""
except ImportError as _e:  # extension not built (e.g. running from a plain source tree)
    ffi = lib = None
    _IMPORT_ERROR = "ckptfs.io._uring_cffi is not built (%s)" % _e

__all__ = ["UringEngine", "uring_unavailable_reason", "crc32c_shift"]


def crc32c_shift(crc: int, n: int) -> int:
    """`crc` times x^(8n) (fuse/crc32c.c): crc32c_shift(crc(A), len(B)) ^ crc(B) is the CRC32C
    of A then B. Only for checksums taken in C, which exist only where this module is
    built."""
    return lib.ck_crc32c_shift(crc, n)

_OP_WRITE = 1
_OP_READ = 2
_OP_FSYNC = 3
_FSYNC_DATASYNC = 1
_DRAIN = 2

DISABLE_ENV = "CKPTFS_DISABLE_IO_URING"


def _setup_hint(err: int) -> str:
    if err == errno.EPERM:
        try:
            with open("/proc/sys/kernel/io_uring_disabled") as f:
                v = f.read().strip()
        except OSError:
            v = "?"
        if v == "2":
            return " (sysctl kernel.io_uring_disabled=2: io_uring is disabled for all processes)"
        if v == "1":
            return (" (sysctl kernel.io_uring_disabled=1: only members of "
                    "kernel.io_uring_group may create rings)")
        return " (blocked, e.g. by a seccomp filter of the container runtime)"
    if err == errno.ENOSYS:
        return " (kernel without io_uring, or the syscall is filtered by seccomp)"
    if err == errno.ENOMEM:
        return " (RLIMIT_MEMLOCK too small for the ring on older kernels?)"
    return ""


def uring_unavailable_reason() -> str | None:
    """Why an io_uring engine cannot be opened here (without opening one), or None if the build
    supports it (ring setup can still fail: UringEngine() raises EngineError with the reason)."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return "io_uring disabled by the environment variable %s=%s" % (
            DISABLE_ENV, os.environ[DISABLE_ENV])
    if lib is None:
        return _IMPORT_ERROR
    if not lib.ck_have_uring():
        return ffi.string(lib.ck_build_info()).decode(errors="replace")
    return None


class UringEngine(Engine):
    """io_uring engine; see :class:`ckptfs.io.base.Engine` for the contract.

    A ring is used from ONE thread only: the thread that calls submit_*/reap/write_all/...
    (create the engine in, or hand it over to, the flusher thread; never share it concurrently).
    Buffers are passed zero-copy (``ffi.from_buffer``) and kept referenced until their
    completion is reaped; an mmap cannot be closed while a request or a registration uses it.
    """

    name = "io_uring"

    def __init__(self, depth: int = 32, dio_align: int = 4096) -> None:
        super().__init__(depth, dio_align)
        self._ring = None
        reason = uring_unavailable_reason()
        if reason is not None:
            raise EngineError(errno.ENOSYS, reason)
        err = ffi.new("int *")
        feat = ffi.new("unsigned int *")
        ring = lib.ck_ring_open(self.depth, err, feat)
        if ring == ffi.NULL:
            e = err[0] or errno.EIO
            raise EngineError(e, "io_uring ring setup failed: %s%s"
                              % (os.strerror(e), _setup_hint(e)))
        self._ring = ring
        self.features = feat[0]
        self.build_info = ffi.string(lib.ck_build_info()).decode(errors="replace")
        self._reqs = ffi.new("struct ck_req[]", self.depth)
        self._cap = max(self.depth, 16)
        self._uds = ffi.new("uint64_t[]", self._cap)
        self._ress = ffi.new("int32_t[]", self._cap)
        self._ud = itertools.count(1)
        # (ud, op, fd, addr, len, off, buf_index, flags) not yet handed to the ring
        self._pending: deque[tuple] = deque()
        self._kinflight = 0          # in the ring (SQ or kernel), not reaped
        self._slots: dict[int, tuple[Any, Any]] = {}   # ud -> (tag, cdata buffer) for submit_*
        self._ready: list[tuple[Any, int]] = []         # completions of submit_* not yet returned
        self._reg_keep: list[Any] = []
        self._reg_starts: list[int] = []
        self._reg_ranges: list[tuple[int, int, int]] = []  # (start, end, index), sorted

    # -- bookkeeping -------------------------------------------------------------------------
    @property
    def inflight(self) -> int:
        return len(self._slots) + len(self._ready)

    def _buf_index(self, addr: int, length: int) -> int:
        starts = self._reg_starts
        if not starts:
            return -1
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0:
            start, end, idx = self._reg_ranges[i]
            if addr + length <= end:
                return idx
        return -1

    def _flush(self) -> None:
        """Hand queued requests to the ring, keeping at most ``depth`` in it."""
        pend = self._pending
        if not pend:
            return
        n = min(self.depth - self._kinflight, len(pend))
        if n <= 0:
            return
        reqs = self._reqs
        batch = [pend.popleft() for _ in range(n)]
        for i, (ud, op, fd, addr, ln, off, bidx, flags) in enumerate(batch):
            r = reqs[i]
            r.op = op
            r.fd = fd
            r.addr = addr
            r.len = ln
            r.off = off
            r.user_data = ud
            r.buf_index = bidx
            r.flags = flags
        got = lib.ck_ring_submit(self._ring, reqs, n)
        if got < 0:
            got = 0
        if got < n:
            pend.extendleft(reversed(batch[got:]))
        self._kinflight += got

    def _reap_raw(self, wait: int) -> list[tuple[int, int]]:
        """Completions as (user_data, res); waits (GIL released) for ``wait`` of them."""
        wait = min(wait, self._kinflight)
        if self._kinflight == 0:
            return []
        while True:
            n = lib.ck_ring_reap(self._ring, wait, self._uds, self._ress, self._cap)
            if n >= 0:
                break
            if n != -errno.EINTR:
                raise OSError(-n, "io_uring wait failed: %s" % os.strerror(-n))
        if n == 0:
            return []
        self._kinflight -= n
        return list(zip(ffi.unpack(self._uds, n), ffi.unpack(self._ress, n)))

    def _deliver(self, ud: int, res: int) -> None:
        """A completion of a submit_* request: keep it for the next reap()."""
        tag, cb = self._slots.pop(ud)
        if cb is not None:
            ffi.release(cb)
        self._ready.append((tag, res))

    def _check_direct(self, fd: int, cb: Any, off: int, what: str,
                      direct: DirectCache | None = None) -> tuple[int, int]:
        n = len(cb)
        addr = int(ffi.cast("uintptr_t", cb))
        if off < 0:
            raise EngineError(errno.EINVAL, "negative file offset %d (%s fd %d)" % (off, what, fd))
        if direct(fd) if direct is not None else is_direct(fd):
            check_direct_alignment(addr, n, off, self.dio_align, what, fd)
        return addr, n

    # -- low level ---------------------------------------------------------------------------
    def _submit_rw(self, op: int, fd: int, buf: Any, offset: int, tag: Any) -> None:
        self._check_open()
        what = "write" if op == _OP_WRITE else "read"
        cb = ffi.from_buffer(buf, require_writable=(op == _OP_READ))
        try:
            addr, n = self._check_direct(fd, cb, offset, what)
        except BaseException:
            ffi.release(cb)
            raise
        ln = min(n, MAX_IO)
        ud = next(self._ud)
        self._slots[ud] = (tag, cb)
        self._pending.append((ud, op, fd, addr, ln, offset, self._buf_index(addr, ln), 0))
        self._flush()

    def submit_write(self, fd: int, buf: Any, offset: int, tag: Any) -> None:
        self._submit_rw(_OP_WRITE, fd, buf, offset, tag)

    def submit_read(self, fd: int, buf: Any, offset: int, tag: Any) -> None:
        self._submit_rw(_OP_READ, fd, buf, offset, tag)

    def submit_fsync(self, fd: int, tag: Any, datasync: bool = True, drain: bool = False) -> None:
        self._check_open()
        ud = next(self._ud)
        self._slots[ud] = (tag, None)
        flags = (_FSYNC_DATASYNC if datasync else 0) | (_DRAIN if drain else 0)
        self._pending.append((ud, _OP_FSYNC, fd, 0, 0, 0, -1, flags))
        self._flush()

    def reap(self, min_complete: int = 1) -> list[tuple[Any, int]]:
        self._check_open()
        self._flush()
        out, self._ready = self._ready, []
        while True:
            need = min_complete - len(out)
            for ud, res in self._reap_raw(need if need > 0 else 0):
                tag, cb = self._slots.pop(ud)
                if cb is not None:
                    ffi.release(cb)
                out.append((tag, res))
            self._flush()
            if len(out) >= min_complete or self._kinflight == 0:
                return out

    # -- high level --------------------------------------------------------------------------
    def _run_all(self, op: int, reqs: Iterable[tuple[int, Any, int]]) -> list[int]:
        self._check_open()
        what = "write" if op == _OP_WRITE else "read"
        writable = op == _OP_READ
        direct = DirectCache()
        prepared: list[tuple[int, Any, int, int, int]] = []   # fd, cdata, addr, n, off
        try:
            for fd, buf, off in reqs:
                cb = ffi.from_buffer(buf, require_writable=writable)
                prepared.append((fd, cb, 0, 0, off))
                addr, n = self._check_direct(fd, cb, off, what, direct)
                prepared[-1] = (fd, cb, addr, n, off)
        except BaseException:
            for p in prepared:
                ffi.release(p[1])
            raise

        count = len(prepared)
        done = [0] * count
        queue = deque(i for i in range(count) if prepared[i][3] > 0)
        owner: dict[int, int] = {}        # ud -> request index
        first_err: tuple[int, int] | None = None
        pending = self._pending
        depth = self.depth
        try:
            while True:
                if first_err is None:
                    while queue and self._kinflight + len(pending) < depth:
                        i = queue.popleft()
                        fd, _cb, addr, n, off = prepared[i]
                        pos = done[i]
                        ln = n - pos
                        if ln > MAX_IO:
                            ln = MAX_IO
                        ud = next(self._ud)
                        owner[ud] = i
                        pending.append((ud, op, fd, addr + pos, ln, off + pos,
                                        self._buf_index(addr + pos, ln), 0))
                    self._flush()
                if not owner:
                    break
                for ud, res in self._reap_raw(1):
                    i = owner.pop(ud, None)
                    if i is None:
                        self._deliver(ud, res)
                        continue
                    fd, _cb, addr, n, off = prepared[i]
                    if res < 0:
                        if first_err is None or i < first_err[0]:
                            first_err = (i, -res)
                        continue
                    if res == 0:
                        if op == _OP_WRITE and first_err is None:
                            first_err = (i, errno.EIO)   # a write that writes nothing
                        continue                          # read: EOF
                    done[i] += res
                    pos = done[i]
                    if pos < n:
                        if (op == _OP_READ and res < min(n - pos + res, MAX_IO)
                                and off + pos >= os.fstat(fd).st_size):
                            continue                      # short read at EOF
                        queue.appendleft(i)               # continue the short transfer
                self._flush()
        finally:
            # Never let a buffer go while the kernel may still use it.
            while owner:
                try:
                    for ud, res in self._reap_raw(1):
                        if owner.pop(ud, None) is None:
                            self._deliver(ud, res)
                except KeyboardInterrupt:
                    continue
            for p in prepared:
                ffi.release(p[1])
        if first_err is not None:
            i, err = first_err
            fd, _cb, _addr, n, off = prepared[i]
            raise io_error(err, "%s request %d of %d" % (what, i, count), fd, off, n)
        return done

    def write_all(self, reqs: Iterable[tuple[int, Any, int]]) -> None:
        self._run_all(_OP_WRITE, reqs)

    def read_all(self, reqs: Iterable[tuple[int, Any, int]]) -> list[int]:
        return self._run_all(_OP_READ, reqs)

    def fsync(self, fd: int, datasync: bool = True) -> None:
        """IORING_OP_FSYNC (IORING_FSYNC_DATASYNC when datasync), drained: it starts after all
        previously submitted requests completed."""
        self._check_open()
        ud = next(self._ud)
        flags = (_FSYNC_DATASYNC if datasync else 0) | _DRAIN
        self._pending.append((ud, _OP_FSYNC, fd, 0, 0, 0, -1, flags))
        result = None
        while result is None:
            self._flush()
            for u, res in self._reap_raw(1):
                if u == ud:
                    result = res
                else:
                    self._deliver(u, res)
        if result < 0:
            raise io_error(-result, "fdatasync" if datasync else "fsync", fd, 0, 0)

    # -- registered buffers ------------------------------------------------------------------
    def register_buffers(self, buffers: Sequence[Any]) -> bool:
        """Register ``buffers`` (writable, e.g. alloc_aligned mmaps; each < 1 GiB) as fixed
        buffers.  Later requests whose buffer lies inside one of them use READ_FIXED/WRITE_FIXED.
        Replaces an earlier registration; must be called with nothing in flight.  On failure
        (RLIMIT_MEMLOCK, file-backed mapping, ...) logs once and returns False; the engine works
        as before.  The buffers stay referenced (mmap.close() raises BufferError) until
        unregister_buffers() or close()."""
        self._check_open()
        if self._kinflight or self._pending:
            raise EngineError(errno.EBUSY, "register_buffers with requests in flight")
        self.unregister_buffers()
        if not buffers:
            return False
        cbs = []
        try:
            for b in buffers:
                cbs.append(ffi.from_buffer(b, require_writable=True))
        except (TypeError, BufferError) as e:
            for cb in cbs:
                ffi.release(cb)
            log_once("io_uring: buffer registration skipped (%s); continuing without fixed "
                     "buffers", e)
            return False
        addrs = ffi.new("void *[]", [ffi.cast("void *", cb) for cb in cbs])
        lens = ffi.new("size_t[]", [len(cb) for cb in cbs])
        rc = lib.ck_ring_register_buffers(self._ring, addrs, lens, len(cbs))
        if rc < 0:
            for cb in cbs:
                ffi.release(cb)
            hint = " (RLIMIT_MEMLOCK too small?)" if -rc == errno.ENOMEM else ""
            log_once("io_uring: registering %d buffers failed: %s%s; continuing without fixed "
                     "buffers", len(cbs), os.strerror(-rc), hint)
            return False
        ranges = sorted((int(ffi.cast("uintptr_t", cb)), int(ffi.cast("uintptr_t", cb)) + len(cb),
                         i) for i, cb in enumerate(cbs))
        self._reg_keep = cbs
        self._reg_ranges = ranges
        self._reg_starts = [r[0] for r in ranges]
        return True

    def unregister_buffers(self) -> None:
        if not self._reg_keep:
            return
        if self._kinflight or self._pending:
            raise EngineError(errno.EBUSY, "unregister_buffers with requests in flight")
        lib.ck_ring_unregister_buffers(self._ring)
        for cb in self._reg_keep:
            ffi.release(cb)
        self._reg_keep = []
        self._reg_ranges = []
        self._reg_starts = []

    @property
    def registered(self) -> int:
        """Number of registered fixed buffers."""
        return len(self._reg_keep)

    # -- teardown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Waits for requests already in the ring, drops queued ones, frees the ring."""
        if self.closed or self._ring is None:
            self.closed = True
            return
        self._pending.clear()
        while self._kinflight:
            for ud, res in self._reap_raw(self._kinflight):
                if ud in self._slots:
                    self._deliver(ud, res)
        for _tag, cb in self._slots.values():
            if cb is not None:
                ffi.release(cb)
        self._slots.clear()
        self._ready.clear()
        self.unregister_buffers()
        lib.ck_ring_close(self._ring)
        self._ring = None
        self.closed = True

    def __del__(self) -> None:
        try:
            if not self.closed and self._ring is not None:
                self.close()
        except Exception:
            pass
