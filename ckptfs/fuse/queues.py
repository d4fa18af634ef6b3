"""The queue threads as the fast path runs them, and what takes in their work.

`QueueThreads` starts the queue threads (fuse/ring.py) right after the INIT reply went to the
kernel, when the negotiation (fuse/negotiation.py) settled on them, and stops them before
libfuse gets its /dev/fuse descriptor back. While they run it holds what the trio thread
leaves with them and takes in from them: the answer cache (fuse/answers.py), the landing
(fuse/landing.py: their WRITEs and CREATEs made real) and the intake (fuse/intake.py: what they
noted, taken in at every settle), and which request handed over came in which ring entry (its
answer goes there). Outside that time `ring`, `answers`, `landing` and `intake` are None.
While they run, the answer cache listens to the mount's change notices (what the namespace and
the refresher tell of the tree's changes: namespace.ChangeNotices) and the ring to the
flusher's error notices (datapath/flusher.ErrorNotices); both are the mount's, given here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ckptfs.datapath.flusher import ErrorNotices
from ckptfs.fuse import ring as fring
from ckptfs.fuse.answers import AnswerCache
from ckptfs.fuse.inplace import InPlaceWrites
from ckptfs.fuse.intake import Intake
from ckptfs.fuse.landing import Landing
from ckptfs.fuse.releases import Releases
from ckptfs.namespace import ChangeNotices

log = logging.getLogger("ckptfs")


class QueueThreads:
    """The queue threads' life on the trio thread's side: start, figures, stop."""

    def __init__(self, ops, entry_valid: tuple[int, int], writes: InPlaceWrites,
                 releases: Releases, change_notices: ChangeNotices,
                 flush_errors: ErrorNotices) -> None:
        """`ops`: the handlers (their tree, handles, reader); `entry_valid`: the mount's entry
        timeout as the protocol's; `writes`: the WRITEs the trio thread serves (landed ones
        are counted with them); `releases`: the RELEASEs' work held; `change_notices`: the
        tree's changes, told to the answer cache while they run; `flush_errors`: whether the
        flusher has an error, told to the ring while they run."""
        self.ops = ops
        self.entry_valid = entry_valid
        self.writes = writes
        self.releases = releases
        self.change_notices = change_notices
        self.flush_errors = flush_errors
        self.ring: fring.Ring | None = None
        self.answers: AnswerCache | None = None
        self.landing: Landing | None = None
        self.intake: Intake | None = None
        self.uniques: dict[int, int] = {}  # request unique -> its ring entry
        self.transport = "/dev/fuse"

    def start(self, fd: int, payload: int, dev: bool, spin_s: float,
              count_reads: Callable[[int], None]) -> fring.Ring | None:
        """Start them on /dev/fuse `fd` (`dev`) or on FUSE's io_uring queues, with entries of
        `payload` bytes, and wire up what takes in their work; `count_reads(n)`: counts the
        READs they answered from read windows with those the trio thread answered. The ring,
        not yet told to read /dev/fuse (Ring.go); None if they could not start."""
        try:
            ring = fring.Ring(fd, payload, spin_s, dev)
        except OSError as exc:
            # (the kernel then keeps every request on /dev/fuse: its queues never got ready)
            log.warning("%s: %s", "queue threads: requests are served by the daemon's loop"
                        if dev else "--fuse-uring: requests stay on /dev/fuse", exc.strerror)
            return None
        self.ring = ring
        ops = self.ops
        # (`settle`: after a look's changes, what they noted first)
        self.answers = AnswerCache(ring, ops, self.entry_valid, lambda: self.intake.settle())
        self.landing = Landing(ring, ops, self.answers, self.writes.count_landed)
        self.intake = Intake(ring, ops, self.answers, self.landing, self.releases.hold,
                             self.releases.now, count_reads)
        ops.reader.cache.land_lazily(True)  # (chunk loads land at every settle)
        self.change_notices.attach(self.answers)
        self.landing.start(self.entry_valid)
        self.flush_errors.attach(ring.flush_fails)  # (told the flusher's state now)
        self.transport = "/dev/fuse, queue threads" if dev else "io_uring"
        return ring

    def counts(self) -> dict:
        """Their figures for the status (while they run)."""
        return {**self.ring.counts(), "ring_creates_not_made": self.landing.creates_not_made,
                "ring_opens_not_made": self.intake.opens_not_made, **self.answers.counts()}

    def stop(self) -> bool:
        """Stop them; False if some did not stop."""
        ring, self.ring = self.ring, None
        if ring is None:
            return True
        self.landing.stop()
        self.answers.close()
        self.answers = self.landing = self.intake = None
        self.change_notices.detach()
        self.flush_errors.detach()
        self.ops.reader.cache.land_lazily(False)
        self.uniques.clear()
        try:
            ring.stop()
        except OSError as exc:
            log.error("queue threads: %s", exc.strerror)
            return False
        return True
