"""`ckptfs import`: copy a plain directory tree into a backing directory (through a mount)."""

from __future__ import annotations

import os
import stat
import sys

from ckptfs.tools.fdtree import ENTER, EXIT, FILE, DirCursor, walk
from ckptfs.tools.snapshot import Progress

COPY_BYTES = 1 << 20  # one WRITE of the mount (its largest)


def cmd_import(a) -> int:
    """Copy a plain directory tree into a backing directory (through a temporary mount, so it
    is packed like any checkpoint written to ckptfs). Both trees are walked one level at a
    time through directory descriptors: a tree of any depth, paths longer than PATH_MAX."""
    import tempfile

    from ckptfs import api

    if not os.path.isdir(a.src):
        print(f"ckptfs: {a.src} is not a directory", file=sys.stderr)
        return 1
    with DirCursor(a.src) as cur:
        total = sum(st.st_size for event, _, st in walk(cur)
                    if event == FILE and stat.S_ISREG(st.st_mode))
    mnt = tempfile.mkdtemp(prefix="ckptfs-import-")
    try:
        opts = {"writer_id": a.writer} if a.writer else {}
        with api.Mount(a.backing, mnt, **opts) as m:
            dest = os.path.join(mnt, a.path.strip("/"))
            prog = Progress(total, "import", force=a.progress)
            try:
                _import_tree(a.src, dest, prog)
            finally:
                prog.finish()
            m.sync()
        print(f"imported {a.src} into {a.backing}:{a.path} ({total / 1e6:.1f} MB)")
        return 0
    finally:
        os.rmdir(mnt)


def _import_tree(src: str, dest: str, prog: Progress) -> None:
    """Directory `src`'s entries into `dest` (made if missing), as `cp -a` would without
    owners: bytes, modes, times; links as links; other kinds (devices, fifos, sockets) left
    out with a warning. Directories take their modes and times once their entries are in."""
    with DirCursor(src) as s, DirCursor(dest, make=0o777) as d:
        for event, name, st in walk(s):
            if event == ENTER:
                d.down(name, make=0o700)
            elif event == EXIT:
                _copy_stat(d.fd, st)
                d.up()
            elif stat.S_ISREG(st.st_mode):
                _copy_file(s.fd, d.fd, name, st)
                prog.add(st.st_size)
            elif stat.S_ISLNK(st.st_mode):
                target = os.readlink(name, dir_fd=s.fd)
                try:
                    os.unlink(name, dir_fd=d.fd)
                except FileNotFoundError:
                    pass
                os.symlink(target, name, dir_fd=d.fd)
                os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=d.fd,
                         follow_symlinks=False)
            else:
                print(f"ckptfs: import: {name} left out (not a file, directory or link)",
                      file=sys.stderr)
        _copy_stat(d.fd, os.fstat(s.fd))


def _copy_stat(fd: int, st: os.stat_result) -> None:
    os.chmod(fd, stat.S_IMODE(st.st_mode))
    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))


def _copy_file(src_dir: int, dest_dir: int, name: str, st: os.stat_result) -> None:
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src_dir)
    try:
        dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600, dir_fd=dest_dir)
        try:
            buf = bytearray(COPY_BYTES)
            view = memoryview(buf)
            while n := os.readv(src, [buf]):
                done = 0
                while done < n:
                    done += os.write(dst, view[done:n])
            _copy_stat(dst, st)
        finally:
            os.close(dst)
    finally:
        os.close(src)
