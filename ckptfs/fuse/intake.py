"""What the queue threads answered, taken in by the trio thread (trio thread only; one
`Intake` exists while they run: QueueThreads.start).

The queue threads note what they answered in lists (fuse/ring.c); `settle` takes them in, in
the order their antecedents need (before every request the trio thread serves, at every
wake-up by the queue threads, on the idle sealer's tick and before the status is read):
the LOOKUPs answered from prepared answers are counted, the handles of the OPENs answered
from prepared windows made (`make_opened`), the READs answered from read windows accounted
for (`reads_served`), the RELEASEs' work held or run, the files created and the writes
landed recorded (fuse/landing.py), and the next names prepared. docs/architecture.md,
"What wakes the trio thread", has the whole order.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from ckptfs.fuse import ring as fring
from ckptfs.fuse.answers import AnswerCache
from ckptfs.fuse.landing import Landing
from ckptfs.fuse.ops import Context

log = logging.getLogger("ckptfs")


class Intake:
    """The trio thread's side of the queue threads' notes."""

    def __init__(self, ring: fring.Ring, ops, answers: AnswerCache, landing: Landing,
                 hold: Callable[[list], None], release: Callable[[int], None],
                 tally: Callable[[int], None]) -> None:
        """`ring`: the queue threads; `ops`: the handlers; `answers`: what the queue threads
        answer from; `landing`: their WRITEs and CREATEs; `hold(fhs)`: released handles
        whose work is held (Releases.hold), `release(fh)`: a released handle's work
        now (Releases.now); `tally(reads)`: counts READs the queue threads answered
        with those the fast path answered (Dispatch.count_reads)."""
        self.ring = ring
        self.ops = ops
        self.answers = answers
        self.landing = landing
        self.hold = hold
        self.release = release
        self.tally = tally
        self.opens_not_made = 0  # OPENs the queue threads answered whose handle was not made

    def settle(self) -> None:
        """Before a request is served (and on the idle tick, and before the status): the
        LOOKUPs the queue threads answered are counted, the handles of the OPENs they
        answered and the files they created are made, the RELEASEs they answered join the
        releases to run (a read-only handle's run in this pass), their READs are accounted
        for, the writes they landed are recorded
        (those of a released handle landed before its RELEASE came; those of a created file
        after it was made), and the tails are offered again (while nothing
        landed, the offer stands: staging is as offered; a landing in progress belongs to a
        WRITE whose caller has no answer yet, so no request served now depends on it)."""
        ring, landing = self.ring, self.landing
        self.ops.reader.cache.land()  # (the chunks read ahead: windows open over them below)
        looked = ring.take_looked() if ring.looked() else None
        answers = self.answers
        if looked:  # (counted before any request: a FORGET among them)
            answers.count_looked(looked)
        # (taken so that every note's antecedents come with it: the OPEN or CREATE of every
        # handle a RELEASE releases, and every READ of it, were noted before the RELEASE, and
        # the OPEN before the READs; so the releases are taken first, then the READs, then
        # the opens, and the handles are made before any of them is worked on)
        released = ring.take_released() if ring.released() else None
        reads = ring.take_reads() if ring.reads() else None
        if ring.opened():
            self.make_opened(ring.take_opened())
        if released:
            # (a handle that can write has its work held, to run after the requests that do
            # not depend on it, as a RELEASE served here; a read-only one, only a count to
            # lower, is let go in this pass, once its READs are accounted for: a LOOKUP of
            # its file served now, which goes before held releases, sees it closed)
            handles = self.ops.handles.by_fh
            ro = {fh for fh in released if (h := handles.get(fh)) is not None
                  and h.flags & os.O_ACCMODE == os.O_RDONLY}
            held = [fh for fh in released if fh not in ro] if ro else released
            if held:
                self.hold(held)
        if reads:
            self.reads_served(reads, released or ())
        if ring.created():
            landing.make_created(ring.take_created())
        if released and answers.windows:
            for fh in released:
                answers.invalidate(fh=fh)
        if released and ro:
            for fh in released:  # (in the order they came)
                if fh in ro:
                    self.release(fh)
        if not landing.live or ring.landed():
            self.ops.staging.claim()
            landing.offer()
        if looked and answers.lookup_next:
            # (the names after the last one answered in each directory, once the writes are
            # recorded: a file's size is what its landed writes made it)
            following, answers.lookup_next = answers.lookup_next, {}
            for parent, name in following.items():
                answers.prepare_lookups(parent, name)

    def make_opened(self, opened: list[tuple]) -> None:
        """Make the handles of the OPENs the queue threads answered from prepared windows, in
        order, as the OPEN would have made them here (Handles.open_prepared); the window is the
        handle's now (it may be dropped already: its READs come here then)."""
        ops, answers = self.ops, self.answers
        for fh, nodeid, flags, uid, gid, pid in opened:
            answers.unprepare(fh)
            w = answers.windows.get(fh)
            try:
                ops.handles.open_prepared(w[0] if w is not None else ops.inode(nodeid), fh,
                                          flags, Context(uid, gid, pid))
            except Exception:  # (a defect: the kernel has the file open already)
                log.exception("an open answered by a queue thread cannot be made (inode %d): "
                              "its reads fail", nodeid)
                self.opens_not_made += 1
                answers.invalidate(fh=fh)  # (its READs come here: EBADF)

    def reads_served(self, reads: list, released=()) -> None:
        """The READs the queue threads answered from windows, accounted for as if answered
        here (Handles.read_served); a window read past its middle is opened anew from where
        its reader got to, when the cache holds the bytes past its end by now (the
        readahead those READs started), unless its handle was released."""
        ops = self.ops
        self.tally(len(reads))
        by_handle: dict[int, list] = {}
        for fh, off, size, n in reads:
            by_handle.setdefault(fh, []).append((off, size, n))
        for fh, served in by_handle.items():
            try:
                ops.handles.read_served(fh, served)
            except Exception:  # (accounting only: the READs were answered)
                log.exception("accounting for the READs of handle %d", fh)
            end = max(off + n for off, _, n in served)
            w = self.answers.windows.get(fh)
            if (w is not None and end > (w[2] + w[3]) // 2 and w[3] < w[0].size
                    and fh not in released and ops.reader.has(w[1], w[3])):
                self.answers.open_window(fh, end)
