"""What the other writers made durable, brought into this mount while it runs.

At an open, lookup or listing when the last look is older than `--refresh` (at every one with
0), and every `--refresh` seconds in the background while such requests keep coming or
something is open (a mount nobody uses makes no calls to the backing store), a worker thread
looks at the backing directory: one listing of `writers/` (a writer that appeared), and per
other writer a listing of its directory (on a
network file system it brings the files' current sizes: format/backingdir.py) and a stat of
its index. Only an index that grew is read, from where the last read stopped to its end, and
only its complete commit groups are taken (a group being appended is read the next time);
a tail of more than replay.TAIL_BYTES is taken that much at a time, each piece applied
before the next is read, in the same look.
The trio thread then applies them to the view (peers.Peers), one commit group at a time,
with a checkpoint when a tail takes longer than PAUSE_S, and the kernel is told what to forget:
it caches attributes for 300 s and entries for `--refresh` (1 s with 0; ops.py, replies.py;
then a path walk asks again with a LOOKUP, which looks first when a look is due), so changed
names, and the attributes and pages of changed files, are invalidated. The invalidations are
written from a worker thread: the kernel may hold the directory's lock for a request the trio
thread has yet to answer.

An index that was replaced (rewritten by a compaction, an index snapshot or a restart: another
file, or bytes other than those read before where the last read stopped: replay.read_tail)
is read whole again, a piece at a time, its tree made in a worker thread as the commit
groups are read (what the daemon holds of the index at once does not grow with its size),
and the tree takes the place of the old one with the same inode numbers for the entries it
kept (peers.Peers.reload_tree); a writer directory that went away leaves the view. A writer
whose changes fail to apply is read whole again in a second look at once.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import time
from collections.abc import Callable

import trio

from ckptfs.format import backingdir, records
from ckptfs.format.records import FormatError, RetireRec, XExtentRec
from ckptfs.namespace import ChangeNotices
from ckptfs.replay import bulk_load, read_tail, read_writer
from ckptfs.peers import Peers
from ckptfs.view import ENTRY, INODE

log = logging.getLogger("ckptfs")

PAUSE_S = 0.005  # the longest the trio thread applies a tail before it serves requests again
IDLE_PERIOD_S = 1.0  # how often --refresh 0 looks in the background (it looks at every request)
REREAD = (-1, -1)  # the ident of an index to read whole at the next look (no file has it)

# linux/fuse.h: notifications are "replies" with unique 0 and the code in the error field
FUSE_NOTIFY_INVAL_INODE = 2
FUSE_NOTIFY_INVAL_ENTRY = 3
OUT_HEADER = struct.Struct("<IiQ")
INVAL_INODE_OUT = struct.Struct("<Qqq")  # ino, offset, length (0, 0: attributes and all pages)
INVAL_ENTRY_OUT = struct.Struct("<QII")  # parent, name length, flags


# (ATTRS, ino): an inode's attributes only; nothing waits on a page, so it may be sent from
# the trio thread before an answer (Handles.forget_attributes)
ATTRS = 3


def notification(kind: int, a: int, name: bytes = b"") -> bytes:
    """The /dev/fuse message that makes the kernel forget an entry, an inode's cache, or
    (ATTRS) an inode's attributes."""
    if kind == ENTRY:
        body = INVAL_ENTRY_OUT.pack(a, len(name), 0) + name + b"\0"
        code = FUSE_NOTIFY_INVAL_ENTRY
    else:
        body = INVAL_INODE_OUT.pack(a, -1 if kind == ATTRS else 0, 0)
        code = FUSE_NOTIFY_INVAL_INODE
    return OUT_HEADER.pack(OUT_HEADER.size + len(body), code, 0) + body


class Invalidations:
    """Where the kernel is told to forget entries and inodes (Refresher.send): pyfuse3's
    calls, until the fast path takes the session's /dev/fuse over from libfuse (libfuse's
    descriptor is a socket toward it from then on: fuse/devfuse.py) and gives this its own
    descriptor of /dev/fuse to write them to. Its own: an invalidation still waiting in the
    kernel at unmount is abandoned, and must not write to a number reused since. The mount
    makes one and gives it to the refresher and to the fast path."""

    def __init__(self) -> None:
        self.fd = -1

    def write_to(self, fd: int) -> None:
        """From now on, to `fd` (a descriptor of /dev/fuse, kept open till the process ends)."""
        self.fd = fd

    def send(self, c: tuple) -> None:
        """Tell the kernel to forget `c` (see notification); raises OSError."""
        if self.fd >= 0:
            os.write(self.fd, notification(*c))
            return
        import pyfuse3  # (loaded by the mount anyway; not by the offline tools)
        if c[0] == ENTRY:
            pyfuse3.invalidate_entry(c[1], c[2])
        else:
            pyfuse3.invalidate_inode(c[1], attr_only=c[0] == ATTRS)


class Refresher:
    """Brings other writers' commits into the view (see the module's docstring)."""

    def __init__(self, peers: Peers, journal, cache, notices: ChangeNotices, backing: str,
                 delay_s: float, *, in_use: Callable[[], bool] = lambda: False,
                 invalidations: Invalidations | None = None) -> None:
        """`notices`: the mount's change notices, told when a look's changes come into the
        view (namespace.ChangeNotices: what the queue threads answer from goes); `in_use()`:
        whether files or directories are open on the mount (the background looks go on while
        they are); `invalidations`: where the kernel is told what changed (a new one: through
        pyfuse3)."""
        self.peers = peers
        self.view = peers.view
        self.journal = journal
        self.cache = cache
        self.notices = notices
        self.backing = backing
        self.delay = delay_s
        self.in_use = in_use
        self.invalidations = invalidations if invalidations is not None else Invalidations()
        # When the last look started (the background looks' clock), and when the last look
        # whose changes are all in the view started: how fresh the view is, what a request's
        # --refresh counts from (a look still reading or applying has brought nothing yet, or
        # some of it). At mount both are when the view's load began, which read every
        # writer's index before the mount served.
        self.last = trio.current_time()
        if peers.read_at is not None:
            self.last -= max(0.0, time.monotonic() - peers.read_at)
        self.fresh = self.last
        self.took = 0.0  # how long the last look took, from its start to its changes in view
        self.running: trio.Event | None = None
        # Set by every open, lookup and listing (due()): the background looker goes on only
        # while they come, and waits for this while nobody uses the mount.
        self.asked = trio.Event()
        # While a look's changes go into the view (they may pause for requests between
        # groups): answers prepared for the queue threads would say what is half applied.
        self.applying = False
        # what the looks cost the backing store, and this mount
        self.polls = 0
        self.listdirs = 0
        self.stats = 0
        self.reads = 0
        self.bytes_read = 0
        self.groups = 0
        self.records = 0
        self.apply_s = 0.0
        self.apply_max_s = 0.0
        self.notifications = 0
        self.look_s = 0.0  # worker-thread time of the looks
        self.look_max_s = 0.0
        self.waits = 0  # requests (open, lookup, listing, sync) that waited for a look
        self.wait_s = 0.0
        self.writers_added = 0
        self.writers_reloaded = 0
        self.errors = 0  # looks (or parts of them) the backing store failed
        self.idle_pauses = 0  # times the background looker stopped: nobody used the mount
        self.failing = False  # the last look failed (logged once per such streak)
        # Invalidations go out from their own task: never from the request that found the
        # changes (a LOOKUP holds its directory's lock in the kernel, which an invalidation of
        # an entry in that directory waits for).
        self.outbox: list[tuple] = []
        # (a problem is logged once, not at every look; those of the mount's replay were)
        self.warned: set[str] = set(peers.union.warnings)
        self._warned = len(peers.union.warnings)
        self.wake = trio.Event()
        # (layer, log) of other writers the reader is to let go of once no READ uses them: a
        # retired log, or every log of a tree that left the view (a new tree, a new layer)
        self.held: set[tuple[int, int]] = set()

    def due(self) -> bool:
        """Whether a look is due (asked by an open, lookup or listing, which looks first
        then, or waits for the one running); the mount counts as in use from here."""
        self.asked.set()
        return trio.current_time() - self.fresh >= self.delay

    def fresh_until(self) -> float:
        """Until when (time.monotonic()) an open, lookup or listing needs no look first; now
        while a look's changes are being applied."""
        if self.applying:
            return time.monotonic()
        return time.monotonic() + (self.fresh + self.delay - trio.current_time())

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._sender)
            await self._looker()

    async def _looker(self) -> None:
        """The background look: every --refresh seconds (--refresh 0: every IDLE_PERIOD_S)
        while the mount is in use, so that requests rarely wait for one and the kernel
        forgets changed attributes soon. A period without an open, lookup or listing stops
        it, unless something is open on the mount (an open file's view is kept as fresh as
        before: a truncate or chmod through it may copy it up), until the next one comes
        (which looks itself, the look being due by then): an idle mount makes no calls to
        the backing store. Each starts a little before the view turns --refresh old (twice
        as long as the last look took, at most a tenth of the period): a request that comes
        while a look is under way and finds the view that old waits for it."""
        period = self.delay if self.delay > 0 else IDLE_PERIOD_S
        while True:
            self.asked = trio.Event()
            lead = min(2 * self.took, period / 10)
            await trio.sleep(max(0.0, self.last + period - lead - trio.current_time()))
            if not self.asked.is_set() and not self.in_use():  # nobody asked, nothing open
                self.idle_pauses += 1
                self._let_go()
                await self.asked.wait()
                continue
            if trio.current_time() - self.last >= period - lead:
                try:
                    await self.refresh(by_request=False)
                except Exception:
                    log.exception("reading other writers' changes")

    async def refresh(self, by_request: bool = True) -> None:
        """Look now: a look that is running when the call comes is waited for, and another
        one follows unless it started less than --refresh before the call."""
        arrived = trio.current_time()
        if by_request:
            self.waits += 1
            try:
                await self._refresh(arrived)
            finally:
                self.wait_s += trio.current_time() - arrived
        else:
            await self._refresh(arrived)

    async def _refresh(self, arrived: float) -> None:
        while self.running is not None:
            await self.running.wait()
            if self.fresh >= arrived - self.delay:
                return
        self.running = trio.Event()
        self.last = started = trio.current_time()
        try:
            peers = self.peers
            # (a writer whose changes could not be applied is read whole at once, in a
            # second look, and a tail read that stopped short is read on in the next: the
            # request waiting for this one gets the view it asked for)
            rereads = 0
            while True:
                known = {layer: (peers.union.writer_dirs[layer], peers.offsets.get(layer, 0),
                                 peers.index_ids.get(layer))
                         for layer in peers.trees}
                names = set(peers.union.layers)
                unread = {layer: peers.union.writer_dirs[layer] for layer in peers.unloaded()}
                found = await trio.to_thread.run_sync(self._look, known, names, unread)
                if await self._apply(found) and not rereads:
                    rereads += 1
                    continue
                if not any(item[0] == "tail" and item[2].stopped for item in found):
                    break
            self.fresh = started
            self.took = trio.current_time() - started
        finally:
            ev, self.running = self.running, None
            ev.set()
        self.kick()

    def _let_go(self) -> None:
        """Close the descriptors of other writers' data logs that nothing reads: an idle
        mount would not see their writer retire one until its next look, and a removed file
        held open keeps its space on the backing store. (Opened again by the next READ; the
        cached chunks stay.)"""
        cache = self.cache
        for layer in list(self.peers.trees):
            for lg in cache.logs.logs_of(layer):
                if not cache.log_in_use(layer, lg):
                    cache.logs.forget(layer, lg)

    def kick(self) -> None:
        """Hand what the view collected for the kernel to the sender."""
        view = self.view
        if view.changed:
            self.outbox.extend(view.changed)
            view.changed.clear()
            self.wake.set()

    # ------------------------------------------------------------ worker thread
    def _look(self, known: dict, names: set, unread: dict) -> list[tuple]:
        """The look (worker thread). A backing store that fails it (writers/ cannot be listed,
        an index cannot be opened) leaves the view as it is: requests are served from it, the
        failure is counted (refresh_errors) and logged once while it lasts, and the next look
        tries again."""
        t0 = time.perf_counter()
        try:
            found = self._look_at(known, names, unread)
        except OSError as exc:
            self.errors += 1
            if not self.failing:
                self.failing = True
                log.warning("looking at other writers' changes: %s (the view stays as it is "
                            "until a look succeeds)", exc)
            return []
        else:
            if self.failing:
                self.failing = False
                log.info("looking at other writers' changes works again")
            return found
        finally:
            dt = time.perf_counter() - t0
            self.look_s += dt
            self.look_max_s = max(self.look_max_s, dt)

    def _look_at(self, known: dict, names: set, unread: dict) -> list[tuple]:
        self.polls += 1
        out: list[tuple] = []
        root = os.path.join(self.backing, backingdir.WRITERS_DIR)
        try:
            present = set(os.listdir(root))
        except FileNotFoundError:
            present = set()
        self.listdirs += 1
        for layer, (wdir, offset, ident) in known.items():
            wid = os.path.basename(wdir)
            if wid not in present:
                out.append(("gone", layer))
                continue
            index = os.path.join(wdir, backingdir.INDEX_NAME)
            try:
                os.listdir(wdir)  # (fresh sizes on a network file system)
                self.listdirs += 1
                st = os.stat(index)
                self.stats += 1
            except FileNotFoundError:
                continue  # no index yet (or a listing raced its creation)
            except OSError as exc:
                self.errors += 1
                self._warn(f"writer {wid}: {exc}")
                continue
            if ident not in ((0, 0), None) and (st.st_dev, st.st_ino) != ident[:2] or \
                    st.st_size < offset:
                out.append(("replaced", layer, wdir))
                continue
            start = max(offset, records.INDEX_HEADER.size)
            if st.st_size <= start:
                continue
            try:
                got = read_tail(index, start, ident)
            except (FormatError, OSError) as exc:
                self.errors += isinstance(exc, OSError)
                self._warn(f"writer {wid}: {exc}")
                continue
            self.reads += 1
            self.bytes_read += st.st_size - start
            if got is None:  # (not the index read before, whatever its name and size say)
                out.append(("replaced", layer, wdir))
                continue
            out.append(("tail", layer, *got))
        for layer, wdir in unread.items():  # writers whose index could not be read: again
            if os.path.basename(wdir) not in present:
                out.append(("gone", layer))
                continue
            out.append(("read", layer, wdir))
        for wid in sorted(present - names):
            wdir = os.path.join(root, wid)
            try:
                backingdir.safe_writer_id(wid)
            except FormatError:
                continue
            if not os.path.isdir(wdir) or wid.startswith("."):
                continue
            try:
                records.check_index_header(os.path.join(wdir, backingdir.INDEX_NAME))
            except FormatError as exc:
                self._warn(f"writer {wid} is not read: {exc}")
                continue
            out.append(("new", wdir))
        return out

    def _read_whole(self, wdir: str, built) -> "tuple | str":
        """A writer's index read whole (worker thread), its tree made as its commit groups
        are read (peers.TreeBuild): what this holds of the index at once is a piece of it
        and one group, whatever its size."""
        with bulk_load():
            got = read_writer(wdir, built.group)
        self.reads += 1
        return got

    def _warn(self, msg: str) -> None:
        if msg not in self.warned:
            self.warned.add(msg)
            log.warning("%s", msg)

    # ------------------------------------------------------------ trio thread
    async def _apply(self, found: list[tuple]) -> bool:
        """Whether a writer is to be read again whole (its changes failed to apply)."""
        peers = self.peers
        self._release()
        again = False
        if found:  # (a look that found nothing changes nothing: answers prepared stand)
            self.applying = True
            try:
                self.notices.view_changed()  # (what the queue threads answer from goes)
                again = await self._apply_found(found)
            finally:
                self.applying = False
                self.notices.view_changed()  # (and what was answered while it paused)
        for w in peers.union.warnings[self._warned:]:
            log.warning("%s", w)
        self._warned = len(peers.union.warnings)
        self.journal.saw(peers.max_stamp)
        return again

    async def _apply_found(self, found: list[tuple]) -> bool:
        """The changes a look found, into the view (see _apply). A writer whose changes fail
        to apply (an error in this code: the view may hold them half applied) is read whole
        again and its tree built anew; returns whether one was."""
        again = False
        t0 = time.perf_counter()
        for item in found:
            try:
                t0 = await self._apply_item(item, t0)
            except Exception:
                again = True
                wid = self._reread(item)
                log.exception("applying the changes of writer %s (its index is read again "
                              "whole)", wid)
        self._account(t0)
        return again

    async def _apply_item(self, item: tuple, t0: float) -> float:
        """One thing a look found, into the view; returns when the trio thread last served
        requests (it does between commit groups, every PAUSE_S)."""
        peers = self.peers
        kind = item[0]
        if kind == "tail":
            _, layer, scan, ident = item
            if layer not in peers.trees:
                return t0
            for group, when in zip(scan.groups, scan.group_times):
                runs = peers.apply_group(layer, group, when)
                self._drop_cached(layer, runs)
                self.groups += 1
                self.records += len(group)
                if time.perf_counter() - t0 > PAUSE_S:
                    self._account(t0)
                    await trio.lowlevel.checkpoint()
                    t0 = time.perf_counter()
            peers.offsets[layer] = max(peers.offsets.get(layer, 0), scan.valid_bytes)
            peers.index_ids[layer] = ident
        elif kind in ("new", "read", "replaced"):
            # (read whole in a worker thread, its tree made there: requests are served
            # meanwhile from the view as it is, which takes the tree in one step)
            wdir = item[-1]
            wid = os.path.basename(wdir)
            if kind == "new":
                if wid in peers.union.layers:
                    return t0
                layer = peers.add_writer(wdir)  # (a layer without a tree if it is not read:
                self.writers_added += 1  # read again at every look)
            else:
                layer = item[1]
                if peers.union.layers.get(wid) != layer or (kind == "read") == (
                        layer in peers.trees):
                    return t0
            built = peers.tree_build(layer, wdir, threaded=True)
            got = await trio.to_thread.run_sync(self._read_whole, wdir, built)
            t0 = time.perf_counter()
            if isinstance(got, str):
                self._warn(got)
                return t0
            if peers.union.layers.get(wid) != layer:
                return t0
            if kind != "replaced":
                peers.add_tree(wdir, *got, layer, built)
                log.info("writer %s joined the view" if kind == "new" else
                         "writer %s: its index read, it joins the view", wid)
                return t0
            self._forget(layer, self.cache.logs_of(layer))
            # (the same layer, the view's numbers kept, unless a READ still uses a log of
            # the old tree: a log its writer removed and made again would then be read
            # from the chunks cached of the old one)
            peers.reload_tree(layer, wdir, *got,
                             same_layer=not any(lay == layer for lay, _ in self.held),
                             built=built)
            self.writers_reloaded += 1
            log.info("writer %s: index rewritten, read again", os.path.basename(wdir))
        elif kind == "gone":
            peers.drop_tree(item[1])
            self._forget(item[1], self.cache.logs_of(item[1]))
            log.info("writer %s left the backing directory",
                     peers.union.writer_ids.get(item[1]))
        return t0

    def _reread(self, item: tuple) -> str | None:
        """The writer of a look's `item` is read whole at the next look (as an index that
        was rewritten); returns its id."""
        peers = self.peers
        kind = item[0]
        if kind in ("tail", "gone"):
            wid = peers.union.writer_of(item[1])
        elif kind == "new":
            wid = os.path.basename(item[1])
        else:
            wid = os.path.basename(item[2])
        layer = peers.union.layers.get(wid)
        if layer in peers.trees:
            peers.index_ids[layer] = REREAD
        return wid

    def _account(self, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.apply_s += dt
        if dt > self.apply_max_s:
            self.apply_max_s = dt

    def _drop_cached(self, layer: int, runs: list) -> None:
        """The reader may hold a chunk of a log read before these bytes were in it."""
        for rec in runs:
            if type(rec) is RetireRec:
                self._forget(layer, (rec.log,))
            elif type(rec) is XExtentRec:
                lay = self.peers.tree_layer_of(rec.writer)
                if lay is not None:
                    self.cache.invalidate(lay, rec.log, rec.loff, rec.run_length)
            else:
                self.cache.invalidate(layer, rec.log, rec.loff, rec.length)

    def _forget(self, layer: int, logs) -> None:
        """The reader lets go of these logs of `layer` (their descriptors, cached chunks and
        bookkeeping), now or, for one a READ or a load is using, at a later look."""
        for lg in logs:
            if self.cache.log_in_use(layer, lg):
                self.held.add((layer, lg))
            else:
                self.cache.forget_log(layer, lg)

    def _release(self) -> None:
        for layer, lg in list(self.held):
            if not self.cache.log_in_use(layer, lg):
                self.cache.forget_log(layer, lg)
                self.held.discard((layer, lg))

    async def _sender(self) -> None:
        while True:
            await self.wake.wait()
            self.wake = trio.Event()
            changes = list(dict.fromkeys(self.outbox))  # (in order, once each)
            self.outbox.clear()
            if not changes:
                continue
            # (abandoned at unmount: the kernel may keep it waiting for a lock until then)
            await trio.to_thread.run_sync(self.send, changes, abandon_on_cancel=True)
            self.view.dirty.difference_update(c[1] for c in changes if c[0] == INODE)

    def send(self, changes: list[tuple]) -> None:
        """Worker thread (the trio thread for ATTRS alone): tell the kernel to forget what
        changed."""
        for c in changes:
            self.notifications += 1
            try:
                self.invalidations.send(c)
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ENODEV):
                    log.warning("invalidating %r in the kernel: %s", c, exc)

    def counts(self) -> dict:
        return {"refresh_s": self.delay, "refresh_polls": self.polls,
                "refresh_listdirs": self.listdirs, "refresh_stats": self.stats,
                "refresh_reads": self.reads, "refresh_bytes_read": self.bytes_read,
                "refresh_groups": self.groups, "refresh_records": self.records,
                "refresh_apply_seconds": round(self.apply_s, 4),
                "refresh_apply_max_ms": round(self.apply_max_s * 1e3, 3),
                "refresh_notifications": self.notifications,
                "refresh_look_seconds": round(self.look_s, 4),
                "refresh_look_max_ms": round(self.look_max_s * 1e3, 3),
                "refresh_waits": self.waits,
                "refresh_wait_seconds": round(self.wait_s, 4),
                "refresh_errors": self.errors,
                "refresh_idle_pauses": self.idle_pauses,
                "writers_joined": self.writers_added,
                "writers_reread": self.writers_reloaded,
                "writers_unread": len(self.peers.unloaded())}
