"""The read cache's loader threads: chunk reads of the data logs and checks of runs, off the
trio thread.

LOAD_THREADS threads (the read path's queue depth) take jobs from one queue: chunk loads in
the order asked for, and a check job that goes ahead of them and checks every run asked for
meanwhile (the sooner a run is checked, the less often a READ must check it itself). What
they complete goes back to the trio thread in batches: one call there for everything that
completed since the last one (Loaders._landed), not a trio task and a worker hand-off per
4 MiB chunk (those cost ~190 us of the trio thread each on this VM, a tenth of its work in a
restore: docs/performance-notes.md). With `lazy` (the fast path with its queue threads, which
lands them at every settle: before every request the trio thread serves and on the idle
tick), only a load a READ waits for is handed over by a call of its own: each such call is a
wake-up of the trio thread (~60 us of its CPU on this VM), once per chunk of a restore.

The threads are daemon threads: one stuck in a read of a store that hangs does not hold the
daemon's exit. One that ends on a defect says so: the mount is failed then (on_fatal), and
the loads no thread will take fail with EIO.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import deque

import trio

from ckptfs import failpoints

log = logging.getLogger("ckptfs.reader")

LOAD_THREADS = 4  # concurrent chunk reads (the queue depth of the read path)
_CHECK = object()  # the job that checks the runs asked for meanwhile


class Load:
    """A chunk load: bytes [lo, hi) of chunk `key` (layer, log, index) into the same bytes
    of `buf` (`ext`: the cached chunk's own buffer, which it widens), asked for while the
    log's generation was `gen`. The loader thread fills in `got` (the bytes read, fewer at
    the log's end) or `failed` (its exception); `done` is set on the trio thread once it
    landed (in the cache, or not: discarded, or failed with `error`, what its waiters get);
    `waited`: a READ waits for it (set under the loaders' `cond`)."""
    __slots__ = ("key", "buf", "gen", "lo", "hi", "ext", "got", "failed", "done", "error",
                 "waited")

    def __init__(self, key: tuple[int, int, int], buf, gen: int, lo: int, hi: int,
                 ext: bool) -> None:
        self.key = key
        self.buf = buf
        self.gen = gen
        self.lo = lo
        self.hi = hi
        self.ext = ext
        self.got = 0
        self.failed: BaseException | None = None
        self.done = trio.Event()
        self.error: OSError | None = None
        self.waited = False


class Loaders:
    """The loader threads (started at the first job), their queue and what they hand back.

    `pread(load)` (loader thread) reads a load's bytes and returns how many; `check(runs)`
    (loader thread) checks runs and returns how many it checked; on the trio thread,
    `loaded(load)` takes each completed load and `checked(batch, n)` each check job's result;
    `on_fatal(exc, where)` is told when a thread ends on a defect."""

    def __init__(self, pread, check, loaded, checked, on_fatal=None) -> None:
        self.pread = pread
        self.check = check
        self.loaded = loaded
        self.checked = checked
        self.on_fatal = on_fatal
        self.lazy = False
        # the jobs (loads in the order asked for; a check job goes first) and the checks
        # asked for, both under `cond`; what completed, handed to the trio thread by one call
        # (_landed) for all that completed before it runs (`posted` while that call is on
        # its way)
        self.cond = threading.Condition()
        self.jobs: deque = deque()
        self.checks: list[tuple[list, list]] = []  # (the runs, their chunks, pinned)
        self.check_queued = False
        self.done: list = []
        self.posted = False
        self.stopping = False
        self.threads: list[threading.Thread] = []
        self.token: trio.lowlevel.TrioToken | None = None

    def start(self) -> None:
        """Trio thread: the threads run, and hand their results to this trio run."""
        token = trio.lowlevel.current_trio_token()  # (the run that gets the results)
        if token is not self.token:
            self.token = token
            self.land()  # (results a run that ended left behind: their loads are still listed)
        if not self.threads and not self.stopping:
            self.threads = [threading.Thread(target=self._loader, name=f"ckptfs-load-{i}",
                                             daemon=True) for i in range(LOAD_THREADS)]
            for t in self.threads:
                t.start()

    def load(self, ld: Load) -> None:
        """Trio thread: queue a load (after start())."""
        with self.cond:
            self.jobs.append(ld)
            self.cond.notify()

    def check_soon(self, runs: list, keys: list) -> None:
        """Trio thread: have `runs` checked (their chunks `keys` pinned until checked()),
        ahead of the loads queued (after start())."""
        with self.cond:
            self.checks.append((runs, keys))
            if not self.check_queued:
                self.check_queued = True
                self.jobs.appendleft(_CHECK)
                self.cond.notify()

    def wait_for(self, loads) -> None:
        """Trio thread: a READ waits for these loads: each one that completes from now on
        is handed over at once."""
        with self.cond:
            for ld in loads:
                ld.waited = True

    def close(self) -> None:
        """Stop the threads; the loads queued fail (no READ waits for them once the mount
        ended). A thread stuck in a read of a store that hangs is left behind after 5 s."""
        with self.cond:
            self.stopping = True
            dropped = [j for j in self.jobs if j is not _CHECK]
            self.jobs.clear()
            self.cond.notify_all()
        for ld in dropped:
            ld.error = OSError(errno.EIO, "the reader is closed")
            ld.done.set()
        end = time.monotonic() + 5
        for t in self.threads:
            t.join(timeout=max(0.0, end - time.monotonic()))
        self.threads = []

    def land_lazily(self, on: bool) -> None:
        """Trio thread: set `lazy` (off: what it left completed lands now, and from then on
        every result calls the trio thread, one call for all that completed meanwhile)."""
        with self.cond:
            self.lazy = on
        if not on:
            self.land()

    def land(self) -> None:
        """Trio thread: land the loads and checks completed and not handed over yet (with
        `lazy`, those no READ waits for)."""
        if self.done:  # (read without the lock: a result appended meanwhile lands later)
            self._landed()

    def _landed(self) -> None:
        """Trio thread: what the threads completed since the last call, to loaded() and
        checked() (once closed, only the loads' waiters are let go)."""
        with self.cond:
            done, self.done = self.done, []
            self.posted = False
        for item in done:
            if self.stopping:
                if isinstance(item, Load):
                    item.done.set()
                continue
            try:
                if isinstance(item, Load):
                    self.loaded(item)
                else:
                    self.checked(*item)
            except Exception:  # (a defect; the other results still land)
                log.exception("a chunk load's result")

    def _loader(self) -> None:
        """A loader thread (_serve) that says so when it ends on a defect."""
        held: list = []  # (the job the thread works on: its waiters are told too)
        try:
            self._serve(held)
        except BaseException as exc:
            log.critical("a loader thread of the read path failed", exc_info=True)
            try:
                self.token.run_sync_soon(self._loader_failed, exc, held)
            except trio.RunFinishedError:
                pass

    def _loader_failed(self, exc: BaseException, held: list) -> None:
        """Trio thread: a loader thread is gone; the load it held and those queued fail (the
        threads left take the next ones), and the mount is failed (on_fatal)."""
        with self.cond:
            dropped = [j for j in [*held, *self.jobs] if j is not _CHECK]
            self.jobs.clear()
        for ld in dropped:
            ld.error = OSError(errno.EIO, f"the read path failed: {exc!r}")
            ld.done.set()
        if self.on_fatal is not None:
            self.on_fatal(exc, "a loader thread of the read path")

    def _serve(self, held: list) -> None:
        """Jobs until closed; each result goes into `done`, and the trio thread is called
        (_landed) unless a call is on its way already, or, with `lazy`, unless no READ waits
        for it (it lands at the fast path's next settle)."""
        cond, jobs = self.cond, self.jobs
        while True:
            with cond:
                while not jobs and not self.stopping:
                    cond.wait()
                if self.stopping:
                    return
                job = jobs.popleft()
                held[:] = [job]
                failpoints.hit("loader")
                if job is _CHECK:
                    batch, self.checks, self.check_queued = self.checks, [], False
            if job is _CHECK:
                runs = [r for rs, _ in batch for r in rs]
                try:
                    result = (batch, self.check(runs))
                except BaseException:  # (a defect: the pins still go)
                    log.exception("checking runs ahead")
                    result = (batch, 0)
            else:
                result = job
                while failpoints.held("loader"):  # (tests: a READ kept in flight)
                    time.sleep(0.01)
                try:
                    job.got = self.pread(job)
                except Exception as exc:
                    job.failed = exc
            with cond:
                self.done.append(result)
                held.clear()
                if self.posted or (self.lazy and (job is _CHECK or not job.waited)):
                    continue
                self.posted = True
            try:
                self.token.run_sync_soon(self._landed)
            except trio.RunFinishedError:  # (the run ended: the next one lands them)
                with cond:
                    self.posted = False
