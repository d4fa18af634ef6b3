"""The `ckptfs` command. Each subcommand parses its own options and calls into the package."""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import logging
import os
import select
import sys
import time

from ckptfs import options
from ckptfs.options import parse_size

BENCHES = ("engine", "micro", "e2e", "scaling", "lifecycle", "mount", "profile", "transport")

EPILOG = """examples:
  ckptfs mount /lustre/proj/run42 /ckpt       mount (daemonizes once the mount is live)
  python train.py --save-dir /ckpt            unmodified training code writes there
  ckptfs sync /ckpt                           barrier: everything written so far is durable
  ckptfs wait --level backing /ckpt/step_100  (node tier) step_100 is in the backing directory
  ckptfs status /ckpt                         live figures (--json for machines)
  ckptfs umount /ckpt                         flush, wait until durable, unmount
  ckptfs mount /lustre/proj/run42 /ckpt       later, anywhere: the same tree again
  ckptfs demo                                 save and restore a model through a temporary mount
  ckptfs bench NAME --help                    a benchmark: %s
""" % ", ".join(BENCHES)

class _Parser(argparse.ArgumentParser):
    """Bad command lines get one line (and the exit status 2), not the usage block."""

    def error(self, message: str):
        self.exit(2, f"ckptfs: {self.prog.removeprefix('ckptfs').strip() or 'error'}: "
                     f"{message} (see {self.prog} --help)\n")


def _setup_logging(debug: bool) -> None:
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO,
                        format="%(asctime)s ckptfs[%(process)d] %(levelname)s %(name)s: "
                               "%(message)s")


def _fail(msg: str, code: int = 1) -> int:
    print(f"ckptfs: {msg}", file=sys.stderr)
    return code


# ---------------------------------------------------------------- mount
class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown in the help, except where there is none to show (None, "", an off
    switch) or the help text already says what it is."""

    def _get_help_string(self, action):
        d = action.default
        if d is None or d is False or d == "" or "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)


def _add_mount(sub) -> None:
    p = sub.add_parser("mount", help="mount a backing directory",
                       formatter_class=_DefaultsHelp,
                       description="Mount BACKING (an existing directory on the real file "
                       "system, initialised on first use) at MOUNTPOINT (an empty directory). "
                       "Returns once the mount is live; the daemon keeps running in the "
                       "background.",
                       epilog="example: ckptfs mount /lustre/proj/run42 /ckpt --staging-size 2G")
    p.add_argument("backing")
    p.add_argument("mountpoint")
    p.add_argument("-f", "--foreground", action="store_true", help="do not daemonize")
    options.add_arguments(p)


def _open_log(cfg, wd) -> int:
    """The daemon's log: --log-file, else daemon.log in the writer's directory (through the
    descriptor the mount holds, never through a link: backingdir.Dir; a read-only mount's
    is made for it)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    if cfg.log_file:
        os.makedirs(os.path.dirname(cfg.log_file), mode=0o700, exist_ok=True)
        return os.open(cfg.log_file, flags | os.O_CLOEXEC, 0o600)
    if wd is not None:
        return wd.dir.open("daemon.log", flags, 0o600)
    from ckptfs.format import backingdir

    where = backingdir.Dir(cfg.backing)
    try:
        for name in (backingdir.WRITERS_DIR, cfg.writer_id):
            inner = backingdir.Dir.at(where, name, create=True)
            where.close()
            where = inner
        return where.open("daemon.log", flags, 0o600)
    finally:
        where.close()


def _mount(a) -> int:
    from ckptfs.daemon import MountConfig, MountError, open_writer, prepare, serve
    from ckptfs.format.records import FormatError

    values = options.config_values(a)
    # (absolute: the daemon works from `/`, so that it holds no directory busy and a child
    # it starts finds nothing of where it was started)
    for key in ("prometheus_file", "log_file", "local_dir"):
        if values.get(key):
            values[key] = os.path.abspath(values[key])
    cfg = MountConfig(os.path.abspath(a.backing), os.path.abspath(a.mountpoint), **values)
    _setup_logging(a.debug)
    if a.foreground:
        def ready(msg: str) -> None:
            print(msg, flush=True)
        try:
            return serve(cfg, ready)
        except (MountError, ValueError, FormatError, OSError) as exc:
            return _fail(str(exc))
    # Daemonize: check and take the writer's lock in the parent (clear errors on the terminal,
    # nothing written on bad input), fork (the child inherits the lock), report readiness.
    try:
        facts = prepare(cfg)
        wd = open_writer(cfg)
    except (MountError, ValueError, FormatError, OSError) as exc:
        return _fail(str(exc))
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        os.setsid()
        os.chdir("/")
        lfd = _open_log(cfg, wd)
        nul = os.open(os.devnull, os.O_RDWR)
        os.dup2(nul, 0)
        os.dup2(lfd, 1)
        os.dup2(lfd, 2)
        os.close(nul)
        os.close(lfd)

        def ready(msg: str) -> None:
            try:
                os.write(wfd, msg.encode() + b"\n")
                os.close(wfd)
            except OSError:
                pass
        code = 1
        try:
            code = serve(cfg, ready, prepared=(facts, wd))
        except BaseException as exc:  # noqa: BLE001 - the daemon must report, then exit
            ready(f"error: {exc}")
            logging.getLogger("ckptfs").exception("daemon failed")
        os._exit(code)
    os.close(wfd)
    if wd is not None:
        os.close(wd.lock_fd)  # the child holds the lock now (same open file description)
    with os.fdopen(rfd, "rb") as r:
        line = r.readline().decode(errors="replace").strip()
    if line.startswith("ready"):
        print(line)
        return 0
    if not line:
        _, st = os.waitpid(pid, 0)
        line = f"error: daemon exited ({st}) before the mount was live; see its log"
    return _fail(line.removeprefix("error: "))


# ---------------------------------------------------------------- umount, sync, status
def _umount(a) -> int:
    from ckptfs import api

    mp = a.mountpoint
    if not api.is_mounted(mp):
        return _fail(f"{mp} is not mounted")
    try:
        st = api.status(mp, timeout=min(30.0, a.timeout))
    except OSError as exc:
        if exc.errno == errno.ETIMEDOUT:  # alive (its status socket took the call) but stuck
            return _fail(f"{mp}: {exc.strerror}; not unmounted (`fusermount3 -uz {mp}` "
                         "detaches it, losing what is staged)")
        # A dead daemon leaves the mount behind (ENOTCONN): detach it lazily.
        res = api.fusermount(mp, lazy=True)
        if res.returncode == 0:
            print(f"ckptfs: {mp}: daemon is gone ({exc.strerror}); stale mount detached. "
                  "Data not synced before the crash may be missing: remount the backing "
                  "directory to see what was durable.", file=sys.stderr)
            return 1
        return _fail(f"{mp}: cannot reach the daemon ({exc}) and lazy unmount failed: "
                     f"{res.stderr.strip()}")
    pid = st["pid"]
    deadline = time.monotonic() + a.timeout
    err = _bounded_sync(mp, a.timeout)
    if err is not None:
        print(f"ckptfs: {mp}: could not make everything durable: {err}", file=sys.stderr)
        if not a.force:
            return _fail("not unmounted (use --force to unmount anyway, losing what is staged)")
    else:  # (the figures once everything is durable)
        try:
            st = api.status(mp, timeout=min(30.0, max(1.0, deadline - time.monotonic())))
        except OSError:
            pass
    try:
        api.unmount(mp, pid, max(1.0, deadline - time.monotonic()),
                    busy="lazy" if a.lazy else "fail")
    except api.CkptfsError as exc:
        return _fail(str(exc))
    st2 = st.get("bytes_durable", 0)
    print(f"unmounted {mp}: everything durable in {st['backing']} "
          f"({st2 / 1e9:.3f} GB flushed by this mount)")
    return 0


def _bounded_sync(mp: str, timeout: float) -> str | None:
    """The barrier of `umount`, given at most `timeout` seconds: None once everything is
    durable, else why not. A backing store that stopped answering must not hang the command,
    and a process whose thread waits in a FUSE request cannot even exit (the kernel waits for
    the daemon's answer once the request reached it), so the barrier runs in a child process
    with its stdio on /dev/null: on timeout it is left behind and exits when the barrier
    completes."""
    from ckptfs import api

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the barrier, its outcome through the pipe
        code = 0
        try:
            nul = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(nul, fd)
            os.closerange(3, w)
            os.closerange(w + 1, 1 << 16)
            try:
                api.sync(mp)
                msg = b""
            except OSError as exc:
                msg = (str(exc) or "barrier failed").encode()
            os.write(w, b"done:" + msg)
        except BaseException:  # noqa: BLE001 - the child must not return into the CLI
            code = 1
        os._exit(code)
    os.close(w)
    try:
        if not select.select([r], [], [], timeout)[0]:
            return (f"the barrier did not complete within {timeout:g} s (is the backing "
                    "store answering?)")
        msg = os.read(r, 4096)
    finally:
        os.close(r)
    os.waitpid(pid, 0)
    if not msg.startswith(b"done:"):
        return "the barrier process failed"
    return msg[5:].decode(errors="replace") or None


def _sync(a) -> int:
    from ckptfs import api

    try:
        api.sync(a.mountpoint, a.level)
    except OSError as exc:
        return _fail(f"sync {a.mountpoint}: {exc.strerror or exc}")
    return 0


def _wait(a) -> int:
    from ckptfs import api

    try:
        api.wait_level(a.path, a.level, timeout=a.timeout)
    except TimeoutError as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"wait {a.path}: {exc.strerror or exc}")
    return 0


def _status(a) -> int:
    from ckptfs import api

    while True:
        try:
            st = api.status(a.mountpoint, timeout=a.timeout)
        except OSError as exc:
            if exc.errno == errno.ETIMEDOUT:  # (its status socket took the call)
                return _fail(f"{a.mountpoint}: {exc.strerror}")
            return _fail(f"{a.mountpoint}: not a live ckptfs mount ({exc.strerror or exc})")
        if a.json:
            print(json.dumps(st, indent=None if a.watch else 2), flush=True)
        else:
            print(_status_summary(st))
            width = max(len(k) for k in st)
            for k, v in st.items():
                print(f"{k:<{width}}  {v}")
            print(flush=True)
        if not a.watch:
            return 0
        time.sleep(a.interval)


def _bytes(n) -> str:
    """In the units of the size options (M = MiB)."""
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _status_summary(st: dict) -> str:
    """The few figures an operator looks at first, above every counter of `ckptfs status`
    (docs/operations.md names them all)."""
    g = st.get
    error = g("current_error") or "none"
    return "\n".join([
        f"{g('mountpoint')}: writer {g('writer')}, pid {g('pid')}, backing {g('backing')}"
        f"{' (read-only)' if g('readonly') else ''}",
        f"  written {_bytes(g('bytes_written'))} in {g('write_requests', 0)} requests; "
        f"durable {_bytes(g('bytes_durable'))}; staged {_bytes(g('bytes_staged'))} of "
        f"{_bytes(g('staging_bytes'))}",
        f"  read {_bytes(g('bytes_read'))} in {g('read_requests', 0)} requests; from disk "
        f"{_bytes(g('read_disk_bytes'))}, from memory {_bytes(g('read_memory_bytes', 0))}",
        f"  data logs {g('data_logs', 0)}: {_bytes(g('live_bytes'))} live, "
        f"{_bytes(g('dead_bytes'))} dead; index {_bytes(g('index_size_bytes'))}",
        *([f"  node tier {g('tier_local_dir')}: {_bytes(g('tier_local_bytes'))} of "
           f"{_bytes(g('tier_local_size'))}; not yet in the backing directory "
           f"{_bytes(g('tier_backlog_bytes'))} (oldest {g('tier_backlog_age_s', 0)} s); "
           f"fsync waits for {g('durability')}"] if g("tier_local_dir") else []),
        f"  errors {g('errors', 0)}, now: {error}",
        ""])


def _options(a) -> int:
    if a.mount_helper:
        sys.stdout.write(options.mount_helper_table())
    elif a.markdown:
        sys.stdout.write(options.markdown_table())
    else:
        for o in options.OPTIONS:
            flag = f"--[no-]{o.name}" if o.kind == "switch" else f"--{o.name}"
            print(f"{flag:<22} {o.shown_default():<8} {o.help}")
    return 0


def _demo(a) -> int:
    from ckptfs import demo

    return demo.main(a)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    parser = _Parser(
        prog="ckptfs", description="ckptfs: a FUSE file system for checkpoints. Packs many "
        "checkpoint files into large aligned io_uring writes to a few logs.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    from ckptfs import __version__

    parser.add_argument("--version", action="version", version=f"ckptfs {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_mount(sub)
    p = sub.add_parser("umount", help="flush, wait until durable, unmount",
                       description="Barrier, then unmount; returns once the daemon has made "
                       "everything durable and exited. On a mount whose daemon died, detaches "
                       "the stale mount.", epilog="example: ckptfs umount /ckpt")
    p.add_argument("mountpoint")
    p.add_argument("--lazy", action="store_true", help="lazy unmount if the mount is busy")
    p.add_argument("--force", action="store_true",
                   help="unmount even when the final sync fails")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds the whole umount may take: the drain (a barrier that does not "
                   "complete in time fails the umount, unless --force) and the daemon's exit")
    p = sub.add_parser("sync", help="barrier: returns when everything is durable",
                       epilog="example: ckptfs sync /ckpt   ckptfs sync --level backing /ckpt")
    p.add_argument("mountpoint")
    p.add_argument("--level", choices=("node", "backing"), default=None,
                   help="what to wait for: node (the node tier) or backing (the backing "
                   "directory); default: the mount's --durability")
    p = sub.add_parser("wait", help="wait until a file or directory tree is durable at a level",
                       epilog="example: ckptfs wait --level backing /ckpt/step_1000   (then "
                       "step_999 can go)")
    p.add_argument("path")
    p.add_argument("--level", choices=("node", "backing"), default="backing",
                   help="node (the node tier) or backing (the backing directory; default)")
    p.add_argument("--timeout", type=float, default=None,
                   help="give up (exit 1) after this many seconds (default: wait)")
    p = sub.add_parser("status", help="live figures of a mount",
                       epilog="example: ckptfs status /ckpt --json")
    p.add_argument("mountpoint")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds to wait for the daemon's answer (default: 30)")
    p.add_argument("--watch", action="store_true", help="repeat every --interval seconds")
    p.add_argument("--interval", type=float, default=1.0)
    p = sub.add_parser("ls", help="list the virtual tree of a backing directory, unmounted",
                       epilog="example: ckptfs ls -lR /lustre/proj/run42 step_1000")
    p.add_argument("backing")
    p.add_argument("path", nargs="?", default="/")
    p.add_argument("-l", "--long", action="store_true", help="mode, owner, size, mtime")
    p.add_argument("-R", "--recursive", action="store_true")
    p.add_argument("--conflicts", action="store_true",
                   help="list paths written by several writers, and which version wins")
    p.add_argument("--writer", default=None, help="writer id (when there are several)")
    p = sub.add_parser("verify", help="check every checksum; exit 1 and name damaged files",
                       epilog="example: ckptfs verify /lustre/proj/run42")
    p.add_argument("backing")
    p.add_argument("--writer", default=None, help="writer id (when there are several)")
    p = sub.add_parser("fsck", help="rebuild a damaged or lost index from the copies of its "
                       "commit groups in the data logs",
                       epilog="example: ckptfs fsck /lustre/proj/run42   (exit 0: clean, "
                       "1: repaired, 2: something is lost; the writers must be unmounted)")
    p.add_argument("backing")
    p.add_argument("--writer", default=None, help="only this writer (default: each writer)")
    p.add_argument("--dry-run", action="store_true", help="report, change nothing")
    p = sub.add_parser("export", help="write the virtual files out as plain files",
                       epilog="example: ckptfs export /lustre/proj/run42 /scratch/step_1000 "
                       "step_1000")
    p.add_argument("backing")
    p.add_argument("dest")
    p.add_argument("path", nargs="?", default="/")
    p.add_argument("--writer", default=None, help="writer id (default: all, merged)")
    p.add_argument("--progress", action="store_true", help="progress even when not a terminal")
    p = sub.add_parser("import", help="copy a plain directory tree into a backing directory",
                       epilog="example: ckptfs import /scratch/step_1000 /lustre/proj/run42 "
                       "step_1000")
    p.add_argument("src")
    p.add_argument("backing")
    p.add_argument("path", nargs="?", default="/")
    p.add_argument("--writer", default=None, help="writer id to import as")
    p.add_argument("--progress", action="store_true", help="progress even when not a terminal")
    p = sub.add_parser("compact", help="rewrite live extents into fresh logs, drop dead ones",
                       epilog="examples: ckptfs compact /lustre/proj/run42\n"
                       "          ckptfs compact --merge --into run42 /lustre/proj/run42",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Atomic: a crash leaves either the old or the new state. "
                       "The writers compacted must be unmounted.")
    p.add_argument("backing")
    p.add_argument("--writer", default=None, help="only this writer (default: each writer)")
    p.add_argument("--merge", action="store_true",
                   help="flatten all writers into one (fewer index files, faster mounts)")
    p.add_argument("--into", default="merged", help="writer id of the result of --merge")
    p.add_argument("--log-size", type=parse_size, default="1G", help="data log size")
    p.add_argument("--progress", action="store_true", help="progress even when not a terminal")
    p = sub.add_parser("gc", help="keep the newest N checkpoint directories, delete the rest",
                       epilog="example: ckptfs gc /ckpt --keep 3 --pattern 'step_*'")
    p.add_argument("mountpoint")
    p.add_argument("--dir", default="/",
                   help="directory inside the mount holding the steps (default: its root)")
    p.add_argument("--keep", type=int, required=True, help="how many of the newest to keep")
    p.add_argument("--pattern", default="step_*",
                   help="shell pattern of the entries (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p = sub.add_parser("demo", help="save and restore a model through a temporary mount",
                       epilog="example: ckptfs demo --size 512M")
    p.add_argument("--size", type=parse_size, default="1G", help="model state size")
    p.add_argument("--dir", default=None, help="where to put the temporary backing directory "
                   "(default: /var/tmp; a disk, not tmpfs)")
    p = sub.add_parser("options", help="the mount options with their defaults, as a table",
                       epilog="the same table as `ckptfs mount --help` and docs/operations.md")
    p.add_argument("--markdown", action="store_true", help="as the table in the docs")
    p.add_argument("--mount-helper", action="store_true",
                   help="as mount.ckptfs reads it: one '-o' option per line, 'value' or 'flag'")
    sub.add_parser("bench", help=f"benchmarks: ckptfs bench {'|'.join(BENCHES)} --help")
    a = parser.parse_args(argv)
    handlers = {"mount": _mount, "umount": _umount, "sync": _sync, "wait": _wait,
                "status": _status,
                "demo": _demo, "ls": _offline, "verify": _offline, "export": _offline,
                "fsck": _offline,
                "compact": _offline, "gc": _offline, "import": _offline,
                "options": _options}
    if a.command is None:
        parser.print_help()
        return 2
    return handlers[a.command](a)


TOOLS = {"ls": "ls", "verify": "verify", "fsck": "fsck", "export": "export", "import": "importer",
         "compact": "compact", "gc": "gc"}  # command -> module of ckptfs.tools


def _offline(a) -> int:
    from ckptfs import api
    from ckptfs.format.records import FormatError

    tool = importlib.import_module(f"ckptfs.tools.{TOOLS[a.command]}")
    try:
        return getattr(tool, f"cmd_{a.command}")(a)
    except (FormatError, OSError, api.CkptfsError) as exc:  # (import mounts)
        return _fail(str(exc).removeprefix("error: "))


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        helping = bool(argv) and argv[0] in ("-h", "--help")
        print("usage: ckptfs bench {%s} [options]   (ckptfs bench NAME --help)" % "|".join(BENCHES),
              file=sys.stdout if helping else sys.stderr)
        return 0 if helping else 2
    mod = importlib.import_module(f"ckptfs.bench.{argv[0]}")
    return mod.main(argv[1:])
