"""A save's requests that the queue threads answered, made real on the trio thread: the
landing zone (staging's tails, offered to them for the next WRITE payloads) and the writes
that landed there, the handles whose WRITEs they may answer, the files they created (trio
thread only; one `Landing` exists while they run: QueueThreads.start).

A WRITE the queue threads landed is recorded here in the order it landed, as a WRITE read
into the tails on /dev/fuse is recorded (InPlaceWrites.record): `claim` takes the tails
back first (staging calls it before it changes, through `Staging.claim`), and `offer`
offers them again. A WRITE they handed over after landing it waits for its outcome (`outcome`) in
its entry's turn. docs/architecture.md, "What the queue threads answer", has the rules.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable

import pyfuse3

from ckptfs.fuse import protocol
from ckptfs.fuse import ring as fring
from ckptfs.fuse.answers import AnswerCache
from ckptfs.fuse.handles import SETID_BITS
from ckptfs.fuse.ops import Context
from ckptfs.fuse.protocol import FATTR_MODE, FUSE_WRITE_KILL_SUIDGID, IN_HEADER
from ckptfs.fuse.replies import ATTR_VALID, IO_BLOCK_BYTES, open_flags

log = logging.getLogger("ckptfs")

SETATTR_IN = protocol.layout("fuse_setattr_in").prefix("mode")  # (valid first, mode last)


def _dead(seg, dpos, soff, k, crc=None) -> None:
    """The recorder of landed bytes that belong to no file (dead space in their segment)."""


def _land(staging, record, n: int, base: int, k: int, crc: int) -> None:
    """Bytes base .. base + k of a landed write into staging: those below `n` (what the
    write writes) by `record`, under the CRC32C taken in C when that is all of them (else
    theirs is owed, as for a write served by the trio thread), the rest as dead space."""
    live = min(k, max(n - base, 0))
    if live == k:
        staging.landed(k, record, base=base, crc=crc)
        return
    if live:
        staging.landed(live, record, base=base)
    staging.landed(k - live, _dead, base=base + live)


class Landing:
    """The trio thread's side of the queue threads' WRITEs and CREATEs."""

    def __init__(self, ring: fring.Ring, ops, answers: AnswerCache,
                 tally: Callable[[int, int], None]) -> None:
        """`ring`: the queue threads; `ops`: the handlers (their staging, handles, tree, the
        create they make);
        `answers`: the answer cache (a handle that can write takes its file's answers back);
        `tally(writes, nbytes)`: counts landed WRITEs answered and bytes landed with those
        the fast path read in place (InPlaceWrites.count_landed)."""
        self.ring = ring
        self.ops = ops
        self.staging = ops.staging
        self.answers = answers
        self.tally = tally
        self.live = False  # staging's tails offered to the queue threads
        # entry -> (bytes recorded, errno, whether that is all the write writes)
        self.outcomes: dict[int, tuple[int, int, bool]] = {}
        self.creates_not_made = 0  # files the queue threads created that could not be made

    def start(self, entry_valid: tuple[int, int]) -> None:
        """What the queue threads need before they answer a save's requests: the create
        policy and the numbers to create with (not on a read-only mount), the zone."""
        ops, ring = self.ops, self.ring
        if not ops.settings.readonly:
            ring.create_setup(self.create_policy(entry_valid))
            ring.reserve(*ops.handles.reserve(fring.RESERVE), fring.RESERVE)
        self.offer()

    def stop(self) -> None:
        """The queue threads stop: nothing is offered or recorded any more."""
        self.staging.offer(None)
        self.live = False

    def create_policy(self, entry_valid: tuple[int, int]) -> fring.CreatePolicy:
        """What a file the queue threads create is: what a CREATE the fast path serves makes
        of it (ops.new_file_mode, Handles.file_info for a new file, open_flags, takes_writes),
        handed over as data (fuse/ring.h, struct ck_fring_policy)."""
        ops = self.ops
        file_type = stat.S_IFMT(ops.new_file_mode(0, 0))
        modes = range(4)  # (by access mode: O_RDONLY, O_WRONLY, O_RDWR, O_ACCMODE)
        return fring.CreatePolicy(
            entry_valid=entry_valid, attr_valid=ATTR_VALID, file_type=file_type,
            mode_bits=ops.new_file_mode(0xFFFFFFFF, 0) & ~file_type, blksize=IO_BLOCK_BYTES,
            open_flags=tuple(open_flags(ops.handles.file_info(acc), acc) for acc in modes),
            writes_here=tuple(acc != os.O_RDONLY for acc in modes),
            no_writes_mode=SETID_BITS)  # (a WRITE may have to clear them: Handles.clear_setid)

    def offer(self) -> None:
        """Offer the staging's tails to the queue threads for the next WRITE payloads (once
        `claim` took them back: an offer while they hold them would land bytes where
        earlier ones went)."""
        if self.live:
            return
        t1, t2 = self.staging.offered_tails()
        if t1 is None or not len(t1):
            return
        self.ring.offer(t1, t2)
        self.live = True
        self.staging.offer(self.claim)

    def claim(self) -> None:
        """Staging's claimer while the zone is offered (Staging.claim calls it, once; so does
        every settle and the fast path's quiesce, through it): take the tails back from the
        queue threads and record the writes they landed, in order, as a /dev/fuse WRITE read
        into the tails is recorded (InPlaceWrites.record); each one's outcome waits for its
        entry's turn (`outcome`). A write that cannot be recorded (a stale handle, say)
        still takes its place in the segment, as dead bytes: the writes after it landed
        behind it; so do the bytes of a write past the largest file (Handles.write_target: a
        short write)."""
        if not self.live:
            return
        ring, handles, staging = self.ring, self.ops.handles, self.staging
        writes = nbytes = 0
        if ring.landed():  # (their checksums, in C, before the zone is taken back)
            ring.sum_landed()
        self.live = False
        ring.revoke()
        if ring.created():  # (a created file's writes land after its CREATE was answered)
            self.make_created(ring.take_created())
        for (i, answered, k1, k2, fh, off, size, write_flags, pid, crc1,
             crc2) in ring.take_landed():
            try:
                h, x, n = handles.write_target(fh, off, size)
                if write_flags & FUSE_WRITE_KILL_SUIDGID and x.mode & SETID_BITS:
                    handles.clear_setid(x)
                record = handles.piece_recorder(x, off)
            except Exception as exc:
                err = exc.errno if isinstance(exc, pyfuse3.FUSEError) else errno.EIO
                if answered:  # (a handle said to take writes that does not: a defect)
                    log.error("a WRITE answered by its queue thread cannot be recorded "
                              "(handle %d, pid %d): %s", fh, pid, exc)
                else:  # (an answered one's entry is another request's by now)
                    if not isinstance(exc, pyfuse3.FUSEError):
                        log.exception("internal error in write (pid %d)", pid)
                    self.outcomes[i] = (0, err, False)
                record, n = _dead, 0
            if k1:
                _land(staging, record, n, 0, k1, crc1)
            if k2:
                _land(staging, record, n, k1, k2, crc2)
            nbytes += k1 + k2
            if record is not _dead:
                whole = k1 + k2 >= n  # (all of it that fits in the file)
                if whole:
                    handles.wrote(h, x, off + n, n)
                if answered:
                    writes += 1
                else:
                    self.outcomes[i] = (min(k1 + k2, n), 0, whole)
        self.tally(writes, nbytes)

    def outcome(self, entry: int) -> tuple[int, int, bool]:
        """A handed-over WRITE's landing (entry `entry`): the bytes of it recorded, the
        errno its recording failed with, and whether those are all the bytes it writes
        (0, 0, False: nothing of it landed)."""
        return self.outcomes.pop(entry, (0, 0, False))

    def make_created(self, created: list[tuple]) -> None:
        """Make the files the queue threads created (fuse/ring_dirs.c), in order, as the CREATE
        would have made them here, with their numbers and time: the INODE record, the open
        handle (the queue threads put it in the writable set themselves; it may be released
        already). The queue threads have the directory's names and attributes as they are
        after it already (the answer cache lets the notices of their directories' changes
        pass meanwhile: `AnswerCache.making_created`)."""
        ops, ring, answers = self.ops, self.ring, self.answers
        with answers.making_created():
            for parent, name, ino, fh, mode, uid, gid, flags, pid, now in created:
                answers.name_order.pop(parent, None)  # (a name more in its order)
                try:
                    ops.create_open(parent, name, mode, flags, Context(uid, gid, pid), ino, fh,
                                    now)
                except Exception:  # (a defect: the kernel has the file open already)
                    log.exception("a file created by a queue thread cannot be made "
                                  "(%r in directory %d): its writes fail", name, parent)
                    self.creates_not_made += 1
                    ring.writable(fh, False)  # (its next WRITEs come here: EBADF)
                    ring.dirs_changed()  # (the directory's attributes as the tree has them)
        if ring.reserve_left() < fring.RESERVE // 4:
            ring.reserve(*ops.handles.reserve(fring.RESERVE), fring.RESERVE)

    def takes_writes(self, fh: int, flags: int) -> None:
        """A handle opened for writing whose writes would be taken (Handles.write_target) gets its
        WRITEs answered by the queue threads when they land whole."""
        if flags & os.O_ACCMODE == os.O_RDONLY:
            return
        # (a file's attributes may change now, and its bytes: its READs come here again)
        handles = self.ops.handles
        h = handles.by_fh.get(fh)
        self.answers.invalidate(inode=h.inode if h is not None else None)
        try:
            h, x, _ = handles.write_target(fh)
        except pyfuse3.FUSEError:
            return
        if x.mode & SETID_BITS:  # (a WRITE may have to clear them first: Handles.clear_setid)
            return
        self.ring.writable(fh, True)

    def setattr_seen(self, msg: bytes) -> None:
        """A SETATTR (`msg`, as read) that gives a file set-user-ID or set-group-ID: the
        handles open on it stop taking WRITEs in the queue threads (takes_writes), whose
        answer would come before the write clears them (Handles.clear_setid)."""
        if len(msg) < IN_HEADER.size + SETATTR_IN.size:
            return
        fields = SETATTR_IN.unpack_from(msg, IN_HEADER.size)
        valid, mode = fields[0], fields[-1]
        if not (valid & FATTR_MODE and mode & SETID_BITS):
            return
        x = self.ops.ns.inodes.get(IN_HEADER.unpack_from(msg)[3])
        for fh, h in self.ops.handles.by_fh.items():
            if h.inode is x:
                self.ring.writable(fh, False)
