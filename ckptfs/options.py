"""The mount options: one table, from which everything else that names them is made.

`ckptfs mount`'s argparse flags (cli.py), `daemon.MountConfig`'s fields and defaults,
`api.Mount(**options)`, the `-o` options of the mount(8) helper (mount_scripts/mount.ckptfs
asks `ckptfs options --mount-helper`) and the options table of docs/operations.md
(`ckptfs options --markdown`; a test keeps the two equal) all come from OPTIONS.

An option's `name` is its flag without the dashes (`staging-size`); `field` the MountConfig
attribute it sets; `default` is in the field's units. Kinds:
  size    a size with a binary unit on the command line ("512M"), bytes in the config
  int, float, str, choice
  flag    an off-by-default switch (`--ro`); `invert`: the field is its negation
  switch  on/off with a `--no-` form (`--fast-path` / `--no-fast-path`); None = automatic
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

MiB = 1 << 20

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40,
          "TIB": 1 << 40}


def parse_size(text: str) -> int:
    """'8M' -> 8 MiB (binary units; 'K', 'M', 'G', 'T', optionally followed by 'B' or 'iB')."""
    t = str(text).strip().upper()
    num = t.rstrip("KMGTIB")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8M, 1G)") from None
    if unit not in _UNITS or value < 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8M, 1G)")
    return int(value * _UNITS[unit])


def format_size(n: int) -> str:
    """The shortest exact spelling of `n` bytes in parse_size's units: 512M, 1G, 4096."""
    for unit, mult in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


@dataclass(frozen=True)
class Option:
    name: str
    field: str
    kind: str
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    invert: bool = False  # flag only: the field is False when the flag is given
    unit: int = 1  # size only: the field holds bytes // unit (readahead: KiB)

    @property
    def dest(self) -> str:
        """The argparse destination and the api.Mount keyword."""
        return self.name.replace("-", "_")

    def shown_default(self) -> str:
        if self.kind == "size":
            return format_size(self.default * self.unit)
        if self.kind in ("flag", "switch"):
            return {True: "on", False: "off", None: "auto"}[
                (not self.default) if self.invert else self.default]
        return str(self.default) if self.default != "" else "-"


OPTIONS: tuple[Option, ...] = (
    Option("writer-id", "writer_id", "str", "",
           "writer identity in the backing directory (default: the host name); distinct "
           "mounts writing the same backing directory need distinct ids"),
    Option("staging-size", "staging_bytes", "size", 512 * MiB,
           "memory for staging segments; writers wait when it is full; what was written "
           "last is read from it until its memory is reused"),
    Option("segment-size", "segment_bytes", "size", 8 * MiB,
           "segment size: the unit of aggregation and of backing writes"),
    Option("checksum-block", "checksum_block_bytes", "size", 2 * MiB,
           "most bytes of a file under one CRC32C: a first read of a place loads and checks "
           "that much (smaller: less read amplification for readers that jump, e.g. DCP; more "
           "index records and daemon memory, ~380 B per block)"),
    Option("queue-depth", "queue_depth", "int", 32, "io_uring queue depth of the flusher"),
    Option("io", "io_mode", "choice", "auto",
           "O_DIRECT (auto: where the backing file system allows it) or buffered",
           choices=("auto", "direct", "buffered")),
    Option("engine", "engine", "choice", "auto",
           "io engine (auto: io_uring when the kernel allows it)",
           choices=("auto", "io_uring", "posix")),
    Option("log-size", "log_bytes", "size", 1 << 30,
           "roll over to a new data log past this size"),
    Option("clean-below", "clean_below", "float", 0.5,
           "the cleaner moves the live bytes out of a data log whose live share fell below "
           "this (cost-benefit order), so the log can be retired; 0: never moves data (logs "
           "with no live byte are retired anyway)"),
    Option("clean-idle", "clean_idle_s", "float", 1.0,
           "seconds without writes before the cleaner and the index snapshot run (a save in "
           "progress has the disk to itself)", metavar="S"),
    Option("index-snapshot-ratio", "index_snapshot_ratio", "float", 2.0,
           "write an index snapshot when the index is this many times the size of a fresh "
           "index of the live tree; 0: never"),
    Option("index-snapshot-min", "index_snapshot_min_bytes", "size", 16 << 10,
           "no index snapshot while the index is smaller than this"),
    Option("data-logs", "data_logs", "int", 1,
           "data logs written at once, segments round robin (parallel file systems: one per "
           "storage target to spread over)"),
    Option("stripe-size", "stripe_bytes", "size", 0,
           "start every segment on a multiple of this (the parallel file system's stripe "
           "size; make --segment-size a multiple of it); 0: 4 KiB"),
    Option("io-chunk", "io_chunk_bytes", "size", 8 * MiB, "largest single write request"),
    Option("read-cache", "read_cache_bytes", "size", 256 * MiB,
           "memory for verified data read back from the logs"),
    Option("prefetch", "prefetch_bytes", "size", 64 * MiB,
           "on the first read of a file, load up to this much of it at once"),
    Option("readahead", "readahead_kb", "size", 4096,
           "kernel readahead of the mount (sequential readers get 1 MiB READs)", unit=1024),
    Option("idle-flush", "idle_flush_s", "float", 1.0,
           "seconds without writes after which a partial segment is flushed"),
    Option("refresh", "refresh_s", "float", 1.0,
           "seconds within which changes other mounts made durable show here: an open, lookup "
           "or listing reads what other writers committed since the last look once it is "
           "older than this (and a background look as often while the mount is in use; "
           "idle, none); 0: at every one; at most 30 (a writer's dead bytes wait 60 s for "
           "the other mounts' views of them)",
           metavar="S"),
    Option("request-spin", "request_spin_us", "int", 250,
           "microseconds the daemon polls for the next request before it sleeps (catches a "
           "busy writer's next request without a wake-up; 0: off)", metavar="US"),
    Option("fast-path", "fast_path", "switch", True,
           "the daemon reads requests itself: WRITE payloads land straight in the staging "
           "segment; READ, WRITE, FLUSH, RELEASE, LOOKUP, GETATTR, OPEN and CREATE skip "
           "pyfuse3 (off: pyfuse3 serves every request)"),
    Option("queue-threads", "queue_threads", "switch", None,
           "C threads, one per CPU (8 at most), read /dev/fuse and answer a small file's "
           "requests and the WRITEs from the caller's CPU, handing the others to the daemon "
           "(fewer wake-ups between CPUs). Automatic: on with the fast path; needs it"),
    Option("fuse-uring", "fuse_uring", "switch", False,
           "requests on FUSE's per-CPU io_uring queues, each served from its caller's CPU "
           "(fewer wake-ups between CPUs; Linux 6.14+ with /sys/module/fuse/parameters/"
           "enable_uring = Y, else /dev/fuse with a warning; needs the fast path)"),
    Option("writeback-cache", "writeback_cache", "switch", False,
           "kernel writeback cache: merges small writes into 1 MiB requests (for workloads "
           "of small writes); turns --direct-writes off"),
    Option("direct-writes", "direct_writes", "switch", True,
           "write-only opens bypass the kernel page cache (FOPEN_DIRECT_IO): one copy less "
           "per byte"),
    Option("direct-reads", "direct_reads", "switch", None,
           "read-only opens of files >= 1 MiB bypass the kernel page cache: faster restores "
           "with torch.load/DCP. Automatic: on where the kernel keeps MAP_SHARED mmap of such "
           "files possible (Linux 6.6+, with the fast path), else off; forced on without that, "
           "MAP_SHARED mmap (safetensors, numpy memmap) of those files fails with ENODEV"),
    Option("local-dir", "local_dir", "str", "",
           "the node tier: a directory on node-local storage where segments are written and "
           "committed first (node-durable), drained to the backing directory in the "
           "background (docs/operations.md, \"The node tier\")", metavar="DIR"),
    Option("local-size", "local_bytes", "size", 0,
           "space the node tier may take in --local-dir; writers wait while it is full of "
           "data not yet drained (0: half the free space there at mount)"),
    Option("durability", "durability", "choice", "backing",
           "what fsync and `ckptfs sync` wait for with the node tier: backing (the backing "
           "directory) or node (the node tier; the drain follows in the background)",
           choices=("backing", "node")),
    Option("allow-other", "allow_other", "flag", False,
           "let other users see the mount (needs user_allow_other for non-root)"),
    Option("prometheus", "prometheus_file", "str", "",
           "write the status figures to FILE every 5 s (Prometheus text format, for "
           "node_exporter's textfile collector)", metavar="FILE"),
    Option("ro", "readonly", "flag", False,
           "read-only mount of the merged tree of all writers (restore)"),
    Option("no-populate", "populate", "flag", True,
           "do not fault the staging memory in once the mount serves (nor register it with "
           "io_uring, which would fault it in)", invert=True),
    Option("debug", "debug", "flag", False, "debug logging (and FUSE debug)"),
    Option("log-file", "log_file", "str", "",
           "daemon log when daemonized (default: BACKING/writers/ID/daemon.log)"),
)

BY_NAME = {o.name: o for o in OPTIONS}
BY_DEST = {o.dest: o for o in OPTIONS}


def config_fields() -> list[tuple[str, type, dataclasses.Field]]:
    """MountConfig's fields after `backing` and `mountpoint` (daemon.py makes the class)."""
    types = {"size": int, "int": int, "float": float, "str": str, "choice": str, "flag": bool,
             "switch": bool}
    return [(o.field, types[o.kind], dataclasses.field(default=o.default)) for o in OPTIONS]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options as argparse flags, their defaults spelled as a user would type them."""
    for o in OPTIONS:
        flag = f"--{o.name}"
        if o.kind == "flag":
            p.add_argument(flag, action="store_true", help=o.help)
        elif o.kind == "switch":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=o.default,
                           help=o.help)
        elif o.kind == "size":
            p.add_argument(flag, type=parse_size, default=format_size(o.default * o.unit),
                           metavar=o.metavar, help=o.help)
        elif o.kind == "choice":
            p.add_argument(flag, choices=o.choices, default=o.default, help=o.help)
        else:
            conv = {"int": int, "float": float, "str": str}[o.kind]
            p.add_argument(flag, type=conv, default=o.default, metavar=o.metavar, help=o.help)


def config_values(args: argparse.Namespace) -> dict:
    """MountConfig keyword arguments from parsed flags."""
    out = {}
    for o in OPTIONS:
        v = getattr(args, o.dest)
        if o.kind == "flag" and o.invert:
            v = not v
        elif o.kind == "size":
            v //= o.unit
        out[o.field] = v
    return out


def command_line(options: dict) -> list[str]:
    """`ckptfs mount` flags for api.Mount's keywords (option names with underscores; a
    switch takes True/False, or `no_<name>=True`; a flag True; sizes as int or "64M").
    Unknown keywords are a TypeError, before anything is started."""
    out: list[str] = []
    for key, v in options.items():
        o = BY_DEST.get(key)
        if o is None and key.startswith("no_") and key[3:] in BY_DEST \
                and BY_DEST[key[3:]].kind == "switch":
            o, v = BY_DEST[key[3:]], not v
        if o is None:
            raise TypeError(f"unknown ckptfs mount option {key!r} (options: "
                            f"{', '.join(sorted(BY_DEST))})")
        if o.kind == "switch":
            if v is not None:
                out.append(f"--{o.name}" if v else f"--no-{o.name}")
        elif o.kind == "flag":
            if v:
                out.append(f"--{o.name}")
        elif v is not None and v != "":
            out += [f"--{o.name}", str(v)]
    return out


def mount_helper_table() -> str:
    """One line per -o option of the mount(8) helper: `name value|switch|flag`."""
    lines = []
    for o in OPTIONS:
        key = o.dest
        if o.kind == "switch":
            lines += [f"{key} flag", f"no_{key} flag"]
        elif o.kind == "flag":
            lines.append(f"{key} flag")
        else:
            lines.append(f"{key} value")
    return "\n".join(lines) + "\n"


def markdown_table() -> str:
    """The options table of docs/operations.md."""
    rows = ["| option | default | what it does |", "|---|---|---|"]
    for o in OPTIONS:
        flag = f"`--{o.name}`" if o.kind not in ("switch",) else f"`--[no-]{o.name}`"
        if o.kind == "choice":
            flag += f" ({', '.join(o.choices)})"
        rows.append(f"| {flag} | {o.shown_default()} | {o.help.replace('|', '/')} |")
    return "\n".join(rows) + "\n"
