"""The read path: file range -> pieces of runs -> staging memory or data logs.

Bytes still in staging are copied from memory. Durable runs are loaded whole from their data
log, checked against their CRC32C once, and kept in a bounded LRU cache, so the 128 KiB-1 MiB
READs of a sequential reader (torch.load) are served from memory after one large read. On the
first disk miss of a file, all of the file's durable runs that fit the prefetch budget are
loaded at once, with adjacent runs in a log coalesced into one large read, off the trio thread.
A run whose checksum does not match makes the read fail with EIO (other files are unaffected).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import OrderedDict

import trio
from crc32c import crc32c

from ckptfs import layout
from ckptfs.staging import ExtentMap, Run

log = logging.getLogger("ckptfs.reader")

COALESCE_GAP_BYTES = 64 * 1024
MAX_READ_BYTES = 64 * 1024 * 1024


class ChecksumError(OSError):
    def __init__(self, msg: str) -> None:
        super().__init__(errno.EIO, msg)


class Reader:
    def __init__(self, writer_dirs: dict[int, str], cache_bytes: int,
                 prefetch_bytes: int) -> None:
        self.writer_dirs = writer_dirs  # layer -> writer directory holding its data logs
        self.cache: OrderedDict[Run, memoryview] = OrderedDict()
        self.cache_bytes = cache_bytes
        self.cached = 0
        self.prefetch_bytes = prefetch_bytes
        self.fds: dict[tuple[int, int], int] = {}
        self.fd_lock = threading.Lock()
        self.loading: dict[Run, trio.Event] = {}
        self.bad: set[Run] = set()
        self.disk_reads = 0
        self.disk_bytes = 0
        self.load_seconds = 0.0  # wall time of disk loads (worker threads)
        self.wait_seconds = 0.0  # time READ handlers waited for loads

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.cache.clear()

    def _fd(self, layer: int, number: int) -> int:
        with self.fd_lock:  # worker threads
            fd = self.fds.get((layer, number))
            if fd is None:
                path = os.path.join(self.writer_dirs[layer], layout.data_log_name(number))
                try:
                    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except FileNotFoundError:
                    raise OSError(errno.EIO, f"data log {path} is missing") from None
                self.fds[(layer, number)] = fd
            return fd

    def invalidate(self, run: Run) -> None:
        mv = self.cache.pop(run, None)
        if mv is not None:
            self.cached -= len(mv)

    # ------------------------------------------------------------ reads
    async def read(self, emap: ExtentMap, off: int, size: int, file_size: int,
                   sequential: bool = True) -> bytes:
        """Bytes [off, off+size) of a file. `sequential`: the reader continues where it
        stopped, so the rest of the file is worth prefetching; random readers (DCP loading
        items by offset) get only the runs they touch."""
        hi = min(off + size, file_size)
        if off >= hi:
            return b""
        while True:
            pieces = emap.find(off, hi)
            # Fast path: one piece covering the whole request.
            if len(pieces) == 1 and pieces[0][0] == off and pieces[0][1] == hi - off:
                _, n, run, roff = pieces[0]
                src = self._source(run)
                if src is not None:
                    return bytes(src[roff:roff + n])
            out = bytearray(hi - off)
            missing = []
            for s, n, run, roff in pieces:
                src = self._source(run)
                if src is None:
                    missing.append(run)
                else:
                    out[s - off:s - off + n] = src[roff:roff + n]
            if not missing:
                return bytes(out)
            t0 = time.perf_counter()
            await self._load(emap, missing, off, sequential)
            self.wait_seconds += time.perf_counter() - t0

    def _source(self, run: Run) -> memoryview | None:
        mv = run.memory()
        if mv is not None:
            return mv
        mv = self.cache.get(run)
        if mv is not None:
            self.cache.move_to_end(run)
        return mv

    async def _load(self, emap: ExtentMap, missing: list[Run], off: int,
                    sequential: bool = True) -> None:
        for run in missing:
            if run in self.bad:
                raise ChecksumError(f"checksum mismatch in data log {run.log} at {run.loff}")
        want: dict[Run, None] = dict.fromkeys(missing)
        # Prefetch: the runs that follow in the file (sequential readers read on).
        budget = self.prefetch_bytes - sum(r.length for r in want)
        if budget > 0 and sequential:
            for _, _, run, _ in emap.find(off, off + self.prefetch_bytes):
                if budget <= 0:
                    break
                if (run not in want and run.memory() is None and run not in self.cache
                        and run not in self.loading):
                    want[run] = None
                    budget -= run.length
        wait = [self.loading[r] for r in want if r in self.loading]
        todo = [r for r in want if r not in self.loading and r.log >= 0]
        if todo:
            ev = trio.Event()
            for r in todo:
                self.loading[r] = ev
            try:
                loaded, bad = await trio.to_thread.run_sync(self._read_runs, todo)
            finally:
                for r in todo:
                    self.loading.pop(r, None)
                ev.set()
            for run, mv in loaded:
                self._insert(run, mv)
            if bad:
                self.bad.update(bad)
        for ev in wait:
            await ev.wait()
        for run in missing:
            if run in self.bad:
                raise ChecksumError(f"checksum mismatch in data log {run.log} at {run.loff}")
            if run.log < 0 and run.memory() is None:
                raise OSError(errno.EIO, "run lost: neither in staging nor in a data log")

    def _insert(self, run: Run, mv: memoryview) -> None:
        if run in self.cache:
            return
        self.cache[run] = mv
        self.cached += len(mv)
        while self.cached > self.cache_bytes and len(self.cache) > 1:
            _, old = self.cache.popitem(last=False)
            self.cached -= len(old)

    def _read_runs(self, runs: list[Run]) -> tuple[list[tuple[Run, memoryview]], list[Run]]:
        """Worker thread: read runs with coalesced preads, verify checksums."""
        t0 = time.perf_counter()
        try:
            return self._read_runs_timed(runs)
        finally:
            self.load_seconds += time.perf_counter() - t0

    def _read_runs_timed(self, runs: list[Run]) -> tuple[list[tuple[Run, memoryview]], list[Run]]:
        runs = sorted(runs, key=lambda r: (r.layer, r.log, r.loff))
        groups: list[list[Run]] = []
        for r in runs:
            g = groups[-1] if groups else None
            if (g and g[0].log == r.log and g[0].layer == r.layer and r.loff >= g[-1].loff
                    and r.loff - (g[-1].loff + g[-1].length) <= COALESCE_GAP_BYTES
                    and r.loff + r.length - g[0].loff <= MAX_READ_BYTES):
                g.append(r)
            else:
                groups.append([r])
        loaded: list[tuple[Run, memoryview]] = []
        bad: list[Run] = []
        for g in groups:
            start = g[0].loff
            end = max(r.loff + r.length for r in g)
            buf = bytearray(end - start)
            fd = self._fd(g[0].layer, g[0].log)
            got = 0
            while got < len(buf):
                n = os.preadv(fd, [memoryview(buf)[got:]], start + got)
                if n == 0:
                    break
                got += n
            self.disk_reads += 1
            self.disk_bytes += got
            mv = memoryview(buf)
            for r in g:
                a = r.loff - start
                piece = mv[a:a + r.length]
                if a + r.length > got or (not r.verified and crc32c(piece) != r.crc):
                    log.error("checksum mismatch: data log %d offset %d length %d",
                              r.log, r.loff, r.length)
                    bad.append(r)
                    continue
                r.verified = True
                loaded.append((r, piece))
        return loaded, bad
