"""The fast path's dispatch table: the common requests answered on the trio thread.

`Dispatch.handlers` maps an opcode to its handler here, for both of the fast path's loops
(fuse/fastpath.py: a request read from /dev/fuse, or one a queue thread handed over); each
handler takes a `Request` and says whether it served it (else it goes to pyfuse3). They call
the same handlers pyfuse3 would call (fuse/ops.py) and encode the replies libfuse would send:
READ (one `writev` from the read cache), WRITE (fuse/inplace.py), FLUSH, RELEASE (its work
held: fuse/releases.py), LOOKUP, GETATTR, OPEN, CREATE, INTERRUPT (fuse/interrupts.py), and
IOCTL answered ENOTTY. While the queue threads run (fuse/queues.py), what a handler serves
also feeds what they answer from (fuse/answers.py).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable

import pyfuse3

from ckptfs.fuse.inplace import HEAD, InPlaceWrites
from ckptfs.fuse.interrupts import Interrupts
from ckptfs.fuse.ops import Context
from ckptfs.fuse.protocol import (
    CREATE_IN,
    FLUSH_IN,
    FUSE_CREATE,
    FUSE_FLUSH,
    FUSE_GETATTR,
    FUSE_INTERRUPT,
    FUSE_IOCTL,
    FUSE_LOOKUP,
    FUSE_OPEN,
    FUSE_READ,
    FUSE_RELEASE,
    FUSE_WRITE,
    INTERRUPT_IN,
    IN_HEADER,
    OPEN_IN,
    OPEN_OUT,
    OUT_HEADER,
    READ_IN,
    RELEASE_IN,
)
from ckptfs.fuse.queues import QueueThreads
from ckptfs.fuse.releases import Releases
from ckptfs.fuse.replies import attr_fields, attr_out, entry_out, open_flags

log = logging.getLogger("ckptfs")


def pieces(n: int, bufs: list) -> list:
    """The n bytes just read, as views of the buffers they landed in."""
    parts, left = [], n
    for b in bufs:
        k = min(left, len(b))
        parts.append(memoryview(b)[:k])
        left -= k
        if not left:
            break
    return parts


class Request:
    """One request as either loop of the fast path found it, for the handlers of the dispatch
    table: its header's fields, the buffer holding its op part (`head`, from `at`), its
    length, and where the rest is: read from /dev/fuse (`entry` -1), the buffers it was read into
    (`bufs`: the header, staging's tails `t1` and `t2` when offered, the overflow buffer); in
    a queue thread's entry `entry`, the op part's size and the payload buffer."""

    __slots__ = ("opcode", "unique", "nodeid", "uid", "gid", "pid", "head", "at", "length",
                 "entry", "bufs", "t1", "t2", "opsize", "pay", "psz")

    def __init__(self, opcode: int, unique: int, nodeid: int, uid: int, gid: int, pid: int,
                 head, at: int, length: int, entry: int = -1) -> None:
        self.opcode, self.unique, self.nodeid = opcode, unique, nodeid
        self.uid, self.gid, self.pid = uid, gid, pid
        self.head, self.at, self.length, self.entry = head, at, length, entry

    def body(self) -> bytes:
        """The request's bytes after the 40-byte header."""
        if self.entry >= 0:
            return bytes(self.head[self.at:self.at + self.opsize]) + bytes(self.pay[:self.psz])
        if self.length <= HEAD:
            return bytes(self.head[IN_HEADER.size:self.length])
        return b"".join(pieces(self.length, self.bufs))[IN_HEADER.size:]


class Dispatch:
    """The handlers of the requests the fast path answers itself, by opcode."""

    def __init__(self, ops, queues: QueueThreads, interrupts: Interrupts,
                 writes: InPlaceWrites, releases: Releases,
                 send: Callable[..., bool], reply_error: Callable[[int, int], None],
                 entry_valid: tuple[int, int]) -> None:
        """`ops`: the handlers pyfuse3 calls (fuse/ops.py); `queues`: the queue threads
        (their answer cache and landing while they run); `interrupts`: the requests that can
        wait long, answered early; `writes`: the WRITEs; `releases`: the RELEASEs' work held;
        `send(header, *data)`, `reply_error(unique, errno)`: the fast path's replies;
        `entry_valid`: the mount's entry timeout as the protocol's."""
        self.ops = ops
        self.queues = queues
        self.interrupts = interrupts
        self.writes = writes
        self.releases = releases
        self.send = send
        self.reply_error = reply_error
        self.entry_valid = entry_valid
        self.reads_direct = 0  # READs answered here and from read windows (count_reads)
        self.answered = 0  # requests answered here (any outcome)
        self.handlers = {
            FUSE_WRITE: self.write_req, FUSE_READ: self.read_req,
            FUSE_INTERRUPT: self.interrupt_req, FUSE_FLUSH: self.flush_req,
            FUSE_RELEASE: self.release_req, FUSE_IOCTL: self.ioctl_req,
            FUSE_LOOKUP: self.entry_req, FUSE_GETATTR: self.entry_req,
            FUSE_OPEN: self.entry_req, FUSE_CREATE: self.entry_req,
        }

    def count_reads(self, reads: int) -> None:
        """READs the queue threads answered from read windows (Intake.reads_served), counted
        with those answered here."""
        self.reads_direct += reads

    async def serve(self, req: Request) -> bool:
        """Serve `req` by its opcode's handler (`handlers`); False if none here takes it (it
        goes to pyfuse3 then)."""
        handler = self.handlers.get(req.opcode)
        if handler is None:
            return False
        self.answered += 1
        if await handler(req):
            return True
        self.answered -= 1
        return False

    async def write_req(self, req: Request) -> bool:
        """WRITE (fuse/inplace.py): on /dev/fuse its payload was read into staging's tails
        as far as they reach; from a queue thread it landed in the landing zone, what of it
        Landing.claim recorded is its outcome."""
        if req.length < HEAD:
            return False
        if req.entry < 0:
            await self.writes.from_dev(req.unique, req.head, req.length, req.t1, req.t2,
                                       req.pid)
        else:
            await self.writes.from_entry(req.unique, req.head, req.at, req.psz, req.pay,
                                         req.pid, self.queues.landing.outcome(req.entry))
        return True

    async def read_req(self, req: Request) -> bool:
        if req.length < HEAD:
            return False
        await self.read(req.unique, req.pid, req.head, req.at)
        return True

    async def interrupt_req(self, req: Request) -> bool:
        if req.length < IN_HEADER.size + INTERRUPT_IN.size:
            return False
        self.interrupts.interrupt(INTERRUPT_IN.unpack_from(req.head, req.at)[0])
        return True

    async def flush_req(self, req: Request) -> bool:
        await self.simple(req.unique, self.ops.flush, FLUSH_IN.unpack_from(req.head, req.at)[0])
        return True

    async def release_req(self, req: Request) -> bool:
        self.release(req.unique, RELEASE_IN.unpack_from(req.head, req.at)[0])
        return True

    async def ioctl_req(self, req: Request) -> bool:
        # ckptfs files have no ioctls; Python's open() asks isatty() (TCGETS) of every file
        # it opens, which libfuse would answer ENOSYS (a round trip through pyfuse3 per
        # open). Regular files answer ENOTTY.
        self.reply_error(req.unique, errno.ENOTTY)
        return True

    async def entry_req(self, req: Request) -> bool:
        await self.entry_op(req.opcode, req.unique, req.nodeid,
                            Context(req.uid, req.gid, req.pid), req.body())
        return True

    async def read(self, unique: int, pid: int, head, at: int) -> None:
        fh, off, size, _, _, _, _ = READ_IN.unpack_from(head, at)
        token = self.interrupts.serve(unique, pid)  # (a wait for the disk is held)
        try:
            # (ops.guarded: only FUSEError escapes)
            parts = await self.ops.read(fh, off, size, gather=True)
        except pyfuse3.FUSEError as exc:
            self.reply_error(unique, exc.errno)
            return
        finally:
            self.interrupts.served(token)
        self.reads_direct += 1
        # views into the read cache and staging, gathered by writev: sent before any other
        # task runs (no await since they were taken)
        n = sum(map(len, parts))
        if self.queues.ring is not None and n:
            # (before the reply, which the reader's next READ may follow at once; also after a
            # short one, at the file's end: torch.load reads a zip's directory there first, in
            # several small READs. Neither loads nor reuses a chunk: the views stand)
            self.queues.answers.open_window(fh, off)
        if not self.send(OUT_HEADER.pack(OUT_HEADER.size + n, 0, unique), *parts):
            self.reply_error(unique, errno.EIO)  # the reader must not wait for ever

    async def entry_op(self, opcode: int, unique: int, nodeid: int, ctx: Context,
                       body: bytes) -> None:
        """LOOKUP, GETATTR, OPEN and CREATE, answered as libfuse would answer pyfuse3's
        reply (plus FOPEN_NOFLUSH for read-only opens, which pyfuse3 cannot ask for). The
        attributes are packed straight from the inode (replies.attr_fields), and a LOOKUP of a
        name that does not exist is answered without raising: a small file's save is six
        requests, and on this path the interpreter runs cold (docs/performance-notes.md), so
        every object and exception per request shows."""
        ops, q = self.ops, self.queues
        window = None  # an OPEN's handle that gets a read window
        found = None  # a LOOKUP's file: its next OPEN may be prepared
        try:
            if opcode == FUSE_GETATTR:
                x = ops.inode(nodeid)
                out = attr_out(attr_fields(x))
                if x.children is not None and q.answers is not None:
                    q.answers.dir_attrs(x, nodeid, out)
            elif opcode == FUSE_LOOKUP:
                if ops.others.refresh_due():  # other writers' changes first (ops.lookup)
                    await ops.others.refresh()
                x = ops.find(nodeid, body[:body.index(b"\0")])
                if x is None:
                    ops.others.fresh_dir(nodeid)  # (ESTALE in a directory renumbered)
                    if q.answers is not None:
                        q.answers.dir_names(nodeid)
                    self.reply_error(unique, errno.ENOENT)
                    return
                x.lookups += 1
                out = entry_out(x, attr_fields(x), self.entry_valid)
                found = x
            elif opcode == FUSE_OPEN:
                flags, _ = OPEN_IN.unpack_from(body)
                fi = await ops.open(nodeid, flags, ctx)
                out = OPEN_OUT.pack(fi.fh, open_flags(fi, flags), 0)
                if q.landing is not None:
                    q.landing.takes_writes(fi.fh, flags)
                if q.ring is not None and flags & os.O_ACCMODE == os.O_RDONLY:
                    window = fi.fh  # (readahead may have brought the file in)
            else:
                flags, mode, umask, _ = CREATE_IN.unpack_from(body)
                name = body[CREATE_IN.size:body.index(b"\0", CREATE_IN.size)]
                ctx.umask = umask
                fi, x = ops.create_open(nodeid, name, mode, flags, ctx)
                out = entry_out(x, attr_fields(x), self.entry_valid) + OPEN_OUT.pack(
                    fi.fh, open_flags(fi, flags), 0)
                if q.landing is not None:
                    q.landing.takes_writes(fi.fh, flags)
                if q.ring is not None:
                    # (the kernel asks for the directory's attributes right after: its
                    # permission check before the next name in it)
                    d = ops.inode(nodeid)
                    q.answers.dir_attrs(d, nodeid, attr_out(attr_fields(d)))
        except pyfuse3.FUSEError as exc:
            self.reply_error(unique, exc.errno)
            return
        except Exception:  # (what ops.guarded does for the handlers)
            log.exception("internal error in request %d", opcode)
            self.reply_error(unique, errno.EIO)
            return
        if window is not None:
            q.answers.open_window(window, 0)
        elif found is not None and q.answers is not None:
            q.answers.lookup_served(found)
            q.answers.prepare_open(found)  # (before the answer: the OPEN follows it at once)
        self.send(OUT_HEADER.pack(OUT_HEADER.size + len(out), 0, unique) + out)
        if found is not None and q.answers is not None:
            q.answers.prepare_lookups(nodeid, body[:body.index(b"\0")])

    def release(self, unique: int, fh: int) -> None:
        """RELEASE: answered at once (the closing process does not wait for it; the kernel
        sends it after close() returned; with the ring the queue threads answer it), its
        work held (fuse/releases.py: run after the requests that do not depend on it)."""
        if self.queues.ring is not None:
            self.queues.ring.writable(fh, False)
            self.queues.answers.invalidate(fh=fh)
        self.releases.hold((fh,))
        self.send(OUT_HEADER.pack(OUT_HEADER.size, 0, unique))

    async def simple(self, unique: int, handler, fh: int) -> None:
        try:
            await handler(fh)
        except pyfuse3.FUSEError as exc:
            self.reply_error(unique, exc.errno)
            return
        self.send(OUT_HEADER.pack(OUT_HEADER.size, 0, unique))
