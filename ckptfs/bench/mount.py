"""``ckptfs bench mount``: how long a mount of a large tree takes and what the tree costs the
daemon in memory.

For each --files count it builds a backing directory the way a mount leaves one after a job
wrote that many small files (a tree of directories of --per-dir files, each file created,
written once and closed: an INODE, an EXTENT and a SETATTR record per file, commit groups of
--group files, the SETATTRs folded into the INODE records as the journal folds them
(journal.fold_setattrs), the files' bytes packed into data logs), written with the format's
own code
(format/records.py, format/index.py) rather than through a mount, which would take minutes for
a million files. Then, after one warm-up mount, --mounts timed mounts of it alternate with
timed mounts of an empty backing directory, and it reports the medians of:

  ready_s     from `ckptfs mount` until the mount is live (fork, imports, replay, FUSE init;
              with the staging memory faulted in meanwhile, unless --no-populate)
  replay_s    of that, what the daemon logs as its replay (all writers' trees built)
  rss_bytes   the daemon's resident memory once the mount is live (the staging memory
              included), and per file: (rss - the empty mount's rss) / files

Every figure is also written with --json. The targets (docs/benchmarks.md), judged at the end:
a tree of 100,000 files mounts in at most 1 s, 1,000,000 in at most 10 s (at most 1 s per
100,000 files, and 1 s for a smaller tree), at most 1 KiB of daemon memory per file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from crc32c import crc32c

from ckptfs import api
from ckptfs.bench.lifecycle import rss
from ckptfs.format import backingdir, index, records
from ckptfs.datapath.journal import fold_setattrs
from ckptfs.format.records import CommitRec, ExtentRec, InodeRec, SetattrRec
from ckptfs.options import parse_size

WRITER = "bench"
LOG_BYTES = 1 << 30  # bytes per synthesised data log (the default --log-size)


def build(backing: str, files: int, per_dir: int, file_bytes: int, group: int) -> dict:
    """A backing directory holding `files` files of `file_bytes` bytes each, in directories
    of `per_dir`. Returns what was built."""
    os.makedirs(backing, exist_ok=True)
    backingdir.check_backing(backing, create=True)
    wd = backingdir.WriterDir(backing, WRITER)
    wd.open()
    try:
        return _fill(wd.path, files, per_dir, file_bytes, group)
    finally:
        wd.close()


def _fill(wdir: str, files: int, per_dir: int, file_bytes: int, group: int) -> dict:
    now = time.time_ns()
    blob = bytearray()
    log, loff, fd = 0, 0, -1
    ino = 2
    seq = 0
    dirs = 0
    recs: list = []
    nrecs = 0
    for i in range(files):
        if i % per_dir == 0:
            dirs += 1
            recs.append(InodeRec(ino, 1, b"d%06d" % dirs, 0o40755, 0, 0, 0, now, now, now))
            d = ino
            ino += 1
        if fd < 0 or loff + file_bytes > LOG_BYTES:
            if fd >= 0:
                os.close(fd)
            log += 1
            fd = os.open(os.path.join(wdir, backingdir.data_log_name(log)),
                         os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.write(fd, records.data_log_header(WRITER, log))
            loff = records.DATA_HEADER_BYTES
        data = i.to_bytes(8, "little").ljust(file_bytes, b"x")  # each file its own bytes
        os.pwrite(fd, data, loff)
        t = now + 2 * i
        recs.append(InodeRec(ino, d, b"rank0_shard%07d.pt" % i, 0o100644, 0, 0, 0, t, t, t))
        recs.append(ExtentRec(ino, 0, file_bytes, log, loff, crc32c(data)))
        recs.append(SetattrRec(ino, 0o100644, 0, 0, t, t + 1, t + 1))  # (at close)
        loff += file_bytes
        ino += 1
        if (i + 1) % group == 0 or i == files - 1:
            folded = fold_setattrs(list(enumerate(recs)))  # as the journal commits them
            for k, rec in enumerate(recs):
                if k not in folded:
                    blob += records.encode(rec)
                    nrecs += 1
            seq += 1
            blob += records.encode(CommitRec(seq, t + 1))
            recs = []
    if fd >= 0:
        os.fsync(fd)
        os.close(fd)
    size = index.write_fresh(os.path.join(wdir, backingdir.INDEX_NAME), bytes(blob))
    return {"files": files, "dirs": dirs, "index_bytes": size, "records": nrecs + seq,
            "data_logs": log}


def timed_mount(backing: str, mnt: str, log_file: str, opts: dict) -> dict:
    """Mount, take the daemon's RSS, list the root, unmount."""
    t0 = time.perf_counter()
    m = api.Mount(backing, mnt, log_file=log_file, writer_id=WRITER, **opts).start()
    ready = time.perf_counter() - t0
    try:
        mem = rss(m.pid)
        os.listdir(mnt)
    finally:
        m.stop()
    with open(log_file, errors="replace") as f:
        replayed = [line for line in f if "ckptfs: replayed " in line]
    return {"ready_s": ready, "replay_s": float(replayed[-1].rsplit(",", 1)[1].split()[0]),
            "rss_bytes": mem}


def measure(backing: str, empty: str, mnt: str, log_file: str, mounts: int,
            opts: dict) -> dict:
    for b in (backing, empty):  # warm-up: the first mount starts a cold daemon
        timed_mount(b, mnt, log_file, opts)
    runs: dict[str, list[dict]] = {"tree": [], "empty": []}
    for i in range(mounts):
        order = [("tree", backing), ("empty", empty)]
        for name, b in order if i % 2 == 0 else order[::-1]:
            runs[name].append(timed_mount(b, mnt, log_file, opts))
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for name, rs in runs.items()}
    return {"runs": runs, "median": med}


def judge(files: int, ready_s: float, rss_per_file: float) -> list[dict]:
    limit = max(1.0, files / 100_000)
    return [{"target": "mount", "what": f"a mount of {files:,} files ready in <= {limit:g} s",
             "value": ready_s, "limit": limit, "held": ready_s <= limit},
            {"target": "memory", "what": "daemon memory per file <= 1 KiB",
             "value": rss_per_file, "limit": 1024, "held": rss_per_file <= 1024}]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ckptfs bench mount", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", default="100000",
                    help="comma-separated file counts (default 100000; e.g. 100000,1000000)")
    ap.add_argument("--per-dir", type=int, default=1000, help="files per directory")
    ap.add_argument("--file-size", type=parse_size, default=512, help="bytes per file")
    ap.add_argument("--group", type=int, default=100, help="files per commit group")
    ap.add_argument("--mounts", type=int, default=5, help="timed mounts of each")
    ap.add_argument("--no-populate", action="store_true",
                    help="mount with --no-populate: the staging memory (512 MiB) is not "
                    "faulted in at mount, what is left is the tree's cost")
    ap.add_argument("--dir", default="/var/tmp", help="where the backing directories go")
    ap.add_argument("--json", default=None, help="write all results as JSON here")
    return ap


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    counts = [int(parse_size(c)) for c in a.files.split(",")]
    work = tempfile.mkdtemp(prefix="ckptfs-bench-mount-", dir=a.dir)
    out: dict = {"machine": {"cpus": os.cpu_count(), "kernel": os.uname().release},
                 "file_bytes": a.file_size, "per_dir": a.per_dir,
                 "populate": not a.no_populate, "results": []}
    try:
        mnt, empty = os.path.join(work, "mnt"), os.path.join(work, "empty")
        os.mkdir(mnt)
        build(empty, 0, a.per_dir, a.file_size, a.group)
        log_file = os.path.join(work, "daemon.log")
        for n in counts:
            backing = os.path.join(work, f"tree-{n}")
            t0 = time.perf_counter()
            built = build(backing, n, a.per_dir, a.file_size, a.group)
            built["build_s"] = time.perf_counter() - t0
            m = measure(backing, empty, mnt, log_file, a.mounts,
                        {"no_populate": True} if a.no_populate else {})
            tree, base = m["median"]["tree"], m["median"]["empty"]
            per_file = (tree["rss_bytes"] - base["rss_bytes"]) / max(n, 1)
            res = {**built, **m, "rss_per_file": per_file,
                   "targets": judge(n, tree["ready_s"], per_file)}
            out["results"].append(res)
            print(f"{n:>9,} files ({built['index_bytes'] / 1e6:.1f} MB index): ready "
                  f"{tree['ready_s']:.3f} s (empty {base['ready_s']:.3f} s), replay "
                  f"{tree['replay_s']:.3f} s, rss {tree['rss_bytes'] / 1e6:.0f} MB "
                  f"(empty {base['rss_bytes'] / 1e6:.0f} MB): {per_file:.0f} B per file",
                  flush=True)
            for t in res["targets"]:
                print(f"  {'held' if t['held'] else 'MISSED'}: {t['what']} ({t['value']:.3g})")
            shutil.rmtree(backing)
    finally:
        for p in api.mounts():
            if p.mountpoint.startswith(work):
                api.fusermount(p.mountpoint, lazy=True)
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
