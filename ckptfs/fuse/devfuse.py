"""The fast path's transport: the session's /dev/fuse descriptor, taken over from libfuse, and
the socket pair that stands in for it toward pyfuse3 (trio thread only).

libfuse's descriptor number is moved onto one end of a SOCK_SEQPACKET socket pair (the real
/dev/fuse descriptor is kept under a new number): the fast path (fuse/fastpath.py) reads every
request from /dev/fuse (`read`), writes its answers there (`write`), writes a request it does
not answer into the pair (`forward`), where pyfuse3 reads it as if from /dev/fuse, and passes
libfuse's replies on (`reply`, then `write`). `detach` gives libfuse its descriptor back before
pyfuse3.close() unmounts. What a request is and who answers it is the fast path's; this module
only moves bytes.
"""

from __future__ import annotations

import errno
import logging
import os
import socket

log = logging.getLogger("ckptfs")

# libfuse 3's receive buffer: 256 pages of payload + 4 KiB of header room. No request is larger
# than that unless max_write says so (checked at INIT).
REQUEST_MAX = 256 * 4096 + 4096
SOCKET_BUFFER = 4 << 20


class DevFuse:
    """/dev/fuse (`fd`) and the socket pair toward libfuse (`sock`; `lib_fd`: libfuse's
    descriptor number, now the pair's other end)."""

    def __init__(self, fd: int, lib_fd: int, sock: socket.socket) -> None:
        self.fd = fd
        self.lib_fd = lib_fd
        self.sock = sock
        self.replies = bytearray(REQUEST_MAX)  # (libfuse's replies, one at a time)

    @classmethod
    def attach(cls, lib_fd: int) -> DevFuse:
        """Move libfuse's descriptor `lib_fd` onto a socket and keep /dev/fuse for us."""
        fuse_fd = os.dup(lib_fd)  # the session's /dev/fuse, under a new number
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for s in (ours, theirs):
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                try:
                    s.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
                except OSError:
                    pass
        os.dup2(theirs.fileno(), lib_fd, inheritable=False)
        theirs.close()
        os.set_blocking(fuse_fd, False)
        return cls(fuse_fd, lib_fd, ours)

    def detach(self, close: bool) -> None:
        """Give libfuse its /dev/fuse descriptor back; ours is closed too when `close` (not
        while a queue thread that still runs may read or write it)."""
        os.set_blocking(self.fd, True)
        os.dup2(self.fd, self.lib_fd, inheritable=False)
        if close:
            os.close(self.fd)
        self.sock.close()

    def read(self, bufs: list) -> int:
        """Read one request into `bufs` (readv): its length; 0 when none was there (withdrawn:
        its caller was interrupted), -1 when the connection is gone (unmounted, aborted)."""
        try:
            return os.readv(self.fd, bufs)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return 0
            if exc.errno != errno.ENODEV:
                log.error("reading /dev/fuse: %s", exc)
            return -1

    def write(self, header: bytes, data) -> bool:
        """Write a reply (`header`, then the buffers `data`) to /dev/fuse; False if the kernel
        refused it (the request is still waiting)."""
        try:
            if not data:
                os.write(self.fd, header)
            else:
                os.writev(self.fd, [header, *data])
        except OSError as exc:
            # ENOENT: the request was interrupted and is gone; ENODEV: unmounted
            if exc.errno not in (errno.ENOENT, errno.ENODEV):
                log.error("replying on /dev/fuse: %s", exc)
                return False
        return True

    def forward(self, parts: list) -> None:
        """Hand a request (its bytes: `parts`) to libfuse."""
        self.sock.sendmsg(parts)

    def reply(self) -> memoryview | None:
        """libfuse's next reply or notification, valid until the next call; None when there
        is none yet."""
        buf = self.replies
        try:
            k = self.sock.recv_into(buf, 0, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            log.error("reading libfuse's replies: %s", exc)
            return None
        if k <= 0:
            return None
        return memoryview(buf)[:k]
