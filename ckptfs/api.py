"""The Python face of ckptfs for scripts and tests.

    with ckptfs.api.Mount("/lustre/run42", "/ckpt", staging_size="256M") as m:
        torch.save(t, "/ckpt/step_1/w.pt")
        m.sync()                  # everything durable
        print(m.status()["bytes_durable"])
    # leaving the block unmounts: returns once everything is durable, raises if it is not

The daemon runs as a child process (`python -m ckptfs mount -f ...`), so a crash of the file
system never takes the caller down, and the caller can kill it by PID.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import NamedTuple

from ckptfs.options import command_line
from ckptfs.system import libc

XATTR_STATUS = "user.ckptfs.status"
XATTR_SYNC = "user.ckptfs.sync"
XATTR_LEVEL = "user.ckptfs.level"



class CkptfsError(RuntimeError):
    pass


def syncfs(path: str) -> None:
    """Write back the kernel's dirty pages of the file system holding `path` (files still
    open in the writeback cache) to the daemon."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if libc.syncfs(fd) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
    finally:
        os.close(fd)


LEVELS = ("staged", "node", "backing")  # how durable a change is, least first


def sync(mountpoint: str, level: str | None = None) -> None:
    """Barrier: returns when everything written to the mount before the call is durable at
    `level` ("node": in the node tier; "backing": in the backing directory; None: what the
    mount's --durability says, the backing directory by default). Raises OSError with the
    errno of the store that failed (ENOSPC, EIO) when it is not."""
    if level not in (None, "node", "backing"):
        raise ValueError(f"level must be node or backing, not {level!r}")
    syncfs(mountpoint)
    os.getxattr(mountpoint, XATTR_SYNC + (f".{level}" if level else ""))


def level(path: str) -> str:
    """How durable the file or directory tree at `path` (on a ckptfs mount) is now: "staged",
    "node" (in the node tier) or "backing" (in the backing directory)."""
    return os.getxattr(path, XATTR_LEVEL).decode()


def wait_level(path: str, want: str = "backing", timeout: float | None = None,
               poll_s: float = 0.05) -> str:
    """Return once the file or tree at `path` is durable at `want` or better (its level);
    TimeoutError after `timeout` seconds. A rotation that waits so for step N never deletes
    step N-1 before step N is in the backing directory."""
    if want not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}, not {want!r}")
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        now = level(path)
        if LEVELS.index(now) >= LEVELS.index(want):
            return now
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"{path} is {now}, not {want}, after {timeout} s")
        time.sleep(poll_s)
        poll_s = min(poll_s * 1.5, 0.5)


def status(mountpoint: str, timeout: float = 30.0) -> dict:
    """The live figures of the ckptfs mount at `mountpoint`: from its daemon's status socket
    when it has one (this touches nothing on the mount, so it answers while every request the
    mount can serve is waiting for a hung backing store), else through the mount's status
    xattr. Raises OSError (ETIMEDOUT when the daemon does not answer within `timeout`)."""
    st = _status_socket(mountpoint, timeout)
    if st is not None:
        return st
    return json.loads(os.getxattr(mountpoint, XATTR_STATUS))


def _mount_path(path: str) -> str:
    """`path` as /proc/self/mountinfo spells a mount point there, resolved without a system
    call on `path` itself: if it is a mount point, an lstat of it asks that mount's daemon
    (its root's attributes), and a stuck daemon would never answer."""
    path = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


class MountEntry(NamedTuple):
    mountpoint: str
    dev: str  # 'major:minor'
    fstype: str  # 'ext4', 'fuse.ckptfs', ...
    source: str  # '/dev/vda', the backing path, ...
    owner: int | None = None  # a FUSE mount's user_id=: the user who mounted it


def _unescape(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace(
        "\\134", "\\")


def mounts() -> list[MountEntry]:
    """Every mount in /proc/self/mountinfo, in mount order (the last entry for a path is the
    topmost mount there)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            try:
                i = parts.index("-")
                fstype, source = parts[i + 1], parts[i + 2]
            except (ValueError, IndexError):
                continue
            owner = None
            for opt in (parts[i + 3] if len(parts) > i + 3 else "").split(","):
                if opt.startswith("user_id="):
                    owner = int(opt[8:]) if opt[8:].isdigit() else None
            out.append(MountEntry(_unescape(parts[4]), parts[2], fstype, _unescape(source),
                                  owner))
    return out


def mount_at(mountpoint: str) -> MountEntry | None:
    """The topmost mount at exactly `mountpoint` (spelled as /proc/self/mountinfo does: an
    absolute, resolved path), or None. Reads only mountinfo: safe while that mount is stuck.
    Raises OSError if mountinfo cannot be read."""
    found = None
    for e in mounts():
        if e.mountpoint == mountpoint:
            found = e
    return found


def mount_holding(path: str) -> MountEntry | None:
    """The mount that holds `path` (resolved; the deepest mount point on its way, the topmost
    mount there), or None if /proc/self/mountinfo cannot be read. Resolving `path` touches
    it: not for a mount whose daemon may be stuck (mount_device_of is for that)."""
    real = os.path.realpath(path)
    best = None
    try:
        entries = mounts()
    except OSError:
        return None
    for e in entries:
        mp = e.mountpoint
        if (real == mp or real.startswith(mp.rstrip("/") + "/")) and (
                best is None or len(mp) >= len(best.mountpoint)):
            best = e
    return best


def ckptfs_mount_at(mountpoint: str) -> MountEntry | None:
    """The ckptfs mount at `mountpoint` (the topmost one there), from /proc/self/mountinfo,
    without touching the mount (_mount_path)."""
    try:
        e = mount_at(_mount_path(mountpoint))
    except OSError:
        return None
    return e if e is not None and e.fstype == "fuse.ckptfs" else None


def mount_device_of(mountpoint: str) -> str | None:
    """'major:minor' of the ckptfs mount at `mountpoint` (ckptfs_mount_at)."""
    e = ckptfs_mount_at(mountpoint)
    return e.dev if e is not None else None


def status_socket_name(dev: str) -> bytes:
    """The abstract AF_UNIX address where the daemon of the mount with device `dev`
    ('major:minor', as in /proc/self/mountinfo) answers with its status (daemon.serve_status)."""
    return b"\0ckptfs-status-" + dev.encode()


def _status_socket(mountpoint: str, timeout: float) -> dict | None:
    """The daemon's figures from its status socket; None where the mount is to be asked
    instead: no socket, or one that another user's process holds (an abstract name can be
    bound by anyone first: only an answer from the user who mounted, or root, and from the
    process whose pid it reports, is taken), or one the daemon of a detached mount still
    holds (lazily unmounted with files open: it serves on, and a new mount may have the same
    device number; only an answer for this mount point is taken, and one that ends while
    the client waits is no answer)."""
    e = ckptfs_mount_at(mountpoint)
    if e is None:
        return None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        try:
            s.connect(status_socket_name(e.dev))
        except (ConnectionRefusedError, FileNotFoundError):
            return None  # an older daemon, or another network namespace: use the mount
        try:  # struct ucred {pid, uid, gid}: who listens there
            cred = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        except OSError:
            return None
        peer_pid = int.from_bytes(cred[:4], sys.byteorder)
        peer_uid = int.from_bytes(cred[4:8], sys.byteorder)
        if peer_uid not in (0, e.owner):
            return None
        who = f"the ckptfs daemon (pid {peer_pid})"
        chunks = []
        try:
            while True:
                b = s.recv(1 << 16)
                if not b:
                    break
                chunks.append(b)
        except socket.timeout:
            raise OSError(errno.ETIMEDOUT, f"{who} does not answer") from None
        except ConnectionResetError:
            return None  # (its listener closed unanswered: a daemon ending, not this mount's)
    finally:
        s.close()
    if not chunks:
        return None  # (refused: not our user)
    try:
        st = json.loads(b"".join(chunks))
    except ValueError:
        return None
    if not isinstance(st, dict) or st.get("pid") != peer_pid:
        return None  # (not the process that answers for itself)
    if st.get("mountpoint") != e.mountpoint:
        return None  # (the daemon of a detached mount that had this device number before)
    return st


def fusermount(mountpoint: str, lazy: bool = False) -> subprocess.CompletedProcess:
    exe = shutil.which("fusermount3") or shutil.which("fusermount") or "fusermount3"
    args = [exe, "-u"] + (["-z"] if lazy else []) + [mountpoint]
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def unmount(mountpoint: str, pid: int, timeout: float, busy: str = "fail") -> None:
    """The one way ckptfs unmounts: detach the mount (the daemon then seals, drains and
    commits everything staged before it exits), and wait up to `timeout` seconds for the
    daemon `pid` to exit. A busy mount (files open) is, by `busy`: "fail" left in place,
    "lazy" detached lazily (the daemon exits once the last file is closed), "signal" handed
    to the daemon with SIGTERM (it unmounts itself). Raises CkptfsError when the mount stays
    or the daemon does not exit in time; the daemon's exit status (0: everything durable)
    is for its parent to read."""
    deadline = time.monotonic() + timeout
    res = fusermount(mountpoint)
    if res.returncode != 0 and busy == "lazy":
        res = fusermount(mountpoint, lazy=True)
    if res.returncode != 0:
        if busy != "signal":
            raise CkptfsError(f"cannot unmount {mountpoint}: {res.stderr.strip()} (busy? "
                              "close files or use --lazy)")
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    if not wait_pid_exit(pid, max(1.0, deadline - time.monotonic())):
        raise CkptfsError(f"daemon {pid} still running {timeout:g} s after the unmount began")


def wait_pid_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # A zombie counts as gone once its last thread has ended (its files are closed
        # then; whoever reaps it may take a while): the first thread to end turns the
        # process into a zombie while the others still run and hold its descriptors.
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if fields["State"].split()[0] == "Z" and int(fields["Threads"]) <= 1:
                return True
        except (OSError, KeyError, ValueError):
            return True
        time.sleep(0.02)
    return False


class Mount:
    """Mount `backing` at `mountpoint` for the duration of a `with` block (or start()/stop()).

    Options are `ckptfs mount` options with underscores (ckptfs/options.py):
    staging_size="256M", segment_size="8M", queue_depth=32, io="buffered", engine="posix",
    writer_id="w1", idle_flush=0.5, fast_path=False (or no_fast_path=True) ... An unknown
    option is a TypeError here, before anything starts.
    """

    def __init__(self, backing: str, mountpoint: str, *, timeout: float = 60.0,
                 log_file: str | None = None, env: dict | None = None, **options) -> None:
        self.backing = backing
        self.mountpoint = mountpoint
        self.timeout = timeout
        self.options = options
        self.flags = command_line(options)
        self.log_file = log_file
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.returncode: int | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "ckptfs", "mount", "-f", self.backing, self.mountpoint,
                *self.flags]

    def start(self) -> "Mount":
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        env = dict(os.environ, **(self.env or {}))
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=out, env=env,
                                     start_new_session=True)
        if out is not subprocess.DEVNULL:
            out.close()
        # the daemon prints one line: "ready: ..." or "error: ..."; wait for it with a deadline
        # (a daemon that hangs before it must not hang the caller)
        fd = self.proc.stdout.fileno()
        buf = b""
        deadline = time.monotonic() + self.timeout
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                buf += chunk
            elif self.proc.poll() is not None:
                break
        text = buf.split(b"\n", 1)[0].decode(errors="replace").strip()
        if not text and self.proc.poll() is None:
            text = f"error: ckptfs mount gave no answer within {self.timeout:.0f} s"
        if not text.startswith("ready"):
            self._reap(kill=True)
            raise CkptfsError(text or f"ckptfs mount exited with {self.returncode}")
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def sync(self, level: str | None = None) -> None:
        sync(self.mountpoint, level)

    def status(self) -> dict:
        return status(self.mountpoint)

    def wait_settled(self, timeout: float = 60.0) -> "Mount":
        """Wait until the mount's start-up work that goes on after "ready" is done: its
        staging memory faulted in (a job's first checkpoint usually comes long after its
        mount; a benchmark that saves at once would measure the fault-in with it). The daemon
        starts that at the first write, or once the mount has served no READ for 2 s
        (faultin.FAULT_IN_QUIET_S)."""
        if self.options.get("no_populate"):
            return self
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if st.get("readonly") or st["staging_faulted_bytes"] >= st["staging_bytes"]:
                return self
            if time.monotonic() > deadline:
                raise CkptfsError(f"{self.mountpoint}: staging memory not faulted in within "
                                  f"{timeout:.0f} s ({st['staging_faulted_bytes']} of "
                                  f"{st['staging_bytes']} bytes)")
            time.sleep(0.02)

    def stop(self) -> int:
        """Unmount; wait until the daemon drained everything. Returns its exit status (0 when
        everything was made durable); raises CkptfsError when it was not."""
        if self.proc is None:
            return 0
        try:
            unmount(self.mountpoint, self.proc.pid, self.timeout, busy="signal")
        except CkptfsError:
            self._reap(kill=True)
            raise CkptfsError(f"ckptfs daemon {self.proc.pid} did not exit; killed") from None
        self._reap(kill=False)
        if self.returncode != 0:
            raise CkptfsError(f"ckptfs daemon exited with status {self.returncode}: "
                              "not everything was made durable (see its log)")
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the daemon (crash tests), then clean up the dead mount."""
        if self.proc is not None:
            self.proc.kill()
            self._reap(kill=False)

    def _reap(self, kill: bool) -> None:
        if self.proc is None:
            return
        if kill and self.proc.poll() is None:
            self.proc.kill()
        try:
            self.returncode = self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.returncode = self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        if is_mounted(self.mountpoint):
            fusermount(self.mountpoint, lazy=True)
        self.proc = None

    def __enter__(self) -> "Mount":
        return self.start()

    def __exit__(self, et, ev, tb) -> None:
        if et is None:
            self.stop()
        else:
            try:
                self.stop()
            except CkptfsError:
                pass


def is_mounted(path: str) -> bool:
    """Whether something is mounted at `path`; does not touch a mount found there, so it
    answers while that mount's daemon is stuck (only a symlink to a mount point is followed,
    which asks the mount)."""
    points = {e.mountpoint for e in mounts()}
    return _mount_path(path) in points or os.path.realpath(path) in points
