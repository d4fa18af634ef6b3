"""Aligned buffers, O_DIRECT capability probing and the file-open helper."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import tempfile
from typing import NamedTuple

from ckptfs.system import libc

__all__ = ["DirectInfo", "alloc_aligned", "fault_in", "probe_direct", "probe_direct_read",
           "open_file", "PAGE_SIZE"]

PAGE_SIZE = mmap.PAGESIZE

# statx(2): the mask bit and the field offsets in struct statx (include/uapi/linux/stat.h).
_STATX_DIOALIGN = 0x00002000
_STATX_SIZE = 256
_OFF_MASK = 0
_OFF_DIO_MEM_ALIGN = 152
_OFF_DIO_OFFSET_ALIGN = 156
_AT_EMPTY_PATH = 0x1000
_AT_FDCWD = -100

# statfs(2) f_type values of memory-backed file systems.
_MEMORY_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}




def alloc_aligned(nbytes: int, populate: bool = True, huge: bool = False) -> mmap.mmap:
    """A page-aligned anonymous private mapping of ``nbytes`` (MAP_POPULATE when ``populate``).

    Suitable for O_DIRECT and for :meth:`Engine.register_buffers`.  Close it (``buf.close()``)
    or drop it to unmap; it cannot be closed while the engine still holds it (BufferError).
    ``huge``: ask for transparent huge pages (MADV_HUGEPAGE) before the memory is touched:
    one fault per 2 MiB instead of 512, cheaper page pinning for O_DIRECT and FUSE replies
    (docs/performance-notes.md); ignored where THP is off.
    """
    if nbytes <= 0:
        raise ValueError("alloc_aligned: nbytes must be > 0, got %r" % (nbytes,))
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    huge = huge and nbytes >= HUGE_PAGE
    if populate and not huge:
        flags |= getattr(mmap, "MAP_POPULATE", 0x8000)
    m = mmap.mmap(-1, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if huge:
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass
        if populate and not fault_in(m):
            for off in range(0, nbytes, PAGE_SIZE):
                m[off] = 0
    return m


def fault_in(m: mmap.mmap) -> bool:
    """Fault a writable mapping in (MADV_POPULATE_WRITE, Linux 5.14+; False where the kernel
    has none). The contents stay as they are, so other threads may write the mapping
    meanwhile. Through libc, which runs without the GIL: mmap.madvise keeps it for the whole
    call, which would stop every other thread (the daemon faults the staging pool in while
    the mount serves)."""
    c = ctypes.c_char.from_buffer(m)
    try:
        rc = libc.madvise(ctypes.c_void_p(ctypes.addressof(c)), ctypes.c_size_t(len(m)),
                           MADV_POPULATE_WRITE)
    finally:
        del c  # (the mapping stays closable)
    return rc == 0


HUGE_PAGE = 2 << 20
MADV_POPULATE_WRITE = 23


def open_file(path: str | os.PathLike, flags: int, mode: int = 0o600, direct: bool = False) -> int:
    """``os.open`` with O_CLOEXEC, plus O_DIRECT when ``direct``."""
    flags |= os.O_CLOEXEC
    if direct:
        flags |= os.O_DIRECT
    return os.open(path, flags, mode)


class DirectInfo(NamedTuple):
    """Result of :func:`probe_direct`.

    supported: O_DIRECT works there and bypasses a page cache (False for tmpfs/ramfs).
    mem_align / offset_align: required alignment of buffer address / file offset and length in
    bytes (from statx STATX_DIOALIGN when the kernel and file system report it, else the block
    size that the probe write succeeded with); 0 when unsupported.
    reason: how that was decided, human readable.
    """

    supported: bool
    mem_align: int
    offset_align: int
    reason: str


def _fs_type(path: str) -> int | None:
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if libc.statfs(os.fsencode(path), buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf, 0).value & 0xFFFFFFFF


def statx_dioalign(fd: int) -> tuple[int, int] | None:
    """(dio_mem_align, dio_offset_align) of an open file if the kernel/fs report them, else None.

    (0, 0) means the file system says "no O_DIRECT for this file".
    """
    statx = getattr(libc, "statx", None)
    if statx is None:
        return None
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    rc = statx(ctypes.c_int(fd), b"", ctypes.c_int(_AT_EMPTY_PATH),
               ctypes.c_uint(_STATX_DIOALIGN), buf)
    if rc != 0:
        return None
    mask = ctypes.c_uint32.from_buffer(buf, _OFF_MASK).value
    if not mask & _STATX_DIOALIGN:
        return None
    return (ctypes.c_uint32.from_buffer(buf, _OFF_DIO_MEM_ALIGN).value,
            ctypes.c_uint32.from_buffer(buf, _OFF_DIO_OFFSET_ALIGN).value)


def _open_probe_file(dirpath: str) -> tuple[int, str | None]:
    """An fd of a new empty file in dirpath: O_TMPFILE (never visible) where supported."""
    tmpfile = getattr(os, "O_TMPFILE", 0)
    if tmpfile:
        try:
            return os.open(dirpath, tmpfile | os.O_RDWR | os.O_CLOEXEC, 0o600), None
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                raise
    fd, name = tempfile.mkstemp(prefix=".ckptfs-dio-probe-", dir=dirpath)
    return fd, name


def _on_memory_fs(dirpath: str, what: str) -> DirectInfo | None:
    """The answer of both probes for tmpfs/ramfs (None elsewhere)."""
    ftype = _fs_type(dirpath)
    if ftype not in _MEMORY_FS:
        return None
    return DirectInfo(False, 0, 0, "%s is on %s (memory-backed): O_DIRECT would bypass no "
                      "page cache; use buffered I/O" % (what, _MEMORY_FS[ftype]))


def probe_direct(dirpath: str | os.PathLike) -> DirectInfo:
    """Can files in ``dirpath`` be written with O_DIRECT, and with which alignment?

    Uses statx(STATX_DIOALIGN) on a temporary file where reported, and always confirms with a
    real probe: open the temporary file with O_DIRECT and write one aligned block.  The file is
    an O_TMPFILE where the file system allows it, else a named temp file that is unlinked; no
    file is left behind.  tmpfs/ramfs report ``supported=False``: kernels >= 6.6 accept O_DIRECT
    there, but it bypasses nothing (the page cache *is* the storage), so buffered I/O is the
    right choice.
    """
    dirpath = os.fspath(dirpath)
    if not os.path.isdir(dirpath):
        return DirectInfo(False, 0, 0, "%s is not a directory" % dirpath)
    mem = _on_memory_fs(dirpath, dirpath)
    if mem is not None:
        return mem
    try:
        fd, name = _open_probe_file(dirpath)
    except OSError as e:
        return DirectInfo(False, 0, 0, "cannot create a probe file in %s: %s" % (dirpath, e))
    buf = None
    try:
        if name is not None:
            os.unlink(name)  # the fd keeps it alive; nothing is left behind even on a crash later
            name = None
        align = statx_dioalign(fd)
        if align is not None and align[1] == 0:
            return DirectInfo(False, 0, 0, "statx reports no O_DIRECT support on %s" % dirpath)
        block = max(4096, PAGE_SIZE, *(align or (0,)))
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        except OSError as e:
            return DirectInfo(False, 0, 0, "O_DIRECT refused in %s: %s" % (dirpath, e))
        buf = alloc_aligned(block)
        try:
            n = os.pwrite(fd, buf, 0)
        except OSError as e:
            return DirectInfo(False, 0, 0, "O_DIRECT write of %d aligned bytes failed in %s: %s"
                              % (block, dirpath, e))
        if n != block:
            return DirectInfo(False, 0, 0, "O_DIRECT probe write was short (%d of %d)" % (n, block))
        if align is not None:
            return DirectInfo(True, align[0], align[1],
                              "statx STATX_DIOALIGN: mem_align=%d offset_align=%d; probe write ok"
                              % align)
        return DirectInfo(True, block, block,
                          "statx does not report DIOALIGN here; probe write of %d bytes ok" % block)
    finally:
        os.close(fd)
        if name is not None:
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass
        if buf is not None:
            buf.close()


def probe_direct_read(path: str | os.PathLike) -> DirectInfo:
    """Can the existing file ``path`` be read with O_DIRECT?  Writes nothing (read-only mounts
    and read-only backing stores): opens the file with O_DIRECT and reads its first aligned
    block.  Memory-backed file systems report ``supported=False`` as in :func:`probe_direct`."""
    path = os.fspath(path)
    mem = _on_memory_fs(os.path.dirname(path) or ".", path)
    if mem is not None:
        return mem
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
    except OSError as e:
        return DirectInfo(False, 0, 0, "O_DIRECT open of %s refused: %s" % (path, e))
    buf = None
    try:
        align = statx_dioalign(fd)
        if align is not None and align[1] == 0:
            return DirectInfo(False, 0, 0, "statx reports no O_DIRECT support for %s" % path)
        block = max(4096, PAGE_SIZE, *(align or (0,)))
        buf = alloc_aligned(block)
        try:
            os.preadv(fd, [buf], 0)
        except OSError as e:
            return DirectInfo(False, 0, 0, "O_DIRECT read of %s failed: %s" % (path, e))
        a = align or (block, block)
        return DirectInfo(True, a[0], a[1], "O_DIRECT read of %d aligned bytes ok" % block)
    finally:
        os.close(fd)
        if buf is not None:
            buf.close()
