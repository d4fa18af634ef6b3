"""Work on a backing directory without mounting it: `ckptfs ls` and `ckptfs verify`.

Both replay the index read-only (no lock taken, nothing written), so they also work next to a
live mount, seeing what is committed so far.
"""

from __future__ import annotations

import os
import stat
import sys
import time

from crc32c import crc32c

from ckptfs import layout
from ckptfs.merge import Union, load_foreign
from ckptfs.namespace import ROOT_INO, Inode, Namespace


class Snapshot:
    """The committed, merged tree of all writers of a backing directory (or of one)."""

    def __init__(self, backing: str, writer: str | None = None) -> None:
        layout.check_backing(backing, create=False)
        ids = [os.path.basename(d) for d in layout.writer_dirs(backing)]
        if writer and writer not in ids:
            raise layout.FormatError(f"no writer '{writer}' in {backing} "
                                     f"(writers: {', '.join(ids) or 'none'})")
        self.backing = backing
        self.ns = Namespace(now_ns=0)
        self.union = Union()
        load_foreign(self.ns, backing, None, self.union, only=writer)
        self.warnings = self.union.warnings

    def lookup(self, path: str) -> Inode:
        x = self.ns.inodes[ROOT_INO]
        for part in [p for p in path.split("/") if p]:
            if x.children is None or part.encode() not in x.children:
                raise FileNotFoundError(f"{path}: no such file or directory in {self.backing}")
            x = self.ns.inodes[x.children[part.encode()]]
        return x

    def walk(self, top: Inode, prefix: str):
        """(path, inode) for `top` and everything below it, depth first, sorted by name."""
        yield prefix or "/", top
        if top.children is not None:
            for name in sorted(top.children):
                child = self.ns.inodes[top.children[name]]
                yield from self.walk(child, f"{prefix}/{name.decode(errors='surrogateescape')}")


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
            versions = ", ".join(f"{w} @ {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t / 1e9))}"
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


def cmd_verify(a) -> int:
    """Read every extent of every file and check its checksum. Exit 1 if anything is damaged."""
    snap = Snapshot(a.backing, a.writer)
    problems: dict[str, list[str]] = {}
    for w in snap.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if not snap.union.writer_dirs:
        print(f"{a.backing}: empty (no writer yet)")
        return 0
    fds: dict[tuple[int, int], int] = {}

    def where(run) -> str:
        return f"{snap.union.writer_ids[run.layer]}/{layout.data_log_name(run.log)}"
    nfiles = nbytes = 0
    try:
        for path, x in snap.walk(snap.ns.inodes[ROOT_INO], ""):
            if x.emap is None:
                continue
            nfiles += 1
            for run in x.emap.runs():
                fd = fds.get((run.layer, run.log))
                if fd is None:
                    p = os.path.join(snap.union.writer_dirs[run.layer],
                                     layout.data_log_name(run.log))
                    try:
                        fd = fds[(run.layer, run.log)] = os.open(p, os.O_RDONLY)
                    except OSError as exc:
                        problems.setdefault(path, []).append(f"data log {run.log}: {exc}")
                        continue
                data = os.pread(fd, run.length, run.loff)
                nbytes += len(data)
                if len(data) != run.length:
                    problems.setdefault(path, []).append(
                        f"extent at {where(run)} offset {run.loff}: short read")
                elif crc32c(data) != run.crc:
                    problems.setdefault(path, []).append(
                        f"extent at {where(run)} offset {run.loff} length {run.length}: "
                        "checksum mismatch")
    finally:
        for fd in fds.values():
            os.close(fd)
    for path, msgs in sorted(problems.items()):
        for m in msgs:
            print(f"DAMAGED {path}: {m}")
    dropped = [w for w in snap.warnings if "dropped" in w]
    status = "OK" if not problems and not dropped else "DAMAGED"
    print(f"{status}: {nfiles} files, {nbytes} bytes checked, {len(problems)} damaged files, "
          f"{len(snap.warnings)} index warnings")
    return 0 if status == "OK" else 1
