"""``ckptfs bench scaling``: one backing directory, 1, 2 and 4 writers.

Each writer is a ckptfs daemon with its own writer id (`w0`, `w1` ...) mounted on one shared
backing directory, fed by one writer process that saves its share of a GPT-2-shaped training
state (weights + Adam state, `ckptfs.bench.models.tensor_specs`) with one `torch.save` per
tensor into `MOUNT/step_1/rank_<i>/<models.file_name>`. The state (`--total`, default 1G) is the
same for every writer count; its tensors are dealt out to the writers like a sharded optimizer
state (largest first to the least loaded writer), so the numbers compare how the same
checkpoint drains with more writers.

The clock starts when every writer process has its state in memory (and the page cache was
dropped, `sync; echo 1 > /proc/sys/vm/drop_caches`, when root) and stops when every writer's
mount returned from `sync` (everything durable in the backing directory). GB/s = total payload
bytes / that time. Runs alternate (1 2 4 1 2 4 ...), after a warm-up run that is not counted,
each in a fresh backing directory.

Metadata: after each run (all unmounted) the entries created under the backing directory are
counted (files + directories): that is what the metadata server sees per checkpoint with ckptfs.
Next to it, what plain `torch.save` straight into a directory creates for the same checkpoint:
one file per tensor plus every directory of the tree.

What the mounts' looks at each other cost (docs/scaling.md, visibility): every mount looks at
the other writers' indexes every `--refresh` seconds, and at a lookup or open when its last
look is older. Per run: the calls those looks made on the backing store while the checkpoint
was saved (listings, stats, index reads, from the mounts' own counters), how long after the
last `sync` returned every mount lists the whole checkpoint, the longest the trio thread spent
applying one batch of other writers' records, and, with the checkpoint saved and nothing
happening (`--idle` seconds), the calls per second the looks alone make. `--refresh 1,0`
alternates the refresh settings too (0: a look before every lookup and open).

Heavy runs share the disk with other benchmarks: run them under
`flock /tmp/ckptfs-bench.lock ckptfs bench scaling ...`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time

from ckptfs import api, bench
from ckptfs.bench import models

QUICK_TOTAL = 16 << 20  # with --quick: weights only (no Adam state), the smallest GPT-2 state
DEFAULT_WRITERS = (1, 2, 4)


def parse_size(text: str) -> int:
    from ckptfs.options import parse_size as p

    return p(text)


def drop_caches() -> bool:
    """`sync; echo 1 > /proc/sys/vm/drop_caches` (page cache). False when not permitted."""
    return bench.drop_caches(1)


# ------------------------------------------------------------------ writer processes
def _save_worker(conn, root: str, specs, seed: int, wait_go: bool, pause_s: float,
                 progress: bool) -> None:
    """A writer process: build the state (outside any timing), report ready, wait for go, save
    one file per tensor under `root`, report ("done", files saved, seconds, error or None).
    Errors (a dead mount: ENOTCONN, EIO ...) are reported, never raised."""
    try:
        import torch

        torch.set_num_threads(1)
        sd = models.state_dict(specs, seed)
        nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("done", 0, 0.0, f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", nbytes))
    if wait_go:
        conn.recv()
    saved, err = 0, None
    t0 = time.perf_counter()
    try:
        for name, t in sd.items():
            path = os.path.join(root, models.file_name(name))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(t, path)
            saved += 1
            if progress:
                conn.send(("saved", saved))
            if pause_s:
                time.sleep(pause_s)
    except BaseException as exc:  # noqa: BLE001
        err = f"{type(exc).__name__}: {exc}"
    conn.send(("done", saved, time.perf_counter() - t0, err))
    conn.close()


_CTX = None


def context():
    """Writer processes come from a fork server that imported torch once (a fresh `python`
    per writer would spend ~2 s of CPU importing torch, on 2 cores)."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "ckptfs.bench.models", "ckptfs.bench.scaling"])
    return _CTX


class Writer:
    """One writer process saving `specs` (contents from `seed`) under `root`."""

    def __init__(self, root: str, specs, seed: int, wait_go: bool = False, pause_s: float = 0.0,
                 progress: bool = False) -> None:
        ctx = context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_save_worker,
                                args=(child, root, specs, seed, wait_go, pause_s, progress))
        self.proc.start()
        child.close()
        self.nbytes = 0
        self.saved = 0
        self.seconds = 0.0
        self.error: str | None = None
        self.done = False

    def _recv(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"writer process {self.proc.pid} silent for {timeout} s")
        msg = self.conn.recv()
        if msg[0] == "saved":
            self.saved = msg[1]
        elif msg[0] == "done":
            _, self.saved, self.seconds, self.error = msg
            self.done = True
        elif msg[0] == "ready":
            self.nbytes = msg[1]
        return msg

    def wait_ready(self, timeout: float = 300.0) -> None:
        msg = self._recv(timeout)
        if msg[0] != "ready":
            raise RuntimeError(f"writer failed before saving: {self.error}")

    def go(self) -> None:
        self.conn.send("go")

    def wait_saved(self, count: int, timeout: float = 60.0) -> None:
        """Until at least `count` tensors are saved (needs progress=True)."""
        deadline = time.monotonic() + timeout
        while self.saved < count and not self.done:
            self._recv(max(0.01, deadline - time.monotonic()))

    def wait(self, timeout: float = 600.0) -> "Writer":
        deadline = time.monotonic() + timeout
        while not self.done:
            self._recv(max(0.01, deadline - time.monotonic()))
        self.proc.join(timeout=max(1.0, deadline - time.monotonic()))
        self.conn.close()
        return self

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)


# ------------------------------------------------------------------ one run
def parallel(calls, raise_first: bool = True) -> list[BaseException]:
    """Run the calls in threads at once; the first exception is raised (or all returned)."""
    errors: list[BaseException] = []

    def run(c) -> None:
        try:
            c()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors and raise_first:
        raise errors[0]
    return errors


def count_entries(path: str) -> tuple[int, int]:
    """(files, directories) below `path` (not counting `path` itself)."""
    files = dirs = 0
    for _, dnames, fnames in os.walk(path):
        files += len(fnames)
        dirs += len(dnames)
    return files, dirs


def plain_entries(shards: list[list[tuple]]) -> tuple[int, int]:
    """(files, directories) that plain torch.save (one file per tensor) creates for the same
    checkpoint tree `step_1/rank_<i>/<file_name>`."""
    files, dirs = 0, {"step_1"}
    for i, specs in enumerate(shards):
        for name, _, _ in specs:
            rel = f"step_1/rank_{i}/{models.file_name(name)}"
            files += 1
            d = os.path.dirname(rel)
            while d and d not in dirs:
                dirs.add(d)
                d = os.path.dirname(d)
    return files, len(dirs)


def shard_specs(arch: str, total: int, writers: int, optimizer: bool = True) -> list[list[tuple]]:
    """One state of about `total` bytes (`models.tensor_specs`), its tensors dealt out to the
    writers like a sharded optimizer state: largest first, each to the least loaded writer, so
    every writer count saves exactly the same tensors and bytes."""
    specs = models.tensor_specs(arch, total, optimizer=optimizer)
    sizes = models.sizes(specs)
    shards: list[list[tuple]] = [[] for _ in range(writers)]
    load = [0] * writers
    for i in sorted(range(len(specs)), key=lambda i: -sizes[i]):
        w = load.index(min(load))
        shards[w].append(specs[i])
        load[w] += sizes[i]
    order = {s[0]: k for k, s in enumerate(specs)}
    return [sorted(s, key=lambda x: order[x[0]]) for s in shards]


LOOK_KEYS = ("refresh_listdirs", "refresh_stats", "refresh_reads")


def _looks(mounts: list[api.Mount]) -> list[dict]:
    return [{k: st.get(k, 0) for k in (*LOOK_KEYS, "refresh_polls", "refresh_apply_max_ms",
                                      "refresh_bytes_read")}
            for st in (m.status() for m in mounts)]


def _calls(before: list[dict], after: list[dict]) -> int:
    return sum(b[k] - a[k] for a, b in zip(before, after) for k in LOOK_KEYS)


def _whole(mount: api.Mount, tensors: int) -> bool:
    return count_entries(os.path.join(mount.mountpoint, "step_1"))[0] >= tensors


def run_once(a, writers: int, label: str, refresh: float = 1.0) -> dict:
    """One checkpoint with `writers` writers; returns the measurements."""
    work = tempfile.mkdtemp(prefix="ckptfs-scaling-", dir=a.dir)
    backing = os.path.join(work, "backing")
    os.makedirs(backing)
    mounts: list[api.Mount] = []
    procs: list[Writer] = []
    res: dict = {"writers": writers, "label": label, "ok": False}
    try:
        shards = shard_specs(a.arch, a.total, writers, optimizer=not a.quick)
        for i in range(writers):
            mp_ = os.path.join(work, f"mnt{i}")
            os.makedirs(mp_)
            mounts.append(api.Mount(backing, mp_, writer_id=f"w{i}", staging_size=a.staging,
                                    segment_size=a.segment, timeout=120.0, refresh=refresh,
                                    log_file=os.path.join(work, f"daemon{i}.log")))
        parallel([m.start for m in mounts])  # the daemons come up at once, as on a cluster
        for i, specs in enumerate(shards):
            procs.append(Writer(os.path.join(mounts[i].mountpoint, "step_1", f"rank_{i}"),
                                specs, seed=1000 * writers + i, wait_go=True))
        for p in procs:
            p.wait_ready()
        payload = sum(p.nbytes for p in procs)
        res["caches_dropped"] = drop_caches() if a.drop_caches else False
        res["refresh_s"] = refresh
        looks0 = _looks(mounts)
        t0 = time.perf_counter()
        for p in procs:
            p.go()
        for p in procs:
            p.wait(timeout=a.step_timeout)
        t_saved = time.perf_counter() - t0
        errors = [p.error for p in procs if p.error]
        if errors:
            raise RuntimeError("; ".join(errors))
        sync_err = parallel([m.sync for m in mounts], raise_first=False)
        t_durable = time.perf_counter() - t0
        if sync_err:
            raise sync_err[0]
        looks1 = _looks(mounts)
        durable = sum(m.status()["bytes_durable"] for m in mounts)
        tensors = sum(len(s) for s in shards)
        # every mount shows the whole checkpoint (without a sync: the contract's delay)
        t1 = time.perf_counter()
        while not all(_whole(m, tensors) for m in mounts):
            if time.perf_counter() - t1 > 60:
                raise RuntimeError("the checkpoint is not whole on every mount after 60 s")
            time.sleep(0.02)
        res["visible_s"] = time.perf_counter() - t1
        looks2 = _looks(mounts)
        time.sleep(a.idle)
        looks3 = _looks(mounts)
        res.update({
            "look_calls_saving": _calls(looks0, looks1),
            "look_calls_per_s_saving": _calls(looks0, looks1) / t_durable,
            "look_bytes_read_saving": sum(b["refresh_bytes_read"] - x["refresh_bytes_read"]
                                          for x, b in zip(looks0, looks1)),
            "apply_max_ms": max(x["refresh_apply_max_ms"] for x in looks3),
            "idle_s": a.idle,
            "idle_calls_per_s": _calls(looks2, looks3) / a.idle if a.idle else 0.0,
            "idle_calls_per_s_per_mount": [
                sum(b[k] - x[k] for k in LOOK_KEYS) / a.idle if a.idle else 0.0
                for x, b in zip(looks2, looks3)],
            "idle_reads": sum(b["refresh_reads"] - x["refresh_reads"]
                              for x, b in zip(looks2, looks3)),
        })
        parallel([m.stop for m in mounts])
        mounts.clear()
        files, dirs = count_entries(backing)
        pfiles, pdirs = plain_entries(shards)
        res.update({
            "ok": durable >= payload,
            "payload_bytes": payload,
            "bytes_durable": durable,
            "tensors": tensors,
            "saved_s": t_saved,
            "durable_s": t_durable,
            "gbps": payload / t_durable / 1e9,
            "per_writer_saved_s": [p.seconds for p in procs],
            "backing_files": files,
            "backing_dirs": dirs,
            "backing_entries": files + dirs,
            "plain_files": pfiles,
            "plain_dirs": pdirs,
            "plain_entries": pfiles + pdirs,
        })
        if not res["ok"]:
            res["error"] = f"only {durable} of {payload} bytes durable"
    except Exception as exc:  # noqa: BLE001 - reported in the results, the bench goes on
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for p in procs:
            p.kill()
        for m in mounts:
            if m.proc is None:
                continue
            try:
                m.stop()
            except Exception:  # noqa: BLE001
                m.kill()
        if a.keep_failed and not res["ok"]:
            res["kept"] = work
        else:
            shutil.rmtree(work, ignore_errors=True)
    return res


# ------------------------------------------------------------------ reporting
def machine() -> dict:
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu": cpu, "memory_bytes": mem,
            "kernel": platform.release(), "python": platform.python_version()}


def summary_key(n: int, refresh: float, refreshes: list[float]) -> str:
    return str(n) if refresh == refreshes[0] else f"{n}@refresh={refresh:g}"


def summarize(runs: list[dict], writers: list[int], refreshes: list[float] = (1.0,)) -> dict:
    out = {}
    for refresh in refreshes:
        for n in writers:
            _summary(out, runs, n, refresh, refreshes)
    return out


def _summary(out: dict, runs: list[dict], n: int, refresh: float, refreshes) -> None:
    """The summary of the measured runs with `n` writers and --refresh `refresh`."""
    rs = [r for r in runs if r["writers"] == n and r["label"] == "measured"
          and r.get("refresh_s", refreshes[0]) == refresh]
    ok = [r for r in rs if r["ok"]]
    s: dict = {"runs": len(rs), "runs_ok": len(ok),
               "errors": [r.get("error") for r in rs if not r["ok"]]}
    if ok:
        g = [r["gbps"] for r in ok]
        s.update({
            "payload_bytes": ok[0]["payload_bytes"],
            "tensors": ok[0]["tensors"],
            "gbps_median": statistics.median(g), "gbps_min": min(g), "gbps_max": max(g),
            "durable_s_median": statistics.median(r["durable_s"] for r in ok),
            "saved_s_median": statistics.median(r["saved_s"] for r in ok),
            "backing_entries": ok[0]["backing_entries"],
            "backing_files": ok[0]["backing_files"],
            "plain_entries": ok[0]["plain_entries"],
            "plain_files": ok[0]["plain_files"],
            "refresh_s": refresh,
            "visible_s_median": statistics.median(r["visible_s"] for r in ok),
            "look_calls_per_s_saving_median": statistics.median(
                r["look_calls_per_s_saving"] for r in ok),
            "idle_calls_per_s_median": statistics.median(r["idle_calls_per_s"] for r in ok),
            "apply_max_ms": max(r["apply_max_ms"] for r in ok),
        })
    out[summary_key(n, refresh, refreshes)] = s


def table(summary: dict) -> str:
    lines = ["| writers | MB | tensors | durable s (median) | GB/s median | min | max | "
             "save s (median) | backing entries (ckptfs) | plain torch.save entries |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, s in summary.items():
        if not s["runs_ok"]:
            lines.append(f"| {n} | failed: {s['errors'][:1]} |")
            continue
        lines.append(f"| {n} | {s['payload_bytes'] / 1e6:.0f} | {s['tensors']} | "
                     f"{s['durable_s_median']:.2f} | {s['gbps_median']:.2f} | "
                     f"{s['gbps_min']:.2f} | {s['gbps_max']:.2f} | {s['saved_s_median']:.2f} | "
                     f"{s['backing_entries']} | {s['plain_entries']} |")
    return "\n".join(lines)


def looks_table(summary: dict) -> str:
    """What the mounts' looks at each other cost (medians)."""
    lines = ["| writers | --refresh s | backing calls/s of the looks while saving | "
             "whole checkpoint on every mount after s | longest apply ms | "
             "backing calls/s idle (all mounts) |", "|---:|---:|---:|---:|---:|---:|"]
    for n, s in summary.items():
        if s["runs_ok"]:
            lines.append(f"| {n.split('@')[0]} | {s['refresh_s']:g} | "
                         f"{s['look_calls_per_s_saving_median']:.1f} | "
                         f"{s['visible_s_median']:.2f} | {s['apply_max_ms']:.1f} | "
                         f"{s['idle_calls_per_s_median']:.1f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ckptfs bench scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--writers", default=",".join(map(str, DEFAULT_WRITERS)),
                    help="writer counts, comma separated")
    ap.add_argument("--total", type=parse_size, default=None,
                    help="checkpoint size, split across the writers (default 1G)")
    ap.add_argument("--arch", choices=sorted(models.ARCHS), default="gpt2")
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds (default 3)")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="tiny run for tests: 16M of weights, 1 round, no cache dropping")
    ap.add_argument("--dir", default="/var/tmp", help="where the backing directories and "
                    "mount points are made (a fresh one per run, removed after)")
    ap.add_argument("--staging", default="512M", help="ckptfs staging memory per writer")
    ap.add_argument("--segment", default="8M", help="ckptfs segment size")
    ap.add_argument("--no-drop-caches", dest="drop_caches", action="store_false",
                    help="do not drop the page cache before each run")
    ap.add_argument("--step-timeout", type=float, default=600.0)
    ap.add_argument("--keep-failed", action="store_true",
                    help="keep the work directory of a failed run")
    ap.add_argument("--refresh", default="1",
                    help="the mounts' --refresh, comma separated values alternate (e.g. 1,0)")
    ap.add_argument("--idle", type=float, default=None,
                    help="seconds of nothing after each checkpoint, to count the looks' calls "
                    "(default 5; 1 with --quick)")
    ap.add_argument("--json", default=None, help="write all results as JSON here")
    return ap


def _list(text: str, kind, option: str, takes: str, least) -> list:
    """A comma-separated list of numbers given to `option`; None (with the message printed)
    when it is not one, or a number is below `least`."""
    try:
        out = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        print(f"ckptfs bench scaling: {option} takes {takes}", file=sys.stderr)
        return None
    if not out or min(out) < least:
        print(f"ckptfs bench scaling: {option} must be >= {least}", file=sys.stderr)
        return None
    return out


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    writers = _list(a.writers, int, "--writers", "numbers, e.g. 1,2,4", 1)
    refreshes = _list(a.refresh, float, "--refresh", "seconds, e.g. 1,0", 0)
    if writers is None or refreshes is None:
        return 2
    a.idle = a.idle if a.idle is not None else (1.0 if a.quick else 5.0)
    if a.quick:
        a.total = a.total or QUICK_TOTAL
        a.rounds = a.rounds or 1
        a.staging = "64M" if a.staging == "512M" else a.staging
        a.segment = "4M" if a.segment == "8M" else a.segment
        a.drop_caches = False
    a.total = a.total or (1 << 30)
    a.rounds = a.rounds or 3
    if not os.path.isdir(a.dir):
        print(f"ckptfs bench scaling: --dir {a.dir} is not a directory", file=sys.stderr)
        return 2
    runs: list[dict] = []
    t_start = time.time()
    if not a.no_warmup:
        r = run_once(a, writers[0], "warmup")
        runs.append(r)
        print(f"warm-up ({writers[0]} writer): "
              + (f"{r['gbps']:.2f} GB/s" if r["ok"] else f"FAILED {r.get('error')}"), flush=True)
    for rnd in range(a.rounds):
        for refresh in refreshes:
            for n in writers:
                r = run_once(a, n, "measured", refresh)
                r["round"] = rnd
                runs.append(r)
                print(f"round {rnd + 1}/{a.rounds}, {n} writer(s), --refresh {refresh:g}: "
                      + (f"{r['payload_bytes'] / 1e6:.0f} MB durable in {r['durable_s']:.2f} s "
                         f"= {r['gbps']:.2f} GB/s; backing entries {r['backing_entries']} vs "
                         f"plain {r['plain_entries']}; looks {r['look_calls_per_s_saving']:.1f}"
                         f" calls/s saving, {r['idle_calls_per_s']:.1f} idle, whole on every "
                         f"mount {r['visible_s']:.2f} s after sync"
                         if r["ok"] else f"FAILED {r.get('error')}"),
                      flush=True)
    summary = summarize(runs, writers, refreshes)
    result = {"bench": "scaling", "command": "ckptfs bench scaling " + " ".join(argv),
              "machine": machine(), "started": t_start, "seconds": time.time() - t_start,
              "config": {"writers": writers, "total_bytes": a.total, "arch": a.arch,
                         "rounds": a.rounds, "warmup": not a.no_warmup, "dir": a.dir,
                         "staging": a.staging, "segment": a.segment,
                         "refresh": refreshes, "idle_s": a.idle,
                         "drop_caches": a.drop_caches, "root": os.geteuid() == 0},
              "runs": runs, "summary": summary}
    print()
    print(table(summary))
    print()
    print(looks_table(summary))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"scaling: wrote {a.json}")
    return 0 if all(s["runs_ok"] == s["runs"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
