"""`ckptfs export`: copy a committed tree out of a backing directory into plain files."""

from __future__ import annotations

import os
import stat
import sys

from ckptfs.format.logs import RunReader
from ckptfs.namespace import ROOT_INO, Inode
from ckptfs.tools.snapshot import Progress, Snapshot


def cmd_export(a) -> int:
    """Write the virtual tree (or PATH below it) out as plain files under DEST."""
    snap = Snapshot(a.backing, a.writer)
    for w in snap.warnings:
        print(f"warning: {w}", file=sys.stderr)
    top = snap.lookup(a.path)
    entries = list(snap.walk(top, ""))
    os.makedirs(a.dest, exist_ok=True)
    logs = RunReader(snap.union.writer_dirs)
    prog = Progress(sum(x.size for _, x in entries if x.emap is not None), "export",
                    force=a.progress)
    failed = 0
    dirs = []
    try:
        for rel, x in entries:
            dst = os.path.join(a.dest, rel.lstrip("/")) if rel != "/" else a.dest
            if x.children is not None:
                os.makedirs(dst, exist_ok=True)
                dirs.append((dst, x))
                continue
            if stat.S_ISLNK(x.mode):
                if os.path.lexists(dst):
                    os.unlink(dst)
                os.symlink(x.target, dst)
                continue
            if x.emap is None:
                continue  # device nodes, fifos: not exported
            try:
                _export_file(logs, x, dst)
            except OSError as exc:
                failed += 1
                print(f"ckptfs: export {rel}: {exc.strerror or exc}", file=sys.stderr)
            prog.add(x.size)
    finally:
        logs.close()
        prog.finish()
    for dst, x in reversed(dirs):  # after their contents, so the times stick
        if x.ino == ROOT_INO:
            continue  # the root has no record of its own: leave DEST as it is
        os.chmod(dst, stat.S_IMODE(x.mode))
        os.utime(dst, ns=(x.atime_ns, x.mtime_ns))
    print(f"exported {sum(1 for _, x in entries if x.emap is not None) - failed} files to "
          f"{a.dest}" + (f"; {failed} failed" if failed else ""))
    return 1 if failed else 0


def _export_file(logs: RunReader, x: Inode, dst: str) -> None:
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        cached_run, cached = None, b""
        for start, length, run, roff in x.emap.pieces:
            if run is not cached_run:
                cached_run, cached = run, logs.read_run(run)
            os.pwrite(fd, memoryview(cached)[roff:roff + length], start)
        os.ftruncate(fd, x.size)
        os.fchmod(fd, stat.S_IMODE(x.mode))
        os.utime(fd, ns=(x.atime_ns, x.mtime_ns))
    finally:
        os.close(fd)
