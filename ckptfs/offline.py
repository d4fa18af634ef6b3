"""Work on a backing directory without mounting it: `ckptfs ls`, `verify` and `export`.

They replay the indexes read-only (no lock taken, nothing written to the backing directory),
so they also work next to live mounts, seeing what is committed so far.
"""

from __future__ import annotations

import errno
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
        for d in layout.writer_dirs(backing):
            if writer is None or os.path.basename(d) == writer:
                layout.check_index_header(os.path.join(d, layout.INDEX_NAME))
        self.backing = backing
        self.ns = Namespace(now_ns=0)
        self.union = Union()
        load_foreign(self.ns, backing, None, self.union, only=writer)
        self.warnings = self.union.warnings

    @property
    def writer_dir(self) -> str | None:
        """The writer directory when the backing directory has exactly one writer."""
        dirs = list(self.union.writer_dirs.values())
        return dirs[0] if len(dirs) == 1 else None

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


class LogReader:
    """Reads runs from the writers' data logs and checks their CRC32C."""

    def __init__(self, union: Union) -> None:
        self.union = union
        self.fds: dict[tuple[int, int], int] = {}

    def where(self, run) -> str:
        return f"{self.union.writer_ids[run.layer]}/{layout.data_log_name(run.log)}"

    def read_run(self, run) -> bytes:
        key = (run.layer, run.log)
        fd = self.fds.get(key)
        if fd is None:
            path = os.path.join(self.union.writer_dirs[run.layer], layout.data_log_name(run.log))
            fd = self.fds[key] = os.open(path, os.O_RDONLY)
        data = os.pread(fd, run.length, run.loff)
        if len(data) != run.length:
            raise OSError(errno.EIO, f"extent at {self.where(run)} offset {run.loff}: short read")
        if crc32c(data) != run.crc:
            raise OSError(errno.EIO, f"extent at {self.where(run)} offset {run.loff} length "
                          f"{run.length}: checksum mismatch")
        return data

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


class Progress:
    """A one-line progress display on stderr (only when it is a terminal, or forced)."""

    def __init__(self, total: int, label: str, force: bool = False) -> None:
        self.total = max(total, 1)
        self.label = label
        self.done = 0
        self.show = force or sys.stderr.isatty()
        self.t0 = time.monotonic()
        self.last = 0.0

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.show and (now - self.last > 0.2 or self.done >= self.total):
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9) / 1e6
            print(f"\r{self.label}: {100 * self.done / self.total:5.1f}% "
                  f"{self.done / 1e6:10.1f} MB  {rate:8.1f} MB/s", end="", file=sys.stderr)

    def finish(self) -> None:
        if self.show:
            print(file=sys.stderr)


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


def cmd_verify(a) -> int:
    """Read every extent of every file and check its checksum. Exit 1 if anything is damaged."""
    snap = Snapshot(a.backing, a.writer)
    for w in snap.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if not snap.union.writer_dirs:
        print(f"{a.backing}: empty (no writer yet)")
        return 0
    logs = LogReader(snap.union)
    problems: dict[str, list[str]] = {}
    files = [(p, x) for p, x in snap.walk(snap.ns.inodes[ROOT_INO], "") if x.emap is not None]
    prog = Progress(sum(x.emap.stored_bytes() for _, x in files), "verify")
    nbytes = 0
    try:
        for path, x in files:
            for run in x.emap.runs():
                try:
                    nbytes += len(logs.read_run(run))
                except OSError as exc:
                    problems.setdefault(path, []).append(str(exc.strerror or exc))
                prog.add(run.length)
    finally:
        logs.close()
        prog.finish()
    for path, msgs in sorted(problems.items()):
        for m in msgs:
            print(f"DAMAGED {path}: {m}")
    dropped = [w for w in snap.warnings if "dropped" in w]
    status = "OK" if not problems and not dropped else "DAMAGED"
    print(f"{status}: {len(files)} files, {nbytes} bytes checked, {len(problems)} damaged files, "
          f"{len(snap.warnings)} index warnings")
    return 0 if status == "OK" else 1


def cmd_export(a) -> int:
    """Write the virtual tree (or PATH below it) out as plain files under DEST."""
    snap = Snapshot(a.backing, a.writer)
    for w in snap.warnings:
        print(f"warning: {w}", file=sys.stderr)
    top = snap.lookup(a.path)
    entries = list(snap.walk(top, ""))
    os.makedirs(a.dest, exist_ok=True)
    logs = LogReader(snap.union)
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


def _export_file(logs: LogReader, x: Inode, dst: str) -> None:
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


def cmd_import(a) -> int:
    """Copy a plain directory tree into a backing directory (through a temporary mount, so it
    is packed like any checkpoint written to ckptfs)."""
    import shutil
    import tempfile

    from ckptfs import api

    if not os.path.isdir(a.src):
        print(f"ckptfs: {a.src} is not a directory", file=sys.stderr)
        return 1
    mnt = tempfile.mkdtemp(prefix="ckptfs-import-")
    try:
        opts = {"writer_id": a.writer} if a.writer else {}
        with api.Mount(a.backing, mnt, **opts) as m:
            dest = os.path.join(mnt, a.path.strip("/"))
            total = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(a.src)
                        for f in fs if not os.path.islink(os.path.join(dp, f)))
            prog = Progress(total, "import", force=a.progress)

            def copy(src: str, dst: str) -> None:
                shutil.copy2(src, dst)
                prog.add(os.path.getsize(src))
            shutil.copytree(a.src, dest, symlinks=True, dirs_exist_ok=True, copy_function=copy)
            prog.finish()
            m.sync()
        print(f"imported {a.src} into {a.backing}:{a.path} ({total / 1e6:.1f} MB)")
        return 0
    finally:
        os.rmdir(mnt)
