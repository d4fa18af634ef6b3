"""Open file handles: their numbers, how an open uses the kernel's page cache, a handle's READs
(readahead, the read cache's accounting) and WRITEs (where one goes, what it changes), and its
release (trio thread only; one `Handles` per mount, CkptOperations.handles).

The handlers (fuse/ops.py) check an OPEN or CREATE and make its handle here (`open`); the
queue threads' OPENs answered from prepared windows get theirs made here later
(`prepare_open`, `open_prepared`), their CREATEs from numbers reserved here (`reserve`). A
READ goes to the reader with the readahead its handle's pattern earns (`_ahead`) and, for a
file read by one handle, the ranges served, which let the read cache reuse a chunk once all
its bytes were read (`_seen`); READs the queue threads answered from read windows are
accounted for the same way (`read_served`). A WRITE, whichever path it took (pyfuse3, the
fast path's in place, a queue thread's landed), goes through the same steps: `write_target`,
`clear_setid` when due, the bytes recorded by `piece_recorder`, then `wrote`. A release
journals a written file's times and lets the handle go (`release_now`; the fast path holds it
for later, fuse/releases.py).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import stat
import time
from operator import itemgetter

import pyfuse3

from ckptfs.datapath import writes
from ckptfs.datapath.dcpreads import DcpReads
from ckptfs.datapath.journal import Journal
from ckptfs.datapath.reader import Reader
from ckptfs.datapath.readplan import ReadPlan
from ckptfs.datapath.staging import Staging
from ckptfs.format.records import MAX_FILE_BYTES, SetattrRec
from ckptfs.fuse.control import CTL_STATS_INO, Control
from ckptfs.fuse.listings import Listing, Listings
from ckptfs.fuse.refresh import ATTRS
from ckptfs.namespace import CONTROL_LAYER, Inode, Namespace

log = logging.getLogger("ckptfs.handles")

SEQUENTIAL_SLACK_BYTES = 4 << 20
DIRECT_READ_MIN_BYTES = 1 << 20  # --direct-reads applies to files of at least one READ
SEEN_RANGES_MAX = 64  # a handle reading more separate ranges is a random reader: not counted
SETID_BITS = stat.S_ISUID | stat.S_ISGID


class Handle:
    """An open file or directory: its inode, the open's flags, whether it wrote, how it
    reads."""

    __slots__ = ("ino", "inode", "flags", "wrote", "next_off", "streak", "seen", "kill_setid",
                 "plan")

    def __init__(self, inode: Inode, flags: int, kill_setid: bool = False) -> None:
        self.ino = inode.ino
        self.inode = inode
        self.flags = flags  # the open's flags (a directory handle's: its listing)
        self.wrote = False
        # opened by a non-root user: its writes clear set-user/group-ID (CkptOperations.write)
        self.kill_setid = kill_setid
        self.next_off = 0  # where a sequential reader's next READ starts
        self.streak = 0  # bytes read sequentially since the last jump
        self.seen: list[list[int]] | None = []  # ranges served to this handle (reader recycling)
        self.plan: ReadPlan | None = None  # the order its reader reads the file in (readplan.py)


@dataclasses.dataclass(frozen=True)
class Negotiated:
    """What FUSE INIT settled: replaced once, when the INIT reply goes by (initialised(), from
    the fast path, which reads it; without the fast path nothing is learnt and this stays)."""

    # the kernel keeps MAP_SHARED mmap of direct-I/O files working (FUSE_DIRECT_IO_ALLOW_MMAP,
    # Linux 6.6+; without it such a mmap fails with ENODEV)
    shared_mmap_direct: bool = False
    direct_reads: bool = False  # Settings.direct_reads, None decided


class Handles:
    """The open handles by number (`by_fh`; a directory's too, made by open_dir), the numbers
    handed out, what they read and wrote (the status's counts)."""

    def __init__(self, ns: Namespace, staging: Staging, journal: Journal, reader: Reader,
                 dcp: DcpReads, control: Control, settings, refresher=None,
                 listings: Listings | None = None) -> None:
        """`ns`: the tree; `staging` and `journal`: where a WRITE's bytes and their extent
        entries go; `reader`: the read path; `dcp`: which opens get a read plan
        (datapath/dcpreads.py); `control`: the control files (a stats.json handle reads its
        snapshot); `settings`: the mount's (ops.Settings: readonly, direct_writes,
        direct_reads, checksum_block); `refresher`: sends the kernel's invalidations
        (fuse/refresh.py; None: pyfuse3 sends them); `listings`: what directory handles
        list (fuse/listings.py)."""
        self.ns = ns
        self.staging = staging
        self.journal = journal
        self.reader = reader
        self.dcp = dcp
        self.control = control
        self.settings = settings
        self.refresher = refresher
        self.listings = listings
        self.negotiated = Negotiated(direct_reads=bool(settings.direct_reads))
        self.by_fh: dict[int, Handle] = {}
        self.next_fh = 1
        self.written_direct: set[int] = set()  # files last written through a direct handle
        self.bytes_written = 0
        self.write_requests = 0
        self.read_requests = 0
        self.bytes_read = 0  # served to READs (re-reads counted again)

    def initialised(self, shared_mmap_direct: bool) -> None:
        """FUSE INIT passed (the fast path reads its reply): what it settled. --direct-reads
        left to its default is on where MAP_SHARED mmap of direct-I/O files keeps working."""
        direct = self.settings.direct_reads
        self.negotiated = Negotiated(shared_mmap_direct=shared_mmap_direct,
                                     direct_reads=shared_mmap_direct if direct is None
                                     else direct)

    # ------------------------------------------------------------ numbers
    def reserve_handle(self) -> int:
        """A new handle number."""
        fh = self.next_fh
        self.next_fh += 1
        return fh

    def reserve(self, n: int) -> tuple[int, int]:
        """n inode numbers and n handle numbers for creates answered elsewhere (the ring's
        queue threads; made later with CkptOperations.create_open): the first of each."""
        ino, fh = self.ns.next_ino, self.next_fh
        self.ns.next_ino += n
        self.next_fh += n
        return ino, fh

    # ------------------------------------------------------------ opens
    def open(self, x: Inode, flags: int, ctx=None, fh: int | None = None,
             plan: ReadPlan | None = None) -> int:
        """A handle of file x opened with `flags` (by `ctx`'s user; with number `fh` when the
        open was answered elsewhere), reading by `plan` if it has one: its number."""
        if fh is None:
            fh = self.reserve_handle()
        h = self.by_fh[fh] = Handle(x, flags, ctx is not None and ctx.uid != 0)
        h.plan = plan
        x.opens += 1
        return fh

    def open_dir(self, x: Inode) -> int:
        """A handle of directory x, which lists x as it is now (Listings.open): its number. It
        is no open of x's (`opens` counts files' handles: they read and write)."""
        listing = self.listings.open(x)
        fh = self.reserve_handle()
        self.by_fh[fh] = Handle(x, listing)
        return fh

    def may_prepare_open(self, x: Inode) -> bool:
        """Whether a read-only open of x can be prepared before it comes (prepare_open): its
        answer then does not depend on when it comes (x was not last written through a
        direct handle, whose pages a reader's open drops)."""
        return (x.ino not in self.written_direct and x.ino != CTL_STATS_INO
                and (x.size <= DIRECT_READ_MIN_BYTES  # (a DCP data file's OPEN: its plan)
                     or self.dcp.metadata_of(x) is None))

    def prepare_open(self, x: Inode) -> tuple[int, pyfuse3.FileInfo]:
        """A handle number and the answer for a read-only open of x that the ring's queue
        threads answer when it comes (may_prepare_open); the handle is made by
        open_prepared then."""
        fh = self.reserve_handle()
        return fh, self.open_info(x, fh, os.O_RDONLY)

    def open_prepared(self, x: Inode, fh: int, flags: int, ctx) -> None:
        """The handle of an open answered elsewhere with prepare_open's number and answer."""
        self.open(x, flags, ctx, fh)

    def open_info(self, x: Inode, fh: int, flags: int) -> pyfuse3.FileInfo:
        """The answer to an open of file x with `flags` as handle fh (file_info); x is noted
        as last written through a direct handle or not."""
        fi = self.file_info(flags, x.size, x.ino in self.written_direct, fh)
        if self.direct_write(flags):
            self.written_direct.add(x.ino)
        else:
            self.written_direct.discard(x.ino)
        return fi

    def direct_write(self, flags: int) -> bool:
        """Whether a handle opened with `flags` bypasses the page cache for its writes."""
        return self.settings.direct_writes and (flags & os.O_ACCMODE) == os.O_WRONLY

    def file_info(self, flags: int, size: int = 0, written_direct: bool = False,
                  fh: int = 0) -> pyfuse3.FileInfo:
        """How a handle opened with `flags` on a file of `size` bytes uses the kernel's page
        cache (written_direct: the file was last written through a direct handle); by
        default a new file's, which the queue threads' CREATEs answer with
        (Landing.create_policy)."""
        # Write-only handles bypass the kernel page cache when direct_writes is on: the
        # application's buffers go straight into WRITE requests (one copy less, no page-cache
        # growth, no dirty-page throttling, close() does not wait for writeback); readers keep
        # the page cache and its readahead. A file written that way may have stale pages
        # cached from an earlier read: the next read-open drops them (keep_cache off).
        if self.direct_write(flags):
            return pyfuse3.FileInfo(fh=fh, keep_cache=False, direct_io=True)
        if (self.negotiated.direct_reads and (flags & os.O_ACCMODE) == os.O_RDONLY
                and size >= DIRECT_READ_MIN_BYTES):
            # --direct-reads: read() goes straight from the daemon into the reader's buffer
            # (no page-cache copy); MAP_SHARED mmap of such a handle fails with ENODEV. Files
            # under one READ request keep the page cache: their small header reads hit it.
            return pyfuse3.FileInfo(fh=fh, keep_cache=False, direct_io=True)
        return pyfuse3.FileInfo(fh=fh, keep_cache=not written_direct)

    # ------------------------------------------------------------ reads
    async def read(self, fh: int, off: int, size: int, gather: bool = False):
        """A READ of handle fh (CkptOperations.read): its bytes, or with `gather` (the fast
        path) a list of buffers."""
        h = self.by_fh.get(fh)
        if h is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        x = h.inode
        self.read_requests += 1
        if x.layer == CONTROL_LAYER:
            out = self.control.read(fh, off, size)
            return [out] if gather else out
        if x.emap is None:  # unlinked and forgotten while open cannot happen; be safe
            return [] if gather else b""
        # Kernel readahead sends several READs at once: "sequential" means at or a little
        # past where this handle read last; a jump back or far ahead (DCP reading items by
        # offset) is a random read, which gets no readahead. Readahead grows with the bytes
        # read in a row (as the kernel's does): a reader going from item to item of one big
        # file in an order of its own (DCP) would otherwise pull in a full window behind every
        # item, evicting what it reads next (a 1 GB DCP restore read 2.75 GB from disk, now
        # 2.2). A READ at offset 0 starts a file: the full window, which covers the next files
        # in the logs (a restore reads files in about the order they were written).
        ahead = self._ahead(h, off, size) if h.plan is None else h.plan
        try:
            out = await self.reader.read(x.emap, off, size, x.size, ahead, self._seen(h, x),
                                         gather)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        self.bytes_read += max(0, min(size, x.size - off))  # what the reader returned
        return out

    @staticmethod
    def _ahead(h: Handle, off: int, size: int) -> int | None:
        """The readahead a READ of handle h gets (Reader.read's `ahead`)."""
        if off == 0:
            h.streak, ahead, h.next_off = size, None, size
        elif h.next_off <= off <= h.next_off + SEQUENTIAL_SLACK_BYTES:
            h.streak += size
            ahead, h.next_off = h.streak, max(h.next_off, off + size)
        else:
            h.streak, ahead, h.next_off = 0, 0, off + size
        return ahead

    @staticmethod
    def _seen(h: Handle, x: Inode) -> list | None:
        """Consumption is counted for a file read by one handle only (several readers of one
        file must not recycle each other's chunks) and up to 64 separate ranges per handle."""
        seen = h.seen if x.opens == 1 else None
        if seen is not None and len(seen) > SEEN_RANGES_MAX:
            seen = h.seen = None
        return seen

    def read_served(self, fh: int, reads: list) -> None:
        """READs of handle fh the queue threads answered from its read window (fuse/ring.c),
        in order, as (off, size, n): what read() does besides the bytes (its counts,
        readahead, the read cache's use). The bytes they answered go to the reader as their
        union, range by range: a restore's 1 MiB READs come a window's worth at a time, and
        `torch.load` reads a file's zip records out of order (its start twice, its end
        backwards in small steps, then its tensors), ~10 READs that make one range. A range's
        readahead is the most any of its READs asked for (a READ from offset 0: a whole
        window, from the range's end)."""
        h = self.by_fh.get(fh)
        if h is None:
            return
        x = h.inode
        self.read_requests += len(reads)
        spans = []
        plan = h.plan
        for off, size, n in reads:
            self.bytes_read += n
            # (in the order they came: the handle's streak)
            a = self._ahead(h, off, size) if plan is None else plan
            if n:
                spans.append((off, off + n, a))
        if not spans:
            return
        spans.sort(key=itemgetter(0))
        lo, hi, ahead = spans[0]
        for off, end, a in spans:
            if off > hi:
                self._window_served(h, x, lo, hi, ahead)
                lo, hi, ahead = off, end, a
                continue
            if end > hi:
                hi = end
            if plan is None:
                ahead = None if a is None or ahead is None else max(ahead, a)
        self._window_served(h, x, lo, hi, ahead)

    def _window_served(self, h: Handle, x: Inode, lo: int, hi: int, ahead) -> None:
        if x.emap is not None:
            self.reader.window_served(x.emap, lo, hi, ahead, self._seen(h, x))

    # ------------------------------------------------------------ writes
    # The steps of a write, shared by the handler (CkptOperations.write), the request loop's
    # in-place writes (fuse/inplace.py), which read the payload straight into the open
    # segment, and the writes the queue threads landed (fuse/landing.py).
    def write_target(self, fh: int, off: int = 0, size: int = 0) -> tuple[Handle, Inode, int]:
        """The handle and file a WRITE of `size` bytes at `off` goes to, and how many of its
        bytes it writes: those below the largest file the index records
        (records.MAX_FILE_BYTES), a short write as POSIX and ext4 have it; EFBIG for one
        that starts at or past it."""
        h = self.by_fh.get(fh)
        if h is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        if size and off >= MAX_FILE_BYTES:
            raise pyfuse3.FUSEError(errno.EFBIG)
        x = h.inode
        if x.emap is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        if x.layer or self.settings.readonly:
            raise pyfuse3.FUSEError(errno.EROFS)
        return h, x, min(size, max(MAX_FILE_BYTES - off, 0))

    def clear_setid(self, x: Inode) -> None:
        """A write by a process without CAP_FSETID clears S_ISUID, and S_ISGID where group
        execution is on (set-group-ID without it marks mandatory locking), as on ext4. The
        kernel does it itself (a SETATTR) before a write through the page cache; a direct
        write it leaves to the file system (FUSE_WRITE_KILL_SUIDGID, fuse/inplace.py)."""
        mode = x.mode & ~stat.S_ISUID
        if mode & stat.S_IXGRP:
            mode &= ~stat.S_ISGID
        if mode != x.mode:
            self.ns.change(SetattrRec(x.ino, mode, x.uid, x.gid, x.atime_ns, x.mtime_ns,
                                      time.time_ns()))
            self.forget_attributes(x.ino)

    def forget_attributes(self, ino: int) -> None:
        """Tell the kernel, before the answer that follows, that inode `ino`'s attributes it
        caches (300 s) are stale: a write that cleared set-user-ID must not leave `stat` (or
        exec) seeing the old mode."""
        if self.refresher is not None:
            self.refresher.send([(ATTRS, ino)])
        else:
            pyfuse3.invalidate_inode(ino, attr_only=True)

    def piece_recorder(self, x: Inode, off: int):
        """on_piece for Staging, for a write of file x at offset `off` (datapath/writes.py)."""
        return writes.piece_recorder(self.journal, self.staging.checksums, x, off,
                                     self.settings.checksum_block)

    def wrote(self, h: Handle, x: Inode, end: int, n: int) -> None:
        """A write of n bytes ending at `end` through handle h is recorded: the file's size
        and times, the counts."""
        if end > x.size:
            x.size = end
        x.mtime_ns = x.ctime_ns = time.time_ns()
        h.wrote = True
        self.bytes_written += n
        self.write_requests += 1

    # ------------------------------------------------------------ releases
    def release_now(self, fh) -> None:
        """RELEASE's work (nothing in it waits): the fast path runs it after the requests
        that do not depend on it (fuse/releases.py)."""
        h = self.by_fh.pop(fh, None)
        self.control.released(fh)
        if h is not None and h.wrote and h.inode.layer == 0 and not self.settings.readonly:
            # Writes move mtime/ctime; one SETATTR per written file at close makes them
            # durable (journaled after the file's extents).
            x = h.inode
            self.ns.change(SetattrRec(x.ino, x.mode, x.uid, x.gid, x.atime_ns, x.mtime_ns,
                                      x.ctime_ns))
        if h is not None:
            if h.plan is not None:
                self.reader.drop_plan(h.plan)
            h.inode.opens -= 1
            self.ns.maybe_forget(h.inode)

    def release_dir(self, fh) -> None:
        """RELEASEDIR's work: the directory handle goes, and its listing with its last
        handle."""
        h = self.by_fh.pop(fh, None)
        if h is not None:
            self.listings.close(h.flags)

    def release_all(self) -> None:
        """When the request loop has ended: every handle still open is released, as its
        RELEASE would have. The kernel sends RELEASE without waiting for it, and an unmount
        aborts the requests not read yet (it sends a FUSE mount no DESTROY to wait for
        them), so a file let go of just before the unmount has its RELEASE dropped; what
        the release journals (the written file's times) goes into the last commit instead.
        A directory's handle is released as its RELEASEDIR would have (release_dir)."""
        for fh, h in list(self.by_fh.items()):
            try:
                if isinstance(h.flags, Listing):
                    self.release_dir(fh)
                else:
                    self.release_now(fh)
            except Exception:  # (the others are still released; the last commit still comes)
                log.exception("unmount: releasing handle %d", fh)
