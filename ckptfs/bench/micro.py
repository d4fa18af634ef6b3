"""`ckptfs bench micro`: the I/O study behind ckptfs, measured on the user's file system.

Seven dimensions, each a sweep of points written with the ckptfs io engines:

  aggregation  the same bytes as many small buffers (one request each) vs gathered (memcpy) into
               staging buffers of 64 KiB .. 256 MiB, vs synthetic equal 8 MiB buffers
  alignment    4 KiB-aligned vs misaligned offsets/lengths/addresses, buffered and O_DIRECT
               (misaligned O_DIRECT: the engine refuses it; shown refused and via a bounce buffer)
  coalescing   one request per small buffer (io_uring, pwrite) vs pwritev with up to IOV_MAX
               iovecs vs adjacent buffers merged into one request (no copy)
  mode         buffered (no fsync), buffered + fdatasync, O_DIRECT, at several request sizes
  depth        io_uring at queue depths 1 .. 64 vs posix pwrite, buffered + fdatasync and O_DIRECT
  workload     synthetic equal buffers vs real tensor-size distributions (models.py)
  metadata     file-per-tensor (create + write + close + fdatasync) vs one aggregated file

Every throughput counts durable bytes: a measured write phase ends with fdatasync (points named
"no fsync" are the one exception). Each point: a warm-up run, then ``--repeat`` runs, each into a
fresh file (deleted afterwards) after dropping the page cache (when root); the median is
reported. The source data sits in one pre-faulted arena and staging memory is one pre-faulted
pool, both allocated once: on this kind of VM first-touch page faults would otherwise dominate.
"""

from __future__ import annotations

import argparse
import csv
import errno
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ckptfs import api, bench
from ckptfs.bench import models
from ckptfs.io import EngineError, alloc_aligned, open_engine, open_file, probe_direct

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

ALIGN_BYTES = 4096
SYNTHETIC_BYTES = 8 * MiB          # the "synthetic large-buffer" request size
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
DIMENSIONS = ("aggregation", "alignment", "coalescing", "mode", "depth", "workload", "metadata")

# Verdict thresholds: "about half" = small-buffer writes at most 65% of synthetic;
# "restores" = the best aggregated point within 20% of synthetic.
HALF_RATIO_MAX = 0.65
RESTORE_RATIO_MIN = 0.80


# ---------------------------------------------------------------------------------- helpers
def fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= div and n % div == 0 or n >= 10 * div:
            v = n / div
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(n)} B"


def _drop_caches() -> bool:
    return bench.drop_caches(1)


def _machine(dirpath: str) -> dict[str, Any]:
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * KiB
    except OSError:
        pass
    st = os.stat(dirpath)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    m = api.mount_holding(dirpath)
    fs, src = (m.fstype, m.source) if m is not None else ("?", "?")
    rota = "?"
    name = os.path.basename(src)
    try:
        with open(f"/sys/block/{name}/queue/rotational") as f:
            rota = f.read().strip()
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "mem_bytes": mem, "kernel": platform.release(),
            "python": platform.python_version(), "fs": fs, "device": src, "dev": dev,
            "rotational": rota}


def _fill(buf: Any, nbytes: int) -> None:
    """Non-zero, non-repeating-per-page contents (touches every page once)."""
    mv = memoryview(buf)
    seed = bytes((i * 131 + 7) & 0xFF for i in range(4093))
    pos = min(len(seed), nbytes)
    mv[:pos] = seed[:pos]
    while pos < nbytes:
        n = min(pos, nbytes - pos)
        mv[pos:pos + n] = mv[:n]
        pos += n


def _layout(sizes: list[int], base: int = 0) -> list[tuple[int, int, int]]:
    """Buffers packed back to back: (arena offset, length, file offset)."""
    out, pos = [], 0
    for n in sizes:
        out.append((base + pos, n, pos))
        pos += n
    return out


def _prefix(specs: list, total: int) -> list:
    """The checkpoint's first tensors in save order, up to ``total`` bytes (at least one).
    models.tensor_specs keeps real layer shapes, so one Llama-7B layer with Adam state is
    ~2.8 GB; a prefix keeps the real size mix (embedding, norms, projections, each as bf16
    weight + three fp32 optimizer tensors) within the point's byte budget."""
    out, tot = [], 0
    for spec, n in zip(specs, models.sizes(specs)):
        if n <= 0:
            continue
        if out and tot + n > total:
            break
        out.append(spec)
        tot += n
    return out


def _scale_small(total: int) -> list[int]:
    """The small-tensor distribution (8 B .. 64 KiB) with about ``total`` bytes."""
    guess = models.sizes(models.small_tensor_specs(1000))
    count = max(16, int(total / (sum(guess) / len(guess))))
    return [s for s in models.sizes(models.small_tensor_specs(count)) if s > 0]


class Refused(Exception):
    """A point that cannot be run as specified (e.g. misaligned O_DIRECT)."""


# ---------------------------------------------------------------------------------- context
@dataclass
class Ctx:
    workdir: str
    arena: Any
    staging: Any
    direct_ok: bool
    direct_reason: str
    engine_kind: str
    _engines: dict = field(default_factory=dict)

    def engine(self, kind: str, depth: int):
        key = (kind, depth)
        if key not in self._engines:
            self._engines[key] = open_engine(kind, depth=depth)
        return self._engines[key]

    def close(self) -> None:
        for e in self._engines.values():
            e.close()
        self._engines.clear()


def _open_out(ctx: Ctx, path: str, direct: bool) -> int:
    if direct and not ctx.direct_ok:
        raise Refused(f"O_DIRECT unavailable here: {ctx.direct_reason}")
    return open_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600, direct=direct)


def _sync_phase(eng, fd: int, mode: str) -> None:
    if mode != "buffered-nosync":
        eng.fsync(fd, datasync=True)


# ---------------------------------------------------------------------------------- writers
# Each writer writes one point into ``path`` (a fresh file or directory) and returns
# (seconds, bytes, requests, files); the clock covers create .. fdatasync.

def w_requests(ctx: Ctx, path: str, reqs: list[tuple[int, int, int]], mode: str,
               engine: str = "io_uring", depth: int = 32,
               prealloc: bool = False) -> tuple[float, int, int, int]:
    """One request per (arena offset, length, file offset). ``prealloc``: posix_fallocate the
    whole file first (inside the clock), so no write extends the file."""
    direct = mode == "direct"
    arena = memoryview(ctx.arena)
    if engine == "pwrite":
        eng = ctx.engine("posix", 1)
    else:
        eng = ctx.engine(ctx.engine_kind if engine == "io_uring" else engine, depth)
    t0 = time.perf_counter()
    fd = _open_out(ctx, path, direct)
    try:
        if prealloc:
            os.posix_fallocate(fd, 0, max(off + n for _, n, off in reqs))
        batch = [(fd, arena[a:a + n], off) for a, n, off in reqs]
        if engine == "pwrite":
            for _fd, mv, off in batch:
                done = 0
                while done < len(mv):
                    done += os.pwrite(fd, mv[done:], off + done)
        else:
            try:
                eng.write_all(batch)
            except EngineError as e:
                if e.errno == errno.EINVAL and direct:
                    raise Refused(f"engine refused: {e.strerror}") from None
                raise
        _sync_phase(eng, fd, mode)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    return dt, sum(n for _, n, _ in reqs), len(reqs), 1


def w_pwritev(ctx: Ctx, path: str, reqs: list[tuple[int, int, int]], mode: str,
              iov_max: int = IOV_MAX) -> tuple[float, int, int, int]:
    """Adjacent buffers coalesced into pwritev calls of up to ``iov_max`` iovecs."""
    arena = memoryview(ctx.arena)
    eng = ctx.engine("posix", 1)
    calls = 0
    t0 = time.perf_counter()
    fd = _open_out(ctx, path, mode == "direct")
    try:
        for i in range(0, len(reqs), iov_max):
            group = reqs[i:i + iov_max]
            iov = [arena[a:a + n] for a, n, _ in group]
            off, total = group[0][2], sum(n for _, n, _ in group)
            done = os.pwritev(fd, iov, off)
            calls += 1
            while done < total:   # short write: finish the rest as one contiguous write
                flat = bytes().join(iov)[done:]
                done += os.pwrite(fd, flat, off + done)
                calls += 1
        _sync_phase(eng, fd, mode)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    return dt, sum(n for _, n, _ in reqs), calls, 1


def merge_adjacent(reqs: list[tuple[int, int, int]], limit: int) -> list[tuple[int, int, int]]:
    """Requests adjacent in memory and file merged into requests of at most ``limit`` bytes."""
    out: list[list[int]] = []
    for a, n, off in reqs:
        if out and out[-1][0] + out[-1][1] == a and out[-1][2] + out[-1][1] == off \
                and out[-1][1] + n <= limit:
            out[-1][1] += n
        else:
            out.append([a, n, off])
    return [tuple(r) for r in out]  # type: ignore[misc]


def w_aggregate(ctx: Ctx, path: str, reqs: list[tuple[int, int, int]], mode: str,
                chunk: int, depth: int = 32) -> tuple[float, int, int, int]:
    """Gather (memcpy) the buffers into staging buffers of ``chunk`` bytes from the pre-faulted
    pool and write each staging buffer as one request, keeping up to ``depth`` in flight. Under
    O_DIRECT the last buffer is padded to the alignment and the file truncated back."""
    direct = mode == "direct"
    eng = ctx.engine(ctx.engine_kind, depth)
    arena = memoryview(ctx.arena)
    pool = memoryview(ctx.staging)
    nbuf = max(1, min(depth, len(pool) // chunk))
    if nbuf < 2 and len(pool) < 2 * chunk:
        nbuf = 1
    bufs = [pool[i * chunk:(i + 1) * chunk] for i in range(nbuf)]
    free = list(range(nbuf))
    expect: dict[int, tuple[int, int, int]] = {}   # tag -> (buf index, length, file offset)
    total = sum(n for _, n, _ in reqs)
    requests = 0
    tags = iter(range(1 << 62))

    def reap(min_complete: int) -> None:
        for tag, res in eng.reap(min_complete):
            bi, ln, off = expect.pop(tag)
            if res < 0:
                raise OSError(-res, f"aggregated write failed: {os.strerror(-res)}")
            if res < ln:   # short write: resubmit the rest from the same staging buffer
                tag2 = next(tags)
                expect[tag2] = (bi, ln - res, off + res)
                eng.submit_write(fd, bufs[bi][res:ln], off + res, tag2)
                continue
            free.append(bi)

    t0 = time.perf_counter()
    fd = _open_out(ctx, path, direct)
    try:
        file_off = 0
        cur, fill = -1, 0

        def submit(bi: int, ln: int) -> None:
            nonlocal file_off, requests
            wlen = ln
            if direct and ln % ALIGN_BYTES:
                wlen = ln + (-ln % ALIGN_BYTES)
                bufs[bi][ln:wlen] = bytes(wlen - ln)
            tag = next(tags)
            expect[tag] = (bi, wlen, file_off)
            eng.submit_write(fd, bufs[bi][:wlen], file_off, tag)
            requests += 1
            file_off += ln

        for a, n, _off in reqs:
            done = 0
            while done < n:
                if cur < 0:
                    while not free:
                        reap(1)
                    cur, fill = free.pop(), 0
                k = min(n - done, chunk - fill)
                bufs[cur][fill:fill + k] = arena[a + done:a + done + k]
                fill += k
                done += k
                if fill == chunk:
                    submit(cur, fill)
                    cur = -1
        if cur >= 0 and fill:
            submit(cur, fill)
        while expect:
            reap(1)
        if direct and file_off != os.fstat(fd).st_size:
            os.ftruncate(fd, file_off)
        _sync_phase(eng, fd, mode)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
    return dt, total, requests, 1


def w_files(ctx: Ctx, path: str, names: list[str], sizes: list[int],
            sync: str) -> tuple[float, int, int, int]:
    """One file per tensor (create + write + close); sync="each": fdatasync before close;
    sync="end": reopen and fdatasync every file after all were written. Directories synced."""
    arena = memoryview(ctx.arena)
    eng = ctx.engine("posix", 1)
    t0 = time.perf_counter()
    os.mkdir(path)
    dirs = {path}
    paths = []
    pos = 0
    for name, n in zip(names, sizes):
        p = os.path.join(path, models.file_name(name))
        d = os.path.dirname(p)
        if d not in dirs:
            os.makedirs(d, exist_ok=True)
            dirs.add(d)
        fd = open_file(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            eng.write_all([(fd, arena[pos:pos + n], 0)])
            if sync == "each":
                eng.fsync(fd)
        finally:
            os.close(fd)
        paths.append(p)
        pos += n
    if sync == "end":
        for p in paths:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
    for d in sorted(dirs, key=len, reverse=True):
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    dt = time.perf_counter() - t0
    return dt, sum(sizes), len(sizes), len(sizes)


# ---------------------------------------------------------------------------------- points
@dataclass
class Point:
    dimension: str
    name: str
    params: dict
    run: Callable[[Ctx, str], tuple[float, int, int, int]]
    warm: Callable[[Ctx, str], tuple[float, int, int, int]] | None = None


def _uniform(total: int, size: int, misalign: int = 0) -> list[tuple[int, int, int]]:
    """Equal requests of ``size`` (+misalign bytes each; arena address shifted by misalign)."""
    n = max(1, total // size)
    return _layout([size + misalign] * n, base=misalign)


def _head(reqs: list[tuple[int, int, int]], nbytes: int) -> list[tuple[int, int, int]]:
    out, tot = [], 0
    for r in reqs:
        out.append(r)
        tot += r[1]
        if tot >= nbytes:
            break
    return out


def build_points(total: int, quick: bool, dims: tuple[str, ...]) -> tuple[list[Point], int]:
    """The sweep; returns (points, arena bytes needed)."""
    pts: list[Point] = []
    warm_bytes = max(4 * MiB, total // 8)
    small = _layout(_scale_small(total))
    synth = _uniform(total, SYNTHETIC_BYTES)
    need = max(sum(n for _, n, _ in small), total + 64 * KiB)

    def add(dim: str, name: str, params: dict, fn: Callable, reqs: list | None = None) -> None:
        if dim not in dims:
            return
        warm = None
        if reqs is not None:
            w = _head(reqs, warm_bytes)
            def warm(c, p, fn=fn, w=w):
                return (fn(c, p, w))
            def run(c, p, fn=fn, r=reqs):
                return (fn(c, p, r))
        else:
            run = fn
        pts.append(Point(dim, name, params, run, warm))

    def requests(mode: str, engine: str = "io_uring", depth: int = 32, prealloc: bool = False):
        return lambda c, p, r: w_requests(c, p, r, mode, engine, depth, prealloc)

    def aggregate(mode: str, chunk: int, depth: int = 32):
        return lambda c, p, r: w_aggregate(c, p, r, mode, chunk, depth)

    # aggregation
    chunks = [64 * KiB, 1 * MiB, 16 * MiB] if quick else \
        [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
    add("aggregation", "small buffers, 1 request each",
        {"mode": "buffered+fsync", "request": "per tensor", "workload": "small"},
        requests("buffered"), small)
    for c in chunks:
        if c > total:
            continue
        add("aggregation", f"aggregated into {fmt_bytes(c)}",
            {"mode": "buffered+fsync", "chunk": c, "workload": "small"},
            aggregate("buffered", c), small)
    add("aggregation", f"synthetic {fmt_bytes(SYNTHETIC_BYTES)} buffers",
        {"mode": "buffered+fsync", "request": SYNTHETIC_BYTES, "workload": "synthetic"},
        requests("buffered"), synth)

    # alignment: 64 KiB requests
    rs = 64 * KiB
    aligned = _uniform(total, rs)
    mis = _uniform(total, rs, misalign=3)
    add("alignment", "buffered, aligned", {"mode": "buffered+fsync", "request": rs,
        "aligned": True}, requests("buffered"), aligned)
    add("alignment", "buffered, misaligned", {"mode": "buffered+fsync", "request": rs + 3,
        "aligned": False}, requests("buffered"), mis)
    add("alignment", "direct, aligned", {"mode": "direct", "request": rs, "aligned": True},
        requests("direct"), aligned)
    add("alignment", "direct, misaligned", {"mode": "direct", "request": rs + 3,
        "aligned": False}, requests("direct"), mis)
    add("alignment", "direct, misaligned via 1 MiB bounce", {"mode": "direct",
        "request": rs + 3, "aligned": False, "bounce": MiB}, aggregate("direct", MiB), mis)

    # coalescing: the small-tensor stream
    add("coalescing", "io_uring, 1 request per buffer", {"mode": "buffered+fsync",
        "engine": "io_uring", "depth": 32}, requests("buffered"), small)
    add("coalescing", "pwrite, 1 call per buffer", {"mode": "buffered+fsync",
        "engine": "pwrite"}, requests("buffered", "pwrite"), small)
    add("coalescing", f"pwritev, {IOV_MAX} iovecs per call", {"mode": "buffered+fsync",
        "engine": "pwritev", "iovecs": IOV_MAX},
        lambda c, p, r: w_pwritev(c, p, r, "buffered"), small)
    merged = merge_adjacent(small, MiB)
    add("coalescing", "io_uring, adjacent merged to 1 MiB", {"mode": "buffered+fsync",
        "engine": "io_uring", "depth": 32, "merge_limit": MiB}, requests("buffered"), merged)

    # mode
    for rs in ([64 * KiB, 8 * MiB] if quick else [64 * KiB, 1 * MiB, 8 * MiB]):
        reqs = _uniform(total, rs)
        for mode, label in (("buffered-nosync", "buffered, no fsync"),
                            ("buffered", "buffered + fdatasync"), ("direct", "O_DIRECT")):
            add("mode", f"{label}, {fmt_bytes(rs)}", {"mode": mode, "request": rs},
                requests(mode), reqs)
        add("mode", f"O_DIRECT, preallocated, {fmt_bytes(rs)}", {"mode": "direct",
            "request": rs, "prealloc": True}, requests("direct", prealloc=True), reqs)

    # engine and depth: 1 MiB requests
    reqs = _uniform(total, MiB)
    for mode, pre in (("direct", False), ("direct", True), ("buffered", False)):
        label = "direct" if mode == "direct" else "buffered+fsync"
        label += ", preallocated" if pre else ""
        for d in ([1, 8, 64] if quick else [1, 2, 4, 8, 16, 32, 64]):
            add("depth", f"io_uring QD {d}, {label}", {"mode": mode, "engine": "io_uring",
                "depth": d, "request": MiB, "prealloc": pre},
                requests(mode, "io_uring", d, pre), reqs)
        add("depth", f"pwrite, {label}", {"mode": mode, "engine": "pwrite", "request": MiB,
            "prealloc": pre}, requests(mode, "pwrite", prealloc=pre), reqs)

    # workload
    loads: list[tuple[str, list[tuple[int, int, int]]]] = [("synthetic", synth)]
    for arch in models.ARCHS:
        sz = models.sizes(_prefix(models.tensor_specs(arch, total), total))
        loads.append((arch, _layout(sz)))
        need = max(need, sum(sz))
    loads.append(("small", small))
    for wl, reqs in loads:
        cnt = len(reqs)
        add("workload", f"{wl}, 1 request per tensor", {"workload": wl, "tensors": cnt,
            "mode": "buffered+fsync"}, requests("buffered"), reqs)
        add("workload", f"{wl}, aggregated 16 MiB", {"workload": wl, "tensors": cnt,
            "mode": "buffered+fsync", "chunk": 16 * MiB}, aggregate("buffered", 16 * MiB), reqs)
        add("workload", f"{wl}, aggregated 16 MiB, direct", {"workload": wl, "tensors": cnt,
            "mode": "direct", "chunk": 16 * MiB}, aggregate("direct", 16 * MiB), reqs)

    # metadata: a smaller set, since per-file fdatasync costs milliseconds per file
    mtotal = max(4 * MiB, total // (16 if quick else 4))
    gspecs = _prefix(models.tensor_specs("gpt2", mtotal), mtotal)
    sspecs = models.small_tensor_specs(300 if quick else 1000)
    for wl, specs in (("gpt2", gspecs), ("small", sspecs)):
        names = [s[0] for s in specs]
        sz = models.sizes(specs)
        reqs = _layout(sz)
        need = max(need, sum(sz))
        base = {"workload": wl, "tensors": len(sz), "mode": "buffered+fsync"}
        if "metadata" in dims:
            wn, wsz = names[:max(1, len(names) // 8)], sz[:max(1, len(sz) // 8)]
            pts.append(Point("metadata", f"{wl}, file per tensor, fdatasync each",
                             dict(base, files="per tensor", sync="each"),
                             lambda c, p, n=names, s=sz: w_files(c, p, n, s, "each"),
                             lambda c, p, n=wn, s=wsz: w_files(c, p, n, s, "each")))
            pts.append(Point("metadata", f"{wl}, file per tensor, fdatasync at end",
                             dict(base, files="per tensor", sync="end"),
                             lambda c, p, n=names, s=sz: w_files(c, p, n, s, "end"),
                             lambda c, p, n=wn, s=wsz: w_files(c, p, n, s, "end")))
        add("metadata", f"{wl}, one file, aggregated 16 MiB", dict(base, files=1,
            chunk=16 * MiB), aggregate("buffered", 16 * MiB), reqs)
    return pts, need


# ---------------------------------------------------------------------------------- running
def _rm(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.monotonic()
        self.done = 0

    def show(self, text: str) -> None:
        if not self.enabled:
            return
        el = time.monotonic() - self.t0
        line = f"[run {self.done:>3}/{self.total}] {el:6.1f}s  {text}"
        if self.tty:
            sys.stderr.write("\r" + line[:110].ljust(110))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def end(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _once(ctx: Ctx, fn: Callable, drop: bool, seq: list[int]) -> tuple[float, int, int, int]:
    """One run into a fresh file/directory, page cache dropped first, deleted afterwards."""
    seq[0] += 1
    path = os.path.join(ctx.workdir, f"p{seq[0]:05d}")
    if drop:
        _drop_caches()
    try:
        return fn(ctx, path)
    finally:
        _rm(path)


def run_dimension(ctx: Ctx, pts: list[Point], repeat: int, drop: bool, seq: list[int],
                  prog: Progress) -> list[dict[str, Any]]:
    """Warm every point up, then ``repeat`` rounds over all points of the dimension (A B C A B C
    ...), so a slow phase of the machine spreads over the contenders instead of hitting one."""
    runs: list[list] = [[] for _ in pts]
    refused: dict[int, str] = {}
    for rnd in range(repeat + 1):
        for i, pt in enumerate(pts):
            if i in refused:
                continue
            prog.show(f"{pt.dimension}: {pt.name} "
                      + ("(warm-up)" if rnd == 0 else f"({rnd}/{repeat})"))
            try:
                if rnd == 0:
                    _once(ctx, pt.warm or pt.run, drop, seq)
                else:
                    runs[i].append(_once(ctx, pt.run, drop, seq))
            except Refused as e:
                refused[i] = str(e)
            prog.done += 1
    out = []
    for i, pt in enumerate(pts):
        res: dict[str, Any] = {"dimension": pt.dimension, "point": pt.name, **pt.params}
        if i in refused:
            res.update(refused=True, reason=refused[i], gbps=None, runs_gbps=[])
        else:
            gb = [b / dt / 1e9 for dt, b, _, _ in runs[i]]
            _, nbytes, nreq, nfiles = runs[i][0]
            res.update(refused=False, bytes=nbytes, requests=nreq, files=nfiles,
                       gbps=statistics.median(gb), gbps_min=min(gb), gbps_max=max(gb),
                       seconds=statistics.median(dt for dt, _, _, _ in runs[i]), runs_gbps=gb)
        out.append(res)
    return out


def _find(results: list[dict], dim: str, pred: Callable[[dict], bool]) -> dict | None:
    for r in results:
        if r["dimension"] == dim and not r.get("refused") and pred(r):
            return r
    return None


def verdicts(results: list[dict]) -> dict[str, dict]:
    """The three findings of the study, decided from the measured numbers."""
    out: dict[str, dict] = {}
    small = _find(results, "aggregation", lambda r: r.get("request") == "per tensor")
    synth = _find(results, "aggregation", lambda r: r.get("workload") == "synthetic")
    aggs = [r for r in results if r["dimension"] == "aggregation" and "chunk" in r
            and not r.get("refused")]
    if small and synth:
        ratio = small["gbps"] / synth["gbps"]
        holds = ratio <= HALF_RATIO_MAX
        wl = [r for r in results if r["dimension"] == "workload"
              and r.get("point", "").endswith("1 request per tensor") and not r.get("refused")]
        wsyn = next((r for r in wl if r["workload"] == "synthetic"), None)
        extra = ""
        if wsyn:
            extra = "; per-tensor requests by workload vs synthetic: " + ", ".join(
                f"{r['workload']} {r['gbps'] / wsyn['gbps']:.2f}x" for r in wl
                if r is not wsyn)
        out["small_buffers_halve"] = {
            "holds": holds, "ratio": ratio, "small_gbps": small["gbps"],
            "synthetic_gbps": synth["gbps"],
            "text": (f"{'HOLDS' if holds else 'DOES NOT HOLD'}: uncoalesced small-buffer writes "
                     f"(1 request per tensor, {small['requests']} requests) reach "
                     f"{small['gbps']:.2f} GB/s = {ratio:.2f}x of synthetic "
                     f"{fmt_bytes(SYNTHETIC_BYTES)} buffers ({synth['gbps']:.2f} GB/s), "
                     + (f"a {100 * (1 - ratio):.0f}% loss" if ratio < 1 else
                        f"no loss ({100 * (ratio - 1):.0f}% faster)")
                     + f" (finding: about half){extra}")}
    if small and synth and aggs:
        best = max(aggs, key=lambda r: r["gbps"])
        knee = min((r for r in aggs if r["gbps"] >= 0.9 * best["gbps"]),
                   key=lambda r: r["chunk"])
        ratio = best["gbps"] / synth["gbps"]
        holds = ratio >= RESTORE_RATIO_MIN and best["gbps"] > small["gbps"]
        out["aggregation_restores"] = {
            "holds": holds, "ratio_to_synthetic": ratio,
            "gain_over_small": best["gbps"] / small["gbps"], "best_chunk": best["chunk"],
            "best_gbps": best["gbps"], "knee_chunk": knee["chunk"],
            "text": (f"{'HOLDS' if holds else 'DOES NOT HOLD'}: gathering the same small "
                     f"buffers into {fmt_bytes(best['chunk'])} staging buffers (memcpy "
                     f"included) reaches {best['gbps']:.2f} GB/s = {ratio:.2f}x of synthetic and "
                     f"{best['gbps'] / small['gbps']:.2f}x of uncoalesced; 90% of that from "
                     f"{fmt_bytes(knee['chunk'])} buffers up")}
    mode = [r for r in results if r["dimension"] == "mode" and not r.get("refused")]
    sizes_ = sorted({r["request"] for r in mode})
    parts = []
    cmp_ = {}
    for s in sizes_:
        b = next((r for r in mode if r["request"] == s and r["mode"] == "buffered"), None)
        d = next((r for r in mode if r["request"] == s and r["mode"] == "direct"
                  and not r.get("prealloc")), None)
        dp = next((r for r in mode if r["request"] == s and r.get("prealloc")), None)
        nb = next((r for r in mode if r["request"] == s and r["mode"] == "buffered-nosync"), None)
        if b and d:
            cmp_[s] = d["gbps"] / b["gbps"]
            parts.append(f"{fmt_bytes(s)} requests: direct {d['gbps']:.2f} vs buffered+fsync "
                         f"{b['gbps']:.2f} GB/s ({cmp_[s]:.2f}x)"
                         + (f", direct into a preallocated file {dp['gbps']:.2f}" if dp else "")
                         + (f", buffered without fsync {nb['gbps']:.2f}" if nb else ""))
    al = {r["point"]: r for r in results if r["dimension"] == "alignment"}
    ba, bm = al.get("buffered, aligned"), al.get("buffered, misaligned")
    da, dm = al.get("direct, aligned"), al.get("direct, misaligned")
    db = al.get("direct, misaligned via 1 MiB bounce")
    if ba and bm and ba.get("gbps") and bm.get("gbps"):
        parts.append(f"misaligned buffered 64 KiB writes run at {bm['gbps'] / ba['gbps']:.2f}x "
                     f"of aligned ({bm['gbps']:.2f} vs {ba['gbps']:.2f} GB/s)")
    if dm is not None:
        if dm.get("refused"):
            txt = "misaligned O_DIRECT is refused"
        else:
            txt = f"misaligned O_DIRECT runs at {dm['gbps']:.2f} GB/s"
        if db and db.get("gbps") and da and da.get("gbps"):
            txt += (f"; through a 1 MiB aligned bounce buffer it reaches {db['gbps']:.2f} GB/s "
                    f"({db['gbps'] / da['gbps']:.2f}x of aligned direct 64 KiB requests)")
        parts.append(txt)
    if cmp_:
        big = max(cmp_)
        faster = cmp_[big] > 1.0
        out["buffered_vs_direct"] = {
            "direct_over_buffered": {str(k): v for k, v in cmp_.items()},
            "direct_faster_large": faster,
            "text": (f"O_DIRECT is {cmp_[big]:.2f}x buffered+fsync at {fmt_bytes(big)} "
                     f"({'faster' if faster else 'slower'}); " + "; ".join(parts))}
    return out


# ---------------------------------------------------------------------------------- output
def print_table(results: list[dict], out=sys.stdout) -> None:
    dim = None
    w = max([len(r["point"]) for r in results] + [10])
    for r in results:
        if r["dimension"] != dim:
            dim = r["dimension"]
            print(f"\n== {dim}", file=out)
            print(f"{'point':<{w}}  {'GB/s':>6}  {'min':>6}  {'max':>6}  {'MB':>7}  "
                  f"{'requests':>8}", file=out)
        if r.get("refused"):
            print(f"{r['point']:<{w}}  {'refused':>6}  ({r['reason'][:70]})", file=out)
            continue
        print(f"{r['point']:<{w}}  {r['gbps']:6.2f}  {r['gbps_min']:6.2f}  {r['gbps_max']:6.2f}  "
              f"{r['bytes'] / 1e6:7.0f}  {r['requests']:8d}", file=out)


def markdown_table(results: list[dict], dim: str) -> str:
    rows = ["| point | GB/s (median) | min | max | MB | requests | files |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r["dimension"] != dim:
            continue
        if r.get("refused"):
            rows.append(f"| {r['point']} | refused | | | | | |")
        else:
            rows.append(f"| {r['point']} | {r['gbps']:.2f} | {r['gbps_min']:.2f} | "
                        f"{r['gbps_max']:.2f} | {r['bytes'] / 1e6:.0f} | {r['requests']} | "
                        f"{r['files']} |")
    return "\n".join(rows)


def write_csv(path: str, results: list[dict]) -> None:
    cols = ["dimension", "point", "gbps", "gbps_min", "gbps_max", "seconds", "bytes",
            "requests", "files", "refused", "mode", "engine", "depth", "request", "chunk",
            "workload", "tensors", "aligned", "prealloc", "sync", "reason"]
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        wr.writeheader()
        for r in results:
            wr.writerow(r)


def write_plots(outdir: str, results: list[dict], title_suffix: str = "") -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(outdir, exist_ok=True)
    written = []
    for dim in DIMENSIONS:
        rs = [r for r in results if r["dimension"] == dim]
        if not rs:
            continue
        fig, ax = plt.subplots(figsize=(9, 0.42 * len(rs) + 1.6))
        names = [r["point"] for r in rs]
        vals = [r["gbps"] or 0.0 for r in rs]
        lo = [max(0.0, (r["gbps"] or 0) - (r.get("gbps_min") or 0)) for r in rs]
        hi = [max(0.0, (r.get("gbps_max") or 0) - (r["gbps"] or 0)) for r in rs]
        colors = ["#bbbbbb" if r.get("refused") else
                  "#c0504d" if r.get("mode") == "direct" else
                  "#9bbb59" if r.get("mode") == "buffered-nosync" else "#4f81bd" for r in rs]
        y = list(range(len(rs)))[::-1]
        ax.barh(y, vals, xerr=[lo, hi], color=colors, capsize=2)
        for yy, r, v in zip(y, rs, vals):
            ax.text(v, yy, " refused" if r.get("refused") else f" {v:.2f}", va="center",
                    fontsize=8)
        ax.set_yticks(y)
        ax.set_yticklabels(names, fontsize=8)
        ax.set_xlabel("durable write throughput, GB/s (median; bars: min..max)")
        ax.set_title(f"ckptfs bench micro: {dim}{title_suffix}", fontsize=10)
        ax.set_xlim(0, max(vals + [r.get("gbps_max") or 0 for r in rs] + [0.1]) * 1.12)
        fig.tight_layout()
        p = os.path.join(outdir, f"micro-{dim}.png")
        fig.savefig(p, dpi=100)
        plt.close(fig)
        written.append(p)
    return written


# ---------------------------------------------------------------------------------- main
def parse_args(argv: list[str]) -> argparse.Namespace:
    from ckptfs.options import parse_size

    p = argparse.ArgumentParser(
        prog="ckptfs bench micro",
        description="The I/O study: aggregation, alignment, coalescing, buffered vs O_DIRECT, "
        "io_uring depth, real tensor-size workloads and metadata cost, measured as durable "
        "write throughput on --dir. Prints a table and the study's three verdicts.",
        epilog="example: flock /tmp/ckptfs-bench.lock ckptfs bench micro --dir /var/tmp "
        "--json micro.json --plots docs/img")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary "
                   "directory under the current directory, i.e. on its file system)")
    p.add_argument("--size", type=parse_size, default=None,
                   help="bytes per point (default 512M; 16M with --quick)")
    p.add_argument("--repeat", type=int, default=None,
                   help="measured runs per point (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="small sizes, 1 repeat, fewer points")
    p.add_argument("--only", default=",".join(DIMENSIONS),
                   help="comma-separated dimensions to run")
    p.add_argument("--engine", choices=["auto", "io_uring", "posix"], default="auto",
                   help="engine for the io_uring points")
    p.add_argument("--json", metavar="FILE", help="write results as JSON")
    p.add_argument("--csv", metavar="FILE", help="write results as CSV")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots micro-<dimension>.png")
    p.add_argument("--markdown", metavar="FILE", help="write markdown tables (for the docs)")
    p.add_argument("--no-drop-caches", action="store_true",
                   help="do not drop the page cache between points")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    dims = tuple(d.strip() for d in a.only.split(",") if d.strip())
    bad = [d for d in dims if d not in DIMENSIONS]
    if bad:
        p.error(f"unknown dimension(s) {bad}; choose from {', '.join(DIMENSIONS)}")
    a.dims = dims
    a.size = a.size or (16 * MiB if a.quick else 512 * MiB)
    a.repeat = a.repeat or (1 if a.quick else 3)
    if a.size < 4 * MiB:
        p.error("--size must be at least 4M")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    parent = os.path.abspath(a.dir or os.getcwd())
    if not os.path.isdir(parent):
        print(f"ckptfs bench micro: {parent} is not a directory", file=sys.stderr)
        return 2
    workdir = tempfile.mkdtemp(prefix=".ckptfs-micro-", dir=parent)
    drop = (not a.no_drop_caches) and os.geteuid() == 0
    results: list[dict] = []
    ctx = None
    t_start = time.monotonic()
    try:
        dinfo = probe_direct(workdir)
        points, need = build_points(a.size, a.quick, a.dims)
        arena = alloc_aligned(need + 2 * ALIGN_BYTES, populate=True)
        _fill(arena, len(arena))
        staging_bytes = max(16 * MiB, min(512 * MiB, 2 * a.size))
        staging = alloc_aligned(staging_bytes, populate=True)
        _fill(staging, len(staging))
        ctx = Ctx(workdir, arena, staging, dinfo.supported, dinfo.reason, a.engine)
        eng = ctx.engine(a.engine, 32)
        engine_name = eng.name
        prog = Progress(len(points) * (a.repeat + 1), not a.no_progress)  # runs, not points
        seq = [0]
        for dim in DIMENSIONS:
            pts = [pt for pt in points if pt.dimension == dim]
            if pts:
                results += run_dimension(ctx, pts, a.repeat, drop, seq, prog)
        prog.done = prog.total
        prog.show("done")
        prog.end()
    finally:
        if ctx is not None:
            ctx.close()
        shutil.rmtree(workdir, ignore_errors=True)
    elapsed = time.monotonic() - t_start
    ver = verdicts(results)
    machine = _machine(parent)
    meta = {"command": "ckptfs bench micro " + " ".join(argv if argv is not None
                                                        else sys.argv[1:]),
            "dir": parent, "bytes_per_point": a.size, "repeat": a.repeat, "quick": a.quick,
            "engine": engine_name, "direct": {"supported": dinfo.supported,
                                              "reason": dinfo.reason},
            "drop_caches": drop, "elapsed_s": elapsed,
            "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    print(f"ckptfs bench micro: {fmt_bytes(a.size)} per point, {a.repeat} run(s) per point, "
          f"engine {engine_name}, dir {parent} ({machine['fs']} on {machine['device']}), "
          f"caches {'dropped' if drop else 'NOT dropped'} between runs, {elapsed:.0f} s")
    print_table(results)
    print("\nverdicts (from the numbers above):")
    for k, v in ver.items():
        print(f"  {k}: {v['text']}")
    doc = {"machine": machine, "meta": meta, "results": results, "verdicts": ver}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    if a.csv:
        write_csv(a.csv, results)
    if a.plots:
        write_plots(a.plots, results)
    if a.markdown:
        with open(a.markdown, "w") as f:
            for dim in a.dims:
                f.write(f"#### {dim}\n\n{markdown_table(results, dim)}\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
