"""Interrupts: a request whose caller is being killed is answered at once.

Once the daemon has read a request, the kernel waits for its answer, also after SIGKILL: a
process waiting in ckptfs for a backing store that stopped answering could not even be killed.
The requests that can wait that long are *held* here while they wait, each under its unique,
with what answering it early takes:

- a WRITE waiting for staging space (fuse/inplace.py; the flusher frees space, so the
  store): its wait is cancelled and the fast path answers it with the bytes it had recorded
  (a short write; EINTR if none); what was recorded stays written and is made durable.
- a READ waiting for the disk (datapath/readcache.py: chunk loads in its loader threads): its wait
  is cancelled and it is answered EINTR; the loader thread's disk read goes on, and a later read
  of the same bytes waits for it or finds them cached.
- a barrier (fsync, fsyncdir, the sync xattr: ops._barrier), which the fast path hands to
  pyfuse3: it is answered EINTR here at once and libfuse's later answer is dropped; the
  handler's wait for the barrier ends (one that has not started does not wait), so its request
  task serves requests again; the barrier itself goes on in the daemon, and what was written
  before it is made durable once the store answers.

A held request is answered early only when its caller is being killed (dying()); other signals
change nothing (reads and writes of regular files do not fail with EINTR). Two things find
it: the kernel's FUSE_INTERRUPT (sent at the first signal), and a sweep every SWEEP_S over the
callers of the requests held since its last look, while any is held (a fatal signal after a
non-fatal one sends no second INTERRUPT, and nobody reads one while every request task is
held).

A wait finds its request as the one the current trio task serves: the fast path says which
(serve(); forwarded() for a barrier, whose handler pyfuse3 runs in the task that handed it
over). Only the fast path reads requests itself, so only it can answer early: it starts this
when it takes over /dev/fuse and stops it when it closes; otherwise every wait here is one
nobody cancels.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import logging
import signal

import trio

log = logging.getLogger("ckptfs")

SWEEP_S = 0.5  # how often the callers of held requests are looked at
SIGKILL_BIT = 1 << (signal.SIGKILL - 1)
# signals whose default action dumps core: the kernel does not turn them into SIGKILL (it does
# for the other fatal ones), so a thread waiting for our answer is not woken for them
CORE_SIGNALS = sum(1 << (getattr(signal, name) - 1) for name in (
    "SIGQUIT", "SIGILL", "SIGTRAP", "SIGABRT", "SIGBUS", "SIGFPE", "SIGSEGV", "SIGXCPU",
    "SIGXFSZ", "SIGSYS") if hasattr(signal, name))
_proc_warned = False

# (unique, caller's pid) of the request the current task serves, for the waits inside it
_SERVING: contextvars.ContextVar = contextvars.ContextVar("ckptfs_serving", default=None)


def dying(pid: int) -> bool:
    """Whether thread `pid` is being killed: SIGKILL is pending (kill -9, and the fatal signals
    the kernel turns into it), or a signal that dumps core is pending, not blocked, ignored,
    caught or seen by a tracer (it kills the process as soon as its request returns). A caller
    we cannot see (pid 0: another pid namespace; /proc hiding it) is not taken for dying:
    answering it early would fail a live process's write. (A core-dumping signal pending for
    the whole process could still be taken by another thread in sigwaitinfo/signalfd, which
    must block it; then the early answer was not needed. Rare, and harmless but for EINTR.)"""
    global _proc_warned
    if pid <= 0:
        return False
    fields = {}
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                key, _, value = line.partition(b":")
                if key in (b"SigPnd", b"ShdPnd", b"SigBlk", b"SigIgn", b"SigCgt"):
                    fields[key] = int(value, 16)
                elif key == b"TracerPid":
                    fields[key] = int(value)
    except (OSError, ValueError) as exc:
        if not _proc_warned:
            _proc_warned = True
            log.warning("interrupted request: cannot read /proc/%d/status (%s); requests of "
                        "killed processes wait for the backing store", pid,
                        getattr(exc, "strerror", None) or exc)
        return False
    pending = fields.get(b"SigPnd", 0) | fields.get(b"ShdPnd", 0)
    if pending & SIGKILL_BIT:
        return True
    if fields.get(b"TracerPid", 1) != 0:
        return False  # (a tracer may take the signal away)
    live = ~(fields.get(b"SigBlk", -1) | fields.get(b"SigIgn", -1) | fields.get(b"SigCgt", -1))
    return bool(pending & CORE_SIGNALS & live)


class _Held:
    """A held request: its caller, the wait to cancel (None while it does not wait), and
    whether pyfuse3 serves it (then it is answered here; else the fast path answers it)."""

    __slots__ = ("pid", "scope", "forwarded")

    def __init__(self, pid: int, scope: trio.CancelScope | None, forwarded: bool) -> None:
        self.pid, self.scope, self.forwarded = pid, scope, forwarded


class Interrupts:
    """The interrupt state of a mount, created once by the daemon; the fast path, the
    handlers' barriers (ops.py) and the reader's disk waits share it."""

    def __init__(self) -> None:
        self.held: dict[int, _Held] = {}  # unique -> what answering it early takes
        self.answered: set[int] = set()  # forwarded, answered here: libfuse's answer is dropped
        self.count = 0  # requests answered early
        self.notices = 0  # FUSE_INTERRUPTs received (a caller got a signal)
        self.reply = None  # (unique, errno) -> the reply written; None: nothing is answered
        self.sweeping = False

    def start(self, reply) -> None:
        """The fast path reads the requests now; `reply(unique, errno)` answers one."""
        self.reply = reply

    def stop(self) -> None:
        """Nothing is answered early any more (the fast path closes: the daemon shuts down)."""
        self.reply = None

    # ------------------------------------------------------------ the requests
    @staticmethod
    def serve(unique: int, pid: int) -> contextvars.Token:
        """The current task serves request `unique` of `pid` (the fast path; until served())."""
        return _SERVING.set((unique, pid))

    @staticmethod
    def served(token: contextvars.Token) -> None:
        _SERVING.reset(token)

    def forwarded(self, unique: int, pid: int) -> None:
        """The current task hands barrier `unique` to pyfuse3, which serves it in this task:
        held until libfuse answers (replied())."""
        if self.reply is None:
            return
        _SERVING.set((unique, pid))
        self.held[unique] = _Held(pid, None, forwarded=True)
        self._sweep_soon()

    @staticmethod
    def done() -> None:
        """The current task is back in the request wait: it serves nothing now."""
        _SERVING.set(None)

    def replied(self, unique: int) -> bool:
        """libfuse answered `unique`: no longer held. True if it was answered here already
        (libfuse's answer is to be dropped)."""
        self.held.pop(unique, None)
        if unique in self.answered:
            self.answered.discard(unique)
            return True
        return False

    @contextlib.contextmanager
    def waiting(self):
        """A wait of the request the current task serves, which may be long: yields its
        CancelScope, cancelled when the caller is being killed (the caller of this answers what
        that means: scope.cancelled_caught). A barrier answered here already starts cancelled
        (scope.cancel_called: it need not wait). Any other wait is one nobody cancels."""
        scope = trio.CancelScope()
        request = _SERVING.get()
        held = self.held.get(request[0]) if request is not None else None
        if held is not None and held.forwarded:  # a barrier, not answered yet
            held.scope = scope
            try:
                with scope:
                    yield scope
            finally:
                held.scope = None
            return
        if request is not None and request[0] in self.answered:
            scope.cancel()
        elif request is not None and self.reply is not None:  # the fast path's: held meanwhile
            unique = request[0]
            self.held[unique] = _Held(request[1], scope, forwarded=False)
            self._sweep_soon()
            try:
                with scope:
                    yield scope
            finally:
                del self.held[unique]
            if scope.cancelled_caught:
                self.count += 1
            return
        with scope:
            yield scope

    # ------------------------------------------------------------ answering early
    def interrupt(self, unique: int) -> None:
        """FUSE_INTERRUPT for `unique`: a held request is answered if its caller is being
        killed (if not, the sweep looks again). An INTERRUPT for any other request is dropped
        (pyfuse3 cannot act on one; libfuse would keep it and answer it EAGAIN later, which
        makes the kernel send it again)."""
        self.notices += 1
        self.answer_if_dying(unique)

    def answer_if_dying(self, unique: int) -> None:
        """Answer held request `unique` now if its caller is being killed: the fast path's
        wait is cancelled (the fast path answers); a barrier is answered EINTR here and its
        handler's wait, if it waits, is cancelled."""
        held = self.held.get(unique)
        if held is None or self.reply is None or not dying(held.pid):
            return
        if not held.forwarded:
            held.scope.cancel()  # (counted in waiting() if it was still waiting)
            return
        del self.held[unique]
        self.answered.add(unique)
        self.reply(unique, errno.EINTR)
        self.count += 1
        if held.scope is not None:
            held.scope.cancel()  # its task serves requests again

    def _sweep_soon(self) -> None:
        if not self.sweeping:
            self.sweeping = True
            trio.lowlevel.spawn_system_task(self._sweep)

    async def _sweep(self) -> None:
        """While requests are held, look every SWEEP_S at the callers of those held since the
        last look, and answer the ones being killed; ends when none is held."""
        seen: set[int] = set()
        try:
            while self.reply is not None:
                await trio.sleep(SWEEP_S)
                held = set(self.held)
                if not held:
                    break
                for unique in held & seen:
                    try:
                        self.answer_if_dying(unique)
                    except Exception:  # a system task must not raise: it would end the daemon
                        log.exception("internal error looking at request %d", unique)
                seen = held
        finally:
            self.sweeping = False
