"""pyfuse3 Operations: translate FUSE requests into namespace changes, staged writes and reads.

Handlers run on the trio thread, check the request (POSIX errnos), then call into the namespace
(namespace.py), the staging area (staging.py), the journal (journal.py), the flusher
(flusher.py) or the reader (reader.py). They never block on disk I/O: writes only copy into
staging (or wait for a free segment), reads of durable data go through the reader's loader
threads. Modules of their own keep what these handlers call: the open handles, their reads'
and writes' bookkeeping (fuse/handles.py), other writers' entries made own before they change
(fuse/adopt.py), directory listings (fuse/listings.py), the control files and xattrs
(fuse/control.py), the attributes' encoding (fuse/replies.py).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import os
import stat
import time

import pyfuse3
import trio

from ckptfs.datapath.flusher import Flusher
from ckptfs.datapath.journal import Journal
from ckptfs.datapath.dcpreads import DcpReads
from ckptfs.datapath.reader import Reader
from ckptfs.datapath.staging import CHECKSUM_BLOCK_BYTES, Staging
from ckptfs.format.records import (
    MAX_FILE_BYTES,
    NAME_MAX,
    TIME_MAX_NS,
    TIME_MIN_NS,
    InodeRec,
    LinkRec,
    RenameRec,
    SetattrRec,
    SizeRec,
    UnlinkRec,
)
from ckptfs import failpoints, metrics
from ckptfs.fuse import loop
from ckptfs.fuse.adopt import OtherWriters
from ckptfs.fuse.control import CTL_DIR_INO, CTL_NAME, CTL_STATS_INO, Control
from ckptfs.fuse.handles import DIRECT_READ_MIN_BYTES, SETID_BITS, Handles
from ckptfs.fuse.listings import Listings
from ckptfs.fuse.interrupts import Interrupts
from ckptfs.fuse.refresh import IDLE_PERIOD_S
from ckptfs.fuse.replies import IO_BLOCK_BYTES, entry_attributes
from ckptfs.namespace import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    ROOT_INO,
    Inode,
    Namespace,
)

log = logging.getLogger("ckptfs.ops")

ENTRY_TIMEOUT_S = 300.0  # (Settings.entry_timeout: a mount gives its --refresh)
BLOCK_BYTES = 4096
MODE_BITS = 0o7777  # the bits of a requested mode a new entry keeps (those the umask leaves)


def clamp_time(ns: int) -> int:
    """A time the index can record (a signed 64-bit count of nanoseconds, 1677 to 2262): one
    outside is clamped to the nearest end, as ext4 clamps times to its own range."""
    return TIME_MIN_NS if ns < TIME_MIN_NS else TIME_MAX_NS if ns > TIME_MAX_NS else ns


def _err(e: int):
    return pyfuse3.FUSEError(e)


def guarded(handler):
    """A request handler that a defect must not end with the daemon: pyfuse3 lets any
    exception but FUSEError end its loop, and the mount with it. An unexpected exception is
    logged with its traceback and the request answered EIO; a FUSEError is the handler's
    answer and passes. Every handler pyfuse3 (or the fast path) calls carries it."""

    @functools.wraps(handler)
    async def wrapper(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except Exception:
            log.exception("internal error in %s", handler.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
    return wrapper


class Context:
    """What the handlers read of pyfuse3's RequestContext: the fast path makes one for the
    requests it serves itself and for those the queue threads answered."""

    __slots__ = ("uid", "gid", "pid", "umask")

    def __init__(self, uid: int, gid: int, pid: int, umask: int = 0) -> None:
        self.uid, self.gid, self.pid, self.umask = uid, gid, pid, umask


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the handlers are told when they are built; Settings.of makes them from a mount's
    options (daemon.MountConfig)."""

    backing: str  # the backing directory, absolute (statfs, the status)
    info: dict  # facts the status shows (writer, mount point, io mode, queue depth, ...)
    readonly: bool = False
    # How long the kernel keeps a name before a path walk asks again (LOOKUP), in the replies
    # of the fast path and of pyfuse3. A mount gives its --refresh: a name another writer
    # changed while nobody used the mount is asked for again, and that LOOKUP looks at the
    # other writers first (fuse/refresh.py). --refresh 0 looks at every LOOKUP that reaches
    # it and in the background every IDLE_PERIOD_S while in use: names are kept that long
    # (0 would make every path walk ask for every name, and look for each).
    entry_timeout: float = ENTRY_TIMEOUT_S
    checksum_block: int = CHECKSUM_BLOCK_BYTES  # the longest run (--checksum-block)
    writeback_cache: bool = False  # the kernel's writeback cache (--writeback-cache)
    direct_writes: bool = False  # write-only opens bypass the page cache (Handles.file_info)
    # read-only opens of files of at least one READ bypass the page cache (Handles.file_info);
    # None: where the kernel keeps MAP_SHARED mmap of them working, which INIT tells
    # (handles.Negotiated)
    direct_reads: bool | None = False

    @classmethod
    def of(cls, cfg, info: dict, readonly: bool) -> "Settings":
        # The writeback cache is for mounts that write. With it the kernel owns mtime and does
        # not move it on direct writes: the two do not mix (docs/tuning.md).
        writeback = cfg.writeback_cache and not readonly
        return cls(backing=os.path.abspath(cfg.backing), info=info, readonly=readonly,
                   entry_timeout=cfg.refresh_s or IDLE_PERIOD_S,
                   checksum_block=cfg.checksum_block_bytes, writeback_cache=writeback,
                   direct_writes=cfg.direct_writes and not writeback,
                   direct_reads=cfg.direct_reads)


class CkptOperations(pyfuse3.Operations):
    supports_dot_lookup = True

    def __init__(self, ns: Namespace, staging: Staging, journal: Journal, flusher: Flusher,
                 reader: Reader, settings: Settings, *, interrupts: Interrupts,
                 wait_hook: loop.WaitHook, view=None, refresher=None,
                 maintainer=None) -> None:
        """`interrupts`: the mount's (fuse/interrupts.py: a barrier whose caller is being
        killed is answered early); `wait_hook`: the wait for the next request the mount
        installs once pyfuse3.init() has these handlers (loop.WaitHook: its figures in the
        status); `view` and `refresher`: other writers' changes, the merged tree and what
        reads their index tails (view.View, fuse/refresh.py); `maintainer`: the cleaner of a
        mount that writes (its figures in the status)."""
        super().__init__()
        self.ns = ns
        self.staging = staging
        self.journal = journal
        self.flusher = flusher
        self.reader = reader
        self.settings = settings
        self.enable_writeback_cache = settings.writeback_cache  # (pyfuse3 reads it at INIT)
        self.interrupts = interrupts
        self.view = view
        self.refresher = refresher
        self.maintainer = maintainer
        # other writers' entries made own before they change, the view's freshness
        # (fuse/adopt.py)
        self.others = OtherWriters(ns, view, refresher, settings.readonly)
        # the control directory, its stats.json and the control xattrs (fuse/control.py)
        self.control = Control(ns, journal, flusher, self.inode, self._barrier,
                               lambda: metrics.status(self), refresher)
        # the DCP read policy: which read-only opens get a read plan (datapath/dcpreads.py)
        self.dcp = DcpReads(ns, reader, IO_BLOCK_BYTES)
        # the listings open directory handles hold (fuse/listings.py)
        self.listings = Listings(ns, self._attr, self.dcp.saw_name)
        # the open handles, their reads and writes (fuse/handles.py)
        self.handles = Handles(ns, staging, journal, reader, self.dcp, self.control, settings,
                               refresher, self.listings)
        self.wait_hook = wait_hook
        self.started = time.time()
        self.fsyncs = 0

    @property
    def request_wait(self) -> loop.RequestWait | None:
        """The wait for the next request in pyfuse3's place (None: pyfuse3's own)."""
        return self.wait_hook.wait

    # ------------------------------------------------------------ helpers
    def _attr(self, x: Inode) -> pyfuse3.EntryAttributes:
        return entry_attributes(x, self.settings.entry_timeout)

    def _inode(self, ino: int) -> Inode:
        x = self.ns.inodes.get(ino)
        if x is None:
            raise _err(errno.ENOENT)
        return x

    def _dir(self, ino: int) -> Inode:
        x = self._inode(ino)
        if x.children is None:
            raise _err(errno.ENOTDIR)
        return x

    def _live_dir(self, ino: int) -> Inode:
        """A directory to put a new name in: ENOENT once it was removed (the kernel may still
        hold it, as a working directory, say, when another writer's change removed it)."""
        d = self._dir(ino)
        if d.nlink <= 0:
            raise _err(errno.ENOENT)
        return d

    def _writable(self, x: Inode) -> Inode:
        """Entries of other writers (and everything in a read-only mount) cannot change."""
        if self.settings.readonly or x.layer != 0:
            raise _err(errno.EROFS)
        return x

    @staticmethod
    def _check_name(name: bytes) -> None:
        if len(name) > NAME_MAX:
            raise _err(errno.ENAMETOOLONG)
        if not name or b"/" in name or name in (b".", b".."):
            raise _err(errno.EINVAL)

    def _touch_dir(self, d: Inode, now: int, journal: bool = True) -> None:
        # A create's INODE record carries the time replay gives its directory
        # (Namespace._apply_inode); an UNLINK, RENAME or LINK record carries none, so those
        # changes journal the directory's new times as a SETATTR after it (docs/format.md).
        d.mtime_ns = d.ctime_ns = now
        if journal and d.layer == 0:  # (another writer's directory: only in this view)
            self.ns.change(SetattrRec(d.ino, d.mode, d.uid, d.gid, d.atime_ns, now, now))

    def _touch_linked(self, x: Inode, now: int) -> None:
        """ctime of an inode whose names changed; journaled while it has a name left."""
        x.ctime_ns = now
        if x.nlink > 0:
            self.ns.change(SetattrRec(x.ino, x.mode, x.uid, x.gid, x.atime_ns, x.mtime_ns, now))

    def _new(self, parent_ino: int, name: bytes, mode: int, ctx, rdev: int = 0,
             target: bytes = b"", ino: int | None = None, now: int | None = None) -> Inode:
        parent = self._live_dir(parent_ino)
        self._check_name(name)
        if name in parent.children or (name == CTL_NAME and parent.ino == ROOT_INO):
            raise _err(errno.EEXIST)
        parent = self.others.own_dir(parent)
        if now is None:
            now = time.time_ns()
        gid = self.inherited_gid(parent)
        if gid is None:
            gid = ctx.gid
        elif stat.S_ISDIR(mode):
            mode |= stat.S_ISGID
        if ino is None:
            ino = self.ns.new_ino()
        self.ns.change(InodeRec(ino, parent.ino, name, mode, ctx.uid, gid, rdev, now, now, now,
                                target))
        self._touch_dir(parent, now, journal=False)
        x = self.ns.inodes[ino]
        x.lookups += 1
        return x

    @staticmethod
    def inherited_gid(parent: Inode) -> int | None:
        """The group a new entry in directory `parent` takes: the directory's where it is
        set-group-ID, else (None) its creator's."""
        return parent.gid if parent.mode & stat.S_ISGID else None

    @staticmethod
    def new_file_mode(mode: int, umask: int) -> int:
        """A new file's mode from CREATE's mode and umask."""
        return stat.S_IFREG | (mode & ~umask & MODE_BITS)

    # ------------------------------------------------------------ lookups and attributes
    def find(self, parent_inode: int, name: bytes) -> Inode | None:
        """The entry `name` in directory `parent_inode`, None if there is none (raises for a
        parent that is not a directory, or a name too long)."""
        parent = self._dir(parent_inode)
        if name == b".":
            return parent
        if name == b"..":
            return self.ns.inodes[parent.parent]
        if len(name) > NAME_MAX:
            raise _err(errno.ENAMETOOLONG)
        ino = parent.children.get(name)
        if ino is None:
            if name == CTL_NAME and parent.ino == ROOT_INO:
                return self.ns.inodes[CTL_DIR_INO]
            return None
        self.dcp.saw_name(parent_inode, name, ino)
        return self.ns.inodes[ino]

    @guarded
    async def lookup(self, parent_inode, name, ctx):
        if self.others.refresh_due():
            await self.others.refresh()
        x = self.find(parent_inode, name)
        if x is None:
            self.others.fresh_dir(parent_inode)
            raise _err(errno.ENOENT)
        x.lookups += 1
        return self._attr(x)

    @guarded
    async def forget(self, inode_list):
        for ino, n in inode_list:
            x = self.ns.inodes.get(ino)
            if x is not None:
                x.lookups -= n
                self.ns.maybe_forget(x)
                if self.view is not None and ino not in self.ns.inodes:
                    self.view.forgotten(ino)

    @guarded
    async def getattr(self, inode, ctx):
        return self._attr(self._inode(inode))

    def inode(self, ino: int) -> Inode:
        """The live inode `ino` (ENOENT if there is none)."""
        return self._inode(ino)

    @guarded
    async def setattr(self, inode, attr, fields, fh, ctx):
        x = self._inode(inode)
        if fields.update_size and attr.st_size > MAX_FILE_BYTES:
            raise _err(errno.EFBIG)
        if x.layer > 0:  # another writer's: copied up first (its bytes unless cut to 0)
            x = self.others.owned(x, keep_data=not (fields.update_size and attr.st_size == 0))
        x = self._writable(x)
        now = time.time_ns()
        if fields.update_size:
            if x.emap is None:
                raise _err(errno.EISDIR if x.is_dir else errno.EINVAL)
            mt = clamp_time(attr.st_mtime_ns) if fields.update_mtime else now
            self.ns.change(SizeRec(x.ino, attr.st_size, mt, now))
        changed = False
        mode, uid, gid = x.mode, x.uid, x.gid
        atime, mtime = x.atime_ns, x.mtime_ns
        if fields.update_mode:
            mode = stat.S_IFMT(x.mode) | (attr.st_mode & 0o7777)
            changed = True
        if fields.update_uid and attr.st_uid != x.uid:
            if ctx.uid != 0:
                raise _err(errno.EPERM)
            uid = attr.st_uid
            changed = True
        if fields.update_gid and attr.st_gid != x.gid:
            if ctx.uid != 0 and (ctx.uid != x.uid):
                raise _err(errno.EPERM)
            gid = attr.st_gid
            changed = True
        if (fields.update_uid or fields.update_gid) and not fields.update_mode and ctx.uid != 0:
            mode &= ~(stat.S_ISUID | stat.S_ISGID)
        if fields.update_atime:
            atime = clamp_time(attr.st_atime_ns)
            changed = True
        if fields.update_mtime:
            mtime = clamp_time(attr.st_mtime_ns)
            changed = True
        if changed:
            self.ns.change(SetattrRec(x.ino, mode, uid, gid, atime, mtime, now))
        return self._attr(x)

    @guarded
    async def readlink(self, inode, ctx):
        x = self._inode(inode)
        if not stat.S_ISLNK(x.mode):
            raise _err(errno.EINVAL)
        return x.target

    @guarded
    async def statfs(self, ctx):
        failpoints.hit("statfs")
        st = os.statvfs(self.settings.backing)
        s = pyfuse3.StatvfsData()
        s.f_bsize = BLOCK_BYTES
        s.f_frsize = st.f_frsize
        s.f_blocks = st.f_blocks
        s.f_bfree = st.f_bfree
        s.f_bavail = st.f_bavail
        ninodes = len(self.ns.inodes)
        s.f_files = ninodes + (1 << 32)
        s.f_ffree = 1 << 32
        s.f_favail = 1 << 32
        s.f_namemax = NAME_MAX
        return s

    # ------------------------------------------------------------ namespace changes
    @guarded
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)
                or stat.S_ISCHR(mode) or stat.S_ISBLK(mode)):
            raise _err(errno.EINVAL)
        return self._attr(self._new(parent_inode, name, mode & ~ctx.umask, ctx, rdev))

    @guarded
    async def mkdir(self, parent_inode, name, mode, ctx):
        mode = stat.S_IFDIR | (mode & ~ctx.umask & MODE_BITS)
        return self._attr(self._new(parent_inode, name, mode, ctx))

    @guarded
    async def symlink(self, parent_inode, name, target, ctx):
        if len(target) > 4096:
            raise _err(errno.ENAMETOOLONG)
        return self._attr(self._new(parent_inode, name, stat.S_IFLNK | 0o777, ctx, 0, target))

    @guarded
    async def create(self, parent_inode, name, mode, flags, ctx):
        fi, x = self.create_open(parent_inode, name, mode, flags, ctx)
        return fi, self._attr(x)

    def create_open(self, parent_inode, name, mode, flags, ctx, ino: int | None = None,
                    fh: int | None = None, now_ns: int | None = None
                    ) -> tuple[pyfuse3.FileInfo, Inode]:
        """CREATE: the new file, open (create() answers pyfuse3 with its attributes). A create
        the ring's queue threads answered comes with its numbers (Handles.reserve) and
        time."""
        mode = self.new_file_mode(mode, ctx.umask)
        x = self._new(parent_inode, name, mode, ctx, ino=ino, now=now_ns)
        self.dcp.saw_name(parent_inode, name, x.ino)  # (read back in this mount: no LOOKUP)
        fh = self.handles.open(x, flags, ctx, fh)
        return self.handles.open_info(x, fh, flags), x

    @guarded
    async def link(self, inode, new_parent_inode, new_name, ctx):
        x = self._inode(inode)
        if x.layer > 0 and not x.is_dir:
            x = self.others.owned(x)
        x = self._writable(x)
        if x.is_dir:
            raise _err(errno.EPERM)
        parent = self._live_dir(new_parent_inode)
        self._check_name(new_name)
        if new_name in parent.children:
            raise _err(errno.EEXIST)
        parent = self.others.own_dir(parent)
        self.ns.change(LinkRec(x.ino, parent.ino, new_name))
        now = time.time_ns()
        self._touch_linked(x, now)
        self._touch_dir(parent, now)
        x.lookups += 1
        return self._attr(x)

    @guarded
    async def unlink(self, parent_inode, name, ctx):
        parent = self._dir(parent_inode)
        x = self.ns.child(parent, name)
        if x is None:
            raise _err(errno.ENOENT)
        if x.is_dir:
            raise _err(errno.EISDIR)
        if self.others.others_at(parent, name):  # every writer's version goes (docs/scaling.md)
            self.view.remove_all(parent, name)
            now = time.time_ns()
            if x.layer == 0 and x.nlink > 0:
                self._touch_linked(x, now)
            self._touch_dir(parent, now)
            return
        self._writable(x)
        self._writable(parent)
        self.ns.change(UnlinkRec(parent.ino, name))
        now = time.time_ns()
        self._touch_linked(x, now)  # another hard link may be left
        self._touch_dir(parent, now)
        if self.view is not None:
            self.view.own_removed(parent)

    @guarded
    async def rmdir(self, parent_inode, name, ctx):
        parent = self._dir(parent_inode)
        x = self.ns.child(parent, name)
        if x is None:
            raise _err(errno.ENOENT)
        if not x.is_dir:
            raise _err(errno.ENOTDIR)
        if x.children:
            raise _err(errno.ENOTEMPTY)
        if self.others.others_at(parent, name) or self.others.merged(x):
            if self.settings.readonly:
                raise _err(errno.EROFS)
            self.view.remove_all(parent, name)  # the directory of every writer merged there
            self._touch_dir(parent, time.time_ns())
            return
        self._writable(x)
        self._writable(parent)
        self.ns.change(UnlinkRec(parent.ino, name))
        self._touch_dir(parent, time.time_ns())
        if self.view is not None:
            self.view.own_removed(parent)

    @guarded
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        op = self._dir(parent_inode_old)
        np_ = self._dir(parent_inode_new)
        self._check_name(name_new)
        moving = self.ns.child(op, name_old)
        if moving is None:
            raise _err(errno.ENOENT)
        target = self.ns.child(np_, name_new)
        if flags & RENAME_NOREPLACE and target is not None:
            raise _err(errno.EEXIST)
        if flags & RENAME_EXCHANGE and target is None:
            raise _err(errno.ENOENT)
        if moving.is_dir and self.ns.is_ancestor(moving, np_):
            raise _err(errno.EINVAL)
        if target is not None and not flags & RENAME_EXCHANGE:
            if target.ino == moving.ino:
                return
            if moving.is_dir and not target.is_dir:
                raise _err(errno.ENOTDIR)
            if not moving.is_dir and target.is_dir:
                raise _err(errno.EISDIR)
            if target.is_dir and target.children:
                raise _err(errno.ENOTEMPTY)
        if (flags & RENAME_EXCHANGE and target.is_dir
                and self.ns.is_ancestor(target, op)):
            raise _err(errno.EINVAL)
        # (other writers' entries taking part become own first: copy-up)
        moving, target = self.others.before_rename(op, name_old, moving, np_, name_new, target,
                                                   flags & RENAME_EXCHANGE)
        self._writable(moving)
        self._writable(op)
        if target is not None:
            self._writable(target)
        np_ = self.others.own_dir(np_)
        self.ns.change(RenameRec(op.ino, name_old, np_.ino, name_new,
                                 flags & RENAME_EXCHANGE))
        if not moving.is_dir:
            self.dcp.saw_name(np_.ino, name_new, moving.ino)
        now = time.time_ns()
        self._touch_linked(moving, now)
        if target is not None:
            # replaced (it may keep other hard links) or exchanged: its ctime moves too
            self._touch_linked(target, now)
        self._touch_dir(op, now)
        if np_ is not op:
            self._touch_dir(np_, now)

    # ------------------------------------------------------------ files (fuse/handles.py)
    @guarded
    async def open(self, inode, flags, ctx):
        if self.others.refresh_due():
            await self.others.refresh()
        x = self._inode(inode)
        self.others.fresh(x)
        if x.emap is None:
            raise _err(errno.EISDIR if x.is_dir else errno.EINVAL)
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC):
            if x.layer > 0:  # another writer's file: copied up (docs/scaling.md)
                x = self.others.owned(x, keep_data=not flags & os.O_TRUNC)
            self._writable(x)
        if x.ino == CTL_STATS_INO:
            fh = self.handles.open(x, flags)
            self.control.opened(fh)
            return pyfuse3.FileInfo(fh=fh, direct_io=True)
        if flags & os.O_TRUNC and x.size:
            now = time.time_ns()
            self.ns.change(SizeRec(x.ino, 0, now, now))
        if flags & os.O_TRUNC and ctx.uid != 0 and x.mode & SETID_BITS:
            # (the kernel leaves an O_TRUNC open to the file system, atomic_o_trunc: it
            # clears the set-ID bits as a truncate by a user without CAP_FSETID does)
            self.handles.clear_setid(x)
        plan = None  # (read before the handle is made: nothing to undo if it fails)
        if flags & os.O_ACCMODE == os.O_RDONLY and x.size > DIRECT_READ_MIN_BYTES:
            plan = await self.dcp.plan_for(x)
            self.others.fresh(x)  # (a look at other writers may have come meanwhile)
        fh = self.handles.open(x, flags, ctx, plan=plan)
        return self.handles.open_info(x, fh, flags)

    @guarded
    async def read(self, fh, off, size, gather=False):
        """pyfuse3's READ; `gather` (the fast path): a list of buffers instead of one."""
        return await self.handles.read(fh, off, size, gather)

    @guarded
    async def write(self, fh, off, buf):
        handles = self.handles
        h, x, n = handles.write_target(fh, off, len(buf))
        if h.kill_setid and x.mode & SETID_BITS:  # pyfuse3 does not pass the write's flags
            handles.clear_setid(x)
        try:
            await self.staging.append(memoryview(buf)[:n], handles.piece_recorder(x, off))
        except OSError as exc:
            raise _err(exc.errno or errno.EIO) from None
        handles.wrote(h, x, off + n, n)
        return n

    @guarded
    async def flush(self, fh):
        # close() does not wait for durability (the product's promise); a handle that wrote
        # learns about a pending flusher error (ENOSPC, EIO) at close at the latest.
        h = self.handles.by_fh.get(fh)
        if self.flusher.error is not None and h is not None and h.wrote:
            raise _err(self.flusher.error.errno or errno.EIO)

    @guarded
    async def release(self, fh):
        self.handles.release_now(fh)

    @guarded
    async def fsync(self, fh, datasync):
        self.fsyncs += 1
        await self._barrier()

    async def _barrier(self, level: str | None = None) -> None:
        # A barrier waits for the backing store, which may never answer: when the caller is
        # being killed, the request is answered EINTR early and this wait ends, so that the
        # task serves requests again; the barrier goes on (fuse/interrupts.py).
        with self.interrupts.waiting() as scope:
            if scope.cancel_called:  # answered before it started
                raise _err(errno.EINTR)
            try:
                await self.flusher.barrier(level)
            except OSError as exc:
                raise _err(exc.errno or errno.EIO) from None
        if scope.cancelled_caught:
            raise _err(errno.EINTR)

    # ------------------------------------------------------------ directories
    @guarded
    async def opendir(self, inode, ctx):
        if self.others.refresh_due():
            await self.others.refresh()
        return self.handles.open_dir(self._dir(inode))

    @guarded
    async def readdir(self, fh, start_id, token):
        h = self.handles.by_fh.get(fh)
        if h is None:
            raise _err(errno.EBADF)
        self.listings.fill(h.flags, h.ino, start_id, token)

    @guarded
    async def releasedir(self, fh):
        self.handles.release_dir(fh)

    @guarded
    async def fsyncdir(self, fh, datasync):
        self.fsyncs += 1
        await self._barrier()

    # ------------------------------------------------------------ xattrs (fuse/control.py)
    @guarded
    async def getxattr(self, inode, name, ctx):
        return await self.control.getxattr(inode, name, ctx)

    @guarded
    async def listxattr(self, inode, ctx):
        return self.control.listxattr(inode)

    @guarded
    async def setxattr(self, inode, name, value, ctx):
        raise _err(errno.ENOTSUP)

    @guarded
    async def removexattr(self, inode, name, ctx):
        raise _err(errno.ENOTSUP)


async def idle_sealer(ops: CkptOperations, idle_s: float) -> None:
    """Seal a partly filled segment after `idle_s` without writes, and commit namespace-only
    changes, so that nothing stays volatile for long without a barrier."""
    staging, journal, flusher = ops.staging, ops.journal, ops.flusher
    while True:
        await trio.sleep(min(idle_s, 0.25))
        if ops.request_wait is not None:  # (what the queue threads answered on their own)
            ops.request_wait.settle()
        if staging.open is not None and trio.current_time() - staging.last_write >= idle_s:
            staging.seal()
        elif journal.entries and staging.open is None and flusher.inflight_segments == 0:
            flusher.kick()

