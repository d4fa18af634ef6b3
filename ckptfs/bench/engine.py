"""``ckptfs bench engine``: large sequential writes through the I/O engine, optionally against fio.

Each measured run writes a fresh file: it is created, preallocated with fallocate(2) mode 0
(``os.posix_fallocate``: what fio does by default, fallocate=native, so the writes go to
unwritten extents in both), then written sequentially in ``--bs`` requests with ``--depth`` in
flight, from ``--depth`` page-aligned buffers of random bytes (registered as fixed buffers for
io_uring).  The write bandwidth is size / (time from the first submission to the last
completion), like fio's (fio's default end_fsync=0); the fdatasync that follows is timed and
reported separately.  One warm-up run per engine is not counted; the median over ``--repeat``
runs is reported.  With ``--fio`` the engine and fio runs alternate (A B A B ...) with the same
file name, size, bs and depth.  All files are removed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

from ckptfs import api
from ckptfs.io import alloc_aligned, open_engine, open_file, probe_direct

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(s: str) -> int:
    """'2G' -> 2 GiB, '8M', '512K', '4096' (binary units, like fio)."""
    t = s.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    num = t[:-1] if unit else t
    try:
        v = int(float(num) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError("bad size %r" % s) from None
    if v <= 0:
        raise argparse.ArgumentTypeError("size must be > 0: %r" % s)
    return v


def _fmt_size(n: int) -> str:
    for u in ("G", "M", "K"):
        if n % _UNITS[u] == 0:
            return "%d%s" % (n // _UNITS[u], u)
    return str(n)


def run_engine(kind: str, path: str, size: int, bs: int, depth: int, direct: bool,
               bufs: list, register: bool = True) -> dict:
    """One measured run; returns write GB/s and fdatasync seconds."""
    nreq = -(-size // bs)
    with open_engine(kind, depth=depth) as eng:
        if register:
            eng.register_buffers(bufs)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        fd = open_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600, direct=direct)
        try:
            os.posix_fallocate(fd, 0, size)
            reqs = []
            for i in range(nreq):
                ln = min(bs, size - i * bs)
                b = bufs[i % len(bufs)]
                reqs.append((fd, b if ln == bs else memoryview(b)[:ln], i * bs))
            t0 = time.perf_counter()
            eng.write_all(reqs)
            t1 = time.perf_counter()
            eng.fsync(fd, datasync=True)
            t2 = time.perf_counter()
        finally:
            os.close(fd)
            os.unlink(path)
        return {"gbps": size / (t1 - t0) / 1e9, "write_s": t1 - t0, "fdatasync_s": t2 - t1,
                "engine": eng.name, "registered": getattr(eng, "registered", 0)}


def run_fio(path: str, size: int, bs: int, depth: int, direct: bool) -> dict:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    cmd = ["fio", "--name=w", "--filename=" + path, "--direct=%d" % int(direct),
           "--ioengine=io_uring", "--rw=write", "--bs=" + _fmt_size(bs),
           "--iodepth=%d" % depth, "--size=" + _fmt_size(size), "--output-format=json"]
    try:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    data = json.loads(out[out.index("{"):])
    w = data["jobs"][0]["write"]
    return {"gbps": w["bw_bytes"] / 1e9, "write_s": w["runtime"] / 1000.0, "cmd": " ".join(cmd)}


def machine_description(dirpath: str) -> str:
    m = api.mount_holding(dirpath)
    dev = "%s %s" % (m.source, m.fstype) if m is not None else "?"
    return "%s, kernel %s, %d CPUs, fs %s" % (platform.machine(), platform.release(),
                                              os.cpu_count() or 0, dev)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ckptfs bench engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp", help="directory for the test file (real disk)")
    ap.add_argument("--size", type=parse_size, default=parse_size("2G"))
    ap.add_argument("--bs", type=parse_size, default=parse_size("8M"))
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--engine", choices=["io_uring", "posix", "both"], default="io_uring")
    ap.add_argument("--buffered", action="store_true", help="no O_DIRECT")
    ap.add_argument("--fio", action="store_true", help="alternate with fio, same parameters")
    ap.add_argument("--no-register", action="store_true", help="no fixed buffers")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    a = ap.parse_args(argv)

    direct = not a.buffered
    if direct:
        info = probe_direct(a.dir)
        if not info.supported:
            print("O_DIRECT not supported in %s: %s (use --buffered or another --dir)"
                  % (a.dir, info.reason), file=sys.stderr)
            return 2
    if a.fio and not shutil.which("fio"):
        print("fio not found", file=sys.stderr)
        return 2
    kinds = ["io_uring", "posix"] if a.engine == "both" else [a.engine]
    path = os.path.join(a.dir, ".ckptfs-bench-engine.%d.dat" % os.getpid())
    bufs = [alloc_aligned(a.bs) for _ in range(a.depth)]
    for b in bufs:
        b.write(os.urandom(a.bs))
    results: dict[str, list[dict]] = {k: [] for k in kinds}
    if a.fio:
        results["fio"] = []
    try:
        for k in kinds:  # warm-up
            run_engine(k, path, a.size, a.bs, a.depth, direct, bufs, not a.no_register)
        if a.fio:
            run_fio(path, a.size, a.bs, a.depth, direct)
        for _ in range(a.repeat):
            for k in kinds:
                results[k].append(run_engine(k, path, a.size, a.bs, a.depth, direct, bufs,
                                             not a.no_register))
            if a.fio:
                results["fio"].append(run_fio(path, a.size, a.bs, a.depth, direct))
    finally:
        for b in bufs:
            b.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    summary = {
        "machine": machine_description(a.dir), "dir": a.dir, "size": a.size, "bs": a.bs,
        "depth": a.depth, "direct": direct, "repeat": a.repeat,
        "preallocated": "fallocate mode 0 (as fio's default fallocate=native)",
        "median_gbps": {k: statistics.median(r["gbps"] for r in v) for k, v in results.items()},
        "runs": results,
    }
    for k in kinds:
        summary.setdefault("median_fdatasync_s", {})[k] = statistics.median(
            r["fdatasync_s"] for r in results[k])
    if a.fio:
        summary["ratio_vs_fio"] = {k: summary["median_gbps"][k] / summary["median_gbps"]["fio"]
                                   for k in kinds}
    if a.json:
        print(json.dumps(summary, indent=2))
        return 0
    print("%s; %s %s, bs %s, depth %d, %s, median of %d (after warm-up)"
          % (summary["machine"], a.dir, _fmt_size(a.size), _fmt_size(a.bs), a.depth,
             "O_DIRECT" if direct else "buffered", a.repeat))
    for k in kinds:
        runs = ", ".join("%.2f" % r["gbps"] for r in results[k])
        print("  %-8s %6.2f GB/s  (runs: %s; fdatasync after: %.1f ms)"
              % (k, summary["median_gbps"][k], runs, 1000 * summary["median_fdatasync_s"][k]))
    if a.fio:
        runs = ", ".join("%.2f" % r["gbps"] for r in results["fio"])
        print("  %-8s %6.2f GB/s  (runs: %s)" % ("fio", summary["median_gbps"]["fio"], runs))
        for k in kinds:
            print("  %s / fio = %.3f" % (k, summary["ratio_vs_fio"][k]))
    return 0
