"""Boundary values of the POSIX surface against a model, on a real `--allow-other` mount and
again after a remount of the same backing directory: sizes and offsets from 0 to 2^63 - 1,
times before 1901 and after 2262, every mode bit, names of 255 and 256 bytes, paths of 4,095
and 4,096 bytes and past PATH_MAX (reached through directory descriptors), a tree 2,000
directories deep, a thousand hard links of one file, extended attributes; as root, and as
another user where POSIX says who may do what.

The model states the result of every operation (a value or an errno) and the state it leaves
(kinds, modes with the set-ID and sticky bits, owners, sizes, times in ns, names, link counts,
which names share an inode and its bytes, xattrs). ckptfs's own limits are documented
(docs/format.md, "limits"; docs/reliability.md): files up to 1 PiB (`MAX_FILE_BYTES`), a size
past it or a write starting at it fails with EFBIG, one across it is short; times outside
1677-09-21 .. 2262-04-11 (a signed 64-bit count of ns) are clamped to the nearest end; no
extended attributes but the control ones on the mount's root. The same model, given ext4's
limits, is run against a plain directory on the local disk, so that what it says about POSIX is
checked against a kernel file system too. The known differences are the Limits below: ext4's
largest file is 16 TiB - 4 KiB; ext4 keeps times 1901-12-13 .. 2446-05-10 and clamps to whole
seconds; ext4 stores xattrs."""

from __future__ import annotations

import collections
import dataclasses
import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Callable

import pytest
from helpers import cli, py_as_user, walk_fds

from ckptfs import api
from ckptfs.format import records
from ckptfs.tools.fdtree import remove_tree

pytestmark = pytest.mark.timeout(180)

MAX = records.MAX_FILE_BYTES
I64 = (1 << 63) - 1
S = 10**9
PATH_MAX = 4096  # with its NUL: a path of 4,096 bytes is ENAMETOOLONG
NAME_MAX = 255
ENOTSUP = errno.errorcode[errno.ENOTSUP]
NOBODY = 65534
OTHER_GID = 1234  # a group `nobody` is not a member of
T2300 = 10_413_792_000 * S + 7  # 2300-01-01
T1600 = -11_676_096_000 * S  # 1600-01-01


# ---------------------------------------------------------------- the limits of each target
def _ckptfs_time(ns: int) -> int:
    return min(max(ns, records.TIME_MIN_NS), records.TIME_MAX_NS)


EXT4_TIME_S = (-(1 << 31), (1 << 34) - (1 << 31) - 1)  # 1901-12-13 .. 2446-05-10


def _ext4_time(ns: int) -> int:
    """ext4 (256-byte inodes) keeps times in this range of seconds; one outside it, or in its
    first or last second, becomes that second, its nanoseconds dropped."""
    s = ns // S
    if s <= EXT4_TIME_S[0]:
        return EXT4_TIME_S[0] * S
    if s >= EXT4_TIME_S[1]:
        return EXT4_TIME_S[1] * S
    return ns


@dataclasses.dataclass(frozen=True)
class Limits:
    name: str
    max_file: int  # the largest size; a truncate past it, or a write starting at it: EFBIG
    time: Callable[[int], int]  # what a time set becomes
    xattrs: bool  # stores extended attributes (else ENOTSUP)
    root_xattrs: tuple[str, ...]  # listed on the root of the tree under test
    # a write by a user outside the file's group clears set-group-ID without group execution
    # too (POSIX: "may be cleared"; Linux 6.2 and later on ext4; FUSE's own kill of the bits
    # before a write through the page cache, and ckptfs, keep it)
    kill_sgid_without_gx: bool


CKPTFS = Limits("ckptfs", MAX, _ckptfs_time, False, (api.XATTR_STATUS,), False)
EXT4 = Limits("ext4", (1 << 44) - 4096, _ext4_time, True, (),
              tuple(map(int, os.uname().release.split(".")[:2])) >= (6, 2))

TIMES = [  # ns since the epoch
    0, 1, -1,
    (1 << 31) * S - 1, (1 << 31) * S,  # 2038
    -(1 << 31) * S, -(1 << 31) * S - 1,  # 1901-12-13 20:45:52, ext4's first second
    -5_364_662_400 * S + 123,  # 1800-01-01
    T1600,
    records.TIME_MIN_NS, records.TIME_MIN_NS - 1,
    records.TIME_MAX_NS, records.TIME_MAX_NS + 1,
    T2300,
    EXT4_TIME_S[1] * S + 999_999_999, (EXT4_TIME_S[1] + 1) * S,  # ext4's last second
    (1 << 40) * S,  # year 36812
]


def _outcome(fn, *args, **kw):
    """fn's value, or the name of the errno it failed with."""
    try:
        return fn(*args, **kw)
    except OSError as exc:
        return errno.errorcode.get(exc.errno, exc.errno)


# ---------------------------------------------------------------- the model
class Node:
    """One inode: what stat, readlink, pread and listxattr must show."""

    def __init__(self, kind: str, mode: int, uid: int = 0, gid: int = 0, rdev: int = 0,
                 target: bytes = b"") -> None:
        self.kind, self.mode, self.uid, self.gid, self.rdev = kind, mode, uid, gid, rdev
        self.target = target
        self.size = len(target)
        self.atime: int | None = None  # None: not set by the test (the time of a change)
        self.mtime: int | None = None
        self.data: dict[int, bytes] = {}  # bytes written at an offset (never overlapping)
        self.xattrs: dict[str, bytes] = {}


KINDS = {"f": stat.S_IFREG, "d": stat.S_IFDIR, "l": stat.S_IFLNK, "p": stat.S_IFIFO,
         "s": stat.S_IFSOCK, "c": stat.S_IFCHR, "b": stat.S_IFBLK}


class Model:
    """The tree (path relative to the root, bytes -> Node; hard links share the Node) and the
    result each operation must have, as root, on a file system with the given limits. Every
    operation returns its expected result: None (success without a value), a value, or the
    name of the errno."""

    def __init__(self, limits: Limits) -> None:
        self.lim = limits
        self.tree: dict[bytes, Node] = {b"": Node("d", 0o755)}

    # resolution
    def _walk(self, path: bytes, last_must_exist: bool) -> str | None:
        """The errno of resolving `path` (None: fine so far), the last component included
        when it must exist."""
        if len(path) >= PATH_MAX:
            return "ENAMETOOLONG"
        parts = path.split(b"/")
        cur = b""
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if len(part) > NAME_MAX:
                return "ENAMETOOLONG"
            cur = cur + b"/" + part if cur else part
            if last and not last_must_exist:
                break
            node = self.tree.get(cur)
            if node is None:
                return "ENOENT"
            if not last and node.kind != "d":
                return "ENOTDIR"
        return None

    @staticmethod
    def parent(path: bytes) -> bytes:
        return path.rpartition(b"/")[0]

    def _new(self, path: bytes, node: Node):
        e = self._walk(path, last_must_exist=False)
        if e:
            return e
        if path in self.tree:
            return "EEXIST"
        parent = self.tree[self.parent(path)]
        if parent.mode & stat.S_ISGID:
            node.gid = parent.gid
            if node.kind == "d":
                node.mode |= stat.S_ISGID
        self.tree[path] = node
        parent.mtime = None
        return None

    def _node(self, path: bytes) -> tuple[str | None, Node | None]:
        e = self._walk(path, last_must_exist=True)
        return e, None if e else self.tree[path]

    # namespace
    def create(self, path: bytes, mode: int):  # (umask 0)
        return self._new(path, Node("f", mode & 0o7777))

    def mkdir(self, path: bytes, mode: int):  # (the kernel takes no set-ID bits from mkdir)
        return self._new(path, Node("d", mode & 0o1777))

    def mknod(self, path: bytes, kind: str, mode: int, rdev: int = 0):
        return self._new(path, Node(kind, mode & 0o7777,
                                    rdev=rdev if kind in "cb" else 0))

    def symlink(self, target: bytes, path: bytes):
        if len(target) >= PATH_MAX:
            return "ENAMETOOLONG"
        return self._new(path, Node("l", 0o777, target=target))

    def link(self, src: bytes, dst: bytes):
        e, node = self._node(src)
        if e:
            return e
        e = self._walk(dst, last_must_exist=False)
        if e:
            return e
        if dst in self.tree:
            return "EEXIST"
        if node.kind == "d":
            return "EPERM"
        self.tree[dst] = node
        self.tree[self.parent(dst)].mtime = None
        return None

    def unlink(self, path: bytes):
        e, node = self._node(path)
        if e:
            return e
        if node.kind == "d":
            return "EISDIR"
        del self.tree[path]
        self.tree[self.parent(path)].mtime = None
        return None

    def rename(self, src: bytes, dst: bytes):  # (of files, not directories)
        e, node = self._node(src)
        if e:
            return e
        e = self._walk(dst, last_must_exist=False)
        if e:
            return e
        assert node.kind != "d"
        old = self.tree.get(dst)
        if old is node:  # two names of one inode: nothing happens
            return None
        if old is not None and old.kind == "d":
            return "EISDIR"
        self.tree[dst] = self.tree.pop(src)
        self.tree[self.parent(src)].mtime = self.tree[self.parent(dst)].mtime = None
        return None

    # attributes
    def stat(self, path: bytes):  # (the kind, and the size of a file or link)
        e, node = self._node(path)
        return e or (node.kind, node.size if node.kind in "fl" else None)

    def chmod(self, path: bytes, mode: int):
        e, node = self._node(path)
        if e:
            return e
        node.mode = mode & 0o7777  # (root: every bit kept)
        return None

    def chown(self, path: bytes, uid: int, gid: int):
        e, node = self._node(path)
        if e:
            return e
        if uid != -1:
            node.uid = uid
        if gid != -1:
            node.gid = gid
        if node.kind != "d":  # any chown of a file, root's too, kills set-user-ID, and
            node.mode &= ~stat.S_ISUID  # set-group-ID where group execution is on
            if node.mode & stat.S_IXGRP:
                node.mode &= ~stat.S_ISGID
        return None

    def utime(self, path: bytes, atime: int, mtime: int):
        e, node = self._node(path)
        if e:
            return e
        node.atime, node.mtime = self.lim.time(atime), self.lim.time(mtime)
        return None

    # bytes
    def truncate(self, path: bytes, size: int):
        e, node = self._node(path)
        if e:
            return e
        if size < 0:
            return "EINVAL"
        if size > self.lim.max_file:
            return "EFBIG"
        node.size = size
        node.data = {o: b[:size - o] for o, b in node.data.items() if o < size}
        node.mtime = None
        return None

    def pwrite(self, path: bytes, data: bytes, off: int, how: int = os.O_WRONLY):
        e, node = self._node(path)
        if e:
            return e
        if off + len(data) > I64:
            return "EINVAL"
        if not data:
            return 0
        if off >= self.lim.max_file:
            return "EFBIG"
        if off + len(data) > self.lim.max_file:
            data = data[:self.lim.max_file - off]  # a short write, as POSIX has it
        end = off + len(data)
        pieces = {}
        for o, b in node.data.items():  # (what the write covers is replaced)
            if o < off:
                pieces[o] = b[:off - o]
            if o + len(b) > end:
                pieces[max(o, end)] = b[max(end - o, 0):]
        pieces[off] = data
        node.data = {o: b for o, b in pieces.items() if b}
        node.size = max(node.size, end)
        node.mtime = None
        return len(data)

    def pread(self, path: bytes, n: int, off: int):
        e, node = self._node(path)
        if e:
            return e
        if off + n > I64:
            return "EINVAL"
        return self.bytes_of(node, off, n)

    @staticmethod
    def bytes_of(node: Node, off: int, n: int) -> bytes:
        end = min(off + n, node.size)
        if end <= off:
            return b""
        out = bytearray(end - off)
        for o, b in node.data.items():
            lo, hi = max(o, off), min(o + len(b), end)
            if lo < hi:
                out[lo - off:hi - off] = b[lo - o:hi - o]
        return bytes(out)

    # extended attributes
    def setxattr(self, path: bytes, name: str, value: bytes):
        e, node = self._node(path)
        if e:
            return e
        if len(name.encode()) > 255:
            return "ERANGE"
        if len(value) > 65536:
            return "E2BIG"
        if not self.lim.xattrs:
            return ENOTSUP
        node.xattrs[name] = value
        return None

    def getxattr(self, path: bytes, name: str):
        e, node = self._node(path)
        if e:
            return e
        return node.xattrs.get(name, "ENODATA")

    def listxattr(self, path: bytes):
        e, node = self._node(path)
        if e:
            return e
        return sorted(node.xattrs) + (list(self.lim.root_xattrs) if path == b"" else [])

    # what the tree must look like
    def nlinks(self) -> dict[bytes, int]:
        """Each path's link count: a directory's is 2 and one per subdirectory, a file's
        the number of its names."""
        names = collections.Counter(id(n) for n in self.tree.values())
        subdirs = collections.Counter(self.parent(p) for p, n in self.tree.items()
                                      if p and n.kind == "d")
        return {p: 2 + subdirs[p] if n.kind == "d" else names[id(n)]
                for p, n in self.tree.items()}


# ---------------------------------------------------------------- the file system under test
class Target:
    """The same operations on a real tree (a mount, or a plain directory): every path is
    relative to a descriptor of the tree's root, so a path's length is what the test says,
    whatever directory holds the tree."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)

    def close(self) -> None:
        os.close(self.fd)

    def create(self, path, mode):
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode, dir_fd=self.fd))

    def mkdir(self, path, mode):
        os.mkdir(path, mode, dir_fd=self.fd)

    def mknod(self, path, kind, mode, rdev=0):
        os.mknod(path, KINDS[kind] | mode, rdev, dir_fd=self.fd)

    def symlink(self, target, path):
        os.symlink(target, path, dir_fd=self.fd)

    def link(self, src, dst):
        os.link(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def unlink(self, path):
        os.unlink(path, dir_fd=self.fd)

    def rename(self, src, dst):
        os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def stat(self, path):
        st = os.stat(path, dir_fd=self.fd, follow_symlinks=False)
        kind = next(k for k, v in KINDS.items() if stat.S_IFMT(st.st_mode) == v)
        return kind, st.st_size if kind in "fl" else None

    def chmod(self, path, mode):
        os.chmod(path, mode, dir_fd=self.fd)

    def chown(self, path, uid, gid):
        os.chown(path, uid, gid, dir_fd=self.fd, follow_symlinks=False)

    def utime(self, path, atime, mtime):
        os.utime(path, ns=(atime, mtime), dir_fd=self.fd, follow_symlinks=False)

    def _open(self, path, flags):
        return os.open(path, flags, dir_fd=self.fd)

    def truncate(self, path, size):
        fd = self._open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def pwrite(self, path, data, off, how=os.O_WRONLY):
        fd = self._open(path, how)
        try:
            return os.pwrite(fd, data, off)
        finally:
            os.close(fd)

    def pread(self, path, n, off):
        fd = self._open(path, os.O_RDONLY)
        try:
            return os.pread(fd, n, off)
        finally:
            os.close(fd)

    def setxattr(self, path, name, value):
        fd = self._open(path, os.O_RDONLY)
        try:
            os.setxattr(fd, name, value)
        finally:
            os.close(fd)

    def getxattr(self, path, name):
        fd = self._open(path or b".", os.O_RDONLY)
        try:
            return os.getxattr(fd, name)
        finally:
            os.close(fd)

    def listxattr(self, path):
        fd = self._open(path or b".", os.O_RDONLY)
        try:
            return sorted(os.listxattr(fd))
        finally:
            os.close(fd)


class Harness:
    """Runs each operation on the model and on the target and compares the outcomes; checks
    the whole tree against the model."""

    def __init__(self, model: Model, root: str) -> None:
        self.model = model
        self.t = Target(root)

    def __getattr__(self, op: str):
        def run(*args):
            shown = tuple(a if not isinstance(a, bytes) or len(a) < 40 else
                          f"<{len(a)} bytes {a[:12]!r}..>" for a in args)
            want = getattr(self.model, op)(*args)
            got = _outcome(getattr(self.t, op), *args)
            assert got == want, f"{op}{shown}: {got!r}, the model says {want!r}"
            return got
        return run

    def check(self) -> dict:
        """The tree is the model's: the same paths, and each entry's kind, mode bits, owner,
        size, link count, device number, link target, times (those the test set), bytes,
        xattrs; the names of one Node share an inode and no other. Returns the snapshot."""
        model = self.model
        reads = {p: [(o, len(b)) for o, b in n.data.items()] + [(max(n.size - 3, 0), 6)]
                 for p, n in model.tree.items() if n.kind == "f" and n.data}
        snap, got = walk_fds(self.t.root, reads)
        want_paths = set(model.tree) - {b""}
        assert set(snap) == want_paths, (sorted(set(snap) - want_paths)[:5],
                                         sorted(want_paths - set(snap))[:5])
        inos: dict[int, int] = {}
        nlinks = model.nlinks()
        for p, node in model.tree.items():
            if not p:
                continue
            mode, uid, gid, size, nlink, rdev, ino, atime, mtime, _, target = snap[p]
            where = f"{p[:60]!r}{'...' if len(p) > 60 else ''}"
            assert (stat.S_IFMT(mode), oct(stat.S_IMODE(mode)), uid, gid) == \
                (KINDS[node.kind], oct(node.mode), node.uid, node.gid), where
            assert nlink == nlinks[p], where
            if node.kind in "fl":
                assert size == node.size, where
            if node.kind in "cb":
                assert rdev == node.rdev, where
            assert target == node.target, where
            if node.atime is not None:
                assert (atime, mtime) == (node.atime, node.mtime), where
            assert inos.setdefault(id(node), ino) == ino, f"{where}: not the other links' inode"
        assert len(set(inos.values())) == len(inos), "two inodes of the model share a number"
        for p, spans in reads.items():
            node = model.tree[p]
            assert got[p] == [model.bytes_of(node, o, n) for o, n in spans], p
        for p, node in model.tree.items():  # (the deep trees' directories are left out)
            if node.kind in "fd" and p.count(b"/") < 2:
                assert _outcome(self.t.listxattr, p) == model.listxattr(p), p
                for name, value in node.xattrs.items():
                    assert self.t.getxattr(p, name) == value, (p, name)
        return snap


# ---------------------------------------------------------------- the operations
MODE_BITS = [1 << i for i in range(12)]  # x w r of other, group, user; sticky, sgid, suid
NAMES = [
    b"n" * 255,
    "é".encode() * 127 + b"x",  # 255 bytes of UTF-8
    bytes(b for b in range(1, 256) if b != ord("/")),  # every byte a name may hold
    b"." * 3, b"-", b" lead and trail ",
]
DEEP = 2000
LINKS = 1000


def build(h: Harness, lim: Limits, deep: int = DEEP) -> None:
    """The boundary cases, each checked against the model as it runs (`deep`: the depth of
    the deep tree)."""
    # sizes and offsets
    h.mkdir(b"sizes", 0o755)
    sizes = [0, 1, 4095, 4096, (1 << 31) - 1, 1 << 32, lim.max_file - 1, lim.max_file,
             lim.max_file + 1, 1 << 44, MAX - 1, MAX, MAX + 1, 1 << 56, I64, -1]
    for i, size in enumerate(sizes):
        p = b"sizes/s%02d" % i
        h.create(p, 0o644)
        h.truncate(p, size)
        h.stat(p)
        h.pread(p, 8, max(size - 4, 0))
    p = b"sizes/updown"
    h.create(p, 0o644)
    for size in (lim.max_file, lim.max_file + 1, I64, 5, 0, 1 << 40):
        h.truncate(p, size)
    offsets = [0, 4095, (1 << 31) - 1, 1 << 32, lim.max_file - 4, lim.max_file - 10,
               lim.max_file, 1 << 44, MAX - 4, MAX, 1 << 60, I64 - 1, I64]
    for how in (os.O_WRONLY, os.O_RDWR):
        p = b"sizes/w%d" % how
        h.create(p, 0o644)
        for off in offsets:
            data = (b"%d@%d|" % (how, off)) * (1 if off != lim.max_file - 10 else 800)
            h.pwrite(p, data, off, how)
        h.pwrite(p, b"last", lim.max_file - 4, how)  # (ends at the largest size exactly)
        h.pwrite(p, b"", MAX, how)  # (nothing to write: no error)
        for off in offsets + [1 << 62]:
            h.pread(p, 16, off)
    # times: atime and mtime each from one end of the list
    h.mkdir(b"times", 0o755)
    for i, t in enumerate(TIMES):
        p = b"times/t%02d" % i
        h.create(p, 0o644)
        h.utime(p, t, TIMES[-1 - i])
    h.mkdir(b"times/dir", 0o755)
    h.symlink(b"t00", b"times/link")
    # every mode bit, of a file and of a directory; every kind of node
    h.mkdir(b"modes", 0o755)
    for bits in MODE_BITS + [0, 0o7777, 0o6755, 0o2745]:
        for kind in "fd":
            p = b"modes/%s%04o" % (kind.encode(), bits)
            if kind == "f":
                h.create(p, 0o600)
            else:
                h.mkdir(p, 0o700)
            h.chmod(p, bits)
    h.create(b"modes/created7777", 0o7777)
    h.mkdir(b"modes/mkdir7777", 0o7777)  # (no set-ID bits from mkdir's mode)
    h.mknod(b"modes/fifo", "p", 0o7777)
    h.mknod(b"modes/sock", "s", 0o640)
    h.mknod(b"modes/chr", "c", 0o600, os.makedev(4095, (1 << 20) - 1))  # the largest
    h.mknod(b"modes/blk", "b", 0o660, os.makedev(0, 0))
    h.mknod(b"modes/reg", "f", 0o6755)
    # set-group-ID directories hand their group (and the bit, to directories) down
    h.chown(b"modes/d2000", 0, 1234)
    h.chmod(b"modes/d2000", 0o2775)
    h.create(b"modes/d2000/f", 0o2755)
    h.mkdir(b"modes/d2000/d", 0o755)
    # owners: the largest ids, -1 (unchanged); a chown kills set-user-ID (root's too)
    h.mkdir(b"owners", 0o755)
    ids = [(0, 0), (1, 2), (NOBODY, NOBODY), (1 << 31, (1 << 31) + 1), ((1 << 32) - 2,) * 2,
           (-1, 5), (7, -1), (-1, -1)]
    for i, (uid, gid) in enumerate(ids):
        for kind in "fd":
            p = b"owners/%s%d" % (kind.encode(), i)
            if kind == "f":
                h.create(p, 0o6755 if i % 2 else 0o6745)
            else:
                h.mkdir(p, 0o1777)
            h.chown(p, uid, gid)
    h.symlink(b"f0", b"owners/link")
    h.chown(b"owners/link", 42, 43)
    # names of 255 and 256 bytes
    h.mkdir(b"names", 0o755)
    for i, name in enumerate(NAMES):
        h.create(b"names/" + name, 0o644)
        h.pwrite(b"names/" + name, b"%d" % i, 0)
    long = b"L" * 256
    h.create(b"names/" + long, 0o644)
    h.mkdir(b"names/" + long, 0o755)
    h.mknod(b"names/" + long, "p", 0o644)
    h.symlink(b"x", b"names/" + long)
    h.link(b"names/-", b"names/" + long)
    h.rename(b"names/-", b"names/" + long)
    h.stat(b"names/" + long)
    h.stat(b"names/" + long + b"/x")
    h.rename(b"names/" + NAMES[0], b"names/" + b"m" * 255)
    h.symlink(b"t" * 4095, b"names/target4095")  # the longest link target
    h.symlink(b"t" * 4096, b"names/target4096")
    h.symlink(bytes(range(1, 256)) * 16, b"names/target_bytes")
    # paths: 4,095 bytes resolve, 4,096 do not; entries deeper than that are reached relative
    # to a directory that holds them
    p = b"paths"
    h.mkdir(p, 0o755)
    for i in range(16):
        p += b"/" + (b"%02d" % i) * 127  # (254 bytes)
        h.mkdir(p, 0o755)
    assert len(p) == PATH_MAX - 11
    h.create(p + b"/" + b"a" * 9, 0o644)  # 4,095 bytes
    h.pwrite(p + b"/" + b"a" * 9, b"at PATH_MAX - 1", 0)
    h.create(p + b"/" + b"b" * 10, 0o644)  # 4,096: ENAMETOOLONG
    h.stat(p + b"/" + b"a" * 9)
    fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY, dir_fd=h.t.fd)
    try:  # (the model is told; the target makes them relative to the deepest directory)
        h.model.tree[p + b"/" + b"b" * 10] = Node("f", 0o600)
        os.close(os.open(b"b" * 10, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600, dir_fd=fd))
        h.model.tree[p + b"/" + b"c" * 255] = Node("d", 0o700)
        os.mkdir(b"c" * 255, 0o700, dir_fd=fd)
    finally:
        os.close(fd)
    # a tree 2,000 directories deep, made level by level through descriptors, with a file at
    # the bottom past PATH_MAX
    h.mkdir(b"deep", 0o755)
    fd = os.open(b"deep", os.O_RDONLY | os.O_DIRECTORY, dir_fd=h.t.fd)
    p = b"deep"
    try:
        for _ in range(deep):
            p += b"/d"
            h.model.tree[p] = Node("d", 0o755)
            os.mkdir(b"d", 0o755, dir_fd=fd)
            nfd = os.open(b"d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        leaf = p + b"/" + b"z" * 200
        h.model.tree[leaf] = node = Node("f", 0o644)
        node.data[0], node.size = b"bottom", 6
        wfd = os.open(b"z" * 200, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644, dir_fd=fd)
        os.write(wfd, b"bottom")
        os.close(wfd)
    finally:
        os.close(fd)
    h.stat(p)  # 4,004 bytes at 2,000 levels: one call resolves them all
    h.stat(leaf)  # (past PATH_MAX at 2,000 levels)
    # many hard links of one file, in two directories
    h.mkdir(b"links", 0o755)
    h.mkdir(b"links/sub", 0o755)
    h.create(b"links/base", 0o640)
    h.pwrite(b"links/base", b"shared", 0)
    for i in range(LINKS):
        h.link(b"links/base", b"links/%sl%04d" % (b"sub/" if i % 2 else b"", i))
    h.link(b"links/base", b"links/l0000")
    h.link(b"links", b"links/dirlink")
    h.pwrite(b"links/sub/l0999", b"SHARED", 0)  # through one name, read through every other
    h.rename(b"links/l0002", b"links/l0004")  # two names of one inode: nothing happens
    h.create(b"links/other", 0o644)
    h.rename(b"links/other", b"links/l0006")  # another file replaces one name
    for i in range(10, LINKS, 3):
        h.unlink(b"links/%sl%04d" % (b"sub/" if i % 2 else b"", i))
    h.chmod(b"links/sub/l0001", 0o4640)  # (one inode: every name shows it)
    h.chown(b"links/l0000", 5, 6)
    # extended attributes (ckptfs has none but its control ones on the root)
    h.mkdir(b"xattrs", 0o755)
    h.create(b"xattrs/f", 0o644)
    h.setxattr(b"xattrs/f", "user.k", b"value")
    h.setxattr(b"xattrs/f", "user.empty", b"")
    h.setxattr(b"xattrs/f", "user." + "x" * 250, b"\x00\xff" * 8)  # a name of 255 bytes
    h.setxattr(b"xattrs/f", "user." + "x" * 251, b"v")  # 256: ERANGE
    h.setxattr(b"xattrs/f", "user.big", b"v" * 65537)  # past XATTR_SIZE_MAX: E2BIG
    h.setxattr(b"xattrs", "trusted.k", b"dir")
    h.getxattr(b"xattrs/f", "user.k")
    h.getxattr(b"xattrs/f", "user.none")
    h.listxattr(b"xattrs/f")
    h.listxattr(b"")


def after_remount(h: Harness) -> None:
    """What the remount must not have changed, by operations: hard links still share their
    bytes (a write through one name is read through the others); a file grows to the largest
    size and is written at its end again."""
    h.pwrite(b"links/l0998", b"again", 0)
    reread(h)
    h.truncate(b"sizes/updown", MAX)
    h.pwrite(b"sizes/updown", b"end", MAX - 3)
    reread(h)


def reread(h: Harness) -> None:
    """The bytes after_remount wrote, read back through other names."""
    for p in (b"links/base", b"links/sub/l0001", b"links/l0000"):
        h.pread(p, 16, 0)
        h.stat(p)
    h.pread(b"sizes/updown", 8, MAX - 3)
    h.stat(b"sizes/updown")


# ---------------------------------------------------------------- another user
def prepare_shared(root: str) -> None:
    """What root leaves for the other user (umask 0): a 0755 directory of root's files, a
    world-writable one with root's set-ID files, a sticky one, a set-group-ID one of a group
    the user is not in, and a file the user owns in root's group."""
    def put(rel: str, mode: int, data: bytes = b"x", owner=(0, 0)) -> None:
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)
        os.chown(os.path.join(root, rel), *owner)
        os.chmod(os.path.join(root, rel), mode)

    for d, mode, gid in (("r", 0o755, 0), ("pub", 0o777, 0), ("sticky", 0o1777, 0),
                         ("sgid", 0o2777, OTHER_GID)):
        os.mkdir(os.path.join(root, d))
        os.chown(os.path.join(root, d), 0, gid)
        os.chmod(os.path.join(root, d), mode)
    put("r/f", 0o644, b"root")
    put("r/secret", 0o600, b"secret")
    put("pub/rootrw", 0o666, b"rootrw")
    for name, mode in (("suid", 0o4777), ("suid_rw", 0o4777), ("sgidx", 0o2777),
                       ("sgid_nox", 0o2767), ("both", 0o6777), ("suid_trunc", 0o6777),
                       ("suid_otrunc", 0o6777)):
        put(f"pub/{name}", mode)
    put("pub/mine", 0o644, b"mine", (NOBODY, 0))
    put("sticky/rootf", 0o666, b"sticky")


# The other user's steps: R[step] = the value, or the name of the errno
NOBODY_STEPS = r"""
def E(step, fn, *a, **k):
    try:
        v = fn(*a, **k)
    except OSError as e:
        v = errno.errorcode[e.errno]
    R[step] = v.decode("latin-1") if isinstance(v, bytes) else v
def j(*p):
    return os.path.join(ROOT, *p)
def opened(p, flags, mode=0o666):
    os.close(os.open(p, flags, mode))
def read(p):
    with open(p, "rb") as f:
        return f.read()
def pw(p, data, off, flags=os.O_WRONLY):
    fd = os.open(p, flags)
    try:
        return os.pwrite(fd, data, off)
    finally:
        os.close(fd)
def look(p):
    st = os.lstat(p)
    return [st.st_uid, st.st_gid, oct(stat.S_IMODE(st.st_mode)), st.st_nlink]
def then_look(p, fn, *a):
    fn(*a)
    return look(p)
def create_unlink(p):
    opened(p, os.O_CREAT | os.O_WRONLY)
    os.unlink(p)
# root's 0755 directory and the files in it
E("create in a 0755 dir", opened, j("r/new"), os.O_CREAT | os.O_WRONLY)
E("mkdir in a 0755 dir", os.mkdir, j("r/newd"))
E("unlink in a 0755 dir", os.unlink, j("r/f"))
E("rename out of a 0755 dir", os.rename, j("r/f"), j("pub/f"))
E("open 0644 for writing", opened, j("r/f"), os.O_WRONLY)
E("read 0644", read, j("r/f"))
E("read 0600", read, j("r/secret"))
E("chmod root's file", os.chmod, j("r/f"), 0o666)
E("chown root's file", os.chown, j("r/f"), os.getuid(), -1)
E("set times of root's 0666 file", os.utime, j("pub/rootrw"), ns=(0, 0))
E("touch root's 0666 file", os.utime, j("pub/rootrw"))
E("touch root's 0644 file", os.utime, j("r/f"))
E("truncate root's 0666 file", os.truncate, j("pub/rootrw"), 3)
E("hard link of root's 0644 file", os.link, j("r/f"), j("pub/lnk"))
# a file of one's own: sizes, times, every mode bit
E("create", opened, j("pub/n"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
E("write ending at the largest size", pw, j("pub/n"), b"tail", MAXF - 4)
E("write at the largest size", pw, j("pub/n"), b"x", MAXF)
E("truncate past the largest size", os.truncate, j("pub/n"), MAXF + 1)
E("truncate to 2**63 - 1", os.truncate, j("pub/n"), 2**63 - 1)
E("size", lambda: os.stat(j("pub/n")).st_size)
E("set times 2300 and 1600", os.utime, j("pub/n"), ns=(T2300, T1600))
E("times", lambda: [os.stat(j("pub/n")).st_atime_ns, os.stat(j("pub/n")).st_mtime_ns])
opened(j("pub/bits"), os.O_CREAT | os.O_WRONLY)
for i in range(12):
    E("chmod %04o" % (1 << i), then_look, j("pub/bits"), os.chmod, j("pub/bits"), 1 << i)
# a file of one's own in a group one is not in: the set-group-ID bit is dropped on chmod
E("chmod 2755, not in its group", then_look, j("pub/mine"), os.chmod, j("pub/mine"), 0o2755)
E("chmod 4755", then_look, j("pub/mine"), os.chmod, j("pub/mine"), 0o4755)
E("chown to root", os.chown, j("pub/mine"), 0, -1)
E("chgrp to a group one is not in", os.chown, j("pub/mine"), -1, 1234)
E("chgrp to one's own group", then_look, j("pub/mine"), os.chown, j("pub/mine"), -1, os.getgid())
# a write clears root's set-user-ID (and set-group-ID with group execution)
for name in ("suid", "sgidx", "sgid_nox", "both"):
    E("write " + name, pw, j("pub", name), b"y", 0)
E("write suid_rw", pw, j("pub/suid_rw"), b"y", 0, os.O_RDWR)
E("truncate suid_trunc", os.truncate, j("pub/suid_trunc"), 0)
E("open suid_otrunc with O_TRUNC", opened, j("pub/suid_otrunc"), os.O_WRONLY | os.O_TRUNC)
# sticky directory
E("unlink root's file, sticky", os.unlink, j("sticky/rootf"))
E("rename root's file, sticky", os.rename, j("sticky/rootf"), j("sticky/x"))
E("create, sticky", opened, j("sticky/mine"), os.O_CREAT | os.O_WRONLY)
E("create and unlink, sticky", create_unlink, j("sticky/tmp"))
# set-group-ID directory of a group one is not in
E("create, sgid dir", then_look, j("sgid/f"), opened, j("sgid/f"), os.O_CREAT | os.O_WRONLY)
E("mkdir, sgid dir", then_look, j("sgid/d"), os.mkdir, j("sgid/d"), 0o777)
E("create 2775, sgid dir", then_look, j("sgid/x"), opened, j("sgid/x"), os.O_CREAT | os.O_WRONLY,
  0o2775)
# hard links, names, nodes, xattrs
for i in range(50):
    os.link(j("pub/n"), j("pub/n_%02d" % i))
E("links", lambda: look(j("pub/n_49")))
E("name of 255 bytes", opened, j("pub", "u" * 255), os.O_CREAT | os.O_WRONLY)
E("name of 256 bytes", opened, j("pub", "u" * 256), os.O_CREAT | os.O_WRONLY)
E("fifo", os.mknod, j("pub/fifo"), stat.S_IFIFO | 0o644)
E("character device", os.mknod, j("pub/chr"), stat.S_IFCHR | 0o644, os.makedev(1, 3))
E("setxattr", os.setxattr, j("pub/n"), "user.k", b"v")
E("control xattr", os.getxattr, ROOT, "user.ckptfs.status")
"""


def nobody_expected(lim: Limits) -> tuple[dict, dict]:
    """What each of the other user's steps gives, and the state they leave
    ({path: [uid, gid, mode, nlink]}, sizes and times separately)."""
    with open("/proc/sys/fs/protected_hardlinks") as f:
        protected = f.read().strip() == "1"
    me = [NOBODY, NOBODY]
    r = {
        "create in a 0755 dir": "EACCES", "mkdir in a 0755 dir": "EACCES",
        "unlink in a 0755 dir": "EACCES", "rename out of a 0755 dir": "EACCES",
        "open 0644 for writing": "EACCES", "read 0644": "root", "read 0600": "EACCES",
        "chmod root's file": "EPERM", "chown root's file": "EPERM",
        "set times of root's 0666 file": "EPERM", "touch root's 0666 file": None,
        "touch root's 0644 file": "EACCES", "truncate root's 0666 file": None,
        "hard link of root's 0644 file": "EPERM" if protected else None,
        "create": None, "write ending at the largest size": 4,
        "write at the largest size": "EFBIG", "truncate past the largest size": "EFBIG",
        "truncate to 2**63 - 1": "EFBIG", "size": lim.max_file,
        "set times 2300 and 1600": None, "times": [lim.time(T2300), lim.time(T1600)],
        "chmod 2755, not in its group": [NOBODY, 0, "0o755", 1],
        "chmod 4755": [NOBODY, 0, "0o4755", 1],
        "chown to root": "EPERM", "chgrp to a group one is not in": "EPERM",
        "chgrp to one's own group": me + ["0o755", 1],  # (set-user-ID killed)
        "write suid": 1, "write sgidx": 1, "write sgid_nox": 1, "write both": 1,
        "write suid_rw": 1, "truncate suid_trunc": None, "open suid_otrunc with O_TRUNC": None,
        "unlink root's file, sticky": "EPERM", "rename root's file, sticky": "EPERM",
        "create, sticky": None, "create and unlink, sticky": None,
        "create, sgid dir": [NOBODY, OTHER_GID, "0o644", 1],
        "mkdir, sgid dir": [NOBODY, OTHER_GID, "0o2755", 2],
        "create 2775, sgid dir": [NOBODY, OTHER_GID, "0o755", 1],  # (not in its group)
        "links": me + ["0o644", 51],
        "name of 255 bytes": None, "name of 256 bytes": "ENAMETOOLONG",
        "fifo": None, "character device": "EPERM",
        "setxattr": None if lim.xattrs else ENOTSUP,
        "control xattr": "EACCES" if lim.root_xattrs else "ENODATA",
    }
    for i in range(12):
        r["chmod %04o" % (1 << i)] = me + [oct(1 << i), 1]
    state = {
        "r/f": [0, 0, "0o644", 1], "pub/rootrw": [0, 0, "0o666", 1],
        "pub/n": me + ["0o644", 51], "pub/bits": me + [oct(1 << 11), 1],
        "pub/mine": me + ["0o755", 1],
        "pub/suid": [0, 0, "0o777", 1], "pub/suid_rw": [0, 0, "0o777", 1],
        "pub/sgidx": [0, 0, "0o777", 1],
        "pub/sgid_nox": [0, 0, "0o767" if lim.kill_sgid_without_gx else "0o2767", 1],
        "pub/both": [0, 0, "0o777", 1], "pub/" + "u" * 255: me + ["0o644", 1],
        "pub/suid_trunc": [0, 0, "0o777", 1], "pub/suid_otrunc": [0, 0, "0o777", 1],
        "pub/fifo": me + ["0o644", 1],
        "sticky/rootf": [0, 0, "0o666", 1], "sticky/mine": me + ["0o644", 1],
        "sgid/f": [NOBODY, OTHER_GID, "0o644", 1], "sgid/d": [NOBODY, OTHER_GID, "0o2755", 2],
        "sgid/x": [NOBODY, OTHER_GID, "0o755", 1],
    }
    sizes = {"pub/n": lim.max_file, "pub/rootrw": 3, "r/f": 4}
    return r, {"attrs": state, "sizes": sizes,
               "times": {"pub/n": [lim.time(T2300), lim.time(T1600)]}}


def check_shared(root: str, want: dict) -> dict:
    """The tree the other user left is `want` (nobody_expected); returns its snapshot."""
    snap, _ = walk_fds(root, {})
    got = {p: [v[1], v[2], oct(stat.S_IMODE(v[0])), v[4]] for p, v in
           ((os.fsdecode(p), v) for p, v in snap.items()) if p in want["attrs"]}
    assert got == want["attrs"]
    assert {p: snap[os.fsencode(p)][3] for p in want["sizes"]} == want["sizes"]
    assert {p: list(snap[os.fsencode(p)][7:9]) for p in want["times"]} == want["times"]
    names = {os.fsdecode(p) for p in snap}
    assert "sticky/x" not in names and "sticky/tmp" not in names and "pub/lnk" not in names
    assert "r/new" not in names and "pub/" + "u" * 256 not in names
    return snap


def run_as_nobody(root: str, lim: Limits) -> dict:
    """The other user's steps on the tree at `root`, checked against the model."""
    want, state = nobody_expected(lim)
    consts = (f"ROOT = {root!r}\nMAXF = {lim.max_file}\nT2300 = {T2300}\nT1600 = {T1600}\n")
    got = py_as_user(consts + NOBODY_STEPS)
    wrong = {k: (got.get(k), v) for k, v in want.items() if got.get(k, "missing") != v}
    assert not wrong, f"step: (result, the model's) {wrong}"
    assert set(got) == set(want)
    return state


# ---------------------------------------------------------------- tests
@pytest.fixture
def public():
    """A directory other users can traverse (pytest's tmp_path parents are 0700)."""
    d = tempfile.mkdtemp(prefix="ckptfs-bounds-", dir="/tmp")
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def umask0():
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _remount(mounts, m: api.Mount, stopped: bool = False) -> api.Mount:
    if not stopped:
        assert m.stop() == 0
    m = mounts.mount(m.backing, m.mountpoint, allow_other=True)
    bad = [line for line in mounts.log(m).splitlines()
           if "skipped" in line or "dropped" in line or "Traceback" in line
           or "out of range" in line or "damaged" in line]
    assert not bad, bad
    return m


def test_boundaries_as_root_against_the_model_and_after_a_remount(public, mounts, umask0):
    """Every boundary case as root on an --allow-other mount matches the model with ckptfs's
    limits, and the tree is the same, field by field (inode numbers and ctimes too), after
    an unmount and a mount of the same backing directory."""
    mp = os.path.join(public, "mnt")
    os.mkdir(mp)
    m = mounts.mount(mounts.backing(), mp, allow_other=True)
    h = Harness(Model(CKPTFS), mp)
    try:
        build(h, CKPTFS)
        before = h.check()
    finally:
        h.t.close()
    assert m.stop() == 0
    # the offline tools walk the same tree (without recursion: it is 2,000 levels deep)
    res = cli("verify", m.backing, encoding="utf-8", errors="surrogateescape")
    assert res.returncode == 0 and ", 0 damaged files, 0 index warnings" in res.stdout, res
    res = cli("ls", "-R", m.backing, encoding="utf-8", errors="surrogateescape")
    assert res.returncode == 0, res.stderr
    listed = res.stdout.split("\n")  # (one name holds a newline)
    assert sum(1 for line in listed if line.startswith("/deep")) == DEEP + 2
    assert "/deep" + "/d" * DEEP + "/" + "z" * 200 in listed
    m = _remount(mounts, m, stopped=True)
    h.t = Target(mp)
    try:
        after = h.check()
        assert after == before
        after_remount(h)
    finally:
        h.t.close()
    m = _remount(mounts, m)
    h.t = Target(mp)
    try:
        reread(h)
    finally:
        h.t.close()
    m.stop()


def test_another_user_on_an_allow_other_mount(public, mounts, umask0):
    """Another user (nobody) on an --allow-other mount gets EACCES and EPERM where POSIX
    says and succeeds where it says: no writes into root's 0755 directory, no chmod or chown
    of root's files, the sticky and set-group-ID directories' rules, set-group-ID dropped on
    a chmod by a non-member, set-user-ID cleared by a write; ckptfs's limits (EFBIG past
    1 PiB, times clamped) hold for that user too. The state it leaves, owners and modes
    included, is the same after a remount."""
    mp = os.path.join(public, "mnt")
    os.mkdir(mp)
    m = mounts.mount(mounts.backing(), mp, allow_other=True)
    prepare_shared(mp)
    want = run_as_nobody(mp, CKPTFS)
    before = check_shared(mp, want)
    m = _remount(mounts, m)
    assert check_shared(mp, want) == before
    m.stop()


def test_another_user_on_a_local_disk(public, umask0):
    """The other user's steps on a plain directory of the local disk (ext4) match the same
    model with ext4's limits."""
    root = os.path.join(public, "ref")
    os.mkdir(root)
    os.chmod(root, 0o755)
    if _fs_type(root) != "ext4":
        pytest.skip("the reference is ext4")
    prepare_shared(root)
    check_shared(root, run_as_nobody(root, EXT4))


def test_the_model_holds_on_a_local_disk(tmp_path, umask0):
    """The model with ext4's limits matches a plain directory on the local disk (ext4): what
    it says of POSIX outside ckptfs's own limits is what a kernel file system does."""
    root = str(tmp_path / "ref")
    os.mkdir(root)
    if os.statvfs(root).f_namemax != 255 or _fs_type(root) != "ext4":
        pytest.skip("the reference is ext4")
    h = Harness(Model(EXT4), root)
    try:
        build(h, EXT4, deep=300)  # (each rmdir of the cleanup costs ext4 here 2-3 ms)
        h.check()
        after_remount(h)
    finally:
        h.t.close()
        remove_tree(root)


def _fs_type(path: str) -> str:
    """The type of the file system holding `path` (/proc/self/mountinfo)."""
    best, kind = "", ""
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            mnt = fields[4]
            sep = fields.index("-")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, fields[sep + 1]
    return kind
