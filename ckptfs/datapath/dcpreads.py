"""The DCP read policy: which read-only opens get a read plan, and the plans kept (trio thread).

A DCP data file's open finds the `.metadata` beside it by the directory the kernel last saw
its name in (`saw_name`: a file's inode does not say which directory holds it), reads that
`.metadata` through the read cache once per version of it and has its plans made in a child
process (readplan.dcp_plans), then gives the handle the plan of its file (`plan_for`). Every
failure means no plan: the reads then go as any other file's, since a plan only decides what
is loaded ahead (readplan.py). The handle table (fuse/handles.py) owns the handles; this
module owns the names, the plans and the count of plans given.
"""

from __future__ import annotations

import logging

import trio

from ckptfs.datapath.readplan import (
    DCP_DATA_SUFFIX,
    DCP_METADATA,
    METADATA_MAX_BYTES,
    ReadPlan,
    dcp_plans,
)
from ckptfs.namespace import Inode, Namespace

log = logging.getLogger("ckptfs.dcpreads")

DCP_NAMES_MAX = 4096  # DCP data files whose directory is remembered (saw_name)
DCP_PLANS_MAX = 16  # `.metadata` files whose plans are kept (one per checkpoint read)
# Items of the kept plans together (~120 bytes each): beyond it the oldest plans go, so that
# crafted `.metadata` files (up to readplan.ITEMS_MAX items each) cannot make the daemon hold
# gigabytes; a real checkpoint has thousands
DCP_PLAN_ITEMS_MAX = 1 << 21


def _keep_newest(table: dict, key, value, limit: int) -> None:
    """table[key] = value as its newest entry; past `limit` entries the oldest goes."""
    table.pop(key, None)
    if len(table) >= limit:
        del table[next(iter(table))]
    table[key] = value


class DcpReads:
    """The names of DCP data files seen, the plans read from `.metadata` files, and how many
    opens were given a plan (`read_plans`, in the status).

    Attributes:
        names: data file inode -> (its directory, its name), the newest DCP_NAMES_MAX.
        plans: `.metadata` inode -> ((its mtime, size), its data files' plans by name).
        reading: `.metadata` inodes being read, the event the other opens wait on.
    """

    def __init__(self, ns: Namespace, reader, io_block_bytes: int) -> None:
        """`reader`: the read path the `.metadata` is read through (datapath/reader.py);
        `io_block_bytes`: the size of the application's reads (st_blksize), which a plan
        rounds its items to."""
        self.ns = ns
        self.reader = reader
        self.io_block_bytes = io_block_bytes
        self.names: dict[int, tuple[int, bytes]] = {}
        self.plans: dict[int, tuple[tuple[int, int], dict]] = {}
        self.reading: dict[int, trio.Event] = {}
        self.read_plans = 0  # read-only opens given a read plan

    def saw_name(self, parent: int, name: bytes, ino: int) -> None:
        """The kernel learns of `name` in directory `parent` (a LOOKUP, CREATE, rename or
        listing): a DCP data file's is kept, where its open finds the `.metadata` for its
        read plan."""
        if name.endswith(DCP_DATA_SUFFIX):
            _keep_newest(self.names, ino, (parent, name), DCP_NAMES_MAX)

    def metadata_of(self, x: Inode) -> tuple[bytes, Inode] | None:
        """DCP data file x's name and the `.metadata` beside it, if it is one."""
        where = self.names.get(x.ino)
        if where is None:
            return None
        parent = self.ns.inodes.get(where[0])
        name = where[1]
        if parent is None or not parent.children or parent.children.get(name) != x.ino:
            return None
        meta = self.ns.inodes.get(parent.children.get(DCP_METADATA, 0))
        if meta is None or meta.emap is None or not 0 < meta.size <= METADATA_MAX_BYTES:
            return None
        return name, meta

    async def plan_for(self, x: Inode) -> ReadPlan | None:
        """The order a DCP reader reads data file x in, from the `.metadata` beside it
        (readplan.py); None for any other file, or when the metadata cannot be read or is not
        DCP's (the reads then go as any other's: a plan is only ever a guess)."""
        found = self.metadata_of(x)
        if found is None:
            return None
        name, meta = found
        try:
            plans = await self._plans_of(meta)
            items = plans.get(name) if plans else None
            if not items:
                return None
            plan = ReadPlan(items, x.size, self.io_block_bytes)
        except Exception as exc:  # noqa: BLE001 - no plan, whatever failed
            log.info("no read plan for %r: %s", name, exc)
            return None
        self.read_plans += 1
        return plan

    async def _plans_of(self, meta: Inode) -> dict | None:
        """The plans a `.metadata` gives its data files, read once per version of it (the
        ranks of a node open their data files at once: one reads it, the others wait);
        None when it cannot be read now (not kept: the next open tries again)."""
        version = (meta.mtime_ns, meta.size)
        while True:
            cached = self.plans.get(meta.ino)
            if cached is not None and cached[0] == version:
                return cached[1]
            busy = self.reading.get(meta.ino)
            if busy is None:
                break
            await busy.wait()
        busy = self.reading[meta.ino] = trio.Event()
        step = self.io_block_bytes
        try:
            data = bytearray()
            for off in range(0, meta.size, step):  # (views valid until an await)
                for part in await self.reader.read(meta.emap, off, step, meta.size, 0,
                                                   gather=True):
                    data += part
            try:
                plans = await trio.to_thread.run_sync(dcp_plans, bytes(data))
            except ValueError as exc:
                log.info("no read plans from .metadata (inode %d): %s", meta.ino, exc)
                plans = {}
            _keep_newest(self.plans, meta.ino, (version, plans), DCP_PLANS_MAX)
            items = {k: sum(map(len, v[1].values())) for k, v in self.plans.items()}
            total = sum(items.values())
            for k in list(self.plans)[:-1]:  # (the oldest first; the newest stays)
                if total <= DCP_PLAN_ITEMS_MAX:
                    break
                del self.plans[k]
                total -= items[k]
            return plans
        except OSError as exc:
            log.info("no read plans from .metadata (inode %d): %s", meta.ino, exc)
            return None
        finally:
            del self.reading[meta.ino]
            busy.set()
