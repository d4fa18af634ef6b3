"""``ckptfs bench transport``: what the FUSE transport itself costs per request, and where the
request is served (docs/benchmarks.md, "What the FUSE transport costs").

A file system that keeps nothing (transport.c, built here with gcc against the system
liburing) is mounted and served in several ways; a client program creates, writes once and
closes ``--files`` small files (six requests each, four of them waited for), makes
``--writes`` writes of 1 MiB (one WRITE request each), then opens, reads and closes as many
small files (LOOKUP, OPEN, READ, FLUSH, RELEASE) and reads 1 MiB as many times (one READ
each, direct I/O). Neither side does any work of its own, so the times are the kernel's FUSE
path, the copies and the wake-ups:

  dev-cross        /dev/fuse read/write; the server on CPU 1, the client on CPU 0
  dev-spin-cross   the same, the server polling 250 us before each blocking read (ckptfs's
                   request loop does that: --request-spin)
  dev, dev-spin    the same two with the scheduler placing both
  dev-same         server and client on CPU 0
  uring            FUSE over io_uring (Linux 6.14+), one thread serving every CPU's queue
  uring-percpu     FUSE over io_uring, one thread per CPU's queue on that CPU: the kernel
                   queues a request on its caller's CPU, so it is served there
  uring-percpu-handoff   the same, LOOKUP and CREATE handed to one other thread (polling
                   250 us before it sleeps), as a daemon that keeps its namespace on one
                   thread would

Variants alternate round by round (the order reversed every other round) after a warm-up
round; medians are reported. Needs root (mount(2), CPU affinity), gcc, liburing-dev, two CPUs.
FUSE over io_uring needs /sys/module/fuse/parameters/enable_uring = Y: ``--enable-uring``
sets it for the run and puts it back after; without it the uring variants are skipped when it
is off. The VM's guest halt polling (/sys/module/haltpoll/parameters/guest_halt_poll_ns)
decides what a wake-up of an idle vCPU costs; its value is printed with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from ckptfs.fuse.ring import ENABLE_URING
from ckptfs.system import guest_halt_poll_ns

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transport.c")
ALL = None  # (every CPU)
# name: (mode, spin us, server CPUs, client CPUs, a thread per queue, queue threads pinned,
# namespace requests handed to one thread)
VARIANTS = {
    "dev-cross": ("dev", 0, {1}, {0}, 0, 0, 0),
    "dev-spin-cross": ("dev", 250, {1}, {0}, 0, 0, 0),
    "dev": ("dev", 0, ALL, ALL, 0, 0, 0),
    "dev-spin": ("dev", 250, ALL, ALL, 0, 0, 0),
    "dev-same": ("dev", 0, {0}, {0}, 0, 0, 0),
    "dev-percpu": ("dev", 0, ALL, ALL, 1, 1, 0),
    "uring": ("uring", 0, ALL, ALL, 0, 0, 0),
    "uring-percpu": ("uring", 0, ALL, ALL, 1, 1, 0),
    "uring-percpu-handoff": ("uring", 250, ALL, ALL, 1, 1, 1),
}
READY_TIMEOUT_S = 10.0
CLIENT_TIMEOUT_S = 300.0


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def build(dst: str) -> str:
    """Compile transport.c into `dst`; returns the program's path (RuntimeError if the build
    fails: gcc or liburing-dev missing)."""
    exe = os.path.join(dst, "transport")
    res = subprocess.run(["gcc", "-O2", "-Wall", "-o", exe, SOURCE, "-luring", "-lpthread"],
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError("building transport.c failed (gcc and liburing-dev needed):\n"
                           + res.stderr)
    return exe


def _unmount(mnt: str) -> None:
    subprocess.run(["umount", "-l", mnt], capture_output=True)


def run_one(exe: str, name: str, files: int, size: int, writes: int) -> dict:
    """One run of variant `name`: a fresh mount, the client, the unmount. Returns the
    microseconds per file and per 1 MiB write and what the server served where."""
    mode, spin, server_cpus, client_cpus, threads, pin, handoff = VARIANTS[name]
    mnt = tempfile.mkdtemp(prefix="ckptfs-transport-")

    def on(cpus):
        return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    server = subprocess.Popen([exe, "serve", mnt, mode, str(spin), str(threads), str(pin),
                               str(handoff)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              preexec_fn=on(server_cpus))
    try:
        ready, _, _ = select.select([server.stdout], [], [], READY_TIMEOUT_S)
        line = server.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            server.kill()  # (its error output ends with it, so reading it cannot hang)
            raise RuntimeError(f"{name}: the server did not start: "
                               + server.stderr.read().decode(errors="replace").strip())
        time.sleep(0.2)  # (io_uring: the queues' entries registered)
        res = subprocess.run([exe, "client", mnt, str(files), str(size), str(writes)],
                             capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S,
                             preexec_fn=on(client_cpus))
        if res.returncode != 0:
            raise RuntimeError(f"{name}: the client failed: {res.stderr.strip()}")
        per_file, per_write, per_file_read, per_read = map(float, res.stdout.split())
    finally:
        _unmount(mnt)
        try:
            server.wait(5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        served = server.stderr.read().decode(errors="replace").strip()
        server.stdout.close()
        server.stderr.close()
        os.rmdir(mnt)
    m = re.match(r"served (\d+) on /dev/fuse, (\d+) on io_uring", served)
    on_ring = int(m.group(2)) if m else -1
    return {"us_per_file": per_file, "us_per_mib_write": per_write,
            "us_per_file_read": per_file_read, "us_per_mib_read": per_read,
            "on_io_uring": on_ring, "served": served}


def machine() -> dict:
    return {"kernel": platform.release(), "cpus": os.cpu_count(),
            "guest_halt_poll_ns": guest_halt_poll_ns(), "enable_uring": _read(ENABLE_URING)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="ckptfs bench transport", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=5000, help="small files per run (5000)")
    ap.add_argument("--size", type=int, default=100, help="bytes per small file (100)")
    ap.add_argument("--writes", type=int, default=500, help="1 MiB writes per run (500)")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (3)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated, of: " + ", ".join(VARIANTS))
    ap.add_argument("--enable-uring", action="store_true",
                    help="set enable_uring for the run (root; put back after)")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    a = ap.parse_args(argv)
    names = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        print(f"ckptfs bench transport: unknown variants {unknown}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("ckptfs bench transport: needs root (mount(2))", file=sys.stderr)
        return 2
    allowed = os.sched_getaffinity(0)
    pinned = [v for v in names if not all(c is ALL or c <= allowed for c in VARIANTS[v][2:4])]
    if pinned:  # (one CPU, or a cpuset without CPUs 0 and 1)
        print(f"CPUs {sorted(allowed)} only: {', '.join(pinned)} skipped")
        names = [v for v in names if v not in pinned]
    uring_was = _read(ENABLE_URING)
    if any(VARIANTS[v][0] == "uring" for v in names):
        if uring_was is None:
            print("FUSE over io_uring: not in this kernel; its variants are skipped")
            names = [v for v in names if VARIANTS[v][0] != "uring"]
        elif uring_was != "Y" and not a.enable_uring:
            print("FUSE over io_uring: off (enable_uring = N); its variants are skipped "
                  "(--enable-uring turns it on for the run)")
            names = [v for v in names if VARIANTS[v][0] != "uring"]
    switched = False
    if a.enable_uring and uring_was == "N" and any(VARIANTS[v][0] == "uring" for v in names):
        try:
            _write(ENABLE_URING, "Y")
            switched = True
        except OSError as exc:  # (a read-only /sys in a container, say)
            print(f"FUSE over io_uring: cannot turn it on ({exc}); its variants are skipped")
            names = [v for v in names if VARIANTS[v][0] != "uring"]
    results: dict[str, list[dict]] = {v: [] for v in names}
    tmp = tempfile.mkdtemp(prefix="ckptfs-transport-build-")
    try:
        exe = build(tmp)
        for r in range(a.rounds + 1):
            for v in (names if r % 2 == 0 else names[::-1]):
                out = run_one(exe, v, a.files, a.size, a.writes)
                if r:  # (round 0 warms up)
                    results[v].append(out)
                print(f"round {r}{' (warm-up)' if not r else ''} {v}: "
                      f"{out['us_per_file']:.1f} / {out['us_per_mib_write']:.1f} us per file / "
                      f"1 MiB written, {out['us_per_file_read']:.1f} / "
                      f"{out['us_per_mib_read']:.1f} read ({out['served']})", flush=True)
    except RuntimeError as exc:
        print(f"ckptfs bench transport: {exc}", file=sys.stderr)
        return 1
    finally:
        if switched:
            _write(ENABLE_URING, "N")
        shutil.rmtree(tmp, ignore_errors=True)
    facts = machine()
    poll = facts["guest_halt_poll_ns"]
    poll = "n/a (not a haltpoll guest)" if poll is None else f"{poll} ns"
    print(f"\nkernel {facts['kernel']}, {facts['cpus']} CPUs, guest halt polling {poll}; "
          f"{a.files} files of {a.size} B and {a.writes} writes of 1 MiB per run, then as many "
          f"reads, medians of {a.rounds} rounds\n")
    print("| variant | us per small file written | per 1 MiB written | per small file read "
          "| per 1 MiB read | requests on io_uring |")
    print("|---|---:|---:|---:|---:|---:|")
    summary = {}
    keys = ("us_per_file", "us_per_mib_write", "us_per_file_read", "us_per_mib_read")
    for v, runs in results.items():
        summary[v] = {k: statistics.median(x[k] for x in runs) for k in keys}
        summary[v]["on_io_uring"] = min(x["on_io_uring"] for x in runs)
        print(f"| {v} | " + " | ".join(f"{summary[v][k]:.1f}" for k in keys)
              + f" | {summary[v]['on_io_uring']} |")
    if a.json:
        with open(a.json, "w") as fp:
            json.dump({"machine": facts, "files": a.files, "size": a.size, "writes": a.writes,
                       "rounds": a.rounds, "results": summary,
                       "runs": results}, fp, indent=1)
    return 0
