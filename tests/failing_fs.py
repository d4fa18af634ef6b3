"""A small pass-through FUSE file system that can be told to fail with EIO: the stand-in for a
failing disk (device-mapper's dm-error) on machines without device-mapper.

    python tests/failing_fs.py SOURCE_DIR MOUNTPOINT

mirrors SOURCE_DIR at MOUNTPOINT. While the control file SOURCE_DIR/.fail exists, the
operations it names (whitespace separated; an empty file means "write fsync") fail with EIO:

    write    write(2)/pwrite(2) to a file
    fsync    fsync/fdatasync of files and directories
    create   create, mkdir, rename, unlink, rmdir, truncate (the metadata writes)
    read     read(2)
    list     opendir (listing a directory)

`fsync-lose` fails an fsync as a disk whose writeback failed does on Linux: the bytes written
to that file since its last good fsync are lost (overwritten with zeros, as the kernel drops
the pages it could not write back), the fsync fails with EIO, and the next fsync succeeds
(the error is reported once).

A name prefixed with `hang-` (`hang-fsync`, `hang-write`, `hang-read`) makes that operation
wait instead, as a store that stopped answering would, until the control file no longer names
it.

`.fail` itself is never shown in the mirror. Reads, lookups and listings keep working unless
`read` or `list` is named. The process runs in the foreground and prints "ready" once
mounted; it exits after `fusermount3 -u MOUNTPOINT` or SIGTERM/SIGINT (which unmount).

What it supports is what ckptfs does to its backing store: lookup/getattr/setattr, create and
open (O_DIRECT is accepted: the kernel sends such writes straight through, the source file is
opened without it), read/write at offsets (O_APPEND kept), fsync, ftruncate, rename, mkdir,
rmdir, unlink, readdir, statfs. fallocate is not implemented (pyfuse3 has no such handler: the
kernel answers EOPNOTSUPP, and glibc's posix_fallocate emulates it with a 1-byte write per
4 KiB block, about 1.2 s per 64 MiB here). flock is handled by the kernel locally.
No hard links, symlinks or xattrs.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import sys

import pyfuse3
import trio

CONTROL = b".fail"
DEFAULT_FAIL = frozenset({"write", "fsync"})


def _oserr(exc: OSError) -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(exc.errno or errno.EIO)


class FailingFS(pyfuse3.Operations):
    enable_writeback_cache = False

    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = os.fsencode(os.path.abspath(source))
        self.control = os.path.join(self.source, CONTROL)
        # Our inode numbers: ROOT_INODE for the source, then a counter. A source file is known
        # by (st_dev, st_ino) while it has a name; the path is the one it was last seen under.
        self.paths: dict[int, bytes | None] = {pyfuse3.ROOT_INODE: self.source}
        st = os.lstat(self.source)
        self.by_key: dict[tuple[int, int], int] = {(st.st_dev, st.st_ino): pyfuse3.ROOT_INODE}
        self.key_of: dict[int, tuple[int, int]] = {pyfuse3.ROOT_INODE: (st.st_dev, st.st_ino)}
        self.lookups: dict[int, int] = {pyfuse3.ROOT_INODE: 1}
        self.next_inode = pyfuse3.ROOT_INODE + 1
        self.fds: dict[int, int] = {}  # fh (= source fd) -> our inode
        self.dirs: dict[int, list[bytes]] = {}  # directory fh -> names listed at opendir
        self.dir_paths: dict[int, bytes] = {}  # directory fh -> its path (kept up to date)
        self.next_dir = 1
        self.injected = 0  # EIOs returned so far
        self.unsynced: dict[int, list[tuple[int, int]]] = {}  # fh -> writes since its fsync

    # ------------------------------------------------------------ failure switch
    def _named(self) -> list[str] | None:
        try:
            with open(self.control, "rb") as f:
                return f.read().decode(errors="replace").split()
        except FileNotFoundError:
            return None
        except OSError:
            return []

    def _check(self, op: str) -> None:
        names = self._named()
        if names is None:
            return
        if op in (frozenset(names) or DEFAULT_FAIL):
            self.injected += 1
            if self.injected <= 20 or self.injected % 1000 == 0:
                print(f"failing_fs: EIO #{self.injected} for {op}", file=sys.stderr, flush=True)
            raise pyfuse3.FUSEError(errno.EIO)

    async def _hang(self, op: str) -> None:
        """Wait while the control file names hang-OP (a store that stopped answering)."""
        said = False
        while True:
            try:
                with open(self.control, "rb") as f:
                    names = f.read().decode(errors="replace").split()
            except OSError:
                return
            if f"hang-{op}" not in names:
                return
            if not said:
                print(f"failing_fs: {op} hangs", file=sys.stderr, flush=True)
                said = True
            await trio.sleep(0.05)

    # ------------------------------------------------------------ inode bookkeeping
    def _path(self, inode: int) -> bytes:
        p = self.paths.get(inode)
        if p is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return p

    def _child(self, parent: int, name: bytes) -> bytes:
        if name == CONTROL and parent == pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.EPERM)
        return os.path.join(self._path(parent), name)

    def _attr(self, st: os.stat_result, inode: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        for f in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size",
                  "st_atime_ns", "st_mtime_ns", "st_ctime_ns"):
            setattr(a, f, getattr(st, f))
        a.st_ino = inode
        a.st_blksize = st.st_blksize
        a.st_blocks = st.st_blocks
        a.generation = 0
        a.entry_timeout = 0
        a.attr_timeout = 0
        return a

    def _remember(self, path: bytes, st: os.stat_result) -> int:
        """Our inode for the source file `st` found at `path` (lookup count +1)."""
        key = (st.st_dev, st.st_ino)
        inode = self.by_key.get(key)
        if inode is None:
            inode = self.next_inode
            self.next_inode += 1
            self.by_key[key] = inode
            self.key_of[inode] = key
            self.lookups[inode] = 0
        self.paths[inode] = path
        self.lookups[inode] += 1
        return inode

    def _entry(self, path: bytes) -> pyfuse3.EntryAttributes:
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise _oserr(exc) from None
        return self._attr(st, self._remember(path, st))

    def _drop_name(self, path: bytes) -> None:
        """`path` is about to be unlinked or replaced: its inode loses its name."""
        try:
            st = os.lstat(path)
        except OSError:
            return
        inode = self.by_key.pop((st.st_dev, st.st_ino), None)
        if inode is not None:
            self.paths[inode] = None
            self.key_of.pop(inode, None)

    def _stat(self, inode: int) -> os.stat_result:
        for fd, ino in self.fds.items():  # an open file may have lost its name
            if ino == inode:
                return os.fstat(fd)
        try:
            return os.lstat(self._path(inode))
        except OSError as exc:
            raise _oserr(exc) from None

    def _own(self, path: bytes, ctx) -> None:
        if os.geteuid() == 0:
            os.lchown(path, ctx.uid, ctx.gid)

    # ------------------------------------------------------------ lookups and attributes
    async def lookup(self, parent_inode, name, ctx=None):
        if name == b".":
            return self._attr(self._stat(parent_inode), parent_inode)
        if name == b"..":
            path = os.path.dirname(self._path(parent_inode))
            return self._entry(path if parent_inode != pyfuse3.ROOT_INODE else self.source)
        return self._entry(self._child(parent_inode, name))

    async def forget(self, inode_list):
        for inode, n in inode_list:
            if inode == pyfuse3.ROOT_INODE or inode not in self.lookups:
                continue
            self.lookups[inode] -= n
            if self.lookups[inode] <= 0:
                del self.lookups[inode]
                self.paths.pop(inode, None)
                key = self.key_of.pop(inode, None)
                if key is not None and self.by_key.get(key) == inode:
                    del self.by_key[key]

    async def getattr(self, inode, ctx=None):
        return self._attr(self._stat(inode), inode)

    async def setattr(self, inode, attr, fields, fh, ctx):
        try:
            if fields.update_size:
                self._check("create")
                if fh is not None and fh in self.fds:
                    os.ftruncate(fh, attr.st_size)
                else:
                    os.truncate(self._path(inode), attr.st_size)
            target = fh if (fh is not None and fh in self.fds) else self._path(inode)
            if fields.update_mode:
                os.chmod(target, stat.S_IMODE(attr.st_mode))
            if fields.update_uid or fields.update_gid:
                os.chown(target, attr.st_uid if fields.update_uid else -1,
                         attr.st_gid if fields.update_gid else -1)
            if fields.update_atime or fields.update_mtime:
                st = self._stat(inode)
                os.utime(target, ns=(attr.st_atime_ns if fields.update_atime else st.st_atime_ns,
                                     attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns))
        except OSError as exc:
            raise _oserr(exc) from None
        return await self.getattr(inode, ctx)

    async def statfs(self, ctx):
        sv = os.statvfs(self.source)
        out = pyfuse3.StatvfsData()
        for f in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                  "f_ffree", "f_favail", "f_namemax"):
            setattr(out, f, getattr(sv, f))
        return out

    # ------------------------------------------------------------ directories
    async def opendir(self, inode, ctx):
        self._check("list")
        try:
            names = sorted(os.listdir(self._path(inode)))
        except OSError as exc:
            raise _oserr(exc) from None
        if inode == pyfuse3.ROOT_INODE:
            names = [n for n in names if n != CONTROL]
        fh = self.next_dir
        self.next_dir += 1
        self.dirs[fh] = names
        self.dir_paths[fh] = self._path(inode)
        return fh

    async def readdir(self, fh, start_id, token):
        names = self.dirs.get(fh)
        if names is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        for i in range(start_id, len(names)):
            name = os.fsencode(names[i])
            path = os.path.join(self.dir_paths[fh], name)
            try:
                st = os.lstat(path)
            except OSError:
                continue  # removed since the listing
            inode = self._remember(path, st)
            if not pyfuse3.readdir_reply(token, name, self._attr(st, inode), i + 1):
                self.lookups[inode] -= 1  # not passed on: the kernel did not count it
                break

    async def releasedir(self, fh):
        self.dirs.pop(fh, None)
        self.dir_paths.pop(fh, None)

    async def fsyncdir(self, fh, datasync):
        await self._hang("fsync")
        self._check("fsync")
        try:
            fd = os.open(self.dir_paths[fh], os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _oserr(exc) from None

    async def mkdir(self, parent_inode, name, mode, ctx):
        self._check("create")
        path = self._child(parent_inode, name)
        try:
            os.mkdir(path, mode & ~ctx.umask)
            self._own(path, ctx)
        except OSError as exc:
            raise _oserr(exc) from None
        return self._entry(path)

    async def rmdir(self, parent_inode, name, ctx):
        self._remove(parent_inode, name, os.rmdir)

    async def unlink(self, parent_inode, name, ctx):
        self._remove(parent_inode, name, os.unlink)

    def _remove(self, parent_inode, name, remove) -> None:
        self._check("create")
        path = self._child(parent_inode, name)
        try:
            st = os.lstat(path)
            remove(path)
        except OSError as exc:
            raise _oserr(exc) from None
        self._forget_key(st)

    def _forget_key(self, st: os.stat_result) -> None:
        inode = self.by_key.pop((st.st_dev, st.st_ino), None)
        if inode is not None:
            self.paths[inode] = None
            self.key_of.pop(inode, None)

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        self._check("create")
        if flags & ~pyfuse3.RENAME_NOREPLACE:
            raise pyfuse3.FUSEError(errno.EINVAL)
        old = self._child(parent_inode_old, name_old)
        new = self._child(parent_inode_new, name_new)
        if flags & pyfuse3.RENAME_NOREPLACE and os.path.lexists(new):
            raise pyfuse3.FUSEError(errno.EEXIST)
        try:
            if os.path.lexists(new) and not os.path.samefile(old, new):
                self._drop_name(new)
            os.rename(old, new)
        except OSError as exc:
            raise _oserr(exc) from None
        # the moved inode and, for a directory, everything known below it get the new path
        prefix = old + b"/"
        for inode, p in list(self.paths.items()):
            if p is None:
                continue
            if p == old:
                self.paths[inode] = new
            elif p.startswith(prefix):
                self.paths[inode] = new + b"/" + p[len(prefix):]
        for fh, p in list(self.dir_paths.items()):
            if p == old:
                self.dir_paths[fh] = new
            elif p.startswith(prefix):
                self.dir_paths[fh] = new + b"/" + p[len(prefix):]

    # ------------------------------------------------------------ files
    @staticmethod
    def _flags(flags: int) -> int:
        # O_DIRECT: the kernel already bypasses its page cache for such files; the source file
        # is written with ordinary (unaligned) buffers. Creation flags are handled by create().
        return flags & ~(os.O_DIRECT | os.O_CREAT | os.O_EXCL | os.O_NOCTTY) | os.O_CLOEXEC

    async def open(self, inode, flags, ctx):
        if flags & os.O_TRUNC:
            self._check("create")
        try:
            fd = os.open(self._path(inode), self._flags(flags))
        except OSError as exc:
            raise _oserr(exc) from None
        self.fds[fd] = inode
        return pyfuse3.FileInfo(fh=fd)

    async def create(self, parent_inode, name, mode, flags, ctx):
        self._check("create")
        path = self._child(parent_inode, name)
        try:
            fd = os.open(path, self._flags(flags) | os.O_CREAT | (flags & os.O_EXCL),
                         mode & ~ctx.umask)
            self._own(path, ctx)
            st = os.fstat(fd)
        except OSError as exc:
            raise _oserr(exc) from None
        inode = self._remember(path, st)
        self.fds[fd] = inode
        return pyfuse3.FileInfo(fh=fd), self._attr(st, inode)

    async def read(self, fh, off, size):
        await self._hang("read")
        self._check("read")
        try:
            return os.pread(fh, size, off)
        except OSError as exc:
            raise _oserr(exc) from None

    async def write(self, fh, off, buf):
        await self._hang("write")
        self._check("write")
        try:
            n = os.pwrite(fh, buf, off)
        except OSError as exc:
            raise _oserr(exc) from None
        self.unsynced.setdefault(fh, []).append((off, n))
        return n

    async def flush(self, fh):
        pass

    async def fsync(self, fh, datasync):
        await self._hang("fsync")
        self._check("fsync")
        lost = self.unsynced.pop(fh, [])
        if lost and "fsync-lose" in (self._named() or ()):
            for off, n in lost:  # (the pages the kernel dropped)
                os.pwrite(fh, bytes(n), off)
            self.injected += 1
            print(f"failing_fs: {len(lost)} writes lost, EIO #{self.injected} for fsync",
                  file=sys.stderr, flush=True)
            raise pyfuse3.FUSEError(errno.EIO)
        try:
            (os.fdatasync if datasync else os.fsync)(fh)
        except OSError as exc:
            raise _oserr(exc) from None

    async def release(self, fh):
        self.fds.pop(fh, None)
        os.close(fh)


async def _serve() -> None:
    """Serve until unmounted (pyfuse3.main returns) or SIGTERM/SIGINT."""
    async def on_signal(scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            print("ready", flush=True)
            async for _ in signals:
                scope.cancel()
                return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(on_signal, nursery.cancel_scope)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: failing_fs.py SOURCE_DIR MOUNTPOINT", file=sys.stderr)
        return 2
    source, mountpoint = argv
    fs = FailingFS(source)
    opts = set(pyfuse3.default_options)  # default_permissions: the kernel checks modes
    opts.add("fsname=failing_fs")
    pyfuse3.init(fs, mountpoint, opts)
    try:
        trio.run(_serve)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
