"""The replies the trio thread sends for the requests it answers itself, and the policy the
queue threads answer from, encoded as libfuse would encode pyfuse3's: attributes, entries and
open flags (FUSE's structs: fuse/protocol.h); a file's attributes once for every reply
(`attr_fields`), and as pyfuse3 wants them for the requests it serves (`entry_attributes`)."""

from __future__ import annotations

import os

import pyfuse3

from ckptfs.fuse.protocol import (
    ATTR_OUT,
    ENTRY_OUT,
    FOPEN_DIRECT_IO,
    FOPEN_KEEP_CACHE,
    FOPEN_NOFLUSH,
    FOPEN_NONSEEKABLE,
)
from ckptfs.namespace import Inode

ATTR_TIMEOUT_S = 300.0
# st_blksize, the preferred I/O size (Lustre reports its stripe size here): Python's open()
# buffers that much, so a reader of small items at offsets (DCP) reads 512 KiB at a time
# instead of 4 KiB (with direct reads each read is a round trip to the daemon). A power of two:
# the kernel rounds it down to one. Not 1 MiB: Python's buffer comes from malloc, rarely
# page-aligned, and a direct read of a full 1 MiB there spans 257 pages, which the kernel
# (256 pages per request) sends as two READs.
IO_BLOCK_BYTES = 512 << 10


def valid(t: float) -> tuple[int, int]:
    """A cache timeout as the protocol's (seconds, nanoseconds), as libfuse computes it."""
    if t <= 0:
        return 0, 0
    sec = int(t)
    return sec, int((t - sec) * 1e9)


ATTR_VALID = valid(ATTR_TIMEOUT_S)


def attr_fields(x: Inode) -> tuple:
    """A file's attributes, once for every reply: the fields of the protocol's struct
    fuse_attr (ino size blocks, atime mtime ctime in s, then their ns parts, mode nlink
    uid gid rdev blksize flags). The fast path packs them itself (no EntryAttributes per
    request); entry_attributes hands them to pyfuse3. Blocks count stored bytes, not holes."""
    at, an = divmod(x.atime_ns, 1_000_000_000)
    mt, mn = divmod(x.mtime_ns, 1_000_000_000)
    ct, cn = divmod(x.ctime_ns, 1_000_000_000)
    return (x.ino, x.size, (x.emap.stored + 511) // 512 if x.emap is not None else 0,
            at, mt, ct, an, mn, cn, x.mode, x.nlink, x.uid, x.gid, x.rdev & 0xFFFFFFFF,
            IO_BLOCK_BYTES, 0)


def entry_attributes(x: Inode, entry_timeout: float) -> pyfuse3.EntryAttributes:
    """attr_fields as pyfuse3 wants them (the requests pyfuse3 serves); `entry_timeout`:
    the mount's (ops.Settings.entry_timeout)."""
    (ino, size, blocks, at, mt, ct, an, mn, cn, mode, nlink, uid, gid, rdev, blksize,
     _) = attr_fields(x)
    a = pyfuse3.EntryAttributes()
    a.st_ino = ino
    a.generation = 0
    a.entry_timeout = entry_timeout
    a.attr_timeout = ATTR_TIMEOUT_S
    a.st_mode = mode
    a.st_nlink = nlink
    a.st_uid = uid
    a.st_gid = gid
    a.st_rdev = rdev
    a.st_size = size
    a.st_blksize = blksize
    a.st_blocks = blocks
    a.st_atime_ns = at * 1_000_000_000 + an
    a.st_mtime_ns = mt * 1_000_000_000 + mn
    a.st_ctime_ns = ct * 1_000_000_000 + cn
    return a


def attr_out(fields: tuple) -> bytes:
    """fuse_attr_out of an inode with these attribute fields (attr_fields)."""
    return ATTR_OUT.pack(ATTR_VALID[0], ATTR_VALID[1], 0, *fields)


def entry_out(x, fields: tuple, entry_valid: tuple[int, int]) -> bytes:
    """fuse_entry_out of inode x (generation 0, as entry_attributes says) with its attribute
    fields; `entry_valid`: the mount's entry timeout (ops.Settings.entry_timeout)."""
    return ENTRY_OUT.pack(x.ino, 0, entry_valid[0], ATTR_VALID[0], entry_valid[1],
                          ATTR_VALID[1], *fields)


def open_flags(fi, flags: int) -> int:
    """fuse_open_out's open_flags for pyfuse3's FileInfo `fi` of an open with `flags`."""
    f = ((FOPEN_DIRECT_IO if fi.direct_io else 0) | (FOPEN_KEEP_CACHE if fi.keep_cache else 0)
         | (FOPEN_NONSEEKABLE if fi.nonseekable else 0))
    if flags & os.O_ACCMODE == os.O_RDONLY:
        f |= FOPEN_NOFLUSH  # close() of a reader sends no FLUSH: ckptfs has nothing to do then
    return f
