"""WRITE requests served on the trio thread, their payloads where they landed (trio thread
only; one `InPlaceWrites` per fast path).

On /dev/fuse the fast path reads a request with one `readv` into [80-byte header | the rest of
the open segment | the next free segment buffer | the overflow buffer]: a WRITE's payload
lands where it will be flushed from (also when it runs past the end of a segment), and the
kernel's copy is the only one (`from_dev`). A WRITE a queue thread handed over has landed in
the landing zone as far as it went (fuse/landing.py recorded that part) and the rest is in its
entry's payload buffer (`from_entry`). What did not land in staging is copied in here
(`record`); that copy is the one place a WRITE waits, for staging space, so for the backing
store, and it is cancelled when the caller is being killed (fuse/interrupts.py).

Bounds: what does not fit in the two segment buffers (no free buffer: backpressure; or
segments smaller than a request) is read into the overflow buffer, one of `request_max`
bytes; a WRITE that waits for staging space keeps it, and the next request is read into a
new one (`spare`).
"""

from __future__ import annotations

import errno
import logging
import struct
from collections.abc import Callable

import pyfuse3

from ckptfs.datapath.staging import Staging
from ckptfs.fuse.devfuse import REQUEST_MAX
from ckptfs.fuse.interrupts import Interrupts
from ckptfs.fuse.handles import SETID_BITS, Handles
from ckptfs.fuse.protocol import (
    FUSE_WRITE_CACHE,
    FUSE_WRITE_KILL_SUIDGID,
    IN_HEADER,
    OUT_HEADER,
    WRITE_IN,
    WRITE_OUT,
)

log = logging.getLogger("ckptfs")

HEAD = IN_HEADER.size + WRITE_IN.size  # a WRITE's or READ's header and op part: 80 bytes
WRITE_REPLY = struct.Struct("<" + OUT_HEADER.format[1:] + WRITE_OUT.format[1:])  # header, body


class InPlaceWrites:
    """The trio thread's WRITEs: recorded where their payloads landed, the rest copied."""

    def __init__(self, handles: Handles, staging: Staging, interrupts: Interrupts,
                 send: Callable[..., bool], reply_error: Callable[[int, int], None]) -> None:
        """`handles`: the open handles, a write's steps (write_target, clear_setid,
        piece_recorder, wrote); `staging`: where the payloads land (datapath/staging.py);
        `interrupts`: the requests answered early when their caller is being killed;
        `send(header, *data)` and `reply_error(unique, errno)`: the fast path's replies."""
        self.handles = handles
        self.staging = staging
        self.interrupts = interrupts
        self.send = send
        self.reply_error = reply_error
        self.request_max = REQUEST_MAX  # the largest request (max_write from INIT: `fit`)
        self.overflow: bytearray | None = bytearray(REQUEST_MAX)
        self.writes_in_place = 0  # WRITEs answered whose payload landed in staging
        self.bytes_in_place = 0
        self.bytes_copied = 0  # bytes of them copied into staging

    def spare(self) -> bytearray:
        """The overflow buffer the next request is read into after staging's tails (a new
        one when a WRITE waiting for staging space kept the last)."""
        if self.overflow is None:
            self.overflow = bytearray(self.request_max)
        return self.overflow

    def fit(self, max_write: int) -> None:
        """INIT settled max_write: the overflow buffer holds the largest request."""
        self.request_max = max(REQUEST_MAX, HEAD + max_write + 4096)
        if len(self.overflow or b"") < self.request_max:
            self.overflow = bytearray(self.request_max)

    def count_landed(self, writes: int, nbytes: int) -> None:
        """WRITEs the queue threads answered and the bytes they landed (Landing.claim),
        counted with those read in place here."""
        self.writes_in_place += writes
        self.bytes_in_place += nbytes

    async def from_dev(self, unique: int, head, n: int, t1, t2, pid: int) -> None:
        """A WRITE of `n` bytes read from /dev/fuse: its header in `head`, its payload in t1
        and t2 (staging's tails, None when not offered) as far as they reach, the rest in
        the overflow buffer."""
        fh, off, size, write_flags, _, _, _ = WRITE_IN.unpack_from(head, IN_HEADER.size)
        if n != HEAD + size:
            self.reply_error(unique, errno.EIO)
            return
        await self.record(unique, fh, off, size, write_flags, pid, t1, t2, None)

    async def from_entry(self, unique: int, head, at: int, psz: int, pay, pid: int,
                         outcome: tuple[int, int, bool]) -> None:
        """A WRITE a queue thread handed over: its op part in `head` from `at`, `psz` bytes
        of payload in its entry's buffer `pay`; `outcome`: what of it landed and was
        recorded (Landing.outcome: bytes, errno, whether that is all the WRITE records).
        Wholly recorded, it is answered now (with the count); in part, the rest is copied."""
        fh, off, size, write_flags, _, _, _ = WRITE_IN.unpack_from(head, at)
        done, err, whole = outcome
        if size != psz or err:
            self.reply_error(unique, err or errno.EIO)
        elif whole:
            self.writes_in_place += 1
            self.send(WRITE_REPLY.pack(WRITE_REPLY.size, 0, unique, done, 0))
        else:
            await self.record(unique, fh, off, size, write_flags, pid, None, None, pay, done)

    async def record(self, unique: int, fh: int, off: int, size: int, write_flags: int,
                     pid: int, t1, t2, payload, recorded: int = 0) -> None:
        """A WRITE whose payload landed in t1 and t2 (the staging's tails) as far as they
        reach, the rest in `payload` if given (a ring entry's), else in the overflow buffer;
        `recorded`: bytes at its start the queue threads landed (and Landing.claim recorded).
        Only the bytes below the largest file are recorded, and the answer says how many."""
        handles, staging = self.handles, self.staging
        try:
            h, x, size = handles.write_target(fh, off, size)
            if write_flags & FUSE_WRITE_KILL_SUIDGID and x.mode & SETID_BITS:
                handles.clear_setid(x)
            record = handles.piece_recorder(x, off)
            k = recorded
            if t1 is not None:
                k = min(size, len(t1))
                if k:
                    staging.landed(k, record)
                if t2 is not None and size > k:  # ran past the segment's end into the next
                    k2 = min(size - k, len(t2))
                    staging.landed(k2, record, base=k)
                    k += k2
                self.bytes_in_place += k
            if size > k:  # the rest went to the overflow buffer: copy it into staging
                if payload is not None:
                    rest = payload[k:size]
                else:
                    # append() may wait for free buffers: the buffer stays with this request
                    # (other tasks read the next requests into a new one)
                    rest = memoryview(self.overflow)[:size - k]
                    self.overflow = None
                done = [k]  # bytes of this write recorded so far

                def counted(seg, dpos, soff, m):
                    record(seg, dpos, soff, m)
                    done[0] = dpos + m

                # the one place a WRITE waits (for staging space, so for the backing store):
                # held, so cancelled when its caller is being killed. Not the kernel's
                # writeback of page-cache pages: their write(2) returned long ago, and the pid
                # is whoever made the kernel write them back
                token = (self.interrupts.serve(unique, pid) if not write_flags & FUSE_WRITE_CACHE
                         else None)
                try:
                    with self.interrupts.waiting() as scope:
                        await staging.append(rest, counted, base=k)
                finally:
                    if token is not None:
                        self.interrupts.served(token)
                if scope.cancelled_caught:
                    self.bytes_copied += done[0] - k
                    if done[0]:  # a short write: what is recorded stays written
                        handles.wrote(h, x, off + done[0], done[0])
                        self.send(WRITE_REPLY.pack(WRITE_REPLY.size, 0, unique, done[0], 0))
                    else:
                        self.reply_error(unique, errno.EINTR)
                    return
                self.bytes_copied += size - k
            handles.wrote(h, x, off + size, size)
        except pyfuse3.FUSEError as exc:
            self.reply_error(unique, exc.errno)
            return
        except OSError as exc:
            self.reply_error(unique, exc.errno or errno.EIO)
            return
        except Exception:
            log.exception("internal error in write")
            self.reply_error(unique, errno.EIO)
            return
        self.writes_in_place += 1
        self.send(WRITE_REPLY.pack(WRITE_REPLY.size, 0, unique, size, 0))
