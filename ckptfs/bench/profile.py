"""``ckptfs bench profile``: where the ckptfs daemon's CPU goes during a checkpoint's save and
cold restore (docs/benchmarks.md, "Where the daemon's CPU goes").

The steps are the end-to-end benchmark's ckptfs steps (``torch.save`` per tensor into a fresh
mount, ``sync``; unmount, caches dropped, a fresh mount, ``torch.load`` of every tensor, checked
bit for bit), on the GPT-2-shaped state or ``--small N`` tensors. Per phase it reports the wall
time, the daemon's user and system CPU (all threads, and per thread; the request thread's
with how often it slept and was woken), how its request waits
ended (found queued, caught spinning, slept in epoll), which requests the queue threads handed
to the trio thread (by opcode; the rest they answered in C), and what one profiler saw:

  perf      ``perf record -g -p PID``: every sample put in a category by its kernel call path
            (readv of /dev/fuse, its reply, poll, epoll, madvise, ...) or its user-space
            library (libpython, CRC32C, libc, ...); Python frames are invisible to perf
  py-spy    ``py-spy record --native --idle``: the request thread's samples by what its Python
            was doing (wall-clock samples: shares of those not parked in epoll count)
  requests  the kernel's FUSE tracepoints (``perf record -a``): every request's opcode, size
            and time from queued to answered, for this mount's connection
  syscalls  the daemon's readv/write/writev on /dev/fuse (syscall tracepoints): per request
            the kernel's copy (readv), the daemon's work up to the reply, and the reply

One profiler per run: attached, each slows the daemon. ``--variants`` alternates mount option
sets round by round (``"request_spin=0;"`` compares that option with the default), which
makes this the alternating comparison for a mount option too (medians at the end). Needs root
(caches, perf); perf and py-spy must be installed for those profilers.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from ckptfs import api
from ckptfs.options import parse_size

PROFILERS = ("none", "perf", "py-spy", "requests", "syscalls")
TICK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------ the daemon's CPU
def thread_cpu(pid: int) -> dict[int, tuple[str, float, float, int]]:
    """tid -> (name, user s, system s, times it slept and was woken) of every thread of
    `pid`, from /proc (CPU in clock ticks, so a phase shorter than a tick of CPU reads 0;
    the sleeps are the kernel's voluntary context switches)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                s = f.read()
        except OSError:
            continue
        fields = s.rsplit(")", 1)[1].split()
        woke = 0
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        woke = int(line.split()[1])
        except OSError:
            pass
        out[int(tid)] = (s[s.index("(") + 1:s.rindex(")")], int(fields[11]) / TICK,
                         int(fields[12]) / TICK, woke)
    return out


def cpu_delta(before: dict, after: dict) -> dict[str, tuple[float, float]]:
    """Per thread (name/tid): user and system seconds between two thread_cpu() looks."""
    d = {}
    for tid, (name, u, s, _) in after.items():
        _, u0, s0, _ = before.get(tid, (name, 0.0, 0.0, 0))
        if u - u0 + s - s0 > 0:
            d[f"{name}/{tid}"] = (round(u - u0, 3), round(s - s0, 3))
    return d


def request_thread(pid: int, before: dict, after: dict) -> dict:
    """The daemon's request thread (trio's: the process's first thread) between two
    thread_cpu() looks: its CPU seconds and how often it slept and was woken (each wake-up
    costs it ~40-60 us of trio's run loop on this VM: docs/performance-notes.md)."""
    name, u, s, woke = after.get(pid, ("", 0.0, 0.0, 0))
    _, u0, s0, woke0 = before.get(pid, (name, 0.0, 0.0, 0))
    return {"cpu_s": round(u - u0 + s - s0, 3), "wakeups": woke - woke0}


WAIT_COUNTS = ("requests_found_queued", "requests_caught_spinning", "requests_waited_for",
               "requests_answered_here", "requests_forwarded")
# linux/fuse.h: the opcodes a checkpoint's save or restore sends
OPCODES = {1: "LOOKUP", 2: "FORGET", 3: "GETATTR", 4: "SETATTR", 9: "MKDIR", 14: "OPEN",
           15: "READ", 16: "WRITE", 18: "RELEASE", 20: "FSYNC", 22: "GETXATTR", 25: "FLUSH",
           27: "OPENDIR", 28: "READDIR", 29: "RELEASEDIR", 35: "CREATE", 36: "INTERRUPT",
           39: "IOCTL", 42: "BATCH_FORGET", 44: "READDIRPLUS"}


def python_side(st0: dict, st1: dict) -> dict:
    """What of a phase's requests the queue threads handed to the daemon's trio thread, by
    opcode, and the WRITE bytes it copied into staging (the rest landed in place); {} on a
    mount without queue threads."""
    if "ring_handed_by_opcode" not in st1:
        return {}
    h0, h1 = st0.get("ring_handed_by_opcode", {}), st1["ring_handed_by_opcode"]
    by = {OPCODES.get(int(op), op): n - h0.get(op, 0) for op, n in h1.items()}
    return {"requests": st1["ring_requests"] - st0.get("ring_requests", 0),
            "answered_in_c": st1["ring_answered_in_c"] - st0.get("ring_answered_in_c", 0),
            "handed": sum(by.values()),
            "by_opcode": dict(sorted(((k, v) for k, v in by.items() if v), key=lambda kv: -kv[1])),
            "bytes_copied_in": st1["bytes_copied_in"] - st0.get("bytes_copied_in", 0)}


# ------------------------------------------------------------------------ profilers
def start_profiler(kind: str, pid: int, stem: str) -> subprocess.Popen | None:
    if kind == "perf":
        cmd = ["perf", "record", "-F", "1999", "-g", "-p", str(pid), "-o", stem + ".perf"]
    elif kind == "py-spy":
        cmd = ["py-spy", "record", "--native", "--idle", "--threads", "-r", "250", "--format",
               "raw", "-o", stem + ".pyspy", "-p", str(pid)]
    elif kind == "requests":
        cmd = ["perf", "record", "-a", "-e", "fuse:fuse_request_send", "-e",
               "fuse:fuse_request_end", "-o", stem + ".requests"]
    elif kind == "syscalls":
        events = ",".join(f"syscalls:sys_{w}_{c}" for c in ("readv", "write", "writev")
                          for w in ("enter", "exit"))
        cmd = ["perf", "record", "-e", events, "-p", str(pid), "-o", stem + ".syscalls"]
    else:
        return None
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached before the phase starts
    return p


def stop_profiler(p: subprocess.Popen | None) -> None:
    if p is None:
        return
    p.send_signal(signal.SIGINT)
    try:
        p.wait(120)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def perf_script(path: str, *fields: str) -> str:
    cmd = ["perf", "script", "-i", path] + (["-F", ",".join(fields)] if fields else [])
    return subprocess.run(cmd, capture_output=True, text=True).stdout


COPY = ("fuse_copy_do", "fuse_copy_folio", "fuse_copy_fill", "fuse_copy_args", "fuse_copy_one",
        "fuse_copy_pages")


def perf_category(frames: list[tuple[str, str]]) -> str:
    """The category of one perf sample: frames are (symbol, library), the leaf first."""
    syms = {s for s, _ in frames}
    leaf_sym, leaf_dso = frames[0]

    def has(*names: str) -> bool:
        return not syms.isdisjoint(names)

    if "kernel" in leaf_dso:
        if has("asm_exc_page_fault", "exc_page_fault"):
            return "k: page faults"
        if has("fuse_dev_do_read"):
            return ("k: readv /dev/fuse: WRITE payload copy" if has(*COPY) else
                    "k: readv /dev/fuse: other")
        if has("fuse_dev_do_write"):
            if has(*COPY):
                return "k: reply: READ payload copy"
            return "k: reply: request end, waking the caller"
        for names, cat in ((("do_sys_poll",), "k: poll (request spin)"),
                           (("do_epoll_wait", "ep_poll"), "k: epoll, scheduling, futex"),
                           (("__x64_sys_futex", "futex_do_wait"), "k: epoll, scheduling, futex"),
                           (("__x64_sys_io_uring_enter", "io_submit_sqes"), "k: io_uring_enter"),
                           (("__x64_sys_madvise",), "k: madvise (first touch of buffers)"),
                           (("__sys_sendmsg", "__x64_sys_recvfrom"), "k: socket pair to libfuse"),
                           (("__schedule", "schedule"), "k: epoll, scheduling, futex")):
            if has(*names):
                return cat
        return "k: other"
    if "_crc32c" in leaf_dso:
        return "u: CRC32C"
    if "vdso" in leaf_dso:
        return "u: clock_gettime (request spin)"
    if "python" in leaf_dso:
        return "u: Python interpreter"
    if "libc" in leaf_dso:
        return "u: libc (syscall wrappers, malloc, GIL mutex)"
    return "u: other: " + leaf_dso.rsplit("/", 1)[-1]


def parse_perf_samples(text: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """`perf script -F comm,tid,ip,sym,dso` with call chains -> [(thread, frames)]."""
    samples, head, frames = [], None, []

    def flush() -> None:
        if head is not None and frames:
            samples.append((head, frames))

    for line in text.splitlines():
        if not line.strip():
            flush()
            head, frames = None, []
        elif not line[0].isspace():
            flush()
            head, frames = line.strip(), []  # "comm tid" of the sample's thread
        else:
            parts = line.strip().split(None, 1)
            if len(parts) < 2:
                continue
            rest = parts[1]
            sym, dso = rest.rsplit(" (", 1) if rest.endswith(")") and " (" in rest else (rest, "")
            frames.append((sym.split("+0x")[0], dso.rstrip(")")))
    flush()
    return samples


def perf_shares(path: str) -> dict:
    samples = parse_perf_samples(perf_script(path, "comm", "tid", "ip", "sym", "dso"))
    if not samples:
        return {"samples": 0}
    threads = collections.Counter(t for t, _ in samples)
    main = threads.most_common(1)[0][0]  # the request thread
    cats = collections.Counter()
    for t, frames in samples:
        c = perf_category(frames)
        cats[c if t == main or c == "u: CRC32C" else "other threads: " + c[3:]] += 1
    n = len(samples)
    return {"samples": n, "request_thread_share": threads[main] / n,
            "shares": {c: k / n for c, k in cats.most_common()}}


PYSPY_CATEGORIES = (
    ("RequestWait._spin", "request spin"),
    ("os_readv", "readv /dev/fuse (the kernel's copy)"),
    ("FastPath.send", "reply write(v)"),
    ("reply_error", "reply write(v)"),
    ("crc32c", "CRC32C"),
    ("get_events", "parked in epoll (or trio's zero-timeout poll)"),
    ("InPlaceWrites.", "Python: WRITE"),
    ("Dispatch.read", "Python: READ"),
    ("Dispatch.entry_op", "Python: LOOKUP, GETATTR, OPEN, CREATE"),
    ("Dispatch.simple", "Python: FLUSH, RELEASE"),
    ("FastPath.serve_one", "Python: reading and dispatching requests"),
    ("RequestWait.__call__", "Python: the request wait"),
    ("FastPath.__call__", "Python: the request wait"),
    ("__init__.pyx", "pyfuse3 (forwarded requests)"),
    ("trio/_core", "trio scheduler, other tasks"),
)


def pyspy_shares(path: str) -> dict:
    """The request thread's (MainThread's) py-spy samples by category."""
    cats = collections.Counter()
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            if not n.isdigit() or "MainThread" not in frames[0]:
                continue
            joined = ";".join(frames[1:])
            cat = next((c for key, c in PYSPY_CATEGORIES if key in joined), "other")
            cats[cat] += int(n)
    n = sum(cats.values())
    idle = cats.get("parked in epoll (or trio's zero-timeout poll)", 0)
    return {"samples": n, "shares": {c: k / n for c, k in cats.most_common()} if n else {},
            "busy_shares": {c: k / (n - idle) for c, k in cats.most_common()
                            if not c.startswith("parked")} if n > idle else {}}


SEND = re.compile(r"\s(\d+\.\d+):\s+fuse:fuse_request_send: connection (\d+) req (\d+) "
                  r"opcode \d+ \((\w+)\) len (\d+)")
END = re.compile(r"\s(\d+\.\d+):\s+fuse:fuse_request_end: connection (\d+) req (\d+) len (\d+)")


def request_table(text: str, connection: str | None = None) -> dict:
    """Per opcode of one FUSE connection (the busiest in data requests unless given): count,
    request and reply sizes, time from queued to answered."""
    sends, ends = {}, {}
    busy = collections.Counter()
    for line in text.splitlines():
        m = SEND.search(line)
        if m:
            t, c, u, op, ln = m.groups()
            sends[(c, u)] = (float(t), op.removeprefix("FUSE_"), int(ln))
            busy[c] += op in ("FUSE_WRITE", "FUSE_READ", "FUSE_CREATE", "FUSE_LOOKUP")
            continue
        m = END.search(line)
        if m:
            t, c, u, ln = m.groups()
            ends[(c, u)] = (float(t), int(ln))
    if connection is None:
        if not busy:
            return {}
        connection = busy.most_common(1)[0][0]
    ops: dict[str, list] = collections.defaultdict(list)
    for (c, u), (t, op, ln) in sends.items():
        e = ends.get((c, u))
        if c == connection and e is not None:
            ops[op].append((ln, e[1], (e[0] - t) * 1e6))
    out = {}
    for op, v in sorted(ops.items(), key=lambda kv: -len(kv[1])):
        lat = sorted(x[2] for x in v)
        out[op] = {"n": len(v), "in_len_median": statistics.median(x[0] for x in v),
                   "in_len_max": max(x[0] for x in v),
                   "out_len_median": statistics.median(x[1] for x in v),
                   "out_len_max": max(x[1] for x in v),
                   "round_trip_us_median": statistics.median(lat),
                   "round_trip_us_p90": lat[int(len(lat) * 0.9)],
                   "round_trip_s_sum": sum(lat) / 1e6}
    return {"connection": connection, "opcodes": out}


EVENT = re.compile(r"^\s*\S.*?\s(\d+)\s+\[\d+\]\s+(\d+\.\d+):\s+(\S+):\s*(.*)$")


def syscall_table(text: str) -> dict:
    """Per kind of request: the readv that took it (a WRITE's copy), the time to the reply,
    the reply (a READ's copy); medians and sums. The kind comes from the sizes read and
    written (a WRITE's payload comes with the readv; a READ's goes with the reply)."""
    state: dict[str, dict] = {}
    rows: dict[str, list] = collections.defaultdict(list)
    for line in text.splitlines():
        m = EVENT.match(line)
        if not m:
            continue
        tid, t, name, rest = m.groups()
        t_us = float(t) * 1e6
        s = state.setdefault(tid, {})
        arg = rest.strip()
        if name == "syscalls:sys_enter_readv":
            state[tid] = {"r0": t_us, "fd": arg.split(",")[0]}
        elif name == "syscalls:sys_exit_readv" and "r0" in s:
            s.update(r1=t_us, n=int(arg, 16) if arg.startswith("0x") else -1)
        elif name in ("syscalls:sys_enter_write", "syscalls:sys_enter_writev") and "r1" in s:
            if s["fd"] in arg:
                s["w0"] = t_us
        elif name in ("syscalls:sys_exit_write", "syscalls:sys_exit_writev") and "w0" in s:
            n, sent = s["n"], int(arg, 16) if arg.startswith("0x") else 0
            kind = ("WRITE of 1 MiB or more" if n >= 1 << 20 else "WRITE, smaller" if n > 200
                    else "READ, reply >= 512 KiB" if sent >= 1 << 19
                    else "READ, smaller reply" if sent > 200 and n == 80 else "other requests")
            rows[kind].append((s["r1"] - s["r0"], s["w0"] - s["r1"], t_us - s["w0"]))
            state[tid] = {}
    out = {}
    for kind, v in sorted(rows.items()):
        out[kind] = {"n": len(v)}
        for i, part in enumerate(("readv", "to_reply", "reply")):
            out[kind][part + "_us_median"] = statistics.median(x[i] for x in v)
            out[kind][part + "_s_sum"] = sum(x[i] for x in v) / 1e6
    return out


def format_profile(kind: str, prof: dict) -> list[str]:
    """What one profiler saw, as lines of text."""
    if kind in ("perf", "py-spy"):
        key = "busy_shares" if kind == "py-spy" else "shares"
        head = (f"  {prof.get('samples', 0)} samples"
                + (f", request thread {100 * prof['request_thread_share']:.1f}%"
                   if "request_thread_share" in prof else "")
                + (" (shares of the request thread's samples not parked in epoll)"
                   if kind == "py-spy" else ""))
        return [head] + [f"  {100 * v:5.1f}%  {c}" for c, v in prof.get(key, {}).items()
                         if v >= 0.003]
    if kind == "requests":
        lines = [f"  connection {prof.get('connection')}: opcode, count, request bytes "
                 "(median/max), reply bytes (median/max), queued to answered (median, p90, sum)"]
        for op, r in prof.get("opcodes", {}).items():
            lines.append(f"  {op:12s} {r['n']:7d}  {r['in_len_median']:9.0f} {r['in_len_max']:9d}"
                         f"  {r['out_len_median']:9.0f} {r['out_len_max']:9d}  "
                         f"{r['round_trip_us_median']:7.1f} us {r['round_trip_us_p90']:7.1f} us "
                         f"{r['round_trip_s_sum']:7.3f} s")
        return lines
    if kind == "syscalls":
        lines = ["  request, count, readv, readv to reply, reply (medians; sums)"]
        for k, r in prof.items():
            lines.append(f"  {k:24s} {r['n']:7d}  " + "  ".join(
                f"{r[p + '_us_median']:7.1f} us ({r[p + '_s_sum']:.3f} s)"
                for p in ("readv", "to_reply", "reply")))
        return lines
    return []


def analyse(kind: str, stem: str) -> dict:
    if kind == "perf":
        return perf_shares(stem + ".perf")
    if kind == "py-spy":
        return pyspy_shares(stem + ".pyspy")
    if kind == "requests":
        return request_table(perf_script(stem + ".requests"))
    if kind == "syscalls":
        return syscall_table(perf_script(stem + ".syscalls"))
    return {}


# ------------------------------------------------------------------------ one run
def phase(mount: api.Mount, kind: str, stem: str, step) -> tuple[object, dict]:
    st0 = mount.status()
    prof = start_profiler(kind, mount.pid, stem)
    before = thread_cpu(mount.pid)
    t0 = time.perf_counter()
    try:
        out = step()
    finally:
        t1 = time.perf_counter()
        after = thread_cpu(mount.pid)
        stop_profiler(prof)
    st1 = mount.status()
    threads = cpu_delta(before, after)
    res = {"wall_s": t1 - t0, "user_s": sum(u for u, _ in threads.values()),
           "sys_s": sum(s for _, s in threads.values()), "threads": threads,
           "request_thread": request_thread(mount.pid, before, after),
           "waits": {k: st1.get(k, 0) - st0.get(k, 0) for k in WAIT_COUNTS},
           "python_side": python_side(st0, st1)}
    if kind != "none":
        res["profile"] = analyse(kind, stem)
    return out, res


def run_once(w, opts: dict, kind: str, base: str, stem: str) -> dict:
    from ckptfs.bench import drop_caches
    from ckptfs.bench.e2e import verify
    from ckptfs.bench.peers import load_per_tensor, save_per_tensor

    root = tempfile.mkdtemp(prefix="ckptfs-profile-", dir=base)
    backing, mnt = os.path.join(root, "backing"), os.path.join(root, "mnt")
    os.makedirs(backing)
    os.makedirs(mnt)
    log = os.path.join(root, "daemon.log")
    res: dict = {"options": opts}
    try:
        with api.Mount(backing, mnt, log_file=log, **opts) as m:
            m.wait_settled()
            drop_caches(3)
            _, res["save"] = phase(m, kind, stem + "-save",
                                   lambda: (save_per_tensor(w, mnt), api.sync(mnt)))
        drop_caches(3)
        with api.Mount(backing, mnt, log_file=log, **opts) as m:  # (a restore right away)
            loaded, res["restore"] = phase(m, kind, stem + "-restore",
                                           lambda: load_per_tensor(w, mnt))
        ok, why = verify(w, loaded)
        res["verified"] = ok
        if not ok:
            res["error"] = why
    finally:
        if api.is_mounted(mnt):
            api.fusermount(mnt, lazy=True)
        shutil.rmtree(root, ignore_errors=True)
    return res


def parse_options(text: str) -> dict:
    """"k=v,k=v" -> api.Mount keywords ("true"/"false" for switches)."""
    out = {}
    for kv in filter(None, (p.strip() for p in text.split(","))):
        k, sep, v = kv.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"not KEY=VALUE: {kv!r}")
        out[k.strip().replace("-", "_")] = {"true": True, "false": False}.get(v.lower(), v)
    return out


def summary_lines(runs: list[dict], payload: int) -> list[str]:
    gb = payload / 1e9
    by = collections.defaultdict(list)
    for r in runs:
        by[(json.dumps(r["options"], sort_keys=True), r["phase"])].append(r)
    lines = []
    for (opts, ph), rs in by.items():
        walls = [r["wall_s"] for r in rs]
        cpus = [(r["user_s"] + r["sys_s"]) / gb for r in rs]
        waited = [r["waits"]["requests_waited_for"] for r in rs]
        lines.append(f"{ph:8s} {opts}: wall median {statistics.median(walls):.2f} s "
                     f"({', '.join(f'{x:.2f}' for x in walls)}), daemon CPU median "
                     f"{statistics.median(cpus):.3f} s/GB, waits in epoll median "
                     f"{statistics.median(waited):.0f}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptfs bench profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="gpt2", choices=("gpt2", "llama-1b", "llama-7b"))
    p.add_argument("--size", type=parse_size, default=2 << 30, help="state size (default 2G)")
    p.add_argument("--small", type=int, default=0, metavar="N",
                   help="N small tensors (8 B .. 64 KiB) instead of a model")
    p.add_argument("--profiler", choices=PROFILERS, default="none")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("-o", dest="options", type=parse_options, default={}, metavar="K=V,...",
                   help="mount options of every run (api.Mount keywords: request_spin=0)")
    p.add_argument("--variants", default="", metavar="K=V,...;K=V,...",
                   help="option sets that alternate in every round (an empty one: the "
                        "defaults), on top of -o")
    p.add_argument("--staging", default="512M", help="staging memory (default 512M, as e2e)")
    p.add_argument("--dir", default="/var/tmp", help="where backing directories go")
    p.add_argument("--keep", default="", metavar="DIR",
                   help="keep the profilers' raw output here (default: removed)")
    p.add_argument("--json", default="", help="write every run's figures here")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str]) -> int:
    from ckptfs.bench import models
    from ckptfs.bench.e2e import Workload

    a = build_parser().parse_args(argv)
    tool = {"perf": "perf", "requests": "perf", "syscalls": "perf", "py-spy": "py-spy"}
    if a.profiler in tool and not shutil.which(tool[a.profiler]):
        print(f"{tool[a.profiler]} is not installed", file=sys.stderr)
        return 2
    variants = [parse_options(v) for v in a.variants.split(";")] if a.variants else [{}]
    specs = (models.small_tensor_specs(a.small, seed=a.seed) if a.small
             else models.tensor_specs(a.arch, a.size))
    w = Workload(specs, a.seed)
    print(f"profile: {len(w.names)} tensors, {w.payload_bytes / 1e9:.3f} GB; profiler "
          f"{a.profiler}; {a.rounds} round(s) of {len(variants)} variant(s)", flush=True)
    os.makedirs(a.dir, exist_ok=True)  # (as `bench e2e` does)
    keep = a.keep or tempfile.mkdtemp(prefix="ckptfs-profile-out-", dir=a.dir)
    os.makedirs(keep, exist_ok=True)
    runs: list[dict] = []
    ok = True
    try:
        for rnd in range(a.rounds):
            for vi, v in enumerate(variants):
                opts = {"staging_size": a.staging, **a.options, **v}
                res = run_once(w, opts, a.profiler, a.dir, os.path.join(keep, f"r{rnd}-v{vi}"))
                ok &= bool(res.get("verified"))
                for ph in ("save", "restore"):
                    r = dict(res[ph], phase=ph, round=rnd, options=opts,
                             verified=res.get("verified"))
                    runs.append(r)
                    cpu = (r["user_s"] + r["sys_s"]) / (w.payload_bytes / 1e9)
                    print(f"round {rnd + 1} {opts} {ph}: {r['wall_s']:.2f} s, daemon CPU "
                          f"{cpu:.3f} s/GB (user {r['user_s']:.2f} s, system "
                          f"{r['sys_s']:.2f} s), waits {r['waits']}", flush=True)
                    rt = r["request_thread"]
                    print(f"  the request thread: {rt['cpu_s']:.2f} s of CPU, woken "
                          f"{rt['wakeups']} times", flush=True)
                    py = r["python_side"]
                    if py:
                        print(f"  the trio thread served {py['handed']} of the queue threads' "
                              f"{py['requests']} requests: {py['by_opcode']}; WRITE bytes "
                              f"copied there {py['bytes_copied_in']}", flush=True)
                    if "profile" in r:
                        print("\n".join(format_profile(a.profiler, r["profile"])), flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(keep, ignore_errors=True)
    print("\n".join(summary_lines(runs, w.payload_bytes)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "ckptfs bench profile " + " ".join(argv),
                       "payload_bytes": w.payload_bytes, "tensors": len(w.names),
                       "runs": runs}, f, indent=1)
    return 0 if ok else 1
