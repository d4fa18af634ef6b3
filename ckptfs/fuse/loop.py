"""A cheaper wait for the next FUSE request than pyfuse3's own.

pyfuse3's request loop (one trio task per request being served, up to `max_tasks`) calls the
module-level coroutine `pyfuse3._wait_fuse_readable` before every `read()` of /dev/fuse. Its
version takes a `trio.Lock` (two scheduler passes even when free), then registers the fd with
epoll and parks until it is readable, for every request, also when the next request is already
queued. With small files (~6 requests per `torch.save`) that wait is ~35-40% of the daemon's
main thread (measured with py-spy).

`RequestWait` replaces it:
- fast path: if /dev/fuse already has a request (a zero-timeout `poll`), return at once, with
  no await between the check and pyfuse3's `read()` (trio runs one task at a time, and only this
  thread reads the fd, so the request is still there). After `FAST_STREAK` fast returns in a row
  the task passes through the scheduler once (a checkpoint: the other tasks that can run, run,
  so a stream of requests cannot starve flusher completions, timers, signals), and then looks
  again. (It does not take the slow path there: that would be a park in epoll, i.e. a sleep
  and a wake-up, for one in 16 requests even while the client keeps sending them.)
- idle work: if nothing is queued yet and writes left checksums owing (the staging's
  `Checksums`), sum them in 64 KiB slices, looking for a request between slices; a request
  that comes meanwhile waits at most one slice (~5 us). The writer thus never waits for the
  CRC32C of its own bytes (~85 us per MiB, cold from the kernel's copy): the sums are taken
  between a reply and the writer's next request, and while torch.save serialises its next
  tensor (a 2.1 GB save 2.40 -> 2.31 s; docs/performance-notes.md).
- spin (`--request-spin`, default 250 us): if nothing is queued yet, keep polling for a short
  while before parking. A client in the middle of a `torch.save` / `torch.load` sends its next
  request tens of microseconds after our reply; catching it here saves the park, the epoll
  wait and the wake-ups on both sides, which dominate a small request's round trip on a VM
  (tiny WRITE 41-59 -> 23-41 us; 3,000 small files saved 2.38 -> 1.69 s;
  docs/performance-notes.md). The price is at most that long of one CPU per request while
  requests come; an idle mount does not spin, and spins that keep missing back off.
- slow path: one task at a time parks in `wait_readable` (trio allows one waiter per fd); the
  others wait in a ParkingLot. After waking it checks again, because a task on the fast path may
  have taken the request meanwhile (a blocking read on an empty /dev/fuse would stall the loop).
- closing: `close()` (called right before pyfuse3.terminate()) makes every waiting and later
  call return False, and terminate() wakes the task in `wait_readable` with ClosedResourceError;
  pyfuse3's loop then ends (its own wait checks the session's exit flag, which Python cannot
  read). An unmount makes the fd readable (an error), and pyfuse3's `read()` then ends the loop
  itself.

pyfuse3 counts idle tasks inside its own wait to decide when to start another one; with this
wait it sees none idle and starts tasks up to `max_tasks`, and each task that has read once
keeps libfuse's ~1 MiB receive buffer. The daemon therefore runs pyfuse3.main() with
`MAX_TASKS` (32): at most that many requests in service at once (handlers that wait for a
flush or a disk read hold one each) and at most ~32 MiB of receive buffers.

Bounds on other work: a task serves at most FAST_STREAK requests in a row without passing
through the scheduler (found queued or caught spinning, each spin at most `--request-spin`),
so other trio tasks (flush completions, timers, signals) wait at most that long; a spin that
catches nothing delays them by one spin time and then backs off.
"""

from __future__ import annotations

import logging
import os
import select
import time
from collections.abc import Callable

import pyfuse3
import trio

log = logging.getLogger("ckptfs")

FAST_STREAK = 16
MAX_TASKS = 32
NO_COUNTS = {"requests_found_queued": 0, "requests_waited_for": 0, "requests_caught_spinning": 0,
             "requests_caught_summing": 0, "checksum_bytes_summed_idle": 0,
             "checksum_bytes_summed_landing": 0,
             "writes_in_place": 0, "bytes_in_place": 0, "bytes_copied_in": 0,
             "reads_direct": 0, "requests_forwarded": 0, "requests_answered_here": 0}


def fuse_fds() -> set[int]:
    """The process's open /dev/fuse descriptors (pyfuse3 does not expose its own)."""
    fds = set()
    try:
        for name in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                    fds.add(int(name))
            except OSError:
                continue
    except OSError:
        pass
    return fds


class RequestWait:
    def __init__(self, fd: int, spin_s: float = 0.0, idle_work=None) -> None:
        """`idle_work`: work for the moments no request waits, the staging's owed checksums
        (datapath/staging.Checksums; None: none)."""
        self.fd = fd
        self.wait_fd = fd  # what the slow path sleeps on (readable: a request may wait)
        self.spin_s = spin_s
        self.idle_work = idle_work
        self.poller = select.poll()
        self.poller.register(fd, select.POLLIN)
        self.busy = False  # a task is in wait_readable(fd)
        self.lot = trio.lowlevel.ParkingLot()
        self.closed = False
        self.streak = 0
        self.fast = 0  # requests found waiting (no epoll registration, no scheduler pass)
        self.slow = 0
        self.spun = 0
        self.misses = 0  # spins in a row that caught nothing
        self.caught_summing = 0  # requests that came while owed checksums were summed
        self.skip = 0  # waits left that do not spin (back-off after misses)

    def counts(self) -> dict:
        """For the mount's status: requests found queued (including those caught spinning
        or while owed checksums were summed), waited for in epoll, caught spinning, caught
        summing; and the checksum bytes summed while no request waited, and those the queue
        threads landed, summed in C before they were recorded."""
        work = self.idle_work
        return dict(NO_COUNTS, requests_found_queued=self.fast, requests_waited_for=self.slow,
                    requests_caught_spinning=self.spun,
                    requests_caught_summing=self.caught_summing,
                    checksum_bytes_summed_idle=work.paid_idle if work is not None else 0,
                    checksum_bytes_summed_landing=(work.taken_landing if work is not None
                                                   else 0))

    def probe(self, timeout: int) -> bool:
        """Whether a request waits (`timeout`: poll's, always 0 here)."""
        return bool(self.poller.poll(timeout))

    def park(self, sleeping: bool) -> bool:
        """Called before the loop sleeps on `wait_fd` (True) and after (False); True: a
        request came meanwhile (do not sleep). /dev/fuse alone needs nothing here."""
        return False

    def _ready(self) -> bool:
        return self.probe(0)

    def _idle(self) -> bool:
        """Sum owed checksums slice by slice (a few microseconds each) until none are owed
        or a request is waiting; True in the second case. The writer whose request comes
        next waits at most one slice, instead of the whole sum before its previous reply."""
        work = self.idle_work
        if work is None or not work.owed:
            return False
        poll = self.probe
        while work.owed:
            work.pay_idle()
            if poll(0):
                self.caught_summing += 1
                return True
        return False

    def _spin(self) -> bool:
        """Poll for up to spin_s: while a client is busy writing or reading, its next request
        usually comes within tens of microseconds of our reply, and catching it here saves
        the park / epoll / wake-up round (costly under virtualisation). Spins that keep
        missing (a client that computes between requests) back off: after n misses in a row
        the next 2**n - 1 waits (at most 255) do not spin; a catch resets that."""
        if self.spin_s <= 0:
            return False
        if self.skip:
            self.skip -= 1
            return False
        end = time.perf_counter() + self.spin_s
        poll, work = self.probe, self.spin_work
        while time.perf_counter() < end:
            if poll(0):
                self.spun += 1
                self.misses = 0
                return True
            work()
        self.misses = min(self.misses + 1, 8)
        self.skip = (1 << self.misses) - 1
        return False

    def quiesce(self) -> None:
        """Called when the loop has ended, before the unmount's last commit: work held back
        for later is done now (FastPath's releases); none here."""

    def settle(self) -> None:
        """Take in what was answered without the trio thread (see FastPath.settle): the idle
        sealer's tick and the status call it; none here."""

    def spin_work(self) -> None:
        """Work done between polls while the loop spins (a few tens of microseconds at most
        at a time; see FastPath.spin_work); none here."""

    def sleep_work(self) -> None:
        """Work held back that must not wait for the next request: done before a task sleeps,
        in epoll or behind the task that does (see FastPath.sleep_work); none here."""

    def detach(self) -> None:
        """Undo what install() changed besides the hook (nothing here; see FastPath)."""

    def close(self) -> None:
        """Call before pyfuse3.terminate(): from now on every wait returns False (pyfuse3's own
        wait checks the session's exit flag, which Python cannot read)."""
        self.closed = True
        self.lot.unpark_all()

    async def __call__(self) -> bool:
        if self.closed:
            return False
        if self.streak >= FAST_STREAK:
            # a scheduler pass, so the other tasks (flusher completions, timers) run; not a
            # park in epoll: the client's next request is usually on its way
            self.streak = 0
            await trio.lowlevel.checkpoint()
            if self.closed:
                return False
        if self._ready() or self._idle() or self._spin():
            self.streak += 1
            self.fast += 1
            return True
        self.streak = 0
        self.slow += 1
        # (the task sleeping on wait_fd did its park(True) before this task held anything
        # back, and may not wake: another task may take the request that made it readable)
        self.sleep_work()
        while self.busy:
            await self.lot.park()
            if self.closed:
                return False
        self.busy = True
        try:
            while True:
                if not self.park(True):
                    try:
                        await trio.lowlevel.wait_readable(self.wait_fd)
                    finally:
                        self.park(False)
                if self.closed:
                    return False
                if self._ready():
                    return True
        except trio.ClosedResourceError:
            self.closed = True
            return False
        finally:
            self.busy = False
            if self.closed:
                self.lot.unpark_all()
            else:
                self.lot.unpark()


_PYFUSE3_WAIT = getattr(pyfuse3, "_wait_fuse_readable", None)


# The pyfuse3 releases whose private request wait (`_wait_fuse_readable`, called with no
# arguments, awaited, returning once /dev/fuse is readable) this module replaces; any other
# release keeps its own wait.
PYFUSE3_HOOKED = ((3, 3), (3, 4), (3, 5))


def pyfuse3_hookable() -> str | None:
    """None when this pyfuse3's request wait can be replaced, else the reason why not."""
    version = tuple(int(p) for p in pyfuse3.__version__.split(".")[:2] if p.isdigit())
    if version not in PYFUSE3_HOOKED:
        return f"pyfuse3 {pyfuse3.__version__} is not a release the request wait was built for"
    if not callable(_PYFUSE3_WAIT):
        return "pyfuse3 has no _wait_fuse_readable"
    return None


class WaitHook:
    """pyfuse3's request wait as a mount has it: `wait`, the one `install` put in place of
    pyfuse3's own (None: pyfuse3's own serves). The mount makes it before its handlers, which
    get it by constructor (the status shows the wait's figures; the idle sealer has it take in
    what the queue threads answered: fuse/ops.py), and installs the wait once pyfuse3.init()
    has opened the session."""

    def __init__(self) -> None:
        self.wait: RequestWait | None = None

    def install(self, spin_s: float, fds_before: set[int],
                attach: Callable[[int, float], RequestWait] = RequestWait) -> RequestWait | None:
        """Replace pyfuse3's wait, right after pyfuse3.init(); `fds_before`: fuse_fds() before
        pyfuse3.init() (the session's fd is the one that is new). `spin_s`: how long to poll
        for the next request before parking. `attach(fd, spin_s)` makes the wait:
        RequestWait only waits; the daemon passes the fast path's (fastpath.py: it reads
        requests itself and serves the common ones). Returns the installed wait, or None
        (pyfuse3's own wait stays) when this pyfuse3 cannot be hooked or the session's fd is
        not known for sure."""
        reason = pyfuse3_hookable()
        if reason:
            log.info("%s: its own request wait is used", reason)
            return None
        new = fuse_fds() - fds_before
        if len(new) != 1:
            log.info("/dev/fuse descriptor of the session not found (%d new): pyfuse3's own "
                     "request wait is used", len(new))
            return None
        self.wait = attach(new.pop(), spin_s)
        pyfuse3._wait_fuse_readable = self.wait
        return self.wait

    def uninstall(self) -> None:
        """Put pyfuse3's own wait back (after pyfuse3.main() returned); `wait` stays, for its
        figures."""
        if _PYFUSE3_WAIT is not None:
            pyfuse3._wait_fuse_readable = _PYFUSE3_WAIT
