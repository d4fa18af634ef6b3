"""ckptfs I/O engine: large aligned writes/reads through io_uring, with a posix fallback.

    from ckptfs.io import open_engine, alloc_aligned, probe_direct, open_file
    with open_engine("auto", depth=32) as eng:
        eng.write_all([(fd, buf, off), ...])
        eng.fsync(fd)

``open_engine("auto")`` picks io_uring if a ring can be set up here (built against liburing,
not disabled by sysctl kernel.io_uring_disabled, not blocked by seccomp, and the environment
variable CKPTFS_DISABLE_IO_URING is unset or "0"), else posix.  The choice, and for a fallback
the reason, is logged once per process on the "ckptfs.io" logger at INFO.

An engine is used from ONE thread only (see :class:`Engine`).  Details: docs/engine.md.
"""

from __future__ import annotations

from .base import Engine, EngineError, log_once
from .buffers import (
    PAGE_SIZE,
    DirectInfo,
    alloc_aligned,
    fault_in,
    open_file,
    probe_direct,
    probe_direct_read,
)
from .posix import PosixEngine
from .uring import DISABLE_ENV, UringEngine, crc32c_shift, uring_unavailable_reason

__all__ = [
    "open_engine", "alloc_aligned", "fault_in", "probe_direct", "probe_direct_read", "open_file",
    "DirectInfo", "Engine",
    "EngineError", "PosixEngine", "UringEngine", "uring_unavailable_reason", "DISABLE_ENV",
    "PAGE_SIZE", "crc32c_shift",
]

KINDS = ("auto", "io_uring", "posix")


def open_engine(kind: str = "auto", depth: int = 32, dio_align: int = 4096) -> Engine:
    """Open an I/O engine.

    kind: "auto" (io_uring if it works here, else posix), "io_uring" (EngineError if it cannot
    be set up), or "posix".  depth: requests kept in flight.  dio_align: the alignment that
    buffer address, offset and length of requests on O_DIRECT fds must have (checked before
    submission; 4096 satisfies every common block device/file system).
    """
    if kind not in KINDS:
        raise ValueError("engine kind must be one of %s, not %r" % (", ".join(KINDS), kind))
    if kind == "posix":
        eng: Engine = PosixEngine(depth, dio_align)
        log_once("using the posix engine (requested), depth %d", depth)
        return eng
    try:
        eng = UringEngine(depth, dio_align)
    except EngineError as e:
        if kind == "io_uring":
            raise
        eng = PosixEngine(depth, dio_align)
        eng.reason = e.strerror or str(e)
        log_once("io_uring unavailable, falling back to the posix engine: %s",
                 eng.reason)
        return eng
    log_once("using the io_uring engine (%s)", eng.build_info)
    return eng
