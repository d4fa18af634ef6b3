"""The mounted daemon: open (or create) this writer's part of the backing directory, replay the
index, start the flusher, serve FUSE until unmounted, then drain everything to disk.

`serve(cfg)` runs in the foreground; `ckptfs mount` forks first (cli.py) and reports the
child's first line (ready or error) to the user.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import glob
import json
import logging
import os
import signal
import socket
import sys
import time

import pyfuse3
import trio

from ckptfs import options
from ckptfs.api import mount_at, status_socket_name
from ckptfs.datapath import cleaner, tier
from ckptfs.datapath.flusher import ErrorNotices, Flusher
from ckptfs.datapath.journal import Journal
from ckptfs.datapath.maintainer import Maintainer
from ckptfs.datapath.readcache import ReadCache
from ckptfs.datapath.reader import Reader
from ckptfs.datapath.staging import Staging, round_up
from ckptfs.format import backingdir, records
from ckptfs.format.backingdir import WriterDir
from ckptfs.format.index import IndexWriter, discard_fresh, keep_damaged
from ckptfs.format.logs import RunReader
from ckptfs.format.records import FormatError
from ckptfs.fuse import loop
from ckptfs.fuse.fastpath import FastPath
from ckptfs.fuse.interrupts import Interrupts
from ckptfs.fuse.ops import CkptOperations, Settings, idle_sealer
from ckptfs import metrics, system
from ckptfs.metrics import stats_exporter
from ckptfs.fuse.refresh import Invalidations, Refresher
from ckptfs.io import probe_direct, probe_direct_read
from ckptfs.namespace import ChangeNotices, Namespace
from ckptfs.options import format_size
from ckptfs.replay import replay, validate_extents
from ckptfs.peers import Peers
from ckptfs.view import Union

log = logging.getLogger("ckptfs")

MiB = 1 << 20


# A mount's settings: `backing`, `mountpoint`, then one field per entry of options.OPTIONS
# (their defaults and units are there).
def _check_config(self) -> None:
    if self.segment_bytes < 64 * 1024 or self.segment_bytes % 4096:
        raise ValueError("--segment-size must be a multiple of 4 KiB and at least 64 KiB")
    if self.checksum_block_bytes < 64 * 1024 or self.checksum_block_bytes % 4096:
        raise ValueError("--checksum-block must be a multiple of 4 KiB and at least 64 KiB")
    if self.staging_bytes < 2 * self.segment_bytes:
        raise ValueError("--staging-size must hold at least two segments")
    if not 1 <= self.queue_depth <= 4096:
        raise ValueError("--queue-depth must be between 1 and 4096")
    if self.io_mode not in ("auto", "direct", "buffered"):
        raise ValueError("--io must be auto, direct or buffered")
    if self.engine not in ("auto", "io_uring", "posix"):
        raise ValueError("--engine must be auto, io_uring or posix")
    if self.log_bytes < self.segment_bytes + records.DATA_HEADER_BYTES:
        raise ValueError("--log-size must be larger than a segment")
    if self.io_chunk_bytes < 4096 or self.io_chunk_bytes % 4096:
        raise ValueError("--io-chunk must be a multiple of 4 KiB")
    if self.idle_flush_s <= 0:
        raise ValueError("--idle-flush must be positive")
    # (at most half of how long this writer's dead bytes wait for other mounts' views of it:
    # datapath/cleaner.SHARED_GRACE_S, datapath/reclaim.py)
    if not 0 <= self.refresh_s <= 30:
        raise ValueError("--refresh must be between 0 and 30 seconds")
    if not 0 <= self.request_spin_us <= 100_000:
        raise ValueError("--request-spin must be between 0 and 100000 microseconds")
    if self.fuse_uring and not self.fast_path:
        raise ValueError("--fuse-uring needs the fast path (drop --no-fast-path)")
    if self.queue_threads and not self.fast_path:
        raise ValueError("--queue-threads needs the fast path (drop --no-fast-path)")
    if not 1 <= self.data_logs <= 256:
        raise ValueError("--data-logs must be between 1 and 256")
    if not 0 <= self.clean_below <= 1:
        raise ValueError("--clean-below must be between 0 and 1")
    if self.clean_idle_s < 0:
        raise ValueError("--clean-idle must not be negative")
    if self.index_snapshot_ratio != 0 and self.index_snapshot_ratio < 1.1:
        raise ValueError("--index-snapshot-ratio must be 0 (never) or at least 1.1")
    if self.durability not in ("backing", "node"):
        raise ValueError("--durability must be backing or node")
    if self.durability == "node" and not self.local_dir:
        raise ValueError("--durability node needs the node tier (--local-dir)")
    if self.local_dir and self.readonly:
        raise ValueError("--local-dir is for a mount that writes (drop --ro)")
    if self.stripe_bytes % 4096 or self.stripe_bytes > self.log_bytes // 2:
        raise ValueError("--stripe-size must be a multiple of 4 KiB (and well below "
                         "--log-size)")


MountConfig = dataclasses.make_dataclass(
    "MountConfig", [("backing", str), ("mountpoint", str), *options.config_fields()],
    namespace={"check": _check_config})


class MountError(Exception):
    """Bad input to mount: reported as one line, nothing written to the backing directory."""


def is_mountpoint(path: str) -> bool:
    real = os.path.realpath(path)
    try:
        return mount_at(real) is not None
    except OSError:
        return os.path.ismount(path)


def check_mountpoint(mountpoint: str) -> None:
    if not os.path.exists(mountpoint):
        if os.path.islink(mountpoint):
            raise MountError(f"mount point {mountpoint} is a dangling symlink")
        raise MountError(f"mount point {mountpoint} does not exist")
    if is_mountpoint(mountpoint):
        raise MountError(f"{mountpoint} is already a mount point (ckptfs umount {mountpoint})")
    if not os.path.isdir(mountpoint):
        raise MountError(f"mount point {mountpoint} is not a directory")
    if os.listdir(mountpoint):
        raise MountError(f"mount point {mountpoint} is not empty")


def prepare(cfg: MountConfig) -> dict:
    """Everything that can fail on bad input, before anything is written. Returns facts."""
    cfg.check()
    if not os.path.exists(cfg.backing):
        raise MountError(f"backing directory {cfg.backing} does not exist")
    if not os.path.isdir(cfg.backing):
        raise MountError(f"backing path {cfg.backing} is not a directory")
    if not cfg.readonly and not os.access(cfg.backing, os.W_OK | os.X_OK):
        raise MountError(f"backing directory {cfg.backing} is not writable")
    check_mountpoint(cfg.mountpoint)
    rb, rm = os.path.realpath(cfg.backing), os.path.realpath(cfg.mountpoint)
    if rb == rm or rb.startswith(rm + os.sep):
        raise MountError("the backing directory must not be the mount point or inside it")
    if not os.path.exists("/dev/fuse"):
        raise MountError("/dev/fuse is missing (load the fuse module)")
    try:
        backingdir.check_backing(cfg.backing, create=False)
    except FormatError as exc:
        if cfg.readonly:
            raise MountError(str(exc)) from None
        if os.path.exists(os.path.join(cfg.backing, backingdir.BACKING_MARKER)) or \
                os.path.isdir(os.path.join(cfg.backing, backingdir.WRITERS_DIR)):
            # Another mount may have been initialising it meanwhile (nodes mounting a new
            # backing directory at once): what it is now decides.
            try:
                backingdir.check_backing(cfg.backing, create=False)
            except FormatError as again:
                raise MountError(str(again)) from None
        # A new backing directory: fine, initialised after all checks.
    cfg.writer_id = backingdir.safe_writer_id(cfg.writer_id or backingdir.default_writer_id())
    for wdir in backingdir.writer_dirs(cfg.backing):  # version checks before anything is written
        try:
            records.check_index_header(os.path.join(wdir, backingdir.INDEX_NAME))
        except FormatError as exc:
            raise MountError(str(exc)) from None
        except OSError:
            pass  # (not read now: the replay reports it, another writer's is read again later)
    facts: dict = {}
    if cfg.io_mode == "buffered":
        facts["direct"] = False
        facts["align"] = 4096
        facts["io_reason"] = "buffered I/O requested"
    elif cfg.readonly:
        # A read-only mount writes nothing, not even a probe: O_DIRECT reads are tried on an
        # existing data log (the reader still falls back to buffered per log if refused).
        logs = sorted(glob.glob(os.path.join(cfg.backing, backingdir.WRITERS_DIR, "*",
                                             "data-*.log")))
        info = probe_direct_read(logs[0]) if logs else None
        if cfg.io_mode == "direct" and info is not None and not info.supported:
            raise MountError(f"O_DIRECT reads are not available on {cfg.backing}: "
                             f"{info.reason}")
        facts["direct"] = info.supported if info else cfg.io_mode == "direct"
        facts["align"] = 4096
        facts["io_reason"] = info.reason if info else "no data log yet: buffered reads"
    else:
        info = probe_direct(cfg.backing)
        if cfg.io_mode == "direct" and not info.supported:
            raise MountError(f"O_DIRECT is not available on {cfg.backing}: {info.reason}")
        facts["direct"] = info.supported
        facts["align"] = max(info.offset_align, info.mem_align, 4096) if info.supported else 4096
        facts["io_reason"] = info.reason
    if cfg.local_dir:
        _prepare_tier(cfg, facts)
    return facts


def _prepare_tier(cfg: MountConfig, facts: dict) -> None:
    """The node tier's checks: its directory, its size, its I/O. The flusher writes there, the
    drain into the backing directory at the same offsets: segments are aligned for both."""
    local = cfg.local_dir
    if not os.path.isdir(local):
        raise MountError(f"local directory {local} does not exist or is not a directory")
    if not os.access(local, os.W_OK | os.X_OK):
        raise MountError(f"local directory {local} is not writable")
    rl, rb = os.path.realpath(local), os.path.realpath(cfg.backing)
    rm = os.path.realpath(cfg.mountpoint)
    for a, b in ((rl, rb), (rb, rl), (rl, rm)):
        if a == b or a.startswith(b + os.sep):
            raise MountError("the local directory, the backing directory and the mount point "
                             "must not be one inside another")
    size = cfg.local_bytes or tier.local_size_default(local)
    least = 8 * cfg.segment_bytes * cfg.data_logs
    if size < least:
        raise MountError(f"--local-size {options.format_size(size)} is too small for the node "
                         f"tier: at least {options.format_size(least)} (8 segments per data log)")
    facts["local_bytes"] = size
    # a data log is at most a quarter of the tier per log written at once: drained logs
    # can then always be removed to make room (the open ones stay)
    facts["log_bytes"] = max(cfg.segment_bytes + records.DATA_HEADER_BYTES,
                             min(cfg.log_bytes, size // (4 * cfg.data_logs)) // 4096 * 4096)
    facts["backing_direct"] = facts["direct"]
    if cfg.io_mode == "buffered":
        return
    info = probe_direct(local)
    if cfg.io_mode == "direct" and not info.supported:
        raise MountError(f"O_DIRECT is not available on {local}: {info.reason}")
    facts["direct"] = info.supported
    if info.supported:
        facts["align"] = max(facts["align"], info.offset_align, info.mem_align)


def open_writer(cfg: MountConfig) -> "WriterDir | None":
    """After prepare(): initialise the backing directory if new and take this writer's lock
    (None for a read-only mount)."""
    if cfg.readonly:
        return None
    backingdir.check_backing(cfg.backing, create=True)
    wd = WriterDir(cfg.backing, cfg.writer_id)
    wd.open()
    return wd


def open_tier(cfg: MountConfig, wd: WriterDir) -> tuple[WriterDir, int]:
    """After open_writer(): the node tier's writer directory, locked, and how much of its index
    the backing directory holds (tier.reconcile)."""
    local = tier.open_local(cfg.local_dir, cfg.backing, cfg.writer_id)
    try:
        return local, tier.reconcile(local.dir, wd.dir)
    except BaseException:
        local.close()
        raise


def serve(cfg: MountConfig, ready=None, prepared=None) -> int:
    """Mount and serve until unmounted. `ready(msg)` is called once the mount is live (or with
    an error string starting with 'error:'). `prepared`: (facts, writer dir) when the caller
    already ran prepare() and open_writer(). Returns the exit status."""
    if prepared is None:
        try:
            facts = prepare(cfg)
            wd = open_writer(cfg)
        except (MountError, ValueError, FormatError, OSError) as exc:
            if ready:
                ready(f"error: {exc}")
            raise
    else:
        facts, wd = prepared
    if wd is not None and not facts["direct"]:
        log.info("buffered I/O on %s: %s", cfg.backing, facts["io_reason"])
    local = None
    if wd is not None and cfg.local_dir:
        try:
            local, facts["drained_index"] = open_tier(cfg, wd)
        except (FormatError, OSError) as exc:
            wd.close()
            if ready:
                ready(f"error: {exc}")
            raise MountError(str(exc)) from None
    try:
        return trio.run(_serve, cfg, wd, facts, ready, local)
    finally:
        if local is not None:
            local.close()
        if wd is not None:
            wd.close()


async def _serve(cfg: MountConfig, wd: WriterDir | None, facts: dict, ready,
                 local: WriterDir | None = None) -> int:
    # the live bytes of the own data logs: every own extent map reports what it lets go of
    space = cleaner.LogSpace(facts["align"]) if wd is not None else None
    # what the tree's changes and the flusher's errors are told to: the queue threads listen
    # while they run (fuse/queues.py)
    change_notices = ChangeNotices()
    flush_errors = ErrorNotices()

    # The tree's changes go into the journal, which is made once the replay of the tree says
    # where it goes on from (the replay applies records without journaling them)
    def journal_add(rec) -> None:
        journal.add(rec)

    # the writers of the backing directory, as layers of the tree (its XEXTENT records name
    # them by id)
    union = Union()
    ns = Namespace(journal_hook=journal_add, uid=os.getuid(), gid=os.getgid(),
                   on_dead=space.dead if space is not None else None, notices=change_notices,
                   layer_of=union.layer_of)
    t0 = time.perf_counter()
    seg_bytes = cfg.segment_bytes if wd else 64 * 1024
    staging_bytes = cfg.staging_bytes if wd else 2 * seg_bytes
    # (layers for every writer before the own index is replayed: it may name their logs)
    peers = Peers(ns, union, cfg.backing, cfg.writer_id if wd else None)
    view = peers.view
    peers.assign()
    gc.disable()  # (until the trees are built: replay.bulk_load)
    index, next_log = None, 1
    # the writer's own directory: the node tier's when there is one (the backing directory
    # then gets a copy of it: datapath/tier.py)
    own = local or wd
    mirror = wd if local is not None else None
    last_seq, valid = 0, 0
    if wd is not None:
        index_path = os.path.join(own.path, backingdir.INDEX_NAME)
        if os.path.exists(index_path):
            last_seq, valid, union.warnings = replay(ns, index_path)
        union.warnings += validate_extents(ns, own.path, also=mirror.path if mirror else None)
    # The own COMMIT stamps follow this writer's last one and every stamp seen (a hybrid
    # logical clock: journal.py); the view notes the stamps of the own inodes' commits
    journal = Journal(last_seq, stamp_hook=view.stamped,
                      last_stamp=max((x.commit_ns for x in ns.inodes.values() if x.layer == 0),
                                     default=0))
    if wd is not None:
        if local is not None and facts["drained_index"] < valid:  # (their level: node)
            scan, _ = records.read_index_tail(
                index_path, max(facts["drained_index"], records.INDEX_HEADER.size))
            journal.touch((r for g in scan.groups for r in g), last_seq)
        damaged = [w for w in union.warnings if getattr(w, "kind", None)
                   in (records.GROUP_SKIPPED, records.INDEX_ENDED)]
        if damaged:  # (kept before anything is cut or rewritten: fsck reads it)
            kept = keep_damaged(own.dir, backingdir.INDEX_NAME)
            log.warning("the index is damaged (%d places); a copy is kept as %s: `ckptfs fsck "
                        "%s` recovers what the data logs hold", len(damaged), kept, cfg.backing)
        index = IndexWriter(own.dir, backingdir.INDEX_NAME, valid)
        discard_fresh(own.dir, backingdir.INDEX_NAME)  # (a crash left it unfinished: index.py)
        # (never a number used before: the index names logs whose files are gone)
        next_log = max(max(backingdir.data_logs(own.path), default=0),
                       max(backingdir.data_logs(wd.path), default=0), ns.last_log) + 1
        union.writer_dirs[0] = own.path
        union.writer_ids[0] = cfg.writer_id
    peers.load()
    union.conflicts = view.conflict_list()
    journal.saw(peers.max_stamp)
    if wd is not None:
        view.adopt_pending()  # other writers removed own entries while this one was away
    for w in union.warnings:
        log.warning("%s", w)
    for c in union.conflicts:
        log.info("conflict at %s: %s wins", c.path, c.versions[0][0])
    # What the replay built lives as long as the mount: out of the cyclic collector's sight
    # from now on, so that its collections do not walk the whole tree (tens of ms per
    # 100,000 files each time, on the trio thread).
    gc.freeze()
    gc.enable()
    ninodes, nbytes = ns.totals()
    replay_s = time.perf_counter() - t0
    log.info("replayed %d writers: %d inodes, %d bytes in files, %d warnings, %d conflicts, "
             "%.3f s", len(union.writer_dirs), ninodes, nbytes, len(union.warnings),
             len(union.conflicts), replay_s)

    flusher: Flusher | None = None
    # (the flusher has the pool faulted in once the mount serves: a mount does not wait for
    # hundreds of ms of the kernel's page faults, on a VM whose memory is backed lazily)
    staging = Staging(seg_bytes, staging_bytes, lambda seg: flusher.seal_hook(seg))

    # A defect in the read cache's loader threads or the node tier's drain fails the mount:
    # the flusher holds that state, and is made after them (it takes the tier)
    def fail(exc: BaseException, where: str) -> None:
        flusher.fail(exc, where)

    # requests whose caller is being killed, answered early (the fast path, the barriers, the
    # reader's disk waits)
    interrupts = Interrupts()
    # (buffers on first use: performance-notes.md; readahead and checks ahead in the loader
    # threads)
    cache = ReadCache(RunReader(union.writer_dirs, direct=facts["direct"],
                                fallback={0: mirror.path} if mirror else None),
                      cfg.read_cache_bytes, background=True, on_fatal=fail)
    reader = Reader(cache, cfg.prefetch_bytes, interruptible=interrupts.waiting,
                    in_memory=staging.in_memory)
    node_tier = None
    if mirror is not None:
        node_tier = tier.Tier(local, mirror.dir, drained_index=facts["drained_index"],
                              limit_bytes=facts["local_bytes"],
                              open_log_bytes=facts["log_bytes"] * cfg.data_logs,
                              engine=cfg.engine,
                              depth=cfg.queue_depth, direct=facts["backing_direct"],
                              io_chunk_bytes=cfg.io_chunk_bytes, local_direct=facts["direct"],
                              on_fatal=fail, open_logs=lambda: flusher.open_logs(),
                              cache=cache)
    flusher = Flusher(own.dir if wd else None, cfg.writer_id, staging, journal,
                      engine=cfg.engine, depth=cfg.queue_depth, direct=facts["direct"],
                      align=facts["align"], log_bytes=facts.get("log_bytes", cfg.log_bytes),
                      next_log=next_log, index=index,
                      io_chunk_bytes=cfg.io_chunk_bytes, data_logs=cfg.data_logs,
                      stripe_bytes=cfg.stripe_bytes, fixed_buffers=cfg.populate,
                      flush_errors=flush_errors, tier=node_tier, durability=cfg.durability,
                      written_hook=lambda seg: cache.invalidate(
                          0, seg.log, seg.loff, round_up(seg.used, facts["align"])),
                      durable_hook=space.durable if space is not None else None)
    replayed = list(ns.inodes.values())  # (their runs noted once the mount serves)
    maintainer = None
    if space is not None:
        space.count(ns, {**backingdir.data_logs(wd.path), **backingdir.data_logs(own.path)})
        maintainer = Maintainer(
            ns, journal, flusher, cache, staging, space, own.dir, cfg, tier=node_tier,
            mirror=mirror.dir if mirror is not None else None,
            others_use=lambda: cleaner.logs_named_by_others(peers, space.live),
            shared=lambda: len(union.writer_dirs) > 1,  # (a writer may join later)
            settled=lambda: peers.whiteouts.settled(ns.xunlinks))
    info = {"writer": cfg.writer_id if wd else "", "readonly": wd is None,
            "mountpoint": os.path.realpath(cfg.mountpoint),  # (as the mount table spells it)
            "io_mode": "direct" if facts["direct"] else "buffered",
            "queue_depth": cfg.queue_depth, "segment_bytes": cfg.segment_bytes,
            "writers": len(union.writer_dirs), "replay_warnings": len(union.warnings),
            "replay_seconds": round(replay_s, 3), "conflicts": len(union.conflicts),
            "guest_halt_poll_ns": system.guest_halt_poll_ns()}
    if info["guest_halt_poll_ns"] == 0:
        # Every FUSE request is a round trip in which the application's CPU idles; on such a
        # guest each wake-up goes through the hypervisor (docs/tuning.md, "On a VM").
        log.info("this VM's idle CPUs halt without polling (cpuidle haltpoll, "
                 "guest_halt_poll_ns 0): each FUSE round trip pays a wake-up through the "
                 "hypervisor; docs/tuning.md says what polling is worth here")
    # The background looks go on while files or directories are open: the handle table is
    # the handlers', which are made after the refresher (they take it)
    def in_use() -> bool:
        return bool(ops.handles.by_fh)

    # (the fast path writes the kernel's invalidations itself once it has /dev/fuse)
    invalidations = Invalidations()
    refresher = Refresher(peers, journal, cache, change_notices, cfg.backing, cfg.refresh_s,
                          in_use=in_use, invalidations=invalidations)
    # the wait for the next request in pyfuse3's place, installed once the session is open
    wait_hook = loop.WaitHook()
    ops = CkptOperations(ns, staging, journal, flusher, reader,
                         Settings.of(cfg, info, readonly=wd is None), interrupts=interrupts,
                         wait_hook=wait_hook, view=view, refresher=refresher,
                         maintainer=maintainer)
    if wd is not None:
        flusher.start()
        if node_tier is not None:
            node_tier.start(journal.committed_seq)
            log.info("node tier in %s (%s), durability %s", cfg.local_dir,
                     format_size(facts["local_bytes"]), cfg.durability)
        log.info("io engine %s, %s I/O, queue depth %d, %d x %d MiB segments",
                 flusher.engine_name, info["io_mode"], cfg.queue_depth,
                 len(staging.buffers), cfg.segment_bytes // MiB)

    real_mountpoint = os.path.realpath(cfg.mountpoint)
    options = set(pyfuse3.default_options)
    options |= {"fsname=" + fsname(cfg.backing), "subtype=ckptfs"}
    if cfg.allow_other:
        options.add("allow_other")
    if cfg.debug:
        options.add("debug")
    if wd is None:
        options.add("ro")
    status = 0
    fds_before = loop.fuse_fds()
    try:
        pyfuse3.init(ops, cfg.mountpoint, options)
    except Exception as exc:
        await flusher.stop()
        if node_tier is not None:
            await node_tier.stop()
        msg = f"error: cannot mount {cfg.mountpoint}: {exc}"
        if ready:
            ready(msg)
        raise MountError(msg[7:]) from None
    # A cheaper wait for the next request than pyfuse3's (loop.py); CKPTFS_PYFUSE3_WAIT=1
    # keeps pyfuse3's own, for comparison.
    if os.environ.get("CKPTFS_PYFUSE3_WAIT") != "1":
        attach = (lambda fd, spin_s: FastPath.attach(
            fd, ops, spin_s, interrupts, change_notices, flush_errors, invalidations,
            cfg.fuse_uring, cfg.queue_threads is not False)) \
            if cfg.fast_path else (lambda fd, spin_s: loop.RequestWait(
                fd, spin_s, idle_work=staging.checksums))
        wait_hook.install(cfg.request_spin_us / 1e6, fds_before, attach)
    request_wait = wait_hook.wait
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(idle_sealer, ops, cfg.idle_flush_s)
            nursery.start_soon(refresher.run)
            if maintainer is not None:
                nursery.start_soon(maintainer.run)
            if node_tier is not None:
                nursery.start_soon(node_tier.run)
            nursery.start_soon(cache.note_replayed, replayed)
            if flusher.fault_in.enabled:
                nursery.start_soon(flusher.fault_in.when_due, lambda: ops.handles.read_requests)
            del replayed
            if cfg.prometheus_file:
                nursery.start_soon(stats_exporter, ops, cfg.prometheus_file, 5.0)
            nursery.start_soon(_signals, nursery, request_wait)
            nursery.start_soon(_tune_later, real_mountpoint, cfg.readahead_kb)
            # (bound before "ready": a client may ask at once)
            status_sock, held = open_status_socket(real_mountpoint)
            if status_sock is not None or held is not None:
                nursery.start_soon(status_service, ops, real_mountpoint, status_sock, held)
            if ready:
                ready(f"ready: {cfg.backing} mounted at {cfg.mountpoint} (pid {os.getpid()})")
            if request_wait is not None:
                await pyfuse3.main(max_tasks=loop.MAX_TASKS)
            else:
                await pyfuse3.main()
            nursery.cancel_scope.cancel()
    finally:
        _hold_signals()  # (also where the loop ended before _signals ran)
        if request_wait is not None:
            try:
                request_wait.quiesce()  # (what it held back goes into the last commit)
            except Exception:  # (the last commit still comes)
                log.exception("unmount: holding back requests' work")
        ops.handles.release_all()  # (handles whose RELEASE the unmount cut off)
        try:
            with trio.CancelScope(shield=True):
                try:
                    await flusher.stop()
                finally:
                    if node_tier is not None:
                        await node_tier.stop()
                log.info("unmounted: all data and index records durable (%d bytes, %d segments)",
                         flusher.stats.payload_bytes, flusher.stats.segments)
        except OSError as exc:
            log.error("unmount: NOT everything could be made durable: %s", exc)
            status = 1
        if request_wait is not None:
            request_wait.detach()  # libfuse's own /dev/fuse descriptor back, to unmount
        pyfuse3.close(unmount=True)
        wait_hook.uninstall()
        cache.close()
        staging.close()
        if index is not None:
            index.close()
        _hold_signals(done=True)
    return status


def fsname(backing: str) -> str:
    """The mount's source, as `mount`, `df` and /proc/self/mountinfo show it: the backing
    directory (what is mounted, as sshfs shows HOST:PATH). Escaped for libfuse's option
    syntax: a comma would end the option, and pyfuse3 passes options as ASCII, so those and
    every byte outside printable ASCII go as libfuse's octal escapes (\\ooo). A path that is not
    UTF-8 shows as "ckptfs": mount table readers (api.mounts) decode it as UTF-8."""
    path = os.fsencode(os.path.abspath(backing))
    try:
        path.decode()
    except UnicodeDecodeError:
        return "ckptfs"
    return "".join(chr(b) if 0x20 <= b < 0x7F and b not in b",\\" else "\\%03o" % b
                   for b in path)


STATUS_BIND_RETRY_S = 5.0  # a status socket's name held by another process: tried this often


def open_status_socket(mountpoint: str) -> tuple[socket.socket | None, str | None]:
    """The listening socket of serve_status: an abstract unix socket named after the mount's
    device (api.status_socket_name; no file to clean up, it goes with the process). Without
    one, the device ('major:minor') when another process holds the name (worth trying again
    later), else None."""
    dev = mount_device(mountpoint)
    if dev is None:
        return None, None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(status_socket_name(dev))
        sock.listen(8)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None, dev
        log.info("status socket for %s: %s (status through the mount only)", dev,
                 exc.strerror or exc)
        return None, None
    return sock, None


async def status_service(ops, mountpoint: str, sock: socket.socket | None,
                         held: str | None) -> None:
    """serve_status on `sock`; or, where another process holds the name (`held`: the daemon
    of a detached mount that had this device number, still ending or hung), the name tried
    again every STATUS_BIND_RETRY_S, status going through the mount meanwhile."""
    if sock is None:
        log.warning("status socket for %s is held by another process (a daemon of a detached "
                    "mount?): status through the mount until it is free", held)
        while sock is None:
            await trio.sleep(STATUS_BIND_RETRY_S)
            sock, held = await trio.to_thread.run_sync(open_status_socket, mountpoint)
            if held is None and sock is None:
                return
        log.info("status socket for %s: bound", mountpoint)
    await serve_status(ops, sock)


async def serve_status(ops, listener: socket.socket) -> None:
    """`ckptfs status` without the mount: the daemon's figures over its status socket.
    Through the mount (the status xattr) they need a free request task, and when the backing
    store hangs all of them can be waiting for it (docs/reliability.md) - which is when an
    operator asks. Served on the trio thread, one client at a time, to those who may read
    the status xattr (Control.controllers, checked with SO_PEERCRED)."""
    with trio.socket.from_stdlib_socket(listener) as sock:
        while True:
            conn, _ = await sock.accept()
            with conn, trio.move_on_after(5):
                try:
                    cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                    uid = int.from_bytes(cred[4:8], sys.byteorder)  # struct ucred
                    if uid not in ops.control.controllers():
                        continue
                    data = memoryview(json.dumps(metrics.status(ops)).encode() + b"\n")
                    while data:
                        data = data[await conn.send(data):]
                except OSError:
                    pass
                except Exception:
                    log.exception("internal error serving the status socket")


def mount_device(mountpoint: str) -> str | None:
    """'major:minor' of the file system mounted at `mountpoint` (a path resolved BEFORE the
    mount: resolving it now would send a FUSE request to ourselves and deadlock)."""
    try:
        e = mount_at(mountpoint)
    except OSError:
        return None
    return e.dev if e is not None else None


def tune_readahead(mountpoint: str, readahead_kb: int) -> None:
    """Larger kernel readahead on the mount: sequential readers (torch.load) then arrive as
    1 MiB READs instead of 128 KiB ones (8x fewer requests). Needs root; skipped otherwise."""
    dev = mount_device(mountpoint)
    if dev is None or readahead_kb <= 0:
        return
    path = f"/sys/class/bdi/{dev}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(f"{readahead_kb}\n")
        log.info("readahead of %s set to %d KiB", mountpoint, readahead_kb)
    except OSError as exc:
        log.info("readahead of %s left at the default (%s)", mountpoint, exc.strerror)


async def _tune_later(mountpoint: str, readahead_kb: int) -> None:
    # The kernel sets the mount's readahead when it processes the FUSE INIT reply, which
    # happens once pyfuse3.main() runs: tune after that, or the kernel overwrites it.
    await trio.sleep(0.2)
    tune_readahead(mountpoint, readahead_kb)


def _hold_signals(done: bool = False) -> None:
    """Once the request loop has ended, the daemon only drains and commits: a further
    SIGTERM/SIGINT/SIGHUP (a supervisor's retry, a second Ctrl-C) is noted, not obeyed, so
    that it cannot cut off what close() already acknowledged (the default action would end
    the process; SIGKILL still does). `done`: the daemon is about to exit; ignored from now
    on (Python puts its default back for a handler of its own as the interpreter ends, and
    a signal then would make a clean exit look killed)."""
    def noted(sig, _frame) -> None:
        log.warning("signal %d: already unmounting (making everything durable first)", sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        try:
            signal.signal(sig, signal.SIG_IGN if done else noted)
        except (ValueError, OSError):  # (not the main thread)
            pass


async def _signals(nursery, request_wait: "loop.RequestWait | None") -> None:
    # SIGTERM/SIGINT: unmount cleanly (drain and commit), like `ckptfs umount`. The receiver
    # puts back the handlers it found when it closes (after the first signal, or when the
    # loop ends): those of _hold_signals, so that no signal finds the default action before
    # the daemon's end.
    _hold_signals()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
        async for sig in sigs:
            log.info("signal %d: unmounting", sig)
            if request_wait is not None:
                request_wait.close()
            pyfuse3.terminate()
            return

