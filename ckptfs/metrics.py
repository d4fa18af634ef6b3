"""The status figures: what they are (status), and as Prometheus text (--prometheus FILE, for
node_exporter's textfile collector): each figure's name, type and help in METRICS, the file
written by stats_exporter on the trio thread every few seconds."""

from __future__ import annotations

import logging
import os
import time

import trio

from ckptfs.datapath.readcache import CHUNK_BYTES
from ckptfs.fuse import loop

log = logging.getLogger("ckptfs.metrics")


def _label(value) -> str:
    """A label value as the text format writes it: backslash, double quote, newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(st: dict) -> str:
    """The status figures in the Prometheus text exposition format (node_exporter's textfile
    collector picks the file up): each figure under its METRICS name, type and help text,
    labelled with the mount point and writer; `ckptfs_info` carries the settings that are
    words, as labels. A figure METRICS does not know yet goes out untyped under its key."""
    labels = f'mountpoint="{_label(st["mountpoint"])}",writer="{_label(st["writer"])}"'
    info = "".join(f',{k}="{_label(str(st[k]).lower() if isinstance(st[k], bool) else st[k])}"'
                   for k in INFO_LABELS if k in st)
    lines = ["# HELP ckptfs_info The mount's settings and daemon, as labels (value 1)",
             "# TYPE ckptfs_info gauge", f"ckptfs_info{{{labels}{info}}} 1"]
    for key, value in st.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or key in NOT_METRICS:
            continue
        name, kind, text, *scale = METRICS.get(key, (key, "untyped", f"status figure {key}"))
        lines += [f"# HELP ckptfs_{name} {text}", f"# TYPE ckptfs_{name} {kind}",
                  f"ckptfs_{name}{{{labels}}} {value * scale[0] if scale else value}"]
    return "\n".join(lines) + "\n"


def _live_union(ops) -> dict:
    """The writers and conflicts of the view as they are now, and what reading the other
    writers' changes has cost."""
    view = ops.view
    out = {"writers": len(view.trees) + (0 if ops.settings.readonly else 1),
           "conflicts": len(view.conflicts)}
    if ops.refresher is not None:
        out.update(ops.refresher.counts())
    return out

def status(ops) -> dict:
    """Every figure of a mount, from its parts (fuse/ops.CkptOperations and what it holds):
    what `ckptfs status`, /.ckptfs/stats.json and the Prometheus file show; METRICS below
    names and types each."""
    if ops.request_wait is not None:  # (what the queue threads answered on their own, in)
        ops.request_wait.settle()
    st = ops.flusher.stats
    ninodes, user_bytes = ops.ns.totals()
    return {
        "pid": os.getpid(),
        "backing": ops.settings.backing,
        **ops.settings.info,
        **(_live_union(ops) if ops.view is not None else {}),
        "engine": ops.flusher.engine_name,
        "uptime_s": round(time.time() - ops.started, 3),
        "bytes_written": ops.handles.bytes_written,
        "write_requests": ops.handles.write_requests,
        "read_requests": ops.handles.read_requests,
        "bytes_read": ops.handles.bytes_read,
        "bytes_staged": ops.staging.staged_segments() * ops.staging.segment_bytes,
        "staging_bytes": ops.staging.capacity_bytes,
        "staging_kept_bytes": ops.staging.kept_bytes(),
        "staging_fixed_buffers": ops.flusher.fault_in.fixed_count,
        "staging_faulted_bytes": ops.flusher.fault_in.faulted_bytes,
        "segments_flushed": st.segments,
        "bytes_durable": st.payload_bytes,
        "log_bytes_written": st.bytes_written,
        # (to the microsecond: a step of a few small files flushes in well under a ms)
        "flush_seconds": round(st.flush_seconds, 6),
        "flush_gbps": round(st.bytes_written / st.flush_seconds / 1e9, 3)
        if st.flush_seconds else 0.0,
        "index_bytes": st.index_bytes,
        "index_commits": st.index_commits,
        "data_syncs": st.data_syncs,
        "segments_in_flight": ops.flusher.inflight_segments,
        "writers_waiting": ops.staging.waiting_writers,
        "uncommitted_changes": len(ops.journal.entries),
        "fsyncs": ops.fsyncs,
        "interrupt_notices": ops.interrupts.notices,
        "errors": st.errors,
        "last_error": st.last_error,
        "current_error": str(ops.flusher.error) if ops.flusher.error else "",
        "failed": 1 if ops.flusher.failed is not None else 0,
        "inodes": ninodes,
        "open_handles": len(ops.handles.by_fh),
        "listing_entries": ops.listings.entries,
        "file_bytes": user_bytes,
        "read_disk_bytes": ops.reader.cache.disk_bytes,
        "read_memory_bytes": ops.reader.memory_bytes,
        "read_cache_bytes": ops.reader.cache.cached,
        "read_cache_allocated_bytes": ops.reader.cache.allocated * CHUNK_BYTES,
        "read_chunks_recycled": ops.reader.cache.recycled,
        "read_runs_verified_ahead": ops.reader.cache.verified_ahead,
        "read_loads_in_flight": len(ops.reader.cache.loading),
        "read_plans": ops.dcp.read_plans,
        "read_plan_chunk_loads": ops.reader.plan_loads,
        "read_plan_misses": ops.reader.plan_misses,
        "read_load_seconds": round(ops.reader.cache.load_seconds, 3),
        "read_wait_seconds": round(ops.reader.wait_seconds, 3),
        "direct_reads": ops.handles.negotiated.direct_reads,
        "shared_mmap_of_direct_files": ops.handles.negotiated.shared_mmap_direct,
        **(ops.request_wait.counts() if ops.request_wait else loop.NO_COUNTS),
        **(ops.maintainer.status() if ops.maintainer is not None else {}),
        **ops.flusher.tier_status(),
    }


# status key -> (metric name without the ckptfs_ prefix, type, help[, factor to the base
# unit]). The exposition format's conventions: base units (bytes, seconds) in the name,
# counters (figures that only grow while the daemon runs) end in _total. docs/operations.md
# lists them.
METRICS = {
    "uptime_s": ("uptime_seconds", "gauge", "Seconds since the daemon started"),
    "queue_depth": ("queue_depth", "gauge", "Writes in flight at most (--queue-depth)"),
    "segment_bytes": ("segment_size_bytes", "gauge", "Size of a staging segment"),
    "guest_halt_poll_ns": ("guest_halt_poll_seconds", "gauge",
                           "How long an idle vCPU of this KVM guest polls before it halts "
                           "(cpuidle haltpoll; absent elsewhere)", 1e-9),
    "writers": ("writers", "gauge", "Writers whose trees the mount shows"),
    "replay_warnings": ("replay_warnings", "gauge", "Problems replay reported at mount time"),
    "replay_seconds": ("replay_seconds", "gauge",
                       "Seconds the mount took to build the tree from the writers' indexes"),
    "conflicts": ("conflicts", "gauge", "Paths that several writers hold (the newest shows)"),
    "bytes_written": ("written_bytes_total", "counter", "Bytes written into files"),
    "write_requests": ("write_requests_total", "counter", "WRITE requests"),
    "read_requests": ("read_requests_total", "counter", "READ requests"),
    "bytes_read": ("read_bytes_total", "counter",
                   "Bytes served to READ requests (a re-read counts again)"),
    "bytes_staged": ("staged_bytes", "gauge", "Staging memory holding data not yet durable"),
    "staging_bytes": ("staging_capacity_bytes", "gauge", "Staging memory (--staging-size)"),
    "staging_kept_bytes": ("staging_kept_bytes", "gauge",
                           "File bytes of written segments still in staging memory (read "
                           "from there until their buffers are reused)"),
    "staging_fixed_buffers": ("staging_fixed_buffers", "gauge",
                              "Staging segments faulted in and registered with io_uring"),
    "staging_faulted_bytes": ("staging_faulted_bytes", "gauge",
                              "Staging memory faulted in since the mount (--no-populate: 0)"),
    "segments_flushed": ("segments_flushed_total", "counter", "Segments written to data logs"),
    "bytes_durable": ("durable_bytes_total", "counter",
                      "File bytes made durable (their data log synced)"),
    "log_bytes_written": ("data_log_written_bytes_total", "counter",
                          "Bytes written to data logs, alignment padding included"),
    "flush_seconds": ("flush_seconds_total", "counter", "Time the flusher spent writing"),
    "index_bytes": ("index_written_bytes_total", "counter", "Bytes appended to the index"),
    "index_commits": ("index_commits_total", "counter", "Commit groups appended to the index"),
    "data_syncs": ("data_syncs_total", "counter", "fdatasync calls on data logs"),
    "segments_in_flight": ("segments_in_flight", "gauge", "Sealed segments not yet durable"),
    "writers_waiting": ("writers_waiting", "gauge", "Writes waiting for staging memory"),
    "uncommitted_changes": ("uncommitted_changes", "gauge",
                            "Changes not yet in the index (journal entries)"),
    "fsyncs": ("fsyncs_total", "counter", "fsync and fsyncdir requests"),
    "errors": ("flush_errors_total", "counter",
               "Writes the backing store refused (ENOSPC, EIO, ...); retried"),
    "failed": ("failed", "gauge",
               "1 once a thread of the daemon failed: fsync, sync and the unmount fail with "
               "EIO from then on (last_error says why)"),
    "inodes": ("inodes", "gauge", "Inodes in the tree"),
    "open_handles": ("open_handles", "gauge", "Files and directories open on the mount"),
    "listing_entries": ("listing_entries", "gauge",
                        "Directory entries the listings of open directory handles hold"),
    "file_bytes": ("file_bytes", "gauge", "Sum of the sizes of the files in the tree"),
    "read_disk_bytes": ("read_disk_bytes_total", "counter", "Bytes read from data logs"),
    "read_memory_bytes": ("read_memory_bytes_total", "counter",
                          "Bytes served to READs from staging memory (not read from disk)"),
    "read_cache_bytes": ("read_cache_bytes", "gauge", "Data log bytes in the read cache"),
    "read_cache_allocated_bytes": ("read_cache_allocated_bytes", "gauge",
                                   "Memory allocated to the read cache"),
    "read_chunks_recycled": ("read_chunks_recycled_total", "counter",
                             "Read cache chunks reused once all their bytes were served"),
    "read_runs_verified_ahead": ("read_runs_verified_ahead_total", "counter",
                                 "Run checksums checked by readahead, off the request path"),
    "read_loads_in_flight": ("read_loads_in_flight", "gauge",
                             "Read cache chunk loads not completed yet (asked for by READs, "
                             "readahead or read plans)"),
    "read_plans": ("read_plans_total", "counter",
                   "Files opened for reading with a read plan (a DCP checkpoint's order)"),
    "read_plan_chunk_loads": ("read_plan_chunk_loads_total", "counter",
                              "Read cache chunks loaded ahead by read plans"),
    "read_plan_misses": ("read_plan_misses_total", "counter",
                         "Chunk loads a READ under a read plan started itself (not foreseen)"),
    "read_load_seconds": ("read_load_seconds_total", "counter",
                          "Time spent reading data logs (the reader's loader threads)"),
    "read_wait_seconds": ("read_wait_seconds_total", "counter",
                          "Time READ requests waited for the disk"),
    "requests_found_queued": ("requests_found_queued_total", "counter",
                              "Requests taken without a sleep: queued when the request "
                              "loop asked, or caught by its spin"),
    "requests_waited_for": ("requests_waited_for_total", "counter",
                            "Requests the request loop slept in epoll for"),
    "requests_caught_spinning": ("requests_caught_spinning_total", "counter",
                                 "Requests that came while the loop polled (--request-spin)"),
    "requests_caught_summing": ("requests_caught_summing_total", "counter",
                                "Requests that came while the loop summed owed checksums"),
    "checksum_bytes_summed_idle": ("checksum_idle_bytes_total", "counter",
                                   "Bytes whose CRC32C the request loop took while no request "
                                   "waited"),
    "checksum_bytes_summed_landing": ("checksum_landing_bytes_total", "counter",
                                      "Bytes the queue threads landed whose CRC32C was taken "
                                      "in C before they were recorded"),
    "writes_in_place": ("writes_in_place_total", "counter",
                        "WRITE requests read straight into staging segments"),
    "bytes_in_place": ("in_place_bytes_total", "counter",
                       "WRITE payload bytes read straight into staging segments"),
    "bytes_copied_in": ("copied_in_bytes_total", "counter",
                        "WRITE payload bytes copied into staging segments"),
    "reads_direct": ("reads_direct_total", "counter", "READ requests answered by the fast path"),
    "requests_forwarded": ("requests_forwarded_total", "counter",
                           "Requests the fast path handed to pyfuse3"),
    "requests_answered_here": ("requests_answered_here_total", "counter",
                               "Requests the fast path answered itself"),
    "interrupt_notices": ("interrupt_notices_total", "counter",
                          "FUSE_INTERRUPTs received: a caller waiting in a request got a "
                          "signal (answered early only if it is being killed)"),
    "requests_interrupted": ("requests_interrupted_total", "counter",
                             "Requests answered early because their caller was being killed"),
    "ring_queues": ("ring_queues", "gauge",
                    "Queue threads, one per CPU (on /dev/fuse 8 at most; absent with "
                    "--no-queue-threads)"),
    "ring_depth": ("ring_queue_entries", "gauge", "Entries of each queue thread"),
    "ring_queues_pinned": ("ring_queues_pinned", "gauge",
                           "Queue threads running on their own CPU"),
    "ring_requests": ("ring_requests_total", "counter",
                      "Requests the queue threads took"),
    "ring_answered_in_c": ("ring_answered_in_c_total", "counter",
                           "Requests the queue threads answered themselves"),
    "ring_attrs_answered_in_c": ("ring_attrs_answered_in_c_total", "counter",
                                 "GETATTRs of directories the queue threads answered "
                                 "from their cache"),
    "ring_absent_answered_in_c": ("ring_absent_answered_in_c_total", "counter",
                                  "LOOKUPs of absent names the queue threads answered "
                                  "from their name filters"),
    "ring_creates_answered_in_c": ("ring_creates_answered_in_c_total", "counter",
                                   "CREATEs the queue threads answered (the daemon makes "
                                   "the files after)"),
    "ring_writes_read_in_place": ("ring_writes_read_in_place_total", "counter",
                                  "WRITEs the queue threads read from /dev/fuse straight "
                                  "into segments"),
    "ring_reads_answered_in_c": ("ring_reads_answered_in_c_total", "counter",
                                 "READs the queue threads answered from the read cache "
                                 "(read windows)"),
    "ring_opens_answered_in_c": ("ring_opens_answered_in_c_total", "counter",
                                 "read-only OPENs the queue threads answered from a read "
                                 "window prepared at the file's LOOKUP"),
    "ring_creates_not_made": ("ring_creates_not_made_total", "counter",
                              "Files the queue threads created that the daemon could "
                              "not make (a defect: their writes fail)"),
    "ring_lookups_answered_in_c": ("ring_lookups_answered_in_c_total", "counter",
                                   "LOOKUPs the queue threads answered from answers the "
                                   "daemon prepared for the names after one looked up"),
    "ring_lookups_prepared": ("ring_lookups_prepared", "gauge",
                              "LOOKUP answers prepared for the queue threads, not used yet"),
    "ring_opens_not_made": ("ring_opens_not_made_total", "counter",
                            "OPENs the queue threads answered whose handle the daemon "
                            "could not make (a defect: their reads fail)"),
    "ring_read_windows": ("ring_read_windows", "gauge",
                          "Handles whose READs the queue threads answer from the read cache, "
                          "prepared ones included"),
    "ring_windows_prepared": ("ring_windows_prepared", "gauge",
                              "Read windows prepared at a LOOKUP, waiting for the file's "
                              "read-only OPEN"),
    "ring_name_filters_built": ("ring_name_filters_built_total", "counter",
                                "Directories whose names the daemon left with the queue "
                                "threads (again after a look at other writers merged into "
                                "them)"),
    "ring_writable_handles": ("ring_writable_handles", "gauge",
                              "Handles whose WRITEs the queue threads answer"),
    "ring_entries_lost": ("ring_entries_lost_total", "counter",
                          "Queue entries whose command the kernel refused (FUSE over "
                          "io_uring)"),
    "data_logs": ("data_logs", "gauge", "Data logs of this writer"),
    "live_bytes": ("data_log_live_bytes", "gauge", "Data log bytes that files still use"),
    "dead_bytes": ("data_log_dead_bytes", "gauge",
                   "Data log bytes no file uses any more that still take up space"),
    "data_logs_dead": ("data_logs_dead", "gauge",
                       "Data logs with no live byte, not yet retired"),
    "data_log_bytes": ("data_log_bytes", "gauge", "Size of this writer's data logs"),
    "data_log_disk_bytes": ("data_log_disk_bytes", "gauge",
                            "Disk space this writer's data logs take"),
    "logs_retired": ("data_logs_retired_total", "counter", "Data logs retired (deleted)"),
    "bytes_reclaimed": ("reclaimed_bytes_total", "counter", "Disk space given back"),
    "index_size_bytes": ("index_size_bytes", "gauge", "Size of the index file"),
    "maintenance_errors": ("maintenance_errors_total", "counter",
                           "Failed space reclamation steps"),
    "bytes_punched": ("punched_bytes_total", "counter",
                      "Dead data log bytes given back by punching holes"),
    "logs_cleaned": ("data_logs_cleaned_total", "counter",
                     "Data logs whose live bytes the cleaner moved out"),
    "cleaner_turns": ("cleaner_turns_total", "counter",
                      "Maintenance ticks that found the writers idle (the cleaner's turn, "
                      "taken or passed)"),
    "bytes_moved": ("cleaner_moved_bytes_total", "counter",
                    "Live bytes the cleaner copied into the current data log"),
    "clean_seconds": ("cleaner_seconds_total", "counter", "Time the cleaner spent moving"),
    "index_fresh_bytes": ("index_fresh_bytes", "gauge",
                          "About the size of a fresh index of the tree (estimate, or the "
                          "last index snapshot's size)"),
    "index_snapshots": ("index_snapshots_total", "counter", "Index snapshots put in place"),
    "index_snapshot_seconds": ("index_snapshot_seconds", "gauge",
                               "Time the last index snapshot took to write"),
    "index_snapshot_peak_rss_bytes": ("index_snapshot_peak_rss_bytes", "gauge",
                                      "Peak memory of the last index snapshot's process"),
    "refresh_s": ("refresh_interval_seconds", "gauge",
                  "How often other writers' indexes are looked at (--refresh)"),
    "refresh_polls": ("refresh_polls_total", "counter",
                      "Looks at the backing directory for other writers' commits"),
    "refresh_listdirs": ("refresh_listdirs_total", "counter", "Directory listings of the looks"),
    "refresh_stats": ("refresh_stats_total", "counter", "Index stats of the looks"),
    "refresh_reads": ("refresh_reads_total", "counter", "Reads of other writers' indexes"),
    "refresh_bytes_read": ("refresh_read_bytes_total", "counter",
                           "Bytes read from other writers' indexes"),
    "refresh_groups": ("refresh_groups_total", "counter",
                       "Commit groups of other writers applied"),
    "refresh_records": ("refresh_records_total", "counter", "Records of other writers applied"),
    "refresh_apply_seconds": ("refresh_apply_seconds_total", "counter",
                              "Time spent applying other writers' commits"),
    "refresh_apply_max_ms": ("refresh_apply_max_seconds", "gauge",
                             "Longest application of one index tail", 1e-3),
    "refresh_notifications": ("refresh_notifications_total", "counter",
                              "Kernel cache invalidations for other writers' changes"),
    "refresh_look_seconds": ("refresh_look_seconds_total", "counter",
                             "Time the looks took (worker thread, the backing store's calls)"),
    "refresh_look_max_ms": ("refresh_look_max_seconds", "gauge", "Longest look", 1e-3),
    "refresh_waits": ("refresh_waits_total", "counter",
                      "Opens, lookups, listings and syncs that waited for a look"),
    "refresh_wait_seconds": ("refresh_wait_seconds_total", "counter",
                             "Time requests waited for looks"),
    "refresh_errors": ("refresh_errors_total", "counter",
                       "Looks (or parts of them) the backing store failed: the view stayed"),
    "refresh_idle_pauses": ("refresh_idle_pauses_total", "counter",
                            "Times the background looks stopped: nothing used the mount for "
                            "a --refresh period (no calls while idle)"),
    "writers_joined": ("writers_joined_total", "counter", "Writers that appeared while mounted"),
    "writers_reread": ("writers_reread_total", "counter",
                       "Other writers' indexes read whole again (replaced by a rewrite)"),
    "writers_unread": ("writers_unread", "gauge",
                       "Other writers whose index could not be read (tried again at every "
                       "look; meanwhile no data log of this writer is given back)"),
    "tier_local_size": ("tier_local_size_bytes", "gauge",
                        "Space the node tier may take (--local-size)"),
    "tier_local_bytes": ("tier_local_bytes", "gauge",
                         "Space the node tier's data logs take (drained ones included)"),
    "tier_node_seq": ("tier_node_sequence", "gauge",
                      "Sequence number of the last change durable in the node tier"),
    "tier_backing_seq": ("tier_backing_sequence", "gauge",
                         "Sequence number of the last change drained to the backing directory"),
    "tier_backlog_bytes": ("tier_backlog_bytes", "gauge",
                           "Data log bytes node-durable but not yet in the backing directory"),
    "tier_backlog_age_s": ("tier_backlog_age_seconds", "gauge",
                           "Age of the oldest change not yet drained (0: none)"),
    "tier_drained_bytes": ("tier_drained_bytes_total", "counter",
                           "Bytes the drain copied to the backing directory"),
    "tier_drain_seconds": ("tier_drain_seconds_total", "counter", "Time the drain spent copying"),
    "tier_drain_rate": ("tier_drain_rate_bytes_per_second", "gauge",
                        "Speed of the last drain cycle of at least 8 MiB"),
    "tier_drain_errors": ("tier_drain_errors_total", "counter",
                          "Drain cycles the backing directory failed (retried)"),
    "tier_evicted_logs": ("tier_evicted_logs_total", "counter",
                          "Drained data logs removed from the node tier to make room"),
    "tier_evicted_bytes": ("tier_evicted_bytes_total", "counter",
                           "Space given back by removing drained data logs"),
}
# words and flags: labels of ckptfs_info
INFO_LABELS = ("pid", "backing", "engine", "io_mode", "readonly", "direct_reads",
               "shared_mmap_of_direct_files", "transport", "durability", "tier_local_dir")
# derived (ckptfs_data_log_written_bytes_total / ckptfs_flush_seconds_total), or in ckptfs_info
NOT_METRICS = {"flush_gbps", "pid"}


async def stats_exporter(ops, path: str, interval_s: float) -> None:
    """Write the status as a Prometheus text file every `interval_s` (atomically)."""
    while True:
        text = prometheus_text(status(ops))
        tmp = f"{path}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("cannot write %s: %s", path, exc)
        await trio.sleep(interval_s)
