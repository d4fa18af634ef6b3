"""`ckptfs export`: copy a committed tree out of a backing directory into plain files."""

from __future__ import annotations

import os
import stat
import sys

from ckptfs.format.logs import RunReader
from ckptfs.namespace import ROOT_INO, Inode
from ckptfs.tools.fdtree import DirCursor
from ckptfs.tools.snapshot import Progress, Snapshot


def cmd_export(a) -> int:
    """Write the virtual tree (or PATH below it) out as plain files under DEST (a file at
    PATH: DEST is its copy). Directories are made and entered one level at a time through
    their descriptors: a tree of any depth, paths longer than PATH_MAX."""
    snap = Snapshot(a.backing, a.writer)
    for w in snap.warnings:
        print(f"warning: {w}", file=sys.stderr)
    top = snap.lookup(a.path)
    files = [x for _, _, x in snap.entries(top) if x.emap is not None]
    logs = RunReader(snap.union.writer_dirs)
    prog = Progress(sum(x.size for x in files), "export", force=a.progress)
    failed = 0
    try:
        if top.children is None:  # one file
            if top.emap is None:
                print(f"ckptfs: export {a.path}: not a regular file", file=sys.stderr)
                return 1
            parent, name = os.path.split(os.path.abspath(a.dest))
            with DirCursor(parent) as cur:
                _export_file(logs, top, cur.fd, name)
            prog.add(top.size)
        else:
            failed = _export_tree(snap, top, a.dest, logs, prog)
    finally:
        logs.close()
        prog.finish()
    print(f"exported {len(files) - failed} files to {a.dest}"
          + (f"; {failed} failed" if failed else ""))
    return 1 if failed else 0


def _export_tree(snap: Snapshot, top: Inode, dest: str, logs: RunReader,
                 prog: Progress) -> int:
    """Everything below directory `top` into directory `dest` (made if missing; it takes
    top's mode and times unless top is the root, which has no record of its own); returns
    how many files failed."""
    failed = 0
    with DirCursor(dest, make=0o777) as cur:
        dirs: list[Inode] = []  # the directory of each level below DEST the cursor is in
        names: list[str] = []  # their names (for messages)
        for depth, name, x in snap.entries(top):
            if not depth:
                continue
            while cur.depth >= depth:  # out of the directories done, their times set last
                _finish_dir(cur.fd, dirs.pop())
                names.pop()
                cur.up()
            if x.children is not None:
                cur.down(name, make=0o700)
                dirs.append(x)
                names.append(name.decode(errors="surrogateescape"))
                continue
            if stat.S_ISLNK(x.mode):
                try:
                    os.unlink(name, dir_fd=cur.fd)
                except FileNotFoundError:
                    pass
                os.symlink(x.target, name, dir_fd=cur.fd)
                os.utime(name, ns=(x.atime_ns, x.mtime_ns), dir_fd=cur.fd,
                         follow_symlinks=False)
                continue
            if x.emap is None:
                continue  # device nodes, fifos: not exported
            try:
                _export_file(logs, x, cur.fd, name)
            except OSError as exc:
                failed += 1
                rel = "/".join(names + [name.decode(errors="surrogateescape")])
                print(f"ckptfs: export {rel}: {exc.strerror or exc}", file=sys.stderr)
            prog.add(x.size)
        while dirs:
            _finish_dir(cur.fd, dirs.pop())
            cur.up()
        if top.ino != ROOT_INO:
            _finish_dir(cur.fd, top)
    return failed


def _finish_dir(fd: int, x: Inode) -> None:
    """A directory's mode and times, once everything in it is written."""
    os.chmod(fd, stat.S_IMODE(x.mode))
    os.utime(fd, ns=(x.atime_ns, x.mtime_ns))


def _export_file(logs: RunReader, x: Inode, dir_fd: int, name) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=dir_fd)
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
