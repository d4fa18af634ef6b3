"""``ckptfs bench e2e``: end-to-end checkpoint save/restore, ckptfs against the alternatives.

The same state dict (model weights + Adam state with real architectures' shapes, or many small
tensors with --small) is saved and restored by each contender (see ckptfs/bench/peers.py), on
the same disk, in one run: a warm-up round (not counted), then --rounds rounds in which the
contenders alternate (A B C ... A B C ...). Before each save and each restore the page cache is
dropped (`sync; echo 3 > /proc/sys/vm/drop_caches`, when root): this machine's memory is backed
lazily, so a benchmark that inherits a full page cache measures that, not the code.

Per contender and run:
  blocked_s   until the save call returns (per-tensor torch.save: until the last one returns)
  durable_s   until the checkpoint is durable (sync/fsync included); GB/s = payload / durable_s
  restore_s   torch.load of every tensor (or the contender's own load), cold; ckptfs after an
              unmount and a remount (both reported, not timed in restore_s). With
              --warm-restore: right after the save, as an evaluation or a restart on the node
              that saved reads it: the page cache is not dropped, and ckptfs restores through
              the mount that saved (what its staging memory still holds is read from there)
  peak RSS    of this process during save / restore (VmHWM, reset per step via clear_refs),
              and the ckptfs daemon's VmHWM
  files, fsyncs on the backing store (files: counted in the backing directory; fsyncs: by
              construction, ckptfs: the daemon's data_syncs + index_commits)
The restored tensors are compared bit for bit with the saved ones, outside the timed region.
Ratios: "time vs ckptfs" = contender median time / ckptfs median time (> 1: ckptfs is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback

from ckptfs import api, bench
from ckptfs.bench import models, targets
from ckptfs.bench.peers import CONTENDERS, cpu_now, cpu_since
from ckptfs.bench.throttle import Throttle
from ckptfs.fuse import ring
from ckptfs.system import guest_halt_poll_ns, libc, status_bytes


DEFAULT_CONTENDERS = ("straight", "straight_fsync", "ckptfs", "ckptfs_pc", "ckptfs_uring", "dcp",
                      "dcp_ckptfs", "torchsnapshot", "datastates", "tmpfs", "raw", "fio")
QUICK_SIZE = 24 << 20


def parse_size(text: str) -> int:
    from ckptfs.options import parse_size as p

    return p(text)


# ------------------------------------------------------------------------ /proc helpers
def drop_caches() -> bool:
    """sync + drop page cache, dentries and inodes. False when not permitted (not root)."""
    return bench.drop_caches(3)


def reset_peak_rss() -> int:
    """Reset VmHWM to the current RSS (Linux >= 4.0); returns the current RSS. Free heap
    memory is first given back (malloc_trim), so memory a contender reuses from an earlier
    one's freed buffers still counts as its own."""
    try:
        libc.malloc_trim(0)
    except AttributeError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return status_bytes("VmRSS") or 0


def peak_rss() -> int:
    return status_bytes("VmHWM") or 0


def fs_type(path: str) -> tuple[str, str]:
    """(file system type, device) of the mount holding `path`, from mountinfo."""
    m = api.mount_holding(path)
    return (m.fstype, m.source) if m is not None else ("?", "?")


def count_tree(path: str) -> tuple[int, int, int]:
    """(regular files, directories, bytes in files) under path."""
    files = dirs = nbytes = 0
    for root, ds, fs in os.walk(path):
        dirs += len(ds)
        for name in fs:
            files += 1
            try:
                nbytes += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return files, dirs, nbytes


def machine_facts(path: str) -> dict:
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    fstype, dev = fs_type(path)
    facts = {"nproc": os.cpu_count(), "mem_total_gib": round(mem / (1 << 30), 1),
             "kernel": platform.release(), "python": platform.python_version(),
             "dir": path, "fs": fstype, "device": dev,
             # an idle vCPU's polling before it halts: it moves small-file figures 2x here
             "guest_halt_poll_ns": guest_halt_poll_ns()}
    try:
        import torch

        facts["torch"] = torch.__version__
    except ImportError:
        pass
    return facts


# ------------------------------------------------------------------------ workload
class Workload:
    """The state dict and its one-file-per-tensor layout."""

    def __init__(self, specs, seed: int = 0) -> None:
        self.specs = specs
        self.sd = models.state_dict(specs, seed)
        self.names = [n for n, _, _ in specs]
        self.rel = {n: models.file_name(n) for n in self.names}
        self.dirs = sorted({os.path.dirname(p) for p in self.rel.values() if os.path.dirname(p)})
        self.payload_bytes = sum(models.sizes(specs))


def verify(w: Workload, loaded: dict) -> tuple[bool, str]:
    """Bit-exact comparison of every restored tensor with the saved one."""
    import torch

    if set(loaded) != set(w.names):
        missing = sorted(set(w.names) - set(loaded))[:3]
        return False, f"restored names differ (missing e.g. {missing})"
    for name in w.names:
        a, b = w.sd[name], loaded[name]
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False, f"{name}: dtype/shape differ ({getattr(b, 'dtype', type(b))})"
        if not torch.equal(a.reshape(-1).view(torch.uint8),
                           b.contiguous().reshape(-1).view(torch.uint8)):
            return False, f"{name}: contents differ"
    return True, ""


class Config:
    def __init__(self, a, base: str, shm_base: str, log_dir: str, local_base: str) -> None:
        self.base = base
        self.shm_base = shm_base
        self.log_dir = log_dir
        self.mount_options = {"staging_size": a.staging, "segment_size": a.segment,
                              "queue_depth": a.queue_depth}
        self.mount_timeout = 60.0
        self.step_timeout = a.step_timeout
        self.live_mounts: list[api.Mount] = []
        self.keep_failed = a.keep_failed
        self.warm_restore = a.warm_restore  # (restore right after the save: see the docstring)
        self.local_base = local_base  # node-local storage (the node tier, ckptfs_local)


class Run:
    """One contender, one round: its directories and what the steps report."""

    def __init__(self, cfg: Config, w: Workload, key: str, label: str) -> None:
        self.cfg, self.w = cfg, w
        self.root = tempfile.mkdtemp(prefix=key + "-", dir=cfg.base)
        self.backing = os.path.join(self.root, "backing")
        self.mountpoint = os.path.join(self.root, "mnt")
        self.log_file = os.path.join(cfg.log_dir, label + ".log")
        self.mounts = cfg.live_mounts
        self.extra: dict = {}
        self.override: dict = {}  # times a contender measures itself (fio)
        self.t_blocked: float | None = None
        self.cpu0: dict[str, float] = {}  # peers.cpu_now() when the save started
        self.daemon_cpu0: float | None = None  # the daemon's CPU seconds then
        self.bytes_moved = w.payload_bytes
        os.makedirs(self.backing)

    def mark_blocked(self) -> None:
        self.t_blocked = time.perf_counter()


def _log_tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def run_one(cfg: Config, w: Workload, key: str, tag: str) -> dict:
    cls = CONTENDERS[key]
    c = cls()
    run = Run(cfg, w, key, f"{key}-{tag}")
    res: dict = {"contender": key, "round": tag, "ok": False}
    failed_backing = False
    try:
        c.setup(run)
        res["caches_dropped_save"] = drop_caches()
        rss0 = reset_peak_rss()
        run.cpu0 = cpu_now()
        t0 = time.perf_counter()
        c.save(run)
        t1 = time.perf_counter()
        res.update(cpu_since(run.cpu0, "save"))
        res["save_wall_s"] = t1 - t0  # (durable_s may be what the contender measured itself)
        res["blocked_s"] = (run.t_blocked or t1) - t0
        res["durable_s"] = t1 - t0
        res["rss_before_save_bytes"] = rss0
        res["rss_peak_save_bytes"] = peak_rss()
        files, dirs, nbytes = count_tree(c.count_dir(run))
        res.update(files_created=files, dirs_created=dirs, bytes_in_files=nbytes)
        c.after_save(run)
        res["fsyncs"], res["fsyncs_counted"] = c.fsyncs(run)
        res["caches_dropped_restore"] = (not cfg.warm_restore and drop_caches()
                                         and c.durable)
        c.setup_restore(run)
        rss1 = reset_peak_rss()
        t2 = time.perf_counter()
        loaded = c.restore(run)
        t3 = time.perf_counter()
        res["restore_s"] = t3 - t2
        res["rss_before_restore_bytes"] = rss1
        res["rss_peak_restore_bytes"] = peak_rss()
        if loaded is None:
            res["verified"] = None  # raw bytes, no tensors
        else:
            ok, why = verify(w, loaded)
            res["verified"] = ok
            if not ok:
                res["error"] = "restore differs from the saved state dict: " + why
                if c.on_ckptfs:
                    res["daemon_log"] = run.log_file
                    res["daemon_log_tail"] = _log_tail(run.log_file)
                    failed_backing = True
            del loaded
        res["bytes"] = run.bytes_moved
        res.update(run.override)
        res["ok"] = "error" not in res
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - one contender failing must not end the run
        # (BaseException: DCP's CheckpointException derives from it)
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc(limit=8)
        if c.on_ckptfs:
            res["daemon_log"] = run.log_file
            res["daemon_log_tail"] = _log_tail(run.log_file)
            failed_backing = True
    finally:
        try:
            c.cleanup(run)
        finally:
            if failed_backing and cfg.keep_failed:
                # post-mortem: keep what ckptfs wrote (remount it to re-read the data)
                dest = os.path.join(cfg.log_dir, f"{key}-{tag}-backing")
                shutil.move(run.backing, dest)
                res["backing_kept"] = dest
            shutil.rmtree(run.root, ignore_errors=True)
    res.update(run.extra)
    return res


# ------------------------------------------------------------------------ summary
FIELDS = ("blocked_s", "durable_s", "backing_durable_s", "restore_s", "files_created",
          "dirs_created", "fsyncs",
          "rss_peak_save_bytes", "rss_peak_restore_bytes", "daemon_peak_rss_bytes",
          "daemon_restore_peak_rss_bytes", "unmount_s", "remount_s", "bytes_in_files",
          "daemon_save_cpu_s", "daemon_restore_cpu_s", "daemon_backing_cpu_s",
          "busy_save_cpu_s", "bench_save_cpu_s", "gluster_save_cpu_s", "disk_save_busy_s",
          "busy_backing_cpu_s", "bench_backing_cpu_s", "gluster_backing_cpu_s",
          "disk_backing_busy_s", "drained_by_node_bytes", "drain_save_mb_s", "drain_after_mb_s")


def summarize(runs: list[dict], keys: list[str], payload: int) -> dict:
    out: dict = {}
    for key in keys:
        rs = [r for r in runs if r["contender"] == key and r["round"] != "warmup"]
        good = [r for r in rs if r["ok"]]
        med = {}
        for f in FIELDS:
            vals = [r[f] for r in good if r.get(f) is not None]
            if vals:
                med[f] = statistics.median(vals)
        for f in ("rss_peak_save_bytes", "rss_peak_restore_bytes"):
            base = "rss_before_save_bytes" if "save" in f else "rss_before_restore_bytes"
            vals = [r[f] - r[base] for r in good if r.get(f) is not None]
            if vals:
                med[f.replace("peak", "extra")] = statistics.median(vals)
        nbytes = good[0]["bytes"] if good else payload
        if med.get("durable_s"):
            med["durable_gbps"] = nbytes / med["durable_s"] / 1e9
        if med.get("blocked_s"):
            med["blocked_gbps"] = nbytes / med["blocked_s"] / 1e9
        if med.get("restore_s"):
            med["restore_gbps"] = nbytes / med["restore_s"] / 1e9
        for f in ("daemon_save_cpu_s", "daemon_restore_cpu_s", "daemon_backing_cpu_s",
                  "bench_save_cpu_s", "gluster_save_cpu_s", "bench_backing_cpu_s",
                  "gluster_backing_cpu_s"):  # per GB of payload
            if med.get(f) is not None:
                med[f + "_per_gb"] = med[f] / (nbytes / 1e9)
        for step, span in (("save", "save_wall_s"), ("backing", "backing_durable_s")):
            # the machine's CPUs busy on average over the step, and the busiest disk's share
            # of it: near the CPUs' number, or 1, they bound it
            for what, field in (("busy_cpus", f"busy_{step}_cpu_s"),
                                ("disk_busy", f"disk_{step}_busy_s")):
                vals = [r[field] / r[span] for r in good
                        if r.get(field) is not None and r.get(span)]
                if vals:
                    med[f"{what}_{step}"] = statistics.median(vals)
        cls = CONTENDERS[key]
        out[key] = {"label": cls.label, "limit": cls.limit, "durable": cls.durable,
                    "runs_ok": len(good), "runs": len(rs), "bytes": nbytes,
                    "verified": all(r.get("verified") in (True, None) for r in good) and
                    bool(good),
                    "caches_dropped": all(r.get("caches_dropped_save") for r in good)
                    and bool(good),
                    "fsyncs_counted": good[0].get("fsyncs_counted", "") if good else "",
                    "errors": sorted({r["error"] for r in rs if r.get("error")}),
                    "median": med}
    ck = out.get("ckptfs", {}).get("median", {})
    for key, s in out.items():
        s["time_vs_ckptfs"] = {f: (s["median"][f] / ck[f]) for f in
                               ("blocked_s", "durable_s", "restore_s")
                               if s["median"].get(f) and ck.get(f)}
    return out


def _mb(v) -> str:
    return "-" if v is None else "%.0f" % (v / MiB)


MiB = 1 << 20


def format_table(summary: dict, payload: int, ntensors: int) -> str:
    hdr = ("contender", "blocked s", "durable s", "GB/s", "restore s", "GB/s",
           "durable vs ckptfs", "restore vs ckptfs", "files", "fsyncs", "+RSS save MB",
           "daemon MB", "daemon CPU s/GB", "busy CPUs", "disk busy", "ok")
    rows = []
    for key, s in summary.items():
        m, r = s["median"], s["time_vs_ckptfs"]

        def f(k, fmt="%.2f"):
            return fmt % m[k] if m.get(k) is not None else "-"
        daemon = None
        if m.get("daemon_peak_rss_bytes") is not None:
            daemon = max(m["daemon_peak_rss_bytes"], m.get("daemon_restore_peak_rss_bytes", 0))
        rows.append((s["label"], f("blocked_s", "%.3f"), f("durable_s", "%.3f")
                     + ("" if s["durable"] else "*"), f("durable_gbps"), f("restore_s", "%.3f"),
                     f("restore_gbps"),
                     "%.2fx" % r["durable_s"] if "durable_s" in r else "-",
                     "%.2fx" % r["restore_s"] if "restore_s" in r else "-",
                     f("files_created", "%d"), f("fsyncs", "%d"),
                     _mb(m.get("rss_extra_save_bytes")), _mb(daemon),
                     "%s/%s" % (f("daemon_save_cpu_s_per_gb"), f("daemon_restore_cpu_s_per_gb"))
                     if m.get("daemon_save_cpu_s_per_gb") is not None else "-",
                     f("busy_cpus_save") + ("/" + f("busy_cpus_backing")
                                            if m.get("busy_cpus_backing") is not None else ""),
                     f("disk_busy_save") + ("/" + f("disk_busy_backing")
                                            if m.get("disk_busy_backing") is not None else ""),
                     "%d/%d%s" % (s["runs_ok"], s["runs"],
                                  " FAILED" if not s["runs_ok"] else
                                  "" if s["verified"] or s["limit"] else " NOT VERIFIED")))
    widths = [max(len(str(x)) for x in col) for col in zip(hdr, *rows)]
    lines = ["  ".join(str(x).ljust(wd) if i == 0 else str(x).rjust(wd)
                       for i, (x, wd) in enumerate(zip(row, widths))) for row in [hdr] + rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append("payload %.3f GB in %d tensors; medians; GB/s = payload / time; "
                 "'vs ckptfs' = contender time / ckptfs time (>1: ckptfs faster); "
                 "* tmpfs is never durable; daemon CPU s/GB: save (until durable) / "
                 "restore, request spin included; busy CPUs: the machine's CPUs busy on "
                 "average from the save's start until durable (/until backing-durable); disk "
                 "busy: the busiest disk's share of that time with requests in flight"
                 % (payload / 1e9, ntensors))
    return "\n".join(lines)


def write_csv(path: str, summary: dict) -> None:
    cols = ["contender", "label", "runs_ok", "bytes", "blocked_s", "durable_s", "durable_gbps",
            "restore_s", "restore_gbps", "durable_vs_ckptfs", "restore_vs_ckptfs",
            "files_created", "dirs_created", "fsyncs", "rss_extra_save_bytes",
            "rss_extra_restore_bytes", "daemon_peak_rss_bytes", "unmount_s", "remount_s",
            "daemon_save_cpu_s_per_gb", "daemon_restore_cpu_s_per_gb", "busy_cpus_save",
            "busy_cpus_backing", "disk_busy_save", "disk_busy_backing"]
    with open(path, "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(cols)
        for key, s in summary.items():
            m = dict(s["median"])
            m["durable_vs_ckptfs"] = s["time_vs_ckptfs"].get("durable_s")
            m["restore_vs_ckptfs"] = s["time_vs_ckptfs"].get("restore_s")
            wr.writerow([key, s["label"], s["runs_ok"], s["bytes"]] +
                        ["" if m.get(c) is None else ("%.6g" % m[c]) for c in cols[4:]])


def plot(path: str, summary: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k, s in summary.items() if s["median"].get("durable_s")]
    labels = [summary[k]["label"] for k in keys]
    dur = [summary[k]["median"]["durable_s"] for k in keys]
    rst = [summary[k]["median"].get("restore_s", 0) for k in keys]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(keys) + 1.8))
    ys = range(len(keys))
    h = 0.38
    b1 = ax.barh([y - h / 2 for y in ys], dur, h, label="save, until durable",
                 color=["#d62728" if k == "ckptfs" else "#1f77b4" for k in keys])
    b2 = ax.barh([y + h / 2 for y in ys], rst, h, label="restore (cold)", color="#9ecae1")
    for bars in (b1, b2):
        for b in bars:
            ax.text(b.get_width(), b.get_y() + b.get_height() / 2, " %.2f" % b.get_width(),
                    va="center", fontsize=7)
    ax.set_yticks(list(ys))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (median), lower is better")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------ main
def _cleanup_all(cfg: Config) -> None:
    """Whatever happened: no mount, no daemon, no directory left behind."""
    for m in cfg.live_mounts:
        if m.proc is not None:
            try:
                m.kill()
            except Exception:  # noqa: BLE001
                pass
        if api.is_mounted(m.mountpoint):
            api.fusermount(m.mountpoint, lazy=True)
    shutil.rmtree(cfg.base, ignore_errors=True)
    shutil.rmtree(cfg.shm_base, ignore_errors=True)
    shutil.rmtree(cfg.local_base, ignore_errors=True)


def _on_sigterm(signum, frame):
    raise KeyboardInterrupt


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ckptfs bench e2e", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=sorted(models.ARCHS), default="gpt2")
    ap.add_argument("--size", type=parse_size, default=None,
                    help="checkpoint size (default 2G; --quick: 24M)")
    ap.add_argument("--small", type=int, default=0, metavar="N",
                    help="N small tensors (8 B .. 64 KiB) instead of a model")
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds (default 3)")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="tiny checkpoint, 1 round, no warm-up (tests)")
    ap.add_argument("--contenders", default=None,
                    help="comma list of: " + ",".join(CONTENDERS) + " (default: all; fio "
                    "only when installed)")
    ap.add_argument("--dir", default="/var/tmp",
                    help="where backing directories and mounts go (a real disk, not tmpfs)")
    ap.add_argument("--throttle", type=parse_size, default=0, metavar="RATE",
                    help="limit the GlusterFS volume holding --dir to RATE bytes/s (e.g. 300M: "
                    "a node's share of a busy parallel file system; tc on loopback, root)")
    ap.add_argument("--local-base", default="/var/tmp",
                    help="node-local storage for ckptfs_tier's local directory and "
                    "ckptfs_local's backing directory (when --dir is a parallel file system)")
    ap.add_argument("--staging", default=None, help="ckptfs staging memory (default 512M, "
                    "--quick 64M)")
    ap.add_argument("--segment", default="8M", help="ckptfs segment size")
    ap.add_argument("--queue-depth", type=int, default=32, help="ckptfs io_uring queue depth")
    ap.add_argument("--step-timeout", type=float, default=None,
                    help="seconds after which a hung ckptfs step is killed (default: "
                    "generous, from the size)")
    ap.add_argument("--warm-restore", action="store_true",
                    help="restore right after the save: the page cache kept, ckptfs through "
                    "the mount that saved (no unmount, no remount)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write all results as JSON here")
    ap.add_argument("--csv", default=None, help="medians as CSV (default: next to --json)")
    ap.add_argument("--plot", default=None, help="PNG bar plot (default: next to --json)")
    ap.add_argument("--keep-failed", action="store_true",
                    help="when a ckptfs run fails, keep its backing directory next to the logs")
    ap.add_argument("--keep-logs", default=None,
                    help="directory for the ckptfs daemon logs (default: removed unless a "
                    "ckptfs run failed, then kept under --dir)")
    return ap


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    quick = a.quick
    if a.size is None:
        a.size = QUICK_SIZE if quick else 2 << 30
    if a.rounds is None:
        a.rounds = 1 if quick else 3
    warmup = not (quick or a.no_warmup)
    if a.staging is None:
        a.staging = "64M" if quick else "512M"
    if a.step_timeout is None:
        a.step_timeout = max(300.0, a.size / 20e6)
    uring_off = ring.enabled()  # (None: the kernel offers FUSE over io_uring)
    keys = a.contenders.split(",") if a.contenders else [
        k for k in DEFAULT_CONTENDERS if (k != "fio" or shutil.which("fio"))
        and (k != "ckptfs_uring" or uring_off is None)]
    skipped = {}  # contender -> why it does not run (only from the default list)
    if not a.contenders and uring_off is not None:
        skipped["ckptfs_uring"] = uring_off
        print(f"ckptfs_uring skipped: {uring_off}")
    bad = [k for k in keys if k not in CONTENDERS]
    if bad:
        print(f"unknown contender(s): {', '.join(bad)}; choose from {', '.join(CONTENDERS)}",
              file=sys.stderr)
        return 2
    if "ckptfs_uring" in keys and uring_off is not None:
        print(f"ckptfs_uring: {uring_off}", file=sys.stderr)
        return 2
    if "fio" in keys and not shutil.which("fio"):
        print("fio is not installed", file=sys.stderr)
        return 2
    specs = (models.small_tensor_specs(a.small, seed=a.seed) if a.small
             else models.tensor_specs(a.arch, a.size))
    for key in list(keys):
        why = CONTENDERS[key].cannot_save(specs)
        if why and a.contenders:
            print(f"{key}: {why}", file=sys.stderr)
            return 2
        if why:
            skipped[key] = why
            keys.remove(key)
            print(f"{key} skipped: {why}")
    os.makedirs(a.dir, exist_ok=True)
    fstype, dev = fs_type(a.dir)
    if fstype in ("tmpfs", "ramfs"):
        print(f"--dir {a.dir} is on {fstype}: pick a directory on a real disk", file=sys.stderr)
        return 2

    what = f"{a.small} small tensors" if a.small else f"{a.arch} ~{a.size / 1e9:.2f} GB"
    print(f"e2e: building the state dict ({what}) ...", flush=True)
    w = Workload(specs, a.seed)
    print(f"e2e: {len(w.names)} tensors, {w.payload_bytes / 1e9:.3f} GB payload; contenders: "
          f"{', '.join(keys)}; {a.rounds} round(s){' after a warm-up' if warmup else ''}; "
          f"dir {a.dir} ({fstype} on {dev})", flush=True)
    if guest_halt_poll_ns() == 0:
        print("e2e: this VM's idle CPUs halt without polling (guest_halt_poll_ns 0): each FUSE "
              "round trip pays a wake-up through the hypervisor (docs/tuning.md, On a VM)",
              flush=True)

    _preimport(keys)
    base = tempfile.mkdtemp(prefix="ckptfs-e2e-", dir=a.dir)
    shm_base = tempfile.mkdtemp(prefix="ckptfs-e2e-", dir="/dev/shm")
    log_dir = a.keep_logs or os.path.join(a.dir, "ckptfs-e2e-logs-%d" % os.getpid())
    os.makedirs(log_dir, exist_ok=True)
    local_base = tempfile.mkdtemp(prefix="ckptfs-e2e-local-", dir=a.local_base)
    cfg = Config(a, base, shm_base, log_dir, local_base)
    old_term = signal.signal(signal.SIGTERM, _on_sigterm)
    runs: list[dict] = []
    started = time.time()
    try:
        plan = (["warmup"] if warmup else []) + [str(i + 1) for i in range(a.rounds)]
        with (Throttle(a.dir, a.throttle) if a.throttle else contextlib.nullcontext()):
            for tag in plan:
                for key in keys:
                    r = run_one(cfg, w, key, tag)
                    runs.append(r)
                    _progress(r, w.payload_bytes)
    except KeyboardInterrupt:
        print("e2e: interrupted; cleaning up", file=sys.stderr)
        _cleanup_all(cfg)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old_term)
        _cleanup_all(cfg)

    summary = summarize(runs, keys, w.payload_bytes)
    failed_ckptfs = any(r.get("daemon_log") for r in runs)
    if not a.keep_logs and not failed_ckptfs:
        shutil.rmtree(log_dir, ignore_errors=True)
    elif failed_ckptfs:
        print(f"e2e: ckptfs daemon logs kept in {log_dir}", file=sys.stderr)
    title = (f"ckptfs e2e: {what} ({w.payload_bytes / 1e9:.2f} GB, {len(w.names)} tensors), "
             f"median of {a.rounds}")
    print()
    print(format_table(summary, w.payload_bytes, len(w.names)))
    for key, s in summary.items():
        if s["median"].get("backing_durable_s") is not None:
            m = s["median"]
            print(f"  {key}: backing-durable after {m['backing_durable_s']:.3f} s "
                  "(the durable column: node-durable)")
            if m.get("drain_after_mb_s") is not None:
                print(f"  {key}: the drain copied {m['drained_by_node_bytes'] / 1e6:.0f} MB by "
                      f"node-durable ({m['drain_save_mb_s']:.0f} MB/s), then "
                      f"{m['drain_after_mb_s']:.0f} MB/s until backing-durable")
        for e in s["errors"]:
            print(f"  {key}: {e}")
    verdicts, fl = targets.judge(summary, runs), targets.floor(summary)
    print()
    print(targets.format_verdicts(verdicts, fl, default_state=not a.small and a.arch == "gpt2"
                                  and a.size == 2 << 30))
    result = {"command": "ckptfs bench e2e " + " ".join(argv), "machine": machine_facts(a.dir),
              "arch": None if a.small else a.arch, "small": a.small, "size_arg": a.size,
              "payload_bytes": w.payload_bytes, "tensors": len(w.names),
              "rounds": a.rounds, "warmup": warmup, "contenders": keys,
              "skipped": skipped,
              "warm_restore": a.warm_restore, "throttle_bytes_per_s": a.throttle,
              "mount_options": cfg.mount_options, "elapsed_s": time.time() - started,
              "ratio_definition": "time_vs_ckptfs = contender median time / ckptfs median "
              "time (> 1: ckptfs faster)",
              "summary": summary, "targets": verdicts, "floor": fl, "runs": runs}
    csv_path, plot_path = a.csv, a.plot
    if a.json:
        stem = os.path.splitext(a.json)[0]
        csv_path = csv_path or stem + ".csv"
        plot_path = plot_path or stem + ".png"
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    if csv_path:
        write_csv(csv_path, summary)
    if plot_path:
        plot(plot_path, summary, title)
    print("e2e: wrote " + ", ".join(p for p in (a.json, csv_path, plot_path) if p))
    return 0 if all(r["ok"] for r in runs) else 1


def _preimport(keys: list[str]) -> None:
    """Import the peers' libraries up front: import time is not checkpoint time."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if any(k.startswith("dcp") for k in keys):
            import torch.distributed.checkpoint  # noqa: F401
        if "torchsnapshot" in keys:
            import torchsnapshot  # noqa: F401
            import torchsnapshot.state_dict  # noqa: F401


def _progress(r: dict, payload: int) -> None:
    if r["ok"]:
        print(f"[{r['round']:>6}] {r['contender']:<15} blocked {r['blocked_s']:7.3f} s  durable "
              f"{r['durable_s']:7.3f} s ({r['bytes'] / r['durable_s'] / 1e9:5.2f} GB/s)  restore "
              f"{r['restore_s']:7.3f} s  files {r['files_created']}  fsyncs {r['fsyncs']}"
              f"{'  verified' if r.get('verified') else ''}", flush=True)
    else:
        print(f"[{r['round']:>6}] {r['contender']:<15} FAILED: {r.get('error')}", flush=True)
        if r.get("daemon_log_tail"):
            print("    daemon log tail:\n    " + r["daemon_log_tail"].replace("\n", "\n    "),
                  flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
