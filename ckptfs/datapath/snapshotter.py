"""The index snapshot of a mount: the index kept near the size of the tree it describes.

Once writers have been idle for --clean-idle seconds (at once for a tree whose fresh index is
under SNAPSHOT_ANYTIME_BYTES) and the index is --index-snapshot-ratio times the size a fresh
index of the tree would have, a process of its own (mover.snapshot_main) replays the index's
committed bytes into a second tree and writes that tree's records into a fresh index beside
it; the flusher puts it in place between two commits (format/index.py: the groups committed
meanwhile are copied after it). Writers never wait for it; commits wait for the copy and
rename (milliseconds). The maintainer (datapath/maintainer.py) decides when; trio thread.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable

import trio

from ckptfs.datapath import mover
from ckptfs.datapath.cleaner import ESTIMATE_SLICE, SHARED_GRACE_S
from ckptfs.format.index import discard_fresh
from ckptfs.namespace import ROOT_INO

log = logging.getLogger("ckptfs.cleaner")

# An index snapshot of a tree this small (its fresh index) takes milliseconds: it does not
# wait for the writers to be idle.
SNAPSHOT_ANYTIME_BYTES = 1 << 20
# More than a fresh index holds per inode (an INODE record with its name and an EXTENT): before
# the first estimate, what says a tree is that small
FRESH_BYTES_PER_INODE = 160
KILL_WAIT_S = 5.0  # how long a cancelled snapshot's process is given to end after SIGKILL


class Snapshotter:
    """Writes index snapshots of this writer's index (see the module docstring): `ratio`
    and `min_bytes` are --index-snapshot-ratio and --index-snapshot-min. `settled()`: the
    own whiteouts (XUNLINK records) whose entries their writers have removed, as (writer,
    ino); a snapshot leaves out those known longer than another mount's view can lag."""

    def __init__(self, ns, flusher, writer_id: str, *, ratio: float = 2.0,
                 min_bytes: int = 64 << 10,
                 settled: Callable[[], set[tuple[str, int]]] = lambda: set()) -> None:
        self.ns = ns
        self.flusher = flusher
        self.writer_id = writer_id
        self.ratio = ratio
        self.min_bytes = min_bytes
        self.settled = settled
        self.doing = "idle"
        self.fresh_bytes: int | None = None  # a fresh index's size: estimated, or the last
        self.fresh_inodes = 0  # the tree's inodes when fresh_bytes was taken
        self.snapshots = 0
        self.seconds = 0.0  # the last one's
        self.peak_rss = 0  # the last one's process: its peak resident memory
        self.settled_since: dict[tuple[str, int], float] = {}

    def anytime(self) -> bool:
        """Whether the tree is so small that a snapshot need not wait for idle writers (a job
        that saves every few seconds may never leave them idle for long), also before its
        first estimate."""
        fresh = self.fresh_bytes if self.fresh_bytes is not None else \
            len(self.ns.inodes) * FRESH_BYTES_PER_INODE
        return fresh < SNAPSHOT_ANYTIME_BYTES

    def expected(self) -> float:
        """The fresh index's size as last taken, scaled down to the inodes the tree has now
        when it has fewer: a job's tree is largest while a new checkpoint is saved and the
        old ones are not deleted yet, and an estimate taken then would let the index grow to
        ratio times that larger tree's."""
        n = len(self.ns.inodes)
        if self.fresh_inodes and n < self.fresh_inodes:
            return self.fresh_bytes * n / self.fresh_inodes
        return self.fresh_bytes

    async def due(self) -> bool:
        idx = self.flusher.index
        ratio = self.ratio
        if not ratio or idx.size < self.min_bytes:
            return False
        if self.fresh_bytes is None or idx.size > ratio * self.expected():
            # (the tree may have grown or shrunk: look again)
            self.fresh_bytes, self.fresh_inodes = await self.estimate()
        return idx.size > ratio * self.fresh_bytes

    async def estimate(self) -> tuple[int, int]:
        """About the size of a fresh index of the own tree, and the inodes it has, in slices
        (other tasks run in between: a slice of 2,000 inodes takes ~1 ms)."""
        ns = self.ns
        xs = list(ns.inodes.values())
        total = 0
        for i in range(0, len(xs), ESTIMATE_SLICE):
            total += mover.fresh_index_bytes(xs[i:i + ESTIMATE_SLICE], ns)
            await trio.sleep(0)
        return total, len(xs)

    async def snapshot(self) -> None:
        """Write an index snapshot and have the flusher put it in place."""
        idx = self.flusher.index
        upto, before = idx.size, idx.size
        root = self.ns.inodes[ROOT_INO]
        now, since = time.monotonic(), self.settled_since
        settled = self.settled()
        for key in list(since):
            if key not in settled:
                del since[key]
        for key in settled:
            since.setdefault(key, now)
        drop = frozenset(k for k, t in since.items() if now - t >= SHARED_GRACE_S)
        self.doing = "writing an index snapshot"
        t0 = time.perf_counter()
        try:
            fresh, size, version = await self._process(mover.snapshot_args(
                idx.path, upto, self.writer_id, os.getuid(), os.getgid(), root.atime_ns, drop,
                os.getpid(), idx.where.fd), idx.where.fd)
        except BaseException:  # (failed, or cancelled at unmount: no stray fresh index left;
            # the process is gone by now)
            discard_fresh(idx.where, idx.name)
            raise
        finally:
            self.doing = "idle"
        self.seconds = time.perf_counter() - t0
        done = trio.Event()
        result: list = []

        def swapped(err) -> None:
            result.append(err)
            done.set()
        self.doing = "putting an index snapshot in place"
        self.flusher.swap_index(os.path.basename(fresh), upto, version, swapped)
        try:
            await done.wait()
        finally:
            self.doing = "idle"
        if result[0] is not None:
            raise result[0]
        if drop:  # (gone from the index: from memory too)
            self.ns.xunlinks = [r for r in self.ns.xunlinks if (r.writer, r.ino) not in drop]
            for key in drop:
                del since[key]
        self.snapshots += 1
        self.fresh_bytes, self.fresh_inodes = size, len(self.ns.inodes)
        log.info("index snapshot: %d -> %d bytes (%.3f s to write, commits held %.3f s)",
                 before, idx.size, self.seconds, self.flusher.stats.swap_seconds)

    async def _process(self, args: bytes, dir_fd: int) -> tuple[str, int, int]:
        """mover.build_snapshot in a process of its own (mover.py says why), started from
        this thread: the process dies with the thread that started it (PR_SET_PDEATHSIG),
        and the trio thread lives as long as the daemon (a worker thread may end first).
        Waited for in a worker thread; cancelled, the process is killed."""
        cmd, env, cwd = mover.snapshot_command()
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, cwd=cwd, close_fds=True,
                                pass_fds=(dir_fd,))
        try:
            pidfd = os.pidfd_open(proc.pid)
        except OSError:  # (out of descriptors, say: no snapshot this time)
            proc.kill()
            proc.communicate()
            raise

        def wait() -> tuple[bytes, int]:
            try:
                proc.stdin.write(args)
                proc.stdin.close()
            except BrokenPipeError:  # (it ended before it read them: its output says why)
                pass
            out = proc.stdout.read()
            proc.stdout.close()
            proc.wait()
            return out, proc.returncode
        try:
            out, rc = await trio.to_thread.run_sync(wait, abandon_on_cancel=True)
        finally:
            if proc.returncode is None:  # (cancelled: the waiting thread reaps it; a pidfd
                # names this process even once it is reaped, never one with its number since)
                try:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                # Gone before the caller removes what it wrote (the pidfd turns readable
                # when the process has ended): else its fresh index could come after.
                with trio.CancelScope(shield=True, deadline=trio.current_time() + KILL_WAIT_S):
                    await trio.lowlevel.wait_readable(pidfd)
            os.close(pidfd)
        fresh, size, version, self.peak_rss = mover.snapshot_result(out, rc)
        return fresh, size, version
