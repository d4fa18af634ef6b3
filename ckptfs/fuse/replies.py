"""The replies the trio thread sends for the requests it answers itself, and the policy the
queue threads answer from, encoded as libfuse would encode pyfuse3's: attributes, entries and
open flags (FUSE's structs: fuse/protocol.h)."""

from __future__ import annotations

import os

from ckptfs.fuse.ops import ATTR_TIMEOUT_S
from ckptfs.fuse.protocol import (
    ATTR_OUT,
    ENTRY_OUT,
    FOPEN_DIRECT_IO,
    FOPEN_KEEP_CACHE,
    FOPEN_NOFLUSH,
    FOPEN_NONSEEKABLE,
)


def valid(t: float) -> tuple[int, int]:
    """A cache timeout as the protocol's (seconds, nanoseconds), as libfuse computes it."""
    if t <= 0:
        return 0, 0
    sec = int(t)
    return sec, int((t - sec) * 1e9)


ATTR_VALID = valid(ATTR_TIMEOUT_S)


def attr_out(fields: tuple) -> bytes:
    """fuse_attr_out of an inode with these attribute fields (ops.attr_fields)."""
    return ATTR_OUT.pack(ATTR_VALID[0], ATTR_VALID[1], 0, *fields)


def entry_out(x, fields: tuple, entry_valid: tuple[int, int]) -> bytes:
    """fuse_entry_out of inode x (generation 0, as ops._attr says) with its attribute fields;
    `entry_valid`: the mount's entry timeout (ops.Settings.entry_timeout)."""
    return ENTRY_OUT.pack(x.ino, 0, entry_valid[0], ATTR_VALID[0], entry_valid[1],
                          ATTR_VALID[1], *fields)


def open_flags(fi, flags: int) -> int:
    """fuse_open_out's open_flags for pyfuse3's FileInfo `fi` of an open with `flags`."""
    f = ((FOPEN_DIRECT_IO if fi.direct_io else 0) | (FOPEN_KEEP_CACHE if fi.keep_cache else 0)
         | (FOPEN_NONSEEKABLE if fi.nonseekable else 0))
    if flags & os.O_ACCMODE == os.O_RDONLY:
        f |= FOPEN_NOFLUSH  # close() of a reader sends no FLUSH: ckptfs has nothing to do then
    return f
