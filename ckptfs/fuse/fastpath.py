"""The fast path: the request loop reads /dev/fuse itself and answers the common requests.

Through pyfuse3 a 1 MiB WRITE costs the daemon the kernel's copy into libfuse's receive buffer,
a copy into a Python `bytes` (pyfuse3), a copy into the segment (staging.append) and a Python
coroutine per request. Here the daemon reads /dev/fuse itself, with one `readv` into
[80-byte header | the rest of the open segment | the next free segment buffer | an overflow
buffer]: a WRITE's payload lands where it will be flushed from, and the kernel's copy is the
only one (fuse/inplace.py). The request is answered here, without pyfuse3 or libfuse.

The requests of a checkpoint's save and restore are answered here too, by one dispatch table
(fuse/dispatch.py) that calls the same handlers pyfuse3 would call and encodes the replies
libfuse would send: READ (one `writev` from the read cache), FLUSH, RELEASE (its work held:
fuse/releases.py), LOOKUP, GETATTR, OPEN, CREATE. Two differences: a read-only open gets
FOPEN_NOFLUSH (its close() sends no FLUSH; ckptfs has nothing to do for it, and pyfuse3 cannot
ask for it), and IOCTL is answered ENOTTY here (Python's open() asks isatty() of every file;
libfuse would answer ENOSYS after a round through pyfuse3). INTERRUPT is read here too: the
requests that can wait long (a WRITE waiting for staging space, a READ waiting for the disk,
forwarded FSYNC, FSYNCDIR, GETXATTR) are answered at once when their caller is being killed
(fuse/interrupts.py; docs/reliability.md); pyfuse3 cannot act on interrupts, so every other
INTERRUPT is dropped here.

Every other request (INIT, MKDIR, RENAME, SETATTR, READDIR, xattrs, FSYNC, ...) still goes to
pyfuse3, unchanged: the loop writes it into the socket pair that stands in for /dev/fuse
(fuse/devfuse.py, the transport), and pyfuse3 reads it from there as if from /dev/fuse;
libfuse's replies come back through the pair and are passed on to /dev/fuse by the task that
forwarded the request (in its next call of the wait, right after pyfuse3 served it). The INIT
reply is read on the way (fuse/negotiation.py): the fast path starts once the protocol version
and max_write are known. Before pyfuse3.close() unmounts, `detach()` gives libfuse its
/dev/fuse descriptor back.

Costs: a forwarded request takes three more system calls (send, recv, write; no extra sleep
or wake-up: all on the daemon's one thread). One request is read at a time (one thread).
libfuse's `debug` output does not show the requests answered here.

Once INIT is answered the queue threads (fuse/ring.py, ring*.c) take over the reading: C
threads, one per CPU, on /dev/fuse (the default) or on FUSE's io_uring queues
(`--fuse-uring`). They answer a small file's requests and land WRITE payloads themselves and
hand every other request to this loop (`serve_ring`), which serves it with the handlers above;
on /dev/fuse it then reads nothing itself. fuse/queues.py starts and stops them and holds, while
they run, what takes in their work (fuse/answers.py, fuse/landing.py, fuse/intake.py).
`--no-queue-threads` leaves the reading here.

`--no-fast-path` turns it off (pyfuse3 reads every request; docs/tuning.md).
"""

from __future__ import annotations

import errno
import logging
import os
import select
import struct

import trio

from ckptfs import failpoints
from ckptfs.datapath.flusher import ErrorNotices
from ckptfs.fuse import ring as fring
from ckptfs.fuse.devfuse import DevFuse
from ckptfs.fuse.dispatch import Dispatch, Request, pieces
from ckptfs.fuse.inplace import HEAD, InPlaceWrites
from ckptfs.fuse.interrupts import Interrupts
from ckptfs.fuse.loop import RequestWait
from ckptfs.fuse.negotiation import Negotiation
from ckptfs.fuse.protocol import (
    FUSE_BATCH_FORGET,
    FUSE_FORGET,
    FUSE_FSYNC,
    FUSE_FSYNCDIR,
    FUSE_GETXATTR,
    FUSE_INIT,
    FUSE_INTERRUPT,
    FUSE_SETATTR,
    IN_HEADER,
    OUT_HEADER,
)
from ckptfs.fuse.queues import QueueThreads
from ckptfs.fuse.refresh import Invalidations
from ckptfs.fuse.releases import Releases
from ckptfs.fuse.replies import valid
from ckptfs.namespace import ChangeNotices

log = logging.getLogger("ckptfs")

_U32 = struct.Struct("<I")  # a field of that size at an offset of the protocol's layouts
# Requests that get no answer (the queue threads read them from /dev/fuse like any other)
NO_REPLY = frozenset((FUSE_FORGET, FUSE_BATCH_FORGET, FUSE_INTERRUPT))
# Forwarded requests that can wait for a long time (barriers: for the flusher, so for the backing
# store) and whose effect does not depend on their answer: answered EINTR when interrupted.
INTERRUPTIBLE_FORWARDED = frozenset((FUSE_FSYNC, FUSE_FSYNCDIR, FUSE_GETXATTR))


class FastPath(RequestWait):
    """pyfuse3's wait for the next request (see fuseloop.RequestWait), extended: it reads the
    request itself and answers the common ones here; anything else it hands to libfuse and
    returns True (pyfuse3 then reads it)."""

    def __init__(self, dev: DevFuse, ops, spin_s: float, interrupts: Interrupts,
                 change_notices: ChangeNotices, flush_errors: ErrorNotices,
                 invalidations: Invalidations, uring: bool = False,
                 queue_threads: bool = False) -> None:
        """`invalidations`: where the refresher tells the kernel what to forget; written to
        /dev/fuse from now on (a descriptor of its own), which libfuse no longer has."""
        super().__init__(dev.fd, spin_s, idle_work=ops.staging.checksums)
        self.dev = dev  # /dev/fuse and the socket pair toward libfuse (fuse/devfuse.py)
        self.ops = ops
        self.staging = ops.staging
        self.entry_valid = valid(ops.settings.entry_timeout)
        self.head = bytearray(HEAD)
        self.init = Negotiation(ops.handles, uring, queue_threads)  # INIT, as it goes by
        self.forwarders: set = set()  # tasks that returned True: pyfuse3 served a request
        self.forwarded = 0
        self.forwarded_ops: dict[int, int] = {}  # opcode -> requests forwarded
        self.handed_ops: dict[int, int] = {}  # opcode -> requests the queue threads handed here
        self.releases = Releases(ops.handles.release_now)  # RELEASEs answered, their work held
        self.detached = False
        self.interrupts = interrupts  # the requests that can wait long, answered early
        interrupts.start(self.reply_error)
        self.writes = InPlaceWrites(ops.handles, ops.staging, interrupts, self.send,
                                    self.reply_error)
        # The queue threads (fuse/queues.py): on FUSE over io_uring (--fuse-uring) where the
        # kernel offers it, else on /dev/fuse (--queue-threads); running once INIT is answered
        # (as the negotiation settled)
        self.queues = QueueThreads(ops, self.entry_valid, self.writes, self.releases,
                                   change_notices, flush_errors)
        self.ring_turn = 0
        # the requests answered here, by opcode, for both loops (serve_one, serve_ring)
        self.dispatch = Dispatch(ops, self.queues, interrupts, self.writes, self.releases,
                                 self.send, self.reply_error, self.entry_valid)
        self.epoll = None
        if uring or queue_threads:
            # the slow path sleeps on /dev/fuse and on the queue threads' eventfd at once (on
            # the eventfd only once they read /dev/fuse themselves)
            self.epoll = select.epoll()
            self.epoll.register(dev.fd, select.EPOLLIN)
            self.wait_fd = self.epoll.fileno()
        invalidations.write_to(os.dup(dev.fd))

    @classmethod
    def attach(cls, lib_fd: int, ops, spin_s: float, interrupts: Interrupts,
               change_notices: ChangeNotices, flush_errors: ErrorNotices,
               invalidations: Invalidations, uring: bool = False,
               queue_threads: bool = False) -> "FastPath":
        """Take /dev/fuse over from libfuse (whose descriptor `lib_fd` becomes a socket)."""
        return cls(DevFuse.attach(lib_fd), ops, spin_s, interrupts, change_notices,
                   flush_errors, invalidations, uring, queue_threads)

    def detach(self) -> None:
        """Give libfuse its /dev/fuse descriptor back (before pyfuse3.close() unmounts)."""
        if self.detached:
            return
        self.detached = True
        self.closed = True
        self.interrupts.stop()  # (the fd goes)
        self.releases.run()
        stopped = self.queues.stop()
        if self.epoll is not None:
            self.epoll.close()
        self.dev.detach(close=stopped)  # (else a queue thread that still runs may use it)

    def counts(self) -> dict:
        c = super().counts()
        w = self.writes
        c.update(writes_in_place=w.writes_in_place, bytes_in_place=w.bytes_in_place,
                 bytes_copied_in=w.bytes_copied, reads_direct=self.dispatch.reads_direct,
                 requests_forwarded=self.forwarded,
                 requests_answered_here=self.dispatch.answered,
                 requests_interrupted=self.interrupts.count, transport=self.queues.transport)
        c["forwarded_by_opcode"] = dict(sorted(self.forwarded_ops.items()))
        if self.queues.ring is not None:
            c["ring_handed_by_opcode"] = dict(sorted(self.handed_ops.items()))
            c.update(self.queues.counts())
        return c

    def close(self) -> None:
        super().close()
        self.interrupts.stop()
        # pyfuse3.terminate() wakes waiters on libfuse's descriptor, not on ours
        trio.lowlevel.notify_closing(self.wait_fd)

    def probe(self, timeout: int) -> bool:
        ring = self.queues.ring
        if ring is not None:
            if ring.pending():
                return True
            if not self.queues.landing.live:
                self.queues.landing.offer()
            if ring.dev:  # (they read /dev/fuse; serve_one closes the loop once it is gone)
                return ring.gone()
        return bool(self.poller.poll(timeout))

    async def __call__(self) -> bool:
        task = trio.lowlevel.current_task()
        if task in self.forwarders:  # pyfuse3 served what this task forwarded: pass replies on
            self.forwarders.discard(task)
            self.pump()
            self.interrupts.done()
        while True:
            if not await super().__call__():
                self.pump()
                return False
            if await self.serve_one():
                self.forwarders.add(task)
                return True

    # ------------------------------------------------------------ requests
    async def serve_one(self) -> bool:
        """Read one request and serve it by the dispatch table (fuse/dispatch.py, which
        serve_ring uses too); True if it was handed to libfuse instead."""
        ring = self.queues.ring
        if ring is not None and ring.pending():
            # (/dev/fuse is looked at every few ring requests: INTERRUPTs come there)
            self.ring_turn += 1
            if ring.dev or self.ring_turn & 7 or not self.poller.poll(0):
                i = ring.take()
                if i >= 0:
                    return await self.serve_ring(i)
                self.queues.intake.settle()  # (only WRITEs they answered: record them)
                return False
        if ring is not None and ring.dev:  # (the queue threads read every request)
            if ring.gone():
                self.close()  # unmounted, or the connection was aborted
            return False
        head = self.head
        overflow = self.writes.spare()
        # (with the ring, its queue threads land WRITEs in the tails; a /dev/fuse WRITE then
        # goes to the overflow buffer and is copied)
        t1, t2 = self.staging.tails() if self.init.minor and ring is None else (None, None)
        bufs = [head, t1, t2, overflow] if t2 is not None else (
            [head, t1, overflow] if t1 is not None else [head, overflow])
        n = self.dev.read(bufs)
        if n <= 0:  # withdrawn (its caller was interrupted), or unmounted, aborted
            if n < 0:
                self.close()
            return False
        if n < IN_HEADER.size:
            log.error("short read on /dev/fuse (%d bytes)", n)
            return False
        _, opcode, unique, nodeid, uid, gid, pid, extlen, _ = IN_HEADER.unpack_from(head)
        if ring is not None:  # (what the queue threads answered comes first, as in serve_ring)
            self.queues.intake.settle()
        self.releases.before(opcode)
        if self.init.minor and not extlen:
            req = Request(opcode, unique, nodeid, uid, gid, pid, head, IN_HEADER.size, n)
            req.bufs, req.t1, req.t2 = bufs, t1, t2
            if await self.dispatch.serve(req):
                return False
        self.forward(pieces(n, bufs), opcode, unique, pid)
        return True

    async def serve_ring(self, i: int) -> bool:
        """Serve the request in ring entry i (fuse/ring.py) as serve_one serves one read from
        /dev/fuse; True if it was handed to libfuse. An unexpected exception on the way (a
        defect) fails the mount (Flusher.fail: every barrier fails with EIO from then on) and
        the request with EIO, and the loop serves on: the caller does not wait for ever, and
        the unmount can run."""
        queues = self.queues
        ring = queues.ring
        h, psz = ring.request(i)
        length, opcode, unique, nodeid, uid, gid, pid, extlen, _ = IN_HEADER.unpack_from(h)
        if opcode not in NO_REPLY:  # (read from /dev/fuse by the queue threads: no answer)
            queues.uniques[unique] = i
        try:
            failpoints.hit("handover")
            queues.intake.settle()
            self.handed_ops[opcode] = self.handed_ops.get(opcode, 0) + 1
            self.releases.before(opcode)
            pay = ring.payloads[i]
            # the op's fixed part (in the header buffer); the rest is in the payload buffer
            opsize = length - IN_HEADER.size - psz
            if not 0 <= opsize <= fring.OP_IN_SIZE:
                log.error("ring request %d: %d bytes, %d of payload", opcode, length, psz)
                self.reply_error(unique, errno.EIO)
                return False
            op = fring.OP_IN
            req = Request(opcode, unique, nodeid, uid, gid, pid, h, op,
                          IN_HEADER.size + opsize + psz, i)
            req.opsize, req.pay, req.psz = opsize, pay, psz
            if not extlen and await self.dispatch.serve(req):
                return False
            head = bytearray(h[:IN_HEADER.size])
            _U32.pack_into(head, 0, IN_HEADER.size + opsize + psz)
            self.forward([head, h[op:op + opsize], pay[:psz]], opcode, unique, pid)
        except Exception as exc:
            log.critical("the hand-over of a queue thread's request failed (opcode %d)", opcode,
                         exc_info=True)
            self.ops.flusher.fail(exc, "the hand-over of the queue threads' requests")
            if unique in queues.uniques:  # (not answered yet)
                self.reply_error(unique, errno.EIO)
            return False
        finally:
            if opcode in NO_REPLY:  # (served, its bytes sent, or failed: the entry is free)
                ring.answered(i)
        return True

    def quiesce(self) -> None:
        """Before the unmount's last commit: the replies of requests pyfuse3 served last go
        out (its tasks end without passing through this wait once the session is told to
        exit, and a signal's unmount keeps the mount live until the end); the releases
        answered so far run (their records go into it); the queue threads answer no more
        RELEASEs and land no more WRITEs (the zone is taken back: a WRITE answered from now
        on could not be recorded, its handle released; one that comes now waits, as every
        request does once the loop has ended)."""
        self.pump()
        ring = self.queues.ring
        if ring is not None:
            ring.stop_deferring()
            self.queues.intake.settle()  # (their handles' landed writes recorded first)
            self.staging.claim()
        self.releases.run()

    def settle(self) -> None:
        """What the queue threads answered is taken in, the releases run and prepared windows
        that waited too long go: on the idle sealer's tick and before the status is read. (A
        WRITE they landed whole and answered wakes the trio thread only once a segment fills or the
        landed list is half full, ring_landing.c: a file written and kept open would otherwise stay
        unrecorded until the next request.)"""
        if self.queues.ring is not None:
            self.queues.intake.settle()
            self.releases.run()
            self.queues.answers.expire_prepared()

    def spin_work(self) -> None:
        """While the loop spins: the releases held, once no request came for a while
        (Releases.spin_work)."""
        self.releases.spin_work(self.probe)

    def sleep_work(self) -> None:
        """Before a task sleeps: the releases held (until the next request they would keep
        their files open: an idle mount would go on looking at other writers, and hold
        their logs)."""
        if self.releases.held:
            self.releases.run()

    def park(self, sleeping: bool) -> bool:
        if sleeping and self.releases.held:  # (not left until the next request)
            self.sleep_work()
            return True
        ring = self.queues.ring
        return ring.sleep(sleeping) if ring is not None else False

    def reply_error(self, unique: int, err: int) -> None:
        self.send(OUT_HEADER.pack(OUT_HEADER.size, -err, unique))

    def send(self, header: bytes, *data) -> bool:
        """Write a reply; False if the kernel refused it (the request is still waiting). The
        reply to a request that came on the ring goes into its entry."""
        uniques = self.queues.uniques
        if uniques:
            i = uniques.pop(OUT_HEADER.unpack_from(header)[2], None)
            ring = self.queues.ring
            if i is not None and ring.dev:  # (written here: then the slot is free)
                try:
                    return self.dev.write(header, data)
                finally:
                    ring.answered(i)
            if i is not None:
                if ring.answer(i, header, data):
                    return True
                log.error("a reply of %d bytes does not fit the ring entry",
                          len(header) + sum(map(len, data)))
                ring.answer(i, OUT_HEADER.pack(OUT_HEADER.size, -errno.EIO,
                                               OUT_HEADER.unpack_from(header)[2]), ())
                return True
        return self.dev.write(header, data)

    # ------------------------------------------------------------ FUSE over io_uring
    def start_ring(self) -> None:
        """Start the queue threads (right after the INIT reply went to the kernel): register
        the per-CPU queues of FUSE over io_uring, or read /dev/fuse."""
        payload, dev = self.init.take_ring()
        ring = self.queues.start(self.fd, payload, dev, self.spin_s, self.dispatch.count_reads)
        if ring is None:
            return
        self.epoll.register(ring.wake_fd, select.EPOLLIN)
        if dev:  # (a request wakes the queue threads, not the trio thread)
            self.epoll.unregister(self.fd)
        ring.sleep(self.busy)  # (a task may already sleep in the slow path)
        if dev:
            ring.go()  # (set up: they may read /dev/fuse now)
        log.info("%s: %d queues of %d entries (%d KiB each), %d of them served from their own "
                 "CPU", "queue threads on /dev/fuse" if dev else "FUSE over io_uring",
                 ring.nqueues, ring.depth, payload >> 10, ring.counts()["ring_queues_pinned"])

    # ------------------------------------------------------------ libfuse's side
    def forward(self, parts: list, opcode: int, unique: int, pid: int) -> None:
        """Hand the request just read (its bytes: `parts`) to libfuse."""
        if opcode == FUSE_INIT:
            self.init.offered(unique, self.head, sum(map(len, parts)))
        if opcode == FUSE_SETATTR and self.queues.ring is not None:
            self.queues.landing.setattr_seen(b"".join(map(bytes, parts)))
        self.forwarded += 1
        self.forwarded_ops[opcode] = self.forwarded_ops.get(opcode, 0) + 1
        self.dev.forward(parts)
        if opcode in INTERRUPTIBLE_FORWARDED:
            self.interrupts.forwarded(unique, pid)

    def pump(self) -> None:
        """Pass libfuse's replies (and notifications) on to /dev/fuse."""
        while True:
            msg = self.dev.reply()
            if msg is None:
                return
            if len(msg) >= OUT_HEADER.size:
                _, err, unique = OUT_HEADER.unpack_from(msg)
                if unique == self.init.unique:
                    max_write = self.init.settle(msg, err)
                    if max_write is not None:
                        self.writes.fit(max_write)
                    self.send(msg)
                    if self.init.ring_payload:  # (the queues register once INIT is answered)
                        self.start_ring()
                    continue
                if self.interrupts.replied(unique):  # answered EINTR here when interrupted
                    continue
            ring = self.queues.ring
            if ring is not None:  # (pyfuse3's handlers may change a directory in steps)
                ring.dirs_changed()
            self.send(msg)
