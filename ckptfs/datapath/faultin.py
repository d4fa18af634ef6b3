"""The staging pool faulted in and registered with the flusher's io engine, once the mount serves.

A mount does not wait for the kernel's page faults of its whole staging pool (hundreds of ms
on a VM whose memory is backed lazily): `FaultIn` leaves the pool unfaulted until the mount's
first write, or until it has served no READ for FAULT_IN_QUIET_S (`when_due`, a trio task);
then a thread of its own at the lowest priority faults it in, a segment at a time, and asks the
flusher thread to register it with its io engine (fixed buffers: that pins every page), which
the flusher does between two of its writes (`register`). Writes meanwhile go without fixed
buffers and fault their pages in themselves; no byte of a buffer changes (io.fault_in).
--no-populate leaves the pool unfaulted and unregistered.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import trio

from ckptfs.datapath.staging import Staging
from ckptfs.io import fault_in

log = logging.getLogger("ckptfs.flusher")

FAULT_IN_QUIET_S = 2.0  # a mount that served no READ this long faults its staging pool in
FAULT_IN_POLL_S = 0.25  # (until then: how often when_due looks)


class FaultIn:
    """The fault-in thread and the pool's registration. `enabled` False (--no-populate):
    nothing is faulted in or registered."""

    def __init__(self, staging: Staging, enabled: bool,
                 register_soon: Callable[[], None]) -> None:
        """`register_soon()`: asks the flusher thread to call `register` (from the fault-in
        thread, once the pool is faulted in)."""
        self.staging = staging
        self.enabled = enabled
        self.register_soon = register_soon
        self.fixed_count = 0  # (status: how many are registered, once the flusher has)
        self.faulted_bytes = 0  # (status: of the staging pool, so far)
        self._stop = threading.Event()
        self._go = threading.Event()  # (when_due says when)
        self.thread: threading.Thread | None = None

    async def when_due(self, reads: Callable[[], int]) -> None:
        """Trio task: let the fault-in thread start at the mount's first write, or once the
        mount has served no READ (`reads()`: the READs served so far) for FAULT_IN_QUIET_S.
        Not at once: a job that resumes reads its checkpoint right after the mount, and on a
        VM that hands freed memory back to its host (free page reporting) a 1 GB restore
        beside a freshly faulted pool took 1.90 s against 1.28 s beside an unfaulted one
        (performance-notes.md); a job that trains before its first save leaves the mount
        quiet long enough."""
        last, quiet_since = reads(), trio.current_time()
        while not self._go.is_set():
            await trio.sleep(FAULT_IN_POLL_S)
            now, n = trio.current_time(), reads()
            if n != last:
                last, quiet_since = n, now
            if self.staging.numbers or now - quiet_since >= FAULT_IN_QUIET_S:
                self._go.set()

    def start(self) -> None:
        """Flusher thread, at its start: the fault-in thread waits for when_due's word."""
        if self.enabled:
            self.thread = threading.Thread(target=self._run, name="ckptfs-fault-in")
            self.thread.start()

    def stop(self) -> None:
        """Flusher thread, at its end: the fault-in thread stops (the buffers are unmapped
        after the unmount) and is joined."""
        if self.thread is not None:
            self._stop.set()
            self._go.set()
            self.thread.join()

    def _run(self) -> None:
        """A thread of its own at the lowest priority (nice 19: it takes a CPU that the
        application and the daemon leave free)."""
        self._go.wait()
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
        for buf in self.staging.buffers:
            if self._stop.is_set():
                return
            fault_in(buf)
            self.faulted_bytes += len(buf)
        self.register_soon()

    def register(self, engine) -> None:
        """Flusher thread: the faulted pool registered with its io engine."""
        try:
            engine.register_buffers(self.staging.buffers)
        except Exception as exc:  # registration is an optimisation only
            log.info("buffer registration skipped: %s", exc)
        self.fixed_count = getattr(engine, "registered", 0)
