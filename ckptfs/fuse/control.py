"""The mount's control files and xattrs, and who may use them (trio thread only; one `Control`
per mount, CkptOperations.control).

- `user.ckptfs.status` on the root: the daemon's figures as JSON (metrics.status);
  `user.ckptfs.sync` on the root: a barrier at the mount's --durability, `.sync.node` and
  `.sync.backing` at that level, then what other writers made durable before it. Only the
  controllers may use them (`controllers`: root, the daemon's user, the owner of the mount's
  root); another user of an --allow-other mount gets EACCES.
- `user.ckptfs.level` on any file or directory, for any user who reaches it: how durable it is
  (`level_of`).
- MOUNT/.ckptfs/stats.json: the status as JSON, for tools that cannot read xattrs, taken at
  its open. The directory is reachable by name but not listed, so cp -r, du and find of the
  user's tree never see it; its inodes are in the tree under CONTROL_LAYER (no writer's).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from collections.abc import Awaitable, Callable

import pyfuse3

from ckptfs.datapath.flusher import Flusher
from ckptfs.datapath.journal import Journal
from ckptfs.namespace import CONTROL_LAYER, ROOT_INO, Inode, Namespace

CTL_NAME = b".ckptfs"
CTL_DIR_INO = (1 << 63) - 2
CTL_STATS_INO = (1 << 63) - 1
XATTR_PREFIX = b"user.ckptfs."
# user.ckptfs.sync: a barrier at the mount's --durability; .sync.node, .sync.backing at that
# level. user.ckptfs.level on any file or directory: how durable it is (level_of)
XATTR_SYNC_LEVELS = {XATTR_PREFIX + b"sync": None, XATTR_PREFIX + b"sync.node": "node",
                     XATTR_PREFIX + b"sync.backing": "backing"}
XATTR_LEVEL = XATTR_PREFIX + b"level"


class Control:
    """The control directory and its stats.json in the tree, the snapshots of stats.json its
    open handles read, the control xattrs."""

    def __init__(self, ns: Namespace, journal: Journal, flusher: Flusher,
                 inode: Callable[[int], Inode], barrier: Callable[[str | None], Awaitable],
                 status: Callable[[], dict], refresher=None) -> None:
        """`ns`: the tree (the control directory goes into it); `journal` and `flusher`:
        what says how durable a change is; `inode(ino)`: a live inode (ENOENT if there is
        none: CkptOperations.inode); `barrier(level)`: a barrier as fsync's, answered EINTR
        when its caller is being killed (CkptOperations._barrier); `status()`: the figures
        (metrics.status); `refresher`: what brings in other writers' changes (fuse/refresh.py;
        None without other writers)."""
        self.ns = ns
        self.journal = journal
        self.flusher = flusher
        self.inode = inode
        self.barrier = barrier
        self.status = status
        self.refresher = refresher
        self.snapshots: dict[int, bytes] = {}  # fh -> stats.json content of that open
        now = time.time_ns()
        ctl = Inode(CTL_DIR_INO, stat.S_IFDIR | 0o555, 0, 0, 0, now, now, now)
        ctl.nlink, ctl.parent, ctl.layer = 2, ROOT_INO, CONTROL_LAYER
        ctl.children[b"stats.json"] = CTL_STATS_INO
        stats = Inode(CTL_STATS_INO, stat.S_IFREG | 0o444, 0, 0, 0, now, now, now)
        stats.nlink, stats.layer = 1, CONTROL_LAYER
        ns.inodes[CTL_DIR_INO] = ctl
        ns.inodes[CTL_STATS_INO] = stats

    def opened(self, fh: int) -> None:
        """Handle fh opened stats.json: it reads the status as it is now."""
        self.snapshots[fh] = json.dumps(self.status(), indent=1).encode() + b"\n"

    def read(self, fh: int, off: int, size: int) -> bytes:
        """A READ of a control file's handle."""
        return self.snapshots.get(fh, b"")[off:off + size]

    def released(self, fh: int) -> None:
        self.snapshots.pop(fh, None)

    def controllers(self) -> set[int]:
        """Who may use the control xattrs and the status socket: root, the daemon's user and
        the owner of the mount's root (the job's user a root prolog handed it to); another
        user of an --allow-other mount may not force barriers or read the figures."""
        return {0, os.getuid(), self.ns.inodes[ROOT_INO].uid}

    def level_of(self, ino: int) -> str:
        """How durable a file is, or a directory with everything under it: "staged", "node"
        (the node tier) or "backing" (the backing directory), by the newest change to any of
        its inodes not yet known to be in the backing directory."""
        x = self.inode(ino)
        inos, todo, inodes = [x.ino], [x], self.ns.inodes
        while todo:  # (iterative: trees of any depth)
            d = todo.pop()
            if d.children:
                for i in d.children.values():
                    inos.append(i)
                    c = inodes.get(i)
                    if c is not None and c.children:
                        todo.append(c)
        return self.flusher.level(self.journal.touched_seq(inos))

    async def getxattr(self, inode: int, name: bytes, ctx) -> bytes:
        if name == XATTR_LEVEL:  # (any user who reaches the file may ask)
            return self.level_of(inode).encode()
        if inode == ROOT_INO and name.startswith(XATTR_PREFIX) \
                and ctx.uid not in self.controllers():
            raise pyfuse3.FUSEError(errno.EACCES)
        if inode == ROOT_INO and name == XATTR_PREFIX + b"status":
            return json.dumps(self.status()).encode()
        if inode == ROOT_INO and name in XATTR_SYNC_LEVELS:
            await self.barrier(XATTR_SYNC_LEVELS[name])
            if self.refresher is not None:  # and what the others made durable before it
                await self.refresher.refresh()
            return b"ok"
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    def listxattr(self, inode: int) -> list[bytes]:
        return [XATTR_PREFIX + b"status"] if inode == ROOT_INO else []
