"""pyfuse3 Operations: translate FUSE requests into namespace changes, staged writes and reads.

Handlers run on the trio thread, check the request (POSIX errnos), then call into the namespace
(namespace.py), the staging area (staging.py), the journal (journal.py), the flusher
(flusher.py) or the reader (reader.py). They never block on disk I/O: writes only copy into
staging (or wait for a free segment), reads of durable data go through the reader's loader
threads. Directory listings (fuse/listings.py) and the control files and xattrs
(fuse/control.py) are kept by modules of their own, which these handlers call.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import math
import os
import stat
import time
from operator import itemgetter

import pyfuse3
import trio

from ckptfs.datapath.flusher import Flusher
from ckptfs.datapath.journal import Journal
from ckptfs.datapath.dcpreads import DcpReads
from ckptfs.datapath.readplan import ReadPlan
from ckptfs.datapath.reader import Reader
from ckptfs.datapath.staging import CHECKSUM_BLOCK_BYTES, ExtentMap, Staging
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
    XExtentRec,
)
from ckptfs import metrics
from ckptfs.datapath import writes
from ckptfs.fuse import loop
from ckptfs.fuse.control import CTL_DIR_INO, CTL_NAME, CTL_STATS_INO, Control
from ckptfs.fuse.listings import Listings
from ckptfs.fuse.interrupts import Interrupts
from ckptfs.fuse.refresh import ATTRS, IDLE_PERIOD_S
from ckptfs.namespace import (
    CONTROL_LAYER,
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    ROOT_INO,
    Inode,
    Namespace,
)

log = logging.getLogger("ckptfs.ops")

ENTRY_TIMEOUT_S = 300.0  # (Settings.entry_timeout: a mount gives its --refresh)
ATTR_TIMEOUT_S = 300.0
BLOCK_BYTES = 4096
# st_blksize, the preferred I/O size (Lustre reports its stripe size here): Python's open()
# buffers that much, so a reader of small items at offsets (DCP) reads 512 KiB at a time
# instead of 4 KiB (with direct reads each read is a round trip to the daemon). A power of two:
# the kernel rounds it down to one. Not 1 MiB: Python's buffer comes from malloc, rarely
# page-aligned, and a direct read of a full 1 MiB there spans 257 pages, which the kernel
# (256 pages per request) sends as two READs.
IO_BLOCK_BYTES = 512 << 10
SEQUENTIAL_SLACK_BYTES = 4 << 20
DIRECT_READ_MIN_BYTES = 1 << 20  # --direct-reads applies to files of at least one READ
SEEN_RANGES_MAX = 64  # a handle reading more separate ranges is a random reader: not counted
SETID_BITS = stat.S_ISUID | stat.S_ISGID
MODE_BITS = 0o7777  # the bits of a requested mode a new entry keeps (those the umask leaves)


def clamp_time(ns: int) -> int:
    """A time the index can record (a signed 64-bit count of nanoseconds, 1677 to 2262): one
    outside is clamped to the nearest end, as ext4 clamps times to its own range."""
    return TIME_MIN_NS if ns < TIME_MIN_NS else TIME_MAX_NS if ns > TIME_MAX_NS else ns


def _err(e: int):
    return pyfuse3.FUSEError(e)


class Context:
    """What the handlers read of pyfuse3's RequestContext: the fast path makes one for the
    requests it serves itself and for those the queue threads answered."""

    __slots__ = ("uid", "gid", "pid", "umask")

    def __init__(self, uid: int, gid: int, pid: int, umask: int = 0) -> None:
        self.uid, self.gid, self.pid, self.umask = uid, gid, pid, umask


class _Handle:
    __slots__ = ("ino", "inode", "flags", "wrote", "next_off", "streak", "seen", "kill_setid",
                 "plan")

    def __init__(self, inode: Inode, flags: int, kill_setid: bool = False) -> None:
        self.ino = inode.ino
        self.inode = inode
        self.flags = flags
        self.wrote = False
        # opened by a non-root user: its writes clear set-user/group-ID (CkptOperations.write)
        self.kill_setid = kill_setid
        self.next_off = 0  # where a sequential reader's next READ starts
        self.streak = 0  # bytes read sequentially since the last jump
        self.seen: list[list[int]] | None = []  # ranges served to this handle (reader recycling)
        self.plan: ReadPlan | None = None  # the order its reader reads the file in (readplan.py)


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
    direct_writes: bool = False  # write-only opens bypass the page cache (_file_info)
    # read-only opens of files of at least one READ bypass the page cache (_file_info); None:
    # where the kernel keeps MAP_SHARED mmap of them working, which INIT tells (Negotiated)
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


@dataclasses.dataclass(frozen=True)
class Negotiated:
    """What FUSE INIT settled: replaced once, when the INIT reply goes by (initialised(), from
    the fast path, which reads it; without the fast path nothing is learnt and this stays)."""

    # the kernel keeps MAP_SHARED mmap of direct-I/O files working (FUSE_DIRECT_IO_ALLOW_MMAP,
    # Linux 6.6+; without it such a mmap fails with ENODEV)
    shared_mmap_direct: bool = False
    direct_reads: bool = False  # Settings.direct_reads, None decided


class CkptOperations(pyfuse3.Operations):
    supports_dot_lookup = True

    def __init__(self, ns: Namespace, staging: Staging, journal: Journal, flusher: Flusher,
                 reader: Reader, settings: Settings, *, interrupts: Interrupts, view=None,
                 refresher=None, maintainer=None) -> None:
        """`interrupts`: the mount's (fuse/interrupts.py: a barrier whose caller is being
        killed is answered early); `view` and `refresher`: other writers' changes, the merged
        tree and what reads their index tails (view.View, fuse/refresh.py); `maintainer`:
        the cleaner of a mount that writes (its figures in the status)."""
        super().__init__()
        self.ns = ns
        self.staging = staging
        self.journal = journal
        self.flusher = flusher
        self.reader = reader
        self.settings = settings
        self.enable_writeback_cache = settings.writeback_cache  # (pyfuse3 reads it at INIT)
        self.negotiated = Negotiated(direct_reads=bool(settings.direct_reads))
        self.interrupts = interrupts
        self.view = view
        self.refresher = refresher
        self.maintainer = maintainer
        self.written_direct: set[int] = set()
        self.handles: dict[int, _Handle] = {}
        # the control directory, its stats.json and the control xattrs (fuse/control.py)
        self.control = Control(ns, journal, flusher, self.inode, self._barrier,
                               lambda: metrics.status(self), refresher)
        self.next_fh = 1
        self.bytes_written = 0
        self.write_requests = 0
        self.read_requests = 0
        self.bytes_read = 0  # served to READs (re-reads counted again)
        # the DCP read policy: which read-only opens get a read plan (datapath/dcpreads.py)
        self.dcp = DcpReads(ns, reader, IO_BLOCK_BYTES)
        # the listings open directory handles hold (fuse/listings.py)
        self.listings = Listings(ns, self._attr, self.dcp.saw_name)
        # the wait for the next request, for its figures in the status: the daemon installs it
        # right after pyfuse3.init(), which these handlers are built for (loop.install)
        self.request_wait: loop.RequestWait | None = None
        self.started = time.time()
        self.fsyncs = 0

    def initialised(self, shared_mmap_direct: bool) -> None:
        """FUSE INIT passed (the fast path reads its reply): what it settled. --direct-reads
        left to its default is on where MAP_SHARED mmap of direct-I/O files keeps working."""
        direct = self.settings.direct_reads
        self.negotiated = Negotiated(shared_mmap_direct=shared_mmap_direct,
                                     direct_reads=shared_mmap_direct if direct is None
                                     else direct)

    # ------------------------------------------------------------ helpers
    def _attr(self, x: Inode) -> pyfuse3.EntryAttributes:
        """attr_fields as pyfuse3 wants them (the requests pyfuse3 serves)."""
        (ino, size, blocks, at, mt, ct, an, mn, cn, mode, nlink, uid, gid, rdev, blksize,
         _) = self.attr_fields(x)
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.generation = 0
        a.entry_timeout = self.settings.entry_timeout
        a.attr_timeout = ATTR_TIMEOUT_S
        a.st_mode = mode
        a.st_nlink = nlink
        a.st_uid = uid
        a.st_gid = gid
        a.st_rdev = rdev
        a.st_size = size
        a.st_blksize = blksize
        a.st_blocks = blocks
        a.st_atime_ns = at * 1_000_000_000 + an
        a.st_mtime_ns = mt * 1_000_000_000 + mn
        a.st_ctime_ns = ct * 1_000_000_000 + cn
        return a

    @staticmethod
    def attr_fields(x: Inode) -> tuple:
        """A file's attributes, once for every reply: the fields of the protocol's struct
        fuse_attr (ino size blocks, atime mtime ctime in s, then their ns parts, mode nlink
        uid gid rdev blksize flags). The fast path packs them itself (no EntryAttributes per
        request); _attr hands them to pyfuse3. Blocks count stored bytes, not holes."""
        at, an = divmod(x.atime_ns, 1_000_000_000)
        mt, mn = divmod(x.mtime_ns, 1_000_000_000)
        ct, cn = divmod(x.ctime_ns, 1_000_000_000)
        return (x.ino, x.size, (x.emap.stored + 511) // 512 if x.emap is not None else 0,
                at, mt, ct, an, mn, cn, x.mode, x.nlink, x.uid, x.gid, x.rdev & 0xFFFFFFFF,
                IO_BLOCK_BYTES, 0)

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

    def _own_dir(self, d: Inode) -> Inode:
        """A directory to create entries in. If it belongs to another writer, adopt it into
        this writer's tree first (copy-up): an INODE record gives it an own inode number, and
        the live inode answers to both numbers, so the kernel's cached entries stay valid.
        Its other writers' ancestors are adopted first, top down (without a recursion per
        level: a tree may be thousands of levels deep)."""
        chain = []  # d and its ancestors below the nearest own directory
        while True:
            if self.settings.readonly or d.layer == CONTROL_LAYER:
                raise _err(errno.EROFS)
            if d.layer == 0:
                break
            chain.append(d)
            d = self.ns.inodes[d.parent]
        parent = d
        for d in reversed(chain):
            name = next(n for n, i in parent.children.items() if i == d.ino)
            del parent.children[name]
            parent.nlink -= 1
            ino = self.ns.new_ino()
            self.ns.change(InodeRec(ino, parent.ino, name, d.mode, d.uid, d.gid, 0, d.atime_ns,
                                    d.mtime_ns, d.ctime_ns))
            fresh = self.ns.inodes[ino]
            d.lookups += fresh.lookups
            old = d.ino
            d.ino, d.layer, d.parent = ino, 0, fresh.parent
            self.ns.inodes[ino] = d  # the old (foreign) number stays an alias of the same inode
            if self.view is not None:
                self.view.renumbered(d, old)
            parent = d
        return parent

    def _owned(self, x: Inode, keep_data: bool = True) -> Inode:
        """x made this writer's own, to change it: another writer's directory is adopted
        (_own_dir), another writer's file copied up (_copy_up)."""
        if self.settings.readonly or x.layer == CONTROL_LAYER:
            raise _err(errno.EROFS)
        if x.layer == 0:
            return x
        if x.is_dir:
            return self._own_dir(x)
        where = self.view.names.get(x.ino) if self.view is not None else None
        if where is None:
            raise _err(errno.EROFS)  # no longer reachable by a name
        return self._copy_up(where[0], where[1], x, keep_data)

    def _copy_up(self, v: Inode, name: bytes, x: Inode, keep_data: bool = True) -> Inode:
        """Another writer's file x at `name` of view directory v becomes an own file at the
        same name, with the same attributes and bytes: an INODE record, XEXTENT records that
        point at the other writer's runs (no byte is copied; `keep_data` off: an empty file,
        for an O_TRUNC open), and XUNLINKs of every other writer's version there. The live
        inode stays the same object and answers to its old number too (the kernel's cached
        entries stay valid); handles open on it read on."""
        view = self.view
        v = self._own_dir(v)
        view.take_over(v, name, x)
        pieces = list(x.emap.pieces) if keep_data and x.emap is not None else []
        size = x.size if keep_data else 0
        ino = self.ns.new_ino()
        self.ns.change(InodeRec(ino, v.ino, name, x.mode, x.uid, x.gid, x.rdev, x.atime_ns,
                                x.mtime_ns, x.ctime_ns, x.target))
        fresh = self.ns.inodes[ino]
        old = x.ino
        x.lookups += fresh.lookups
        x.ino, x.layer, x.nlink, x.commit_ns = ino, 0, 1, 0
        x.tail_run, x.tail_end = None, -1
        if x.emap is not None:
            x.emap.replaced()
            x.emap, x.size = ExtentMap(self.ns.on_dead), 0
        self.ns.inodes[ino] = x  # the old number stays an alias of the same inode
        for foff, n, run, roff in pieces:
            self.ns.change(XExtentRec(ino, foff, n, view.run_writer(run), run.log, run.loff,
                                      run.length, run.crc, roff))
        if x.emap is not None and x.size != size:
            self.ns.change(SizeRec(ino, size, x.mtime_ns, x.ctime_ns))
        view.renumbered(x, old)
        return x

    def _copy_up_tree(self, d: Inode) -> None:
        """View directory d and everything in it made own (to move it): other writers'
        directories adopted, their files copied up, the versions a conflict hid and the
        other writers' directories merged here removed; each directory's entries before the
        directory itself is done (without a recursion per level)."""
        view = self.view
        d = self._own_dir(d)
        stack = [(d, iter(list(d.children)), b"")]  # (directory, names left, its name)
        while stack:
            d, names, _ = stack[-1]
            for name in names:
                c = self.ns.inodes[d.children[name]]
                if c.is_dir:
                    c = self._own_dir(c)
                    stack.append((c, iter(list(c.children)), name))
                    break
                if c.layer != 0:
                    self._copy_up(d, name, c)
                view.remove_others(d, name)
            else:
                _, _, name = stack.pop()
                view.drop_members(d)
                if stack:
                    view.remove_others(stack[-1][0], name)

    def _others_at(self, v: Inode, name: bytes) -> bool:
        """Whether `name` in view directory v has a version of another writer (the one shown,
        or one a conflict hides)."""
        view = self.view
        return (view is not None and not self.settings.readonly and v.layer != CONTROL_LAYER
                and any(c[0] != 0 for c in view.versions(v, name)))

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
        parent = self._own_dir(parent)
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

    def refresh_due(self) -> bool:
        """Whether an open, lookup or listing has to look at other writers' changes first:
        the last look is older than --refresh (docs/scaling.md, the visibility contract)."""
        r = self.refresher
        return r is not None and r.due()

    def merged(self, d: Inode) -> bool:
        """Whether another writer's directory is merged into view directory d (its entries
        then come and go with that writer's changes too)."""
        return self.view is not None and bool(self.view.members.get(d))

    def fresh_until(self) -> float:
        """Until when (time.monotonic()) a lookup's answer needs no look at other writers
        first (refresh_due)."""
        r = self.refresher
        return math.inf if r is None else r.fresh_until()

    async def refresh(self) -> None:
        await self.refresher.refresh()

    def _fresh(self, x: Inode) -> None:
        """An open of an inode that another writer's change removed from the tree, or changed
        since the kernel cached its attributes, fails with ESTALE: the kernel then walks the
        path again, asking (LOOKUP) for every entry, and opens what is there now."""
        view = self.view
        if view is not None and (x.ino in view.gone or x.ino in view.dirty):
            view.dirty.discard(x.ino)
            raise _err(errno.ESTALE)

    async def lookup(self, parent_inode, name, ctx):
        if self.refresher is not None and self.refresher.due():
            await self.refresher.refresh()
        x = self.find(parent_inode, name)
        if x is None:
            raise _err(errno.ENOENT)
        x.lookups += 1
        return self._attr(x)

    async def forget(self, inode_list):
        for ino, n in inode_list:
            x = self.ns.inodes.get(ino)
            if x is not None:
                x.lookups -= n
                self.ns.maybe_forget(x)
                if self.view is not None and ino not in self.ns.inodes:
                    self.view.forgotten(ino)

    async def getattr(self, inode, ctx):
        return self._attr(self._inode(inode))

    def inode(self, ino: int) -> Inode:
        """The live inode `ino` (ENOENT if there is none)."""
        return self._inode(ino)

    async def setattr(self, inode, attr, fields, fh, ctx):
        x = self._inode(inode)
        if fields.update_size and attr.st_size > MAX_FILE_BYTES:
            raise _err(errno.EFBIG)
        if x.layer > 0:  # another writer's: copied up first (its bytes unless cut to 0)
            x = self._owned(x, keep_data=not (fields.update_size and attr.st_size == 0))
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

    async def readlink(self, inode, ctx):
        x = self._inode(inode)
        if not stat.S_ISLNK(x.mode):
            raise _err(errno.EINVAL)
        return x.target

    async def statfs(self, ctx):
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
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)
                or stat.S_ISCHR(mode) or stat.S_ISBLK(mode)):
            raise _err(errno.EINVAL)
        return self._attr(self._new(parent_inode, name, mode & ~ctx.umask, ctx, rdev))

    async def mkdir(self, parent_inode, name, mode, ctx):
        mode = stat.S_IFDIR | (mode & ~ctx.umask & MODE_BITS)
        return self._attr(self._new(parent_inode, name, mode, ctx))

    async def symlink(self, parent_inode, name, target, ctx):
        if len(target) > 4096:
            raise _err(errno.ENAMETOOLONG)
        return self._attr(self._new(parent_inode, name, stat.S_IFLNK | 0o777, ctx, 0, target))

    async def create(self, parent_inode, name, mode, flags, ctx):
        fi, x = self.create_open(parent_inode, name, mode, flags, ctx)
        return fi, self._attr(x)

    def create_open(self, parent_inode, name, mode, flags, ctx, ino: int | None = None,
                    fh: int | None = None, now_ns: int | None = None
                    ) -> tuple[pyfuse3.FileInfo, Inode]:
        """CREATE: the new file, open (create() answers pyfuse3 with its attributes). A create
        the ring's queue threads answered comes with its numbers (reserve) and time."""
        mode = self.new_file_mode(mode, ctx.umask)
        x = self._new(parent_inode, name, mode, ctx, ino=ino, now=now_ns)
        self.dcp.saw_name(parent_inode, name, x.ino)  # (read back in this mount: no LOOKUP)
        fh = self._open_handle(x, flags, ctx, fh)
        return self._file_info(x, fh, flags), x

    def reserve(self, n: int) -> tuple[int, int]:
        """n inode numbers and n handle numbers for creates answered elsewhere (the ring's
        queue threads; made here later with create_open): the first of each."""
        ino, fh = self.ns.next_ino, self.next_fh
        self.ns.next_ino += n
        self.next_fh += n
        return ino, fh

    async def link(self, inode, new_parent_inode, new_name, ctx):
        x = self._inode(inode)
        if x.layer > 0 and not x.is_dir:
            x = self._owned(x)
        x = self._writable(x)
        if x.is_dir:
            raise _err(errno.EPERM)
        parent = self._live_dir(new_parent_inode)
        self._check_name(new_name)
        if new_name in parent.children:
            raise _err(errno.EEXIST)
        parent = self._own_dir(parent)
        self.ns.change(LinkRec(x.ino, parent.ino, new_name))
        now = time.time_ns()
        self._touch_linked(x, now)
        self._touch_dir(parent, now)
        x.lookups += 1
        return self._attr(x)

    async def unlink(self, parent_inode, name, ctx):
        parent = self._dir(parent_inode)
        x = self.ns.child(parent, name)
        if x is None:
            raise _err(errno.ENOENT)
        if x.is_dir:
            raise _err(errno.EISDIR)
        if self._others_at(parent, name):  # every writer's version goes (docs/scaling.md)
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

    async def rmdir(self, parent_inode, name, ctx):
        parent = self._dir(parent_inode)
        x = self.ns.child(parent, name)
        if x is None:
            raise _err(errno.ENOENT)
        if not x.is_dir:
            raise _err(errno.ENOTDIR)
        if x.children:
            raise _err(errno.ENOTEMPTY)
        if self._others_at(parent, name) or (self.view is not None and self.view.members.get(x)):
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
        view = self.view
        if view is not None and not self.settings.readonly and (
                moving.layer != 0 or (target is not None and target.layer != 0)
                or self._others_at(op, name_old)
                or (target is not None and self._others_at(np_, name_new))
                or (moving.is_dir and view.foreign_inside(moving))):
            # other writers' entries take part: what moves becomes own first (copy-up), the
            # other versions at both names go (docs/scaling.md)
            if flags & RENAME_EXCHANGE:
                raise _err(errno.EXDEV)
            if moving.is_dir:
                self._copy_up_tree(moving)
            elif moving.layer != 0:
                moving = self._copy_up(op, name_old, moving)
            view.remove_others(op, name_old)
            if target is not None:
                view.remove_others(np_, name_new)
                target = self.ns.child(np_, name_new)  # the own version, if there is one
        self._writable(moving)
        self._writable(op)
        if target is not None:
            self._writable(target)
        np_ = self._own_dir(np_)
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

    # ------------------------------------------------------------ files
    def reserve_handle(self) -> int:
        """A new handle number."""
        fh = self.next_fh
        self.next_fh += 1
        return fh

    def _open_handle(self, x: Inode, flags: int, ctx=None, fh: int | None = None) -> int:
        if fh is None:
            fh = self.reserve_handle()
        self.handles[fh] = _Handle(x, flags, ctx is not None and ctx.uid != 0)
        x.opens += 1
        return fh

    async def open(self, inode, flags, ctx):
        if self.refresher is not None and self.refresher.due():
            await self.refresher.refresh()
        x = self._inode(inode)
        self._fresh(x)
        if x.emap is None:
            raise _err(errno.EISDIR if x.is_dir else errno.EINVAL)
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC):
            if x.layer > 0:  # another writer's file: copied up (docs/scaling.md)
                x = self._owned(x, keep_data=not flags & os.O_TRUNC)
            self._writable(x)
        if x.ino == CTL_STATS_INO:
            fh = self._open_handle(x, flags)
            self.control.opened(fh)
            return pyfuse3.FileInfo(fh=fh, direct_io=True)
        if flags & os.O_TRUNC and x.size:
            now = time.time_ns()
            self.ns.change(SizeRec(x.ino, 0, now, now))
        if flags & os.O_TRUNC and ctx.uid != 0 and x.mode & SETID_BITS:
            # (the kernel leaves an O_TRUNC open to the file system, atomic_o_trunc: it
            # clears the set-ID bits as a truncate by a user without CAP_FSETID does)
            self.clear_setid(x)
        plan = None  # (read before the handle is made: nothing to undo if it fails)
        if flags & os.O_ACCMODE == os.O_RDONLY and x.size > DIRECT_READ_MIN_BYTES:
            plan = await self.dcp.plan_for(x)
            self._fresh(x)  # (a look at other writers may have come meanwhile)
        fh = self._open_handle(x, flags, ctx)
        self.handles[fh].plan = plan
        return self._file_info(x, fh, flags)

    def may_prepare_open(self, x: Inode) -> bool:
        """Whether a read-only open of x can be prepared before it comes (prepare_open): its
        answer then does not depend on when it comes (x was not last written through a
        direct handle, whose pages a reader's open drops)."""
        return (x.ino not in self.written_direct and x.ino != CTL_STATS_INO
                and (x.size <= DIRECT_READ_MIN_BYTES  # (a DCP data file's OPEN: its plan)
                     or self.dcp.metadata_of(x) is None))

    def prepare_open(self, x: Inode) -> tuple[int, pyfuse3.FileInfo]:
        """A handle number and the answer for a read-only open of x that the ring's queue
        threads answer when it comes (may_prepare_open); the handle is made by
        open_prepared then."""
        fh = self.reserve_handle()
        return fh, self._file_info(x, fh, os.O_RDONLY)

    def open_prepared(self, x: Inode, fh: int, flags: int, ctx) -> None:
        """The handle of an open answered elsewhere with prepare_open's number and answer."""
        self._open_handle(x, flags, ctx, fh)

    def _file_info(self, x: Inode, fh: int, flags: int) -> pyfuse3.FileInfo:
        fi = self.file_info(flags, x.size, x.ino in self.written_direct, fh)
        if self.direct_write(flags):
            self.written_direct.add(x.ino)
        else:
            self.written_direct.discard(x.ino)
        return fi

    def direct_write(self, flags: int) -> bool:
        """Whether a handle opened with `flags` bypasses the page cache for its writes."""
        return self.settings.direct_writes and (flags & os.O_ACCMODE) == os.O_WRONLY

    def file_info(self, flags: int, size: int = 0, written_direct: bool = False,
                  fh: int = 0) -> pyfuse3.FileInfo:
        """How a handle opened with `flags` on a file of `size` bytes uses the kernel's page
        cache (written_direct: the file was last written through a direct handle); by
        default a new file's, which the queue threads' CREATEs answer with
        (Landing.create_policy)."""
        # Write-only handles bypass the kernel page cache when direct_writes is on: the
        # application's buffers go straight into WRITE requests (one copy less, no page-cache
        # growth, no dirty-page throttling, close() does not wait for writeback); readers keep
        # the page cache and its readahead. A file written that way may have stale pages
        # cached from an earlier read: the next read-open drops them (keep_cache off).
        if self.direct_write(flags):
            return pyfuse3.FileInfo(fh=fh, keep_cache=False, direct_io=True)
        if (self.negotiated.direct_reads and (flags & os.O_ACCMODE) == os.O_RDONLY
                and size >= DIRECT_READ_MIN_BYTES):
            # --direct-reads: read() goes straight from the daemon into the reader's buffer
            # (no page-cache copy); MAP_SHARED mmap of such a handle fails with ENODEV. Files
            # under one READ request keep the page cache: their small header reads hit it.
            return pyfuse3.FileInfo(fh=fh, keep_cache=False, direct_io=True)
        return pyfuse3.FileInfo(fh=fh, keep_cache=not written_direct)

    async def read(self, fh, off, size, gather=False):
        """pyfuse3's READ; `gather` (the fast path): a list of buffers instead of one."""
        h = self.handles.get(fh)
        if h is None:
            raise _err(errno.EBADF)
        x = h.inode
        self.read_requests += 1
        if x.layer == CONTROL_LAYER:
            out = self.control.read(fh, off, size)
            return [out] if gather else out
        if x.emap is None:  # unlinked and forgotten while open cannot happen; be safe
            return [] if gather else b""
        # Kernel readahead sends several READs at once: "sequential" means at or a little
        # past where this handle read last; a jump back or far ahead (DCP reading items by
        # offset) is a random read, which gets no readahead. Readahead grows with the bytes
        # read in a row (as the kernel's does): a reader going from item to item of one big
        # file in an order of its own (DCP) would otherwise pull in a full window behind every
        # item, evicting what it reads next (a 1 GB DCP restore read 2.75 GB from disk, now
        # 2.2). A READ at offset 0 starts a file: the full window, which covers the next files
        # in the logs (a restore reads files in about the order they were written).
        ahead = self._ahead(h, off, size) if h.plan is None else h.plan
        try:
            out = await self.reader.read(x.emap, off, size, x.size, ahead, self._seen(h, x),
                                         gather)
        except OSError as exc:
            raise _err(exc.errno or errno.EIO) from None
        self.bytes_read += max(0, min(size, x.size - off))  # what the reader returned
        return out

    @staticmethod
    def _ahead(h: _Handle, off: int, size: int) -> int | None:
        """The readahead a READ of handle h gets (Reader.read's `ahead`)."""
        if off == 0:
            h.streak, ahead, h.next_off = size, None, size
        elif h.next_off <= off <= h.next_off + SEQUENTIAL_SLACK_BYTES:
            h.streak += size
            ahead, h.next_off = h.streak, max(h.next_off, off + size)
        else:
            h.streak, ahead, h.next_off = 0, 0, off + size
        return ahead

    @staticmethod
    def _seen(h: _Handle, x: Inode) -> list | None:
        """Consumption is counted for a file read by one handle only (several readers of one
        file must not recycle each other's chunks) and up to 64 separate ranges per handle."""
        seen = h.seen if x.opens == 1 else None
        if seen is not None and len(seen) > SEEN_RANGES_MAX:
            seen = h.seen = None
        return seen

    def read_served(self, fh: int, reads: list) -> None:
        """READs of handle fh the queue threads answered from its read window (fuse/ring.c),
        in order, as (off, size, n): what read() does besides the bytes (its counts,
        readahead, the read cache's use). The bytes they answered go to the reader as their
        union, range by range: a restore's 1 MiB READs come a window's worth at a time, and
        `torch.load` reads a file's zip records out of order (its start twice, its end
        backwards in small steps, then its tensors), ~10 READs that make one range. A range's
        readahead is the most any of its READs asked for (a READ from offset 0: a whole
        window, from the range's end)."""
        h = self.handles.get(fh)
        if h is None:
            return
        x = h.inode
        self.read_requests += len(reads)
        spans = []
        plan = h.plan
        for off, size, n in reads:
            self.bytes_read += n
            # (in the order they came: the handle's streak)
            a = self._ahead(h, off, size) if plan is None else plan
            if n:
                spans.append((off, off + n, a))
        if not spans:
            return
        spans.sort(key=itemgetter(0))
        lo, hi, ahead = spans[0]
        for off, end, a in spans:
            if off > hi:
                self._window_served(h, x, lo, hi, ahead)
                lo, hi, ahead = off, end, a
                continue
            if end > hi:
                hi = end
            if plan is None:
                ahead = None if a is None or ahead is None else max(ahead, a)
        self._window_served(h, x, lo, hi, ahead)

    def _window_served(self, h: _Handle, x: Inode, lo: int, hi: int, ahead) -> None:
        if x.emap is not None:
            self.reader.window_served(x.emap, lo, hi, ahead, self._seen(h, x))

    async def write(self, fh, off, buf):
        h, x, n = self.write_target(fh, off, len(buf))
        if h.kill_setid and x.mode & SETID_BITS:  # pyfuse3 does not pass the write's flags
            self.clear_setid(x)
        try:
            await self.staging.append(memoryview(buf)[:n], self.piece_recorder(x, off))
        except OSError as exc:
            raise _err(exc.errno or errno.EIO) from None
        self.wrote(h, x, off + n, n)
        return n

    # The three steps of a write, shared with the request loop's in-place writes
    # (fuse/inplace.py), which read the payload straight into the open segment.
    def write_target(self, fh: int, off: int = 0,
                     size: int = 0) -> tuple[_Handle, Inode, int]:
        """The handle and file a WRITE of `size` bytes at `off` goes to, and how many of its
        bytes it writes: those below the largest file the index records
        (records.MAX_FILE_BYTES), a short write as POSIX and ext4 have it; EFBIG for one
        that starts at or past it."""
        h = self.handles.get(fh)
        if h is None:
            raise _err(errno.EBADF)
        if size and off >= MAX_FILE_BYTES:
            raise _err(errno.EFBIG)
        x = h.inode
        if x.emap is None:
            raise _err(errno.EBADF)
        if x.layer or self.settings.readonly:
            raise _err(errno.EROFS)
        return h, x, min(size, max(MAX_FILE_BYTES - off, 0))

    def clear_setid(self, x: Inode) -> None:
        """A write by a process without CAP_FSETID clears S_ISUID, and S_ISGID where group
        execution is on (set-group-ID without it marks mandatory locking), as on ext4. The
        kernel does it itself (a SETATTR) before a write through the page cache; a direct
        write it leaves to the file system (FUSE_WRITE_KILL_SUIDGID, fuse/inplace.py)."""
        mode = x.mode & ~stat.S_ISUID
        if mode & stat.S_IXGRP:
            mode &= ~stat.S_ISGID
        if mode != x.mode:
            self.ns.change(SetattrRec(x.ino, mode, x.uid, x.gid, x.atime_ns, x.mtime_ns,
                                      time.time_ns()))
            self.forget_attributes(x.ino)

    def forget_attributes(self, ino: int) -> None:
        """Tell the kernel, before the answer that follows, that inode `ino`'s attributes it
        caches (300 s) are stale: a write that cleared set-user-ID must not leave `stat` (or
        exec) seeing the old mode."""
        if self.refresher is not None:
            self.refresher.send([(ATTRS, ino)])
        else:
            pyfuse3.invalidate_inode(ino, attr_only=True)

    def piece_recorder(self, x: Inode, off: int):
        """on_piece for Staging, for a write of file x at offset `off` (datapath/writes.py)."""
        return writes.piece_recorder(self.journal, self.staging.checksums, x, off,
                                     self.settings.checksum_block)

    def wrote(self, h: _Handle, x: Inode, end: int, n: int) -> None:
        if end > x.size:
            x.size = end
        x.mtime_ns = x.ctime_ns = time.time_ns()
        h.wrote = True
        self.bytes_written += n
        self.write_requests += 1

    async def flush(self, fh):
        # close() does not wait for durability (the product's promise); a handle that wrote
        # learns about a pending flusher error (ENOSPC, EIO) at close at the latest.
        h = self.handles.get(fh)
        if self.flusher.error is not None and h is not None and h.wrote:
            raise _err(self.flusher.error.errno or errno.EIO)

    async def release(self, fh):
        self.release_now(fh)

    def release_now(self, fh) -> None:
        """RELEASE's work (nothing in it waits): the fast path runs it after the requests
        that do not depend on it (fuse/releases.py)."""
        h = self.handles.pop(fh, None)
        self.control.released(fh)
        if h is not None and h.wrote and h.inode.layer == 0 and not self.settings.readonly:
            # Writes move mtime/ctime; one SETATTR per written file at close makes them
            # durable (journaled after the file's extents).
            x = h.inode
            self.ns.change(SetattrRec(x.ino, x.mode, x.uid, x.gid, x.atime_ns, x.mtime_ns,
                                      x.ctime_ns))
        if h is not None:
            if h.plan is not None:
                self.reader.drop_plan(h.plan)
            h.inode.opens -= 1
            self.ns.maybe_forget(h.inode)

    def release_all(self) -> None:
        """When the request loop has ended: every handle still open is released, as its
        RELEASE would have. The kernel sends RELEASE without waiting for it, and an unmount
        aborts the requests not read yet (it sends a FUSE mount no DESTROY to wait for
        them), so a file let go of just before the unmount has its RELEASE dropped; what
        the release journals (the written file's times) goes into the last commit instead."""
        for fh in list(self.handles):
            try:
                self.release_now(fh)
            except Exception:  # (the others are still released; the last commit still comes)
                log.exception("unmount: releasing handle %d", fh)

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
    async def opendir(self, inode, ctx):
        if self.refresher is not None and self.refresher.due():
            await self.refresher.refresh()
        x = self._dir(inode)
        listing = self.listings.open(x)
        fh = self.reserve_handle()
        self.handles[fh] = _Handle(x, 0)
        self.handles[fh].flags = listing
        return fh

    async def readdir(self, fh, start_id, token):
        h = self.handles.get(fh)
        if h is None:
            raise _err(errno.EBADF)
        self.listings.fill(h.flags, h.ino, start_id, token)

    async def releasedir(self, fh):
        h = self.handles.pop(fh, None)
        if h is not None:
            self.listings.close(h.flags)

    async def fsyncdir(self, fh, datasync):
        self.fsyncs += 1
        await self._barrier()

    # ------------------------------------------------------------ xattrs (fuse/control.py)
    async def getxattr(self, inode, name, ctx):
        return await self.control.getxattr(inode, name, ctx)

    async def listxattr(self, inode, ctx):
        return self.control.listxattr(inode)

    async def setxattr(self, inode, name, value, ctx):
        raise _err(errno.ENOTSUP)

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


def _guard(fn):
    """An unexpected exception in a handler must not take the daemon (and the mount) down:
    log it with its traceback and answer EIO."""
    import functools

    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except Exception:
            log.exception("internal error in %s", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
    return wrapper


for _name, _fn in list(vars(CkptOperations).items()):
    if _name in dir(pyfuse3.Operations) and not _name.startswith("_") and callable(_fn):
        setattr(CkptOperations, _name, _guard(_fn))
