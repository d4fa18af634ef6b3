"""The engine interface shared by the io_uring and posix engines."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from typing import Any, Iterable, Sequence

log = logging.getLogger("ckptfs.io")

# One FFI for taking addresses of Python buffers (zero copy): the compiled module's where it is
# built (a plain cffi.FFI() loads cffi's C parser, ~40 ms of every daemon's and tool's start).
try:
    from ._uring_cffi import ffi as _ffi  # type: ignore[import-not-found]
except ImportError:
    import cffi

    _ffi = cffi.FFI()

# Largest single read/write handed to the kernel; longer requests continue like short writes.
MAX_IO = 1 << 30

DEFAULT_DIO_ALIGN = 4096

_logged: set[str] = set()


def log_once(msg: str, *args: Any, level: int = logging.INFO) -> None:
    """Log a message once per process (keyed by the formatted text)."""
    text = msg % args if args else msg
    if text in _logged:
        return
    _logged.add(text)
    log.log(level, "%s", text)


def _reset_log_once() -> None:
    """Forget what was logged (tests)."""
    _logged.clear()


class EngineError(OSError):
    """A request the engine refuses before submitting it (errno EINVAL), or an engine that
    cannot be opened.  Subclass of OSError."""


def buffer_address(cbuf: Any) -> int:
    return int(_ffi.cast("uintptr_t", cbuf))


def is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def check_direct_alignment(addr: int, length: int, offset: int, align: int, what: str,
                           fd: int) -> None:
    """Raise EngineError(EINVAL) naming what is misaligned for an O_DIRECT request."""
    bad = []
    if addr % align:
        bad.append("buffer address 0x%x" % addr)
    if offset % align:
        bad.append("file offset %d" % offset)
    if length % align:
        bad.append("length %d" % length)
    if bad:
        raise EngineError(errno.EINVAL,
                          "misaligned O_DIRECT %s on fd %d: %s not a multiple of the required "
                          "alignment %d bytes (nothing was submitted)"
                          % (what, fd, ", ".join(bad), align))


class DirectCache:
    """fd -> opened with O_DIRECT?, for the duration of one batch call."""

    __slots__ = ("_d",)

    def __init__(self) -> None:
        self._d: dict[int, bool] = {}

    def __call__(self, fd: int) -> bool:
        v = self._d.get(fd)
        if v is None:
            v = self._d[fd] = is_direct(fd)
        return v


def io_error(err: int, what: str, fd: int, offset: int, length: int) -> OSError:
    return OSError(err, "%s (%s fd=%d offset=%d length=%d)"
                   % (os.strerror(err), what, fd, offset, length))


class Engine:
    """Asynchronous block I/O on file descriptors.

    Thread-safety: an engine (and its io_uring ring) must be used from ONE thread at a time —
    the flusher thread that owns it.  Other threads may run Python meanwhile: waiting happens in
    C with the GIL released.  Create one engine per thread if several threads do I/O.

    High level (blocking):
      write_all(reqs)  reqs: iterable of (fd, buffer, offset).  Keeps up to ``depth`` requests in
                       flight, continues short writes, waits for all.  On failure raises OSError
                       with the errno of the first failed request (in request order), after every
                       in-flight request completed (no buffer is still used by the kernel).
      read_all(reqs) -> list[int]   bytes read per request; short only at EOF (0 past EOF).
      fsync(fd, datasync=True)
    Requests on an fd opened with O_DIRECT are checked first: buffer address, offset and length
    must be multiples of ``dio_align`` (default 4096) or EngineError (EINVAL) is raised before
    anything of the call is submitted.

    Low level (pipelining):
      submit_write(fd, buf, offset, tag) / submit_read(...) / submit_fsync(fd, tag, datasync)
      reap(min_complete=1) -> list[(tag, result)]
    ``result`` is what the kernel returned for that one operation: bytes transferred (may be
    short: a write/read is not continued at this level) or a NEGATIVE errno (-errno.EBADF ...);
    reap never raises for a failed request.  Any number of requests may be submitted; beyond
    ``depth`` they are queued inside the engine and go to the kernel as earlier ones complete.
    The engine keeps each buffer referenced until its completion is reaped.  ``reap`` waits
    until at least ``min_complete`` completions (or everything outstanding, if fewer) are
    available; ``reap(0)`` does not wait.  ``inflight`` = submitted and not yet reaped.
    Ordering: requests run concurrently; a ``submit_fsync(..., drain=True)`` starts only after
    everything submitted before it completed (``fsync()`` uses that).
    """

    name = "base"

    def __init__(self, depth: int = 32, dio_align: int = DEFAULT_DIO_ALIGN) -> None:
        if depth < 1:
            raise ValueError("depth must be >= 1")
        if dio_align < 1 or dio_align & (dio_align - 1):
            raise ValueError("dio_align must be a power of two")
        self.depth = int(depth)
        self.dio_align = int(dio_align)
        self.closed = False

    # -- context manager ---------------------------------------------------------------------
    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return "<%s engine depth=%d%s>" % (self.name, self.depth, " closed" if self.closed else "")

    # -- interface ---------------------------------------------------------------------------
    @property
    def inflight(self) -> int:
        raise NotImplementedError

    def write_all(self, reqs: Iterable[tuple[int, Any, int]]) -> None:
        raise NotImplementedError

    def read_all(self, reqs: Iterable[tuple[int, Any, int]]) -> list[int]:
        raise NotImplementedError

    def fsync(self, fd: int, datasync: bool = True) -> None:
        raise NotImplementedError

    def register_buffers(self, buffers: Sequence[Any]) -> bool:
        """Register fixed buffers; returns True if they are in use.  No-op (False) for posix."""
        return False

    def unregister_buffers(self) -> None:
        pass

    def submit_write(self, fd: int, buf: Any, offset: int, tag: Any) -> None:
        raise NotImplementedError

    def submit_read(self, fd: int, buf: Any, offset: int, tag: Any) -> None:
        raise NotImplementedError

    def submit_fsync(self, fd: int, tag: Any, datasync: bool = True, drain: bool = False) -> None:
        raise NotImplementedError

    def reap(self, min_complete: int = 1) -> list[tuple[Any, int]]:
        raise NotImplementedError

    def close(self) -> None:
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("I/O engine is closed")
