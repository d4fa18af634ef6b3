"""``ckptfs bench lifecycle``: a training job's life on one mount.

One mount for the whole run. Every step saves a checkpoint of a GPT-shaped state (model
weights and Adam state, one `torch.save` per tensor, ckptfs/bench/models.py) into
`step_NNNNN/`, makes it durable (`ckptfs sync`), deletes the checkpoints older than the
`--keep` newest the way Hugging Face Trainer's `save_total_limit` rotates them (after the new
one is saved), then "trains" for `--interval` seconds (nothing is written: the mount is idle,
as between a real job's checkpoints). At the end of each step it records:

  durable_s     from the first torch.save to the end of the sync
  written_s     of it, until the last torch.save returned (the rest: the sync)
  flush_s       the flusher's time inside its write batches during the step (status)
  app_cpu_s, daemon_cpu_s, steal_s   during the save until durable: this process's CPU, the
                daemon's, and the time the hypervisor gave this machine's CPUs to others
                (/proc/stat steal): a slower save with the same CPU and more steal is the host's
  disk_probe_s  every --probe-every steps, in the pause after the save: the disk's own
                O_DIRECT write + fdatasync of the checkpoint's bytes into a file next to
                the backing directory (the reference the save-time drift is read against)
  disk_bytes    the backing directory's allocated blocks (du: st_blocks, not sizes)
  live_bytes    the bytes the live tree's extents point at in the data logs (daemon status)
  index_bytes   the size of the writer's index (with the node tier: its backing copy, which
                takes an index snapshot once the drain reaches it; local_index_bytes: the
                local one); index_fresh_bytes: the daemon's estimate of a fresh index's size
  rss_bytes     the daemon's resident memory (VmRSS)
  and the daemon's lifecycle counters (logs retired, bytes punched and moved, snapshots)

At the end: an unmount, timed remounts of the backing directory (with a node tier: also
with it, its local directory as the run left it) and of a fresh copy of the live tree
(`ckptfs export` + `ckptfs import` into a new backing directory, whose index is the "fresh
index" the targets compare with), --remounts of each after a warm-up, in ABBA order, without
faulting the staging memory in (--no-populate: the daemon's start, not the backing
directory's doing); the medians of the time until the mount is ready and of the replay the
daemon logs. The targets (docs/benchmarks.md) are judged at the end; a plot of the series
per step and a JSON with everything are written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from ckptfs import api
from ckptfs.bench import models
from ckptfs.format import backingdir
from ckptfs.io import alloc_aligned
from ckptfs.options import BY_NAME, parse_size
from ckptfs.system import cpu_seconds, guest_halt_poll_ns, status_bytes, steal_seconds

WRITER = "lifecycle"
FROM_STEP = 10  # the targets hold from this step on (the first ones fill the logs)
PROBE_BLOCK = 8 << 20  # the disk probe's requests (as fio's reference write: 8 MiB)


def du(path: str) -> int:
    """Bytes allocated to everything under `path` (st_blocks: what du counts)."""
    total = 0
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def rss(pid: int) -> int:
    return status_bytes("VmRSS", pid) or 0


def disk_probe(path: str, nbytes: int) -> tuple[float, bool]:
    """(seconds to write `nbytes` at `path` in 8 MiB requests and fdatasync them, whether
    O_DIRECT was used); the file is removed. O_DIRECT where the file system takes it, so that
    the figure is the disk's and not the page cache's."""
    buf = alloc_aligned(PROBE_BLOCK)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(4096) * (PROBE_BLOCK // 4096))
    direct = True
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError:
        direct = False
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        left = -(-nbytes // PROBE_BLOCK) * PROBE_BLOCK  # whole requests (O_DIRECT)
        while left > 0:
            left -= os.write(fd, buf)
        os.fdatasync(fd)
        return time.perf_counter() - t0, direct
    finally:
        os.close(fd)
        os.unlink(path)
        buf.close()


def windows(steps: list[dict], key: str) -> tuple[list, list]:
    """The values of `key` in the save-time target's two windows: steps FROM_STEP to
    3 x FROM_STEP, and the last 20 steps (from FROM_STEP on); steps without it left out."""
    early = [s[key] for s in steps if FROM_STEP <= s["step"] <= 3 * FROM_STEP
             and s.get(key) is not None]
    last = [s[key] for s in steps[-20:] if s["step"] >= FROM_STEP and s.get(key) is not None]
    return early, last


def drift(steps: list[dict]) -> dict:
    """What the save-time target's two windows were made of: medians of the save's parts and
    of the disk probes in each window."""
    out = {}
    for key in ("durable_s", "written_s", "flush_s", "disk_probe_s", "app_cpu_s",
                "daemon_cpu_s", "steal_s"):
        early, last = windows(steps, key)
        if early and last:
            out[key] = {"early": statistics.median(early), "last": statistics.median(last),
                        "n": [len(early), len(last)]}
    return out


def format_drift(d: dict) -> str:
    names = {"durable_s": "save until durable", "written_s": "of it until the last torch.save "
             "returned", "flush_s": "the flusher inside its write batches",
             "disk_probe_s": "the disk's own write of the same bytes (probe)",
             "app_cpu_s": "the saving process's CPU in the save", "daemon_cpu_s":
             "the daemon's CPU in the save", "steal_s": "CPU time the host took (steal)"}
    lines = [f"{'medians, steps %d-%d against the last 20' % (FROM_STEP, 3 * FROM_STEP):<56}"
             f"{'early':>9} {'last':>9} {'ratio':>7}"]
    for key, v in d.items():
        lines.append(f"{names[key]:<56}{v['early']:>8.3f}s {v['last']:>8.3f}s "
                     f"{v['last'] / v['early'] if v['early'] else 0:>7.2f}")
    return "\n".join(lines)


def save(state: dict, root: str) -> None:
    import torch

    for name, t in state.items():
        path = os.path.join(root, models.file_name(name))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(t, path)


def timed_mount(backing: str, mnt: str, log_file: str, opts: dict) -> tuple[float, float]:
    """Mount, list the root, unmount: (seconds until the mount was ready, seconds of it the
    daemon spent replaying, from its log line)."""
    # (staging memory not faulted in: that is the daemon's start, the same for any backing
    # directory, and on a VM whose memory is backed lazily it scatters by 3x from one mount
    # to the next)
    opts = dict(opts, no_populate=True)
    t0 = time.perf_counter()
    m = api.Mount(backing, mnt, log_file=log_file, writer_id=WRITER, **opts).start()
    wall = time.perf_counter() - t0
    os.listdir(mnt)
    m.stop()
    with open(log_file, errors="replace") as f:
        replayed = [line for line in f if "ckptfs: replayed " in line]
    return wall, float(replayed[-1].rsplit(",", 1)[1].split()[0]) if replayed else 0.0


def remounts(cases: list[tuple[str, str, dict]], mnt: str, log_file: str,
             times: int) -> dict[str, list[tuple[float, float]]]:
    """`times` timed mounts of each (name, backing, mount options) after one warm-up mount of
    each (not counted: the first mount after the long run starts a cold daemon), in ABBA
    order, so that the machine's drift (memory being reclaimed, other load) falls on all
    alike."""
    out: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in cases}
    for _, backing, opts in cases:
        timed_mount(backing, mnt, log_file, opts)
    for i in range(times):
        for name, backing, opts in (cases if i % 2 == 0 else cases[::-1]):
            out[name].append(timed_mount(backing, mnt, log_file, opts))
    return out


def judge(steps: list[dict], fresh_index: int, remount_s: float, fresh_remount_s: float,
          log_bytes: int, tier_remount_s: float | None = None) -> list[dict]:
    """The benchmark's targets, each with its figure and whether it held."""
    later = [s for s in steps if s["step"] >= FROM_STEP]
    out = []
    if later:
        worst = max(later, key=lambda s: s["disk_bytes"] - 1.5 * s["live_bytes"])
        allowed = 1.5 * worst["live_bytes"] + log_bytes
        out.append({"target": "disk", "what": f"backing bytes <= 1.5 x live + one data log "
                    f"(steps {FROM_STEP}+; worst step {worst['step']})",
                    "value": worst["disk_bytes"], "limit": allowed,
                    "held": worst["disk_bytes"] <= allowed})
        worst = max(later, key=lambda s: s["index_bytes"])
        out.append({"target": "index", "what": f"index <= 2 x a fresh index of the live tree "
                    f"(steps {FROM_STEP}+; largest at step {worst['step']})",
                    "value": worst["index_bytes"], "limit": 2 * fresh_index,
                    "held": worst["index_bytes"] <= 2 * fresh_index})
    early, last = windows(steps, "durable_s")
    if early and last:
        a, b = statistics.median(early), statistics.median(last)
        out.append({"target": "save", "what": f"median save of the last {len(last)} steps "
                    f"within 10% of steps {FROM_STEP}-{3 * FROM_STEP}",
                    "value": b, "limit": 1.1 * a, "held": b <= 1.1 * a})
    out.append({"target": "remount", "what": "remount <= 1.2 x the fresh copy's",
                "value": remount_s, "limit": 1.2 * fresh_remount_s,
                "held": remount_s <= 1.2 * fresh_remount_s})
    if tier_remount_s is not None:
        out.append({"target": "remount", "what": "remount with the node tier <= 1.2 x the "
                    "fresh copy's", "value": tier_remount_s, "limit": 1.2 * fresh_remount_s,
                    "held": tier_remount_s <= 1.2 * fresh_remount_s})
    at10 = next((s for s in steps if s["step"] == FROM_STEP), None)
    if at10 is not None:
        end = steps[-1]["rss_bytes"]
        out.append({"target": "rss", "what": f"daemon RSS at the end <= 1.1 x step {FROM_STEP}'s",
                    "value": end, "limit": 1.1 * at10["rss_bytes"],
                    "held": end <= 1.1 * at10["rss_bytes"]})
    return out


def format_verdicts(verdicts: list[dict]) -> str:
    def fmt(key: str, v: float) -> str:
        return f"{v:.2f} s" if key in ("save", "remount") else f"{v / 1e6:.1f} MB"

    lines = [f"{'target':<72} {'figure':>11} {'limit':>11}  held"]
    for v in verdicts:
        lines.append(f"{v['what']:<72} {fmt(v['target'], v['value']):>11} "
                     f"{fmt(v['target'], v['limit']):>11}  {'yes' if v['held'] else 'NO'}")
    lines.append(f"{sum(v['held'] for v in verdicts)} of {len(verdicts)} targets held")
    return "\n".join(lines)


def plot(path: str, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = res["steps"]
    x = [s["step"] for s in steps]
    mb = 1e6
    fig, ax = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    ax[0].plot(x, [s["durable_s"] for s in steps], ".-", ms=3, color="#d62728",
               label="save until durable")
    if steps and "app_cpu_s" in steps[0]:
        ax[0].plot(x, [s["app_cpu_s"] for s in steps], lw=0.7, color="#1f77b4",
                   label="the saving process's own CPU in it")
    probes = [(s["step"], s["disk_probe_s"]) for s in steps if s.get("disk_probe_s")]
    if probes:
        ax[0].plot(*zip(*probes), "o", ms=3, color="#7f7f7f",
                   label="the disk's own write of the same bytes")
    ax[0].legend(fontsize=8)
    ax[0].set_ylabel("save until durable (s)")
    ax[0].set_ylim(bottom=0)
    ax[1].plot(x, [s["disk_bytes"] / mb for s in steps], label="backing directory (du)")
    ax[1].plot(x, [s["live_bytes"] / mb for s in steps], label="live bytes")
    ax[1].plot(x, [(1.5 * s["live_bytes"] + res["log_bytes"]) / mb for s in steps], "--",
               color="grey", label="target: 1.5 x live + one data log")
    ax[1].set_ylabel("MB")
    ax[1].legend(fontsize=8)
    ax[2].plot(x, [s["index_bytes"] / 1e3 for s in steps], label="index")
    ax[2].axhline(2 * res["fresh"]["index_bytes"] / 1e3, ls="--", color="grey",
                  label="target: 2 x a fresh index of the live tree")
    ax[2].set_ylabel("kB")
    ax[2].legend(fontsize=8)
    ax[3].plot(x, [s["rss_bytes"] / mb for s in steps], color="#2ca02c")
    ax[3].set_ylabel("daemon RSS (MB)")
    ax[3].set_xlabel("step")
    for a in ax:
        a.axvline(FROM_STEP, color="#dddddd", lw=0.8)
    fig.suptitle(f"ckptfs bench lifecycle: {len(steps)} checkpoints of "
                 f"{res['checkpoint_bytes'] / mb:.0f} MB ({res['tensors']} tensors), "
                 f"{res['keep']} kept; remount {res['remount_s']:.2f} s vs fresh copy "
                 f"{res['fresh']['remount_s']:.2f} s", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ckptfs bench lifecycle", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="checkpoints saved")
    ap.add_argument("--size", type=parse_size, default=parse_size("150M"),
                    help="checkpoint size (GPT-shaped state, model + Adam)")
    ap.add_argument("--arch", choices=sorted(models.ARCHS), default="gpt2")
    ap.add_argument("--tensors", type=int, default=0, metavar="N",
                    help="instead: N small tensors (8 B - 64 KiB each) per checkpoint")
    ap.add_argument("--keep", type=int, default=2, help="newest checkpoints kept")
    ap.add_argument("--interval", type=float, default=3.0,
                    help="seconds of 'training' (nothing written) after each save")
    ap.add_argument("--remounts", type=int, default=15,
                    help="timed remounts of each backing directory, alternating (median)")
    ap.add_argument("--probe-every", type=int, default=5, metavar="N",
                    help="time the disk's own write of the checkpoint's bytes every N steps, "
                    "in the pause after the save (0: never)")
    ap.add_argument("--dir", default="/var/tmp", help="where the backing directories go "
                    "(a disk, not tmpfs)")
    ap.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE",
                    help="a ckptfs mount option (e.g. log-size=256M); default: the defaults")
    ap.add_argument("--json", default=None, help="results as JSON")
    ap.add_argument("--plot", default=None, help="PNG of the series per step")
    ap.add_argument("--keep-dir", action="store_true", help="leave the backing directories")
    return ap


def _mount_options(pairs: list[str]) -> dict:
    out = {}
    for p in pairs:
        name, _, value = p.partition("=")
        if name not in BY_NAME:
            raise SystemExit(f"ckptfs bench lifecycle: unknown mount option {name!r}")
        out[BY_NAME[name].dest] = value if value else True
    return out


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    opts = _mount_options(a.option)
    log_bytes = parse_size(opts["log_size"]) if "log_size" in opts else \
        BY_NAME["log-size"].default
    specs = models.small_tensor_specs(a.tensors) if a.tensors else \
        models.tensor_specs(a.arch, a.size)
    state = models.state_dict(specs)
    payload = sum(models.sizes(specs))
    work = tempfile.mkdtemp(prefix="ckptfs-lifecycle-", dir=a.dir)
    backing, mnt = os.path.join(work, "backing"), os.path.join(work, "mnt")
    fresh_backing = os.path.join(work, "fresh")
    for d in (backing, mnt, fresh_backing):
        os.makedirs(d)
    log_file = os.path.join(work, "daemon.log")
    index = os.path.join(backing, backingdir.WRITERS_DIR, WRITER, backingdir.INDEX_NAME)
    print(f"lifecycle: {a.steps} checkpoints of {payload / 1e6:.1f} MB ({len(specs)} tensors, "
          f"{a.arch}), {a.keep} kept, {a.interval:g} s between saves, in {work}", flush=True)
    steps: list[dict] = []
    m = api.Mount(backing, mnt, log_file=log_file, writer_id=WRITER, **opts).start()
    m.wait_settled()
    flushed = m.status()["flush_seconds"]
    probe_direct = None
    try:
        for k in range(a.steps):
            root = os.path.join(mnt, f"step_{k:05d}")
            cpu0, dcpu0, steal0 = cpu_seconds(), cpu_seconds(m.pid), steal_seconds()
            t0 = time.perf_counter()
            save(state, root)
            written = time.perf_counter() - t0
            m.sync()
            durable = time.perf_counter() - t0
            cpu1, dcpu1, steal1 = cpu_seconds(), cpu_seconds(m.pid), steal_seconds()
            for old in sorted(os.listdir(mnt))[:-a.keep]:  # (Trainer: after the save)
                shutil.rmtree(os.path.join(mnt, old))
            pause = time.perf_counter()
            probe = None
            if a.probe_every and k % a.probe_every == 0:
                probe, probe_direct = disk_probe(os.path.join(work, "probe"), payload)
            time.sleep(max(0.0, a.interval - (time.perf_counter() - pause)))
            st = m.status()
            s = {"step": k, "durable_s": durable, "written_s": written,
                 "flush_s": st["flush_seconds"] - flushed, "disk_probe_s": probe,
                 "app_cpu_s": cpu1 - cpu0, "steal_s": steal1 - steal0,
                 "daemon_cpu_s": None if dcpu0 is None or dcpu1 is None else dcpu1 - dcpu0,
                 "disk_bytes": du(backing),
                 "live_bytes": st["live_bytes"], "index_bytes": os.path.getsize(index),
                 "rss_bytes": rss(m.pid), "file_bytes": st["file_bytes"],
                 # (the node tier's local directory: bounded by --local-size)
                 "local_disk_bytes": du(opts["local_dir"]) if opts.get("local_dir") else None,
                 "local_index_bytes": st["index_size_bytes"] if opts.get("local_dir") else None,
                 "index_fresh_bytes": st["index_fresh_bytes"]}
            for key in ("data_logs", "logs_retired", "bytes_punched", "bytes_moved",
                        "index_snapshots", "dead_bytes", "bytes_reclaimed"):
                s[key] = st.get(key, 0)
            flushed = st["flush_seconds"]
            steps.append(s)
            print(f"step {k:4d}: durable {durable:6.2f} s  du {s['disk_bytes'] / 1e6:8.1f} MB  "
                  f"live {s['live_bytes'] / 1e6:7.1f} MB  index {s['index_bytes'] / 1e3:7.1f} kB"
                  f"  rss {s['rss_bytes'] / 1e6:6.1f} MB  logs {s['data_logs']}"
                  f"  retired {s['logs_retired']}  snapshots {s['index_snapshots']}"
                  + (f"  local {s['local_disk_bytes'] / 1e6:.1f} MB, index "
                     f"{s['local_index_bytes'] / 1e3:.1f} kB"
                     if s["local_disk_bytes"] is not None else ""), flush=True)
        t0 = time.perf_counter()
        m.stop()
        unmount_s = time.perf_counter() - t0
    except BaseException:
        m.stop()
        raise
    export = os.path.join(work, "export")
    for cmd in (["export", backing, export], ["import", export, fresh_backing, "--writer",
                                              WRITER]):
        res = subprocess.run([sys.executable, "-m", "ckptfs", *cmd], capture_output=True,
                             text=True)
        if res.returncode != 0:
            print(res.stdout + res.stderr, file=sys.stderr)
            return 1
    # (the remounts time the backing directories' replay without a node tier, whose local
    # directory serves the aged backing directory only; with a tier, the aged one is also
    # mounted with it, as the job's restart on the same node mounts it)
    plain = {k: v for k, v in opts.items() if k not in ("local_dir", "local_size", "durability")}
    cases = [("aged", backing, plain), ("fresh", fresh_backing, plain)]
    if opts.get("local_dir"):
        cases.insert(1, ("tier", backing, opts))
    times = remounts(cases, mnt, log_file, a.remounts)
    fresh_index = os.path.getsize(os.path.join(fresh_backing, backingdir.WRITERS_DIR, WRITER,
                                               backingdir.INDEX_NAME))
    result = {
        "guest_halt_poll_ns": guest_halt_poll_ns(),  # (docs/tuning.md, On a VM)
        "steps": steps, "checkpoint_bytes": payload, "tensors": len(specs), "arch": a.arch,
        "keep": a.keep, "interval_s": a.interval, "mount_options": opts, "log_bytes": log_bytes,
        "unmount_s": unmount_s,
        "remount_s": statistics.median(t for t, _ in times["aged"]),
        "remounts_s": [t for t, _ in times["aged"]],
        "replay_s": statistics.median(r for _, r in times["aged"]),
        "fresh": {"remount_s": statistics.median(t for t, _ in times["fresh"]),
                  "remounts_s": [t for t, _ in times["fresh"]],
                  "replay_s": statistics.median(r for _, r in times["fresh"]),
                  "index_bytes": fresh_index, "disk_bytes": du(fresh_backing)},
        "final_index_bytes": os.path.getsize(index), "final_disk_bytes": du(backing),
    }
    if "tier" in times:
        result["tier"] = {"remount_s": statistics.median(t for t, _ in times["tier"]),
                          "remounts_s": [t for t, _ in times["tier"]],
                          "replay_s": statistics.median(r for _, r in times["tier"])}
    result["targets"] = judge(steps, fresh_index, result["remount_s"],
                              result["fresh"]["remount_s"], log_bytes,
                              result["tier"]["remount_s"] if "tier" in result else None)
    result["drift"] = drift(steps)
    if a.probe_every:
        result["disk_probe_direct"] = probe_direct  # (None: no step probed)
    print(f"unmount {unmount_s:.2f} s; remount {result['remount_s']:.3f} s, replay "
          f"{result['replay_s']:.3f} s of it (fresh copy {result['fresh']['remount_s']:.3f} s, "
          f"{result['fresh']['replay_s']:.3f} s)"
          + (f"; with the node tier {result['tier']['remount_s']:.3f} s, replay "
             f"{result['tier']['replay_s']:.3f} s" if "tier" in result else "")
          + f"; index {result['final_index_bytes']} bytes (fresh {fresh_index})")
    print(format_verdicts(result["targets"]))
    if result["drift"]:
        print(format_drift(result["drift"]))
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    if a.plot:
        plot(a.plot, result)
    if not a.keep_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0
