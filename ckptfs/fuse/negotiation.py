"""FUSE INIT, as it passes through the fast path (trio thread only; one `Negotiation` per fast
path).

pyfuse3 (libfuse) answers INIT; the fast path reads the kernel's offer on the way in
(`offered`) and libfuse's reply on the way out (`settle`). The reply settles what the fast
path may do: it serves requests itself once the protocol is one it knows (7.12 or later:
header sizes) and max_write is known. Flags libfuse 3.14 does not know are set in its reply
here: FUSE_DIRECT_IO_ALLOW_MMAP where the kernel offers it, FUSE_OVER_IO_URING for
--fuse-uring; and whether the queue threads start, on which transport and with how large
payload buffers (`take_ring`) is decided here.
"""

from __future__ import annotations

import logging
import struct

from ckptfs.fuse import protocol
from ckptfs.fuse import ring as fring
from ckptfs.fuse.handles import Handles
from ckptfs.fuse.protocol import (
    FUSE_DIRECT_IO_ALLOW_MMAP,
    FUSE_INIT_EXT,
    FUSE_MAX_PAGES,
    FUSE_OVER_IO_URING,
    IN_HEADER,
    INIT_IN,
    INIT_OUT,
    OUT_HEADER,
)

log = logging.getLogger("ckptfs")

# offsets in FUSE's wire protocol (fuse/protocol.h)
INIT_OUT_FLAGS = protocol.layout("fuse_init_out").offset("flags")
INIT_OUT_FLAGS2 = protocol.layout("fuse_init_out").offset("flags2")  # (64-byte reply: 7.23+)
INIT_OUT_MAX_PAGES = protocol.layout("fuse_init_out").offset("max_pages")  # (7.28+)
_U16 = struct.Struct("<H")  # a field of that size at an offset of the protocol's layouts
_U32 = struct.Struct("<I")


class Negotiation:
    """The kernel's INIT offer and libfuse's reply, and what they settled."""

    def __init__(self, handles: Handles, uring: bool, queue_threads: bool) -> None:
        """`handles`: the open handles, told what INIT settled (Handles.initialised: how
        opens use the page cache); `uring`: the queue threads on FUSE's io_uring queues are
        wanted (--fuse-uring), `queue_threads`: on /dev/fuse (--queue-threads)."""
        self.handles = handles
        self.uring_wanted = uring
        self.threads_wanted = queue_threads
        self.unique = -1  # the INIT request's, until its reply went by
        self.kernel_flags = 0  # what the kernel offered
        self.minor = 0  # the protocol's minor version; 0 until the reply went by
        # the queue threads to start once INIT is answered: their payload buffers' size (0:
        # none), on /dev/fuse (else on io_uring)
        self.ring_payload = 0
        self.ring_dev = False

    def offered(self, unique: int, msg, n: int) -> None:
        """The INIT request (`n` bytes of it read, the header and op part in `msg`)."""
        self.unique = unique
        if n >= IN_HEADER.size + INIT_IN.size:
            _, _, _, flags, flags2 = INIT_IN.unpack_from(msg, IN_HEADER.size)
            self.kernel_flags = flags | (flags2 << 32 if flags & FUSE_INIT_EXT else 0)

    def take_ring(self) -> tuple[int, bool]:
        """The queue threads INIT settled, once: their payload buffers' size (0: none) and
        whether they read /dev/fuse."""
        payload, self.ring_payload = self.ring_payload, 0
        return payload, self.ring_dev

    def settle(self, msg, err: int) -> int | None:
        """libfuse's INIT reply `msg` (its error `err`), changed in place where flags are
        added; the max_write it settled, None if the fast path does not start (an error, or
        a protocol it does not know)."""
        self.unique = -1
        if err or len(msg) < OUT_HEADER.size + INIT_OUT.size:
            return None
        major, minor, _, flags, _, _, max_write = INIT_OUT.unpack_from(msg, OUT_HEADER.size)
        if major != 7 or minor < 12:
            log.info("FUSE protocol %d.%d: every request goes through pyfuse3", major, minor)
            return None
        # Flags libfuse 3.14 does not know, set in its reply:
        # - FUSE_DIRECT_IO_ALLOW_MMAP: the READs of a mapping come here anyway. With it,
        #   MAP_SHARED mmap of a --direct-reads file works (through the page cache) instead of
        #   failing with ENODEV, so direct reads can be the default.
        # - FUSE_OVER_IO_URING (--fuse-uring): requests on per-CPU rings (fuse/ring.py).
        more = self.kernel_flags & FUSE_DIRECT_IO_ALLOW_MMAP
        if self.uring_wanted:
            reason = fring.enabled()
            if reason is None and not self.kernel_flags & FUSE_OVER_IO_URING:
                reason = "the kernel did not offer it"
            if reason is None:
                more |= FUSE_OVER_IO_URING
            else:
                log.warning("--fuse-uring: requests stay on /dev/fuse: %s", reason)
        # (the queue threads' payload buffers: the kernel's least read buffer, max_write,
        # max_pages pages, FUSE_MIN_READ_BUFFER)
        pages = (_U16.unpack_from(msg, OUT_HEADER.size + INIT_OUT_MAX_PAGES)[0]
                 if flags & FUSE_MAX_PAGES else 32)
        payload = (max(8192, max_write, pages * 4096) + 4095) & ~4095
        if self.threads_wanted and not more & FUSE_OVER_IO_URING:
            reason = fring.threads_unavailable()
            if reason is None:
                self.ring_payload, self.ring_dev = payload, True
            else:
                log.warning("queue threads: requests are served by the daemon's loop: %s",
                            reason)
        if more and len(msg) >= OUT_HEADER.size + INIT_OUT_FLAGS2 + 4:
            at = OUT_HEADER.size + INIT_OUT_FLAGS2
            flags2 = _U32.unpack_from(msg, at)[0] if flags & FUSE_INIT_EXT else 0
            flags |= FUSE_INIT_EXT
            _U32.pack_into(msg, OUT_HEADER.size + INIT_OUT_FLAGS, flags)
            _U32.pack_into(msg, at, flags2 | more >> 32)
            if more & FUSE_DIRECT_IO_ALLOW_MMAP:
                self.handles.initialised(shared_mmap_direct=True)
                log.info("shared mmap of direct-I/O files: on; --direct-reads %s",
                         "on" if self.handles.negotiated.direct_reads else "off")
            if more & FUSE_OVER_IO_URING:
                self.ring_payload, self.ring_dev = payload, False
        self.minor = minor
        log.info("FUSE protocol %d.%d, max_write %d: in-place writes on", major, minor, max_write)
        return max_write
