"""The performance targets, judged from one `ckptfs bench e2e` run.

Every target is a ratio of two medians of the same run (ckptfs against one contender, which ran
alternating with it), so the machine's drift cancels. A run also gives a floor: no file system
that takes `torch.save`'s output and makes it durable on this disk can finish before both
`torch.save` into RAM (tmpfs: the serialisation) and the disk's own O_DIRECT write of the same
bytes (the faster of the raw engine and fio) would. The floor is approximate (a throttled cloud
disk's speed moves within a run, and ckptfs writes while the save still runs, so it can come in
under it), but it says when a target asks for more than the machine gives: on a disk-bound
machine the durable-time targets become ratios of disk speeds. For each durable-time target the
verdict therefore shows the time it allows ckptfs and that time against the floor.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    key: str
    what: str
    field: str  # median compared ("durable_s", "blocked_s", "restore_s"; "flush" special)
    contender: str
    limit: float
    at_most: bool = True  # ratio <= limit (times); False: ratio >= limit (bandwidth)


TARGETS = (
    Target("straight", "until durable vs torch.save straight (+sync)", "durable_s", "straight",
           0.6),
    Target("straight_fsync", "until durable vs straight + fsync per file", "durable_s",
           "straight_fsync", 0.6),
    Target("dcp", "until durable vs DCP straight", "durable_s", "dcp", 0.8),
    Target("torchsnapshot", "until durable vs TorchSnapshot", "durable_s", "torchsnapshot", 0.4),
    Target("datastates", "until durable vs DataStates-LLM pattern", "durable_s", "datastates",
           0.4),
    Target("tmpfs", "until durable vs tmpfs (serialisation ceiling)", "durable_s", "tmpfs",
           1.25),
    Target("blocked", "blocked vs straight buffered", "blocked_s", "straight", 1.1),
    Target("restore", "restore (cold torch.load) vs straight", "restore_s", "straight", 1.1),
    Target("flusher", "flusher bandwidth vs raw O_DIRECT", "flush", "raw", 0.9, at_most=False),
)


def floor(summary: dict) -> dict | None:
    """The run's floor for the time until durable (see the module docstring), or None when the
    run lacks tmpfs or both disk limits."""
    def med(key):
        return summary.get(key, {}).get("median", {}).get("durable_s")

    disk = {k: med(k) for k in ("raw", "fio") if med(k)}
    if not med("tmpfs") or not disk:
        return None
    disk_key = min(disk, key=disk.get)
    out = {"tmpfs_s": med("tmpfs"), "disk_s": disk[disk_key], "disk_contender": disk_key,
           "floor_s": max(med("tmpfs"), disk[disk_key])}
    out["bound"] = "disk" if out["disk_s"] >= out["tmpfs_s"] else "serialisation"
    ck = med("ckptfs")
    if ck:
        out["ckptfs_s"] = ck
        out["ckptfs_vs_floor"] = ck / out["floor_s"]
    return out


def flush_gbps(runs: list[dict]) -> float | None:
    """Median of the ckptfs daemon's own flush bandwidth over the measured rounds."""
    vals = [r["status_flush_gbps"] for r in runs if r.get("contender") == "ckptfs"
            and r.get("round") != "warmup" and r.get("ok") and r.get("status_flush_gbps")]
    return statistics.median(vals) if vals else None


def judge(summary: dict, runs: list[dict]) -> list[dict]:
    """One verdict per target whose two contenders ran: ratio, held, and for durable-time
    targets the time the target allows ckptfs and that time against the run's floor."""
    ck = summary.get("ckptfs", {}).get("median", {})
    fl = floor(summary)
    out = []
    for t in TARGETS:
        other = summary.get(t.contender, {})
        m = other.get("median", {})
        if t.field == "flush":
            ours = flush_gbps(runs)
            theirs = other.get("bytes", 0) / m["durable_s"] / 1e9 if m.get("durable_s") else None
        else:
            ours, theirs = ck.get(t.field), m.get(t.field)
        if not ours or not theirs:
            continue
        ratio = ours / theirs
        v = {"target": t.key, "what": t.what, "limit": t.limit, "at_most": t.at_most,
             "ckptfs": ours, "contender": theirs, "ratio": ratio,
             "held": ratio <= t.limit if t.at_most else ratio >= t.limit}
        if t.field == "durable_s":
            v["allows_s"] = t.limit * theirs
            if fl is not None:
                v["allows_vs_floor"] = v["allows_s"] / fl["floor_s"]
        out.append(v)
    return out


def format_verdicts(verdicts: list[dict], fl: dict | None, default_state: bool) -> str:
    if not verdicts:
        return "targets: not judged (ckptfs or the contenders they compare with did not run)"
    hdr = ("target", "limit", "ckptfs / contender", "held", "allows ckptfs s",
           "allows / floor")
    rows = []
    for v in verdicts:
        rows.append((v["what"], ("<= %gx" if v["at_most"] else ">= %gx") % v["limit"],
                     "%.3fx" % v["ratio"], "yes" if v["held"] else "NO",
                     "%.2f" % v["allows_s"] if "allows_s" in v else "-",
                     "%.2fx" % v["allows_vs_floor"] if "allows_vs_floor" in v else "-"))
    widths = [max(len(str(x)) for x in col) for col in zip(hdr, *rows)]
    lines = ["  ".join(str(x).ljust(wd) if i == 0 else str(x).rjust(wd)
                       for i, (x, wd) in enumerate(zip(row, widths))) for row in [hdr] + rows]
    lines.insert(1, "-" * len(lines[0]))
    held = sum(v["held"] for v in verdicts)
    lines.append(f"{held} of {len(verdicts)} targets held in this run"
                 + ("" if default_state else " (the targets are set for the default ~2 GB "
                    "state dict; this run used another)"))
    if fl is not None:
        line = ("floor until durable: the larger of torch.save into tmpfs (%.2f s) and the "
                 "disk's O_DIRECT write of the same bytes (%s, %.2f s) = %.2f s, %s-bound"
                 % (fl["tmpfs_s"], fl["disk_contender"], fl["disk_s"], fl["floor_s"],
                    fl["bound"]))
        if "ckptfs_vs_floor" in fl:
            line += "; ckptfs %.2f s = %.2fx of it" % (fl["ckptfs_s"], fl["ckptfs_vs_floor"])
        lines.append(line)
        lines.append("allows / floor < 1: the target asks ckptfs to beat the floor, i.e. "
                     "serialisation or the disk itself")
    return "\n".join(lines)
