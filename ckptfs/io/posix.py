"""The posix engine: pwrite/preadv in the calling thread (no queue depth; ``depth`` is kept for
the interface).  Used where io_uring is unavailable."""

from __future__ import annotations

import errno
import os
from typing import Any, Iterable

from .base import (
    MAX_IO,
    DirectCache,
    Engine,
    _ffi,
    buffer_address,
    check_direct_alignment,
    io_error,
)

__all__ = ["PosixEngine"]


def _byte_view(buf: Any) -> memoryview:
    mv = memoryview(buf)
    if mv.ndim != 1 or mv.format not in ("B", "b", "c"):
        mv = mv.cast("B")
    return mv


class PosixEngine(Engine):
    """Synchronous fallback engine.  submit_* performs the operation at once and ``reap`` hands
    back the results; see :class:`Engine` for the contract (one thread at a time)."""

    name = "posix"

    def __init__(self, depth: int = 32, dio_align: int = 4096) -> None:
        super().__init__(depth, dio_align)
        self._done: list[tuple[Any, int]] = []
        self.reason = ""

    @property
    def inflight(self) -> int:
        return len(self._done)

    # -- validation --------------------------------------------------------------------------
    def _validate(self, reqs: list, what: str) -> list[tuple[int, memoryview, int]]:
        direct = DirectCache()
        out = []
        for fd, buf, off in reqs:
            mv = _byte_view(buf)
            if off < 0:
                raise io_error(errno.EINVAL, what, fd, off, mv.nbytes)
            if direct(fd):
                cb = _ffi.from_buffer(mv)
                try:
                    check_direct_alignment(buffer_address(cb), mv.nbytes, off, self.dio_align,
                                           what, fd)
                finally:
                    _ffi.release(cb)
            out.append((fd, mv, off))
        return out

    # -- single operations -------------------------------------------------------------------
    @staticmethod
    def _write_full(fd: int, mv: memoryview, off: int) -> None:
        done, n = 0, mv.nbytes
        while done < n:
            w = os.pwrite(fd, mv[done:done + MAX_IO], off + done)
            if w <= 0:
                raise io_error(errno.EIO, "write returned 0", fd, off + done, n - done)
            done += w

    @staticmethod
    def _read_full(fd: int, mv: memoryview, off: int) -> int:
        done, n = 0, mv.nbytes
        while done < n:
            r = os.preadv(fd, [mv[done:done + MAX_IO]], off + done)
            if r == 0:
                break
            done += r
            if done < n and off + done >= os.fstat(fd).st_size:
                break  # short at EOF
        return done

    # -- high level --------------------------------------------------------------------------
    def write_all(self, reqs: Iterable[tuple[int, Any, int]]) -> None:
        self._check_open()
        for fd, mv, off in self._validate(list(reqs), "write"):
            try:
                self._write_full(fd, mv, off)
            except OSError as e:
                raise io_error(e.errno or errno.EIO, "write", fd, off, mv.nbytes) from None

    def read_all(self, reqs: Iterable[tuple[int, Any, int]]) -> list[int]:
        self._check_open()
        out = []
        for fd, mv, off in self._validate(list(reqs), "read"):
            if mv.readonly:
                raise TypeError("read_all: buffer for fd %d is read-only" % fd)
            try:
                out.append(self._read_full(fd, mv, off))
            except OSError as e:
                raise io_error(e.errno or errno.EIO, "read", fd, off, mv.nbytes) from None
        return out

    def fsync(self, fd: int, datasync: bool = True) -> None:
        self._check_open()
        (os.fdatasync if datasync else os.fsync)(fd)

    # -- low level ---------------------------------------------------------------------------
    def submit_write(self, fd: int, buf: Any, offset: int, tag: Any) -> None:
        self._check_open()
        ((fd, mv, off),) = self._validate([(fd, buf, offset)], "write")
        try:
            res = os.pwrite(fd, mv[:MAX_IO], off)
        except OSError as e:
            res = -(e.errno or errno.EIO)
        self._done.append((tag, res))

    def submit_read(self, fd: int, buf: Any, offset: int, tag: Any) -> None:
        self._check_open()
        ((fd, mv, off),) = self._validate([(fd, buf, offset)], "read")
        try:
            res = os.preadv(fd, [mv[:MAX_IO]], off)
        except OSError as e:
            res = -(e.errno or errno.EIO)
        self._done.append((tag, res))

    def submit_fsync(self, fd: int, tag: Any, datasync: bool = True, drain: bool = False) -> None:
        self._check_open()
        try:
            (os.fdatasync if datasync else os.fsync)(fd)
            res = 0
        except OSError as e:
            res = -(e.errno or errno.EIO)
        self._done.append((tag, res))

    def reap(self, min_complete: int = 1) -> list[tuple[Any, int]]:
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        self._done = []
        self.closed = True
