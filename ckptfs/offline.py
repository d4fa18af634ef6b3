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
from ckptfs.daemon import replay, validate_extents
from ckptfs.namespace import ROOT_INO, Inode, Namespace


class Snapshot:
    """The committed tree of one writer of a backing directory."""

    def __init__(self, backing: str, writer: str | None = None) -> None:
        layout.check_backing(backing, create=False)
        dirs = layout.writer_dirs(backing)
        if writer:
            dirs = [d for d in dirs if os.path.basename(d) == writer]
            if not dirs:
                raise layout.FormatError(f"no writer '{writer}' in {backing}")
        if len(dirs) > 1:
            names = ", ".join(os.path.basename(d) for d in dirs)
            raise layout.FormatError(f"{backing} has several writers ({names}); pick one "
                                     "with --writer")
        self.backing = backing
        self.ns = Namespace(now_ns=0)
        self.warnings: list[str] = []
        self.writer_dir = dirs[0] if dirs else None
        if self.writer_dir:
            index = os.path.join(self.writer_dir, layout.INDEX_NAME)
            if os.path.exists(index):
                _, _, self.warnings = replay(self.ns, index)
            self.warnings += validate_extents(self.ns, self.writer_dir)

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
    if snap.writer_dir is None:
        print(f"{a.backing}: empty (no writer yet)")
        return 0
    fds: dict[int, int] = {}
    nfiles = nbytes = 0
    try:
        for path, x in snap.walk(snap.ns.inodes[ROOT_INO], ""):
            if x.emap is None:
                continue
            nfiles += 1
            for run in x.emap.runs():
                fd = fds.get(run.log)
                if fd is None:
                    p = os.path.join(snap.writer_dir, layout.data_log_name(run.log))
                    try:
                        fd = fds[run.log] = os.open(p, os.O_RDONLY)
                    except OSError as exc:
                        problems.setdefault(path, []).append(f"data log {run.log}: {exc}")
                        continue
                data = os.pread(fd, run.length, run.loff)
                nbytes += len(data)
                if len(data) != run.length:
                    problems.setdefault(path, []).append(
                        f"extent at log {run.log} offset {run.loff}: short read")
                elif crc32c(data) != run.crc:
                    problems.setdefault(path, []).append(
                        f"extent at log {run.log} offset {run.loff} length {run.length}: "
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
