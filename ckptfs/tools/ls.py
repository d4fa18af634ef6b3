"""`ckptfs ls`: list the committed tree of a backing directory."""

from __future__ import annotations

import stat
import sys
import time

from ckptfs.namespace import Inode
from ckptfs.tools.snapshot import Snapshot


def _fmt(path: str, x: Inode, long: bool) -> str:
    if not long:
        return path
    t = time.strftime("%Y-%m-%d %H:%M", time.localtime(x.mtime_ns / 1e9))
    target = f" -> {x.target.decode(errors='replace')}" if stat.S_ISLNK(x.mode) else ""
    return f"{stat.filemode(x.mode)} {x.uid:>5} {x.gid:>5} {x.size:>14} {t} {path}{target}"


def cmd_ls(a) -> int:
    snap = Snapshot(a.backing, a.writer)
    for w in snap.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if getattr(a, "conflicts", False):
        for c in sorted(snap.union.conflicts, key=lambda c: c.path):
            versions = ", ".join(
                f"{w} @ {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t / 1e9))}"
                f".{t % 1_000_000_000:09d}" for w, t in c.versions)
            print(f"{c.path}: {versions}  (winner: {c.versions[0][0]})")
        return 0
    top = snap.lookup(a.path)
    prefix = "/" + a.path.strip("/") if a.path.strip("/") else ""
    entries = snap.walk(top, prefix) if a.recursive else (
        [(prefix or "/", top)] if top.children is None else
        [(f"{prefix}/{n.decode(errors='surrogateescape')}", snap.ns.inodes[i])
         for n, i in sorted(top.children.items())])
    for path, x in entries:
        print(_fmt(path, x, a.long))
    return 0
