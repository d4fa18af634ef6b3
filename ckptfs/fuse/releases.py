"""RELEASEs answered at once, their work run later (trio thread only; one `Releases` per fast
path).

The kernel sends RELEASE after close() returned and does not wait for it; the fast path (or a
queue thread) answers it at once, and its work (Handles.release_now: the file's times into the
journal, the handle and maybe the inode let go) is held here. A small file's save sends
RELEASE and then, for the next file, GETATTR of the directory, LOOKUP and CREATE, which the
caller waits for and which do not depend on it: they go first (PAST_RELEASES), and the held
work runs while the caller serialises its next tensor: once no request came for
RELEASE_GRACE_S while the loop spins, before the loop sleeps, before any other request, and
before the unmount's last commit. docs/architecture.md, "What wakes the trio thread", has the
rules.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from ckptfs.fuse.protocol import FUSE_CREATE, FUSE_GETATTR, FUSE_INTERRUPT, FUSE_LOOKUP

log = logging.getLogger("ckptfs")

# Requests that do not depend on a RELEASE before them (a lookup, a new file, attributes): a
# RELEASE's work (its journal record) may wait until they are answered.
PAST_RELEASES = frozenset((FUSE_LOOKUP, FUSE_GETATTR, FUSE_CREATE, FUSE_INTERRUPT))
# How long no request comes before the releases' work is done while the loop spins: a small
# file's RELEASE is followed within ~25-75 us by the next file's GETATTR/LOOKUP/CREATE, then the
# caller serialises its tensor for ~100 us or more.
RELEASE_GRACE_S = 60e-6


class Releases:
    """The released handles whose work has not run yet, in the order they were released."""

    def __init__(self, release_now: Callable[[int], None]) -> None:
        """`release_now(fh)`: a released handle's work (Handles.release_now)."""
        self.release_now = release_now
        self.held: deque[int] = deque()
        self.held_at = 0.0  # when the first of them came (perf_counter)

    def hold(self, fhs) -> None:
        """Released handles whose work `run` does later (the grace counts from the first one
        held)."""
        if not self.held:
            self.held_at = time.perf_counter()
        self.held.extend(fhs)

    def before(self, opcode: int) -> None:
        """Before a request with `opcode` is served: the held work runs unless the request
        does not depend on it (PAST_RELEASES)."""
        if self.held and opcode not in PAST_RELEASES:
            self.run()

    def run(self, until: Callable[[int], bool] | None = None) -> None:
        """The held work, in order (`until`: stop when it says a request waits)."""
        held = self.held
        while held:
            self.now(held.popleft())
            if until is not None and until(0):
                break
        self.held_at = time.perf_counter()

    def now(self, fh: int) -> None:
        """A released handle's work, now; an error is logged, as ops.guarded does for the
        handlers: the RELEASE was answered already."""
        try:
            self.release_now(fh)
        except Exception:
            log.exception("internal error in release")

    def spin_work(self, probe: Callable[[int], bool]) -> None:
        """While the loop spins: the held work, once no request came for RELEASE_GRACE_S
        since the first of them (the caller is busy with its own work then); `probe` says
        whether a request waits."""
        if self.held and time.perf_counter() - self.held_at >= RELEASE_GRACE_S:
            self.run(probe)
