"""The backing directory: its marker, the writers' directories and their locks.

BACKING/
  ckptfs.json                       format marker and version, written once, atomically
  writers/<writer-id>/writer.json   who this writer is (host, created)
  writers/<writer-id>/writer.lock   flock held by the process that owns the writer (a mount,
                                    or an offline compaction)
  writers/<writer-id>/index.log     the index (records.py)
  writers/<writer-id>/data-NNNNNN.log  the data logs (records.py: header block)
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time

from ckptfs.format.records import FORMAT_VERSION, INDEX_HEADER, FormatError, index_header

log = logging.getLogger("ckptfs")

# How every file of a backing directory is opened: never through a symbolic link (whoever
# owns the backing directory could plant one where a daemon running as root writes), never
# inherited by a child.
NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC

BACKING_MARKER = "ckptfs.json"
WRITERS_DIR = "writers"
INDEX_NAME = "index.log"
WRITER_META = "writer.json"


def write_writer_meta(where: Dir, writer_id: str, **extra) -> None:
    """writers/<id>/writer.json: who the writer is (host, created; `extra` adds facts, e.g.
    the writers a compaction merged), written atomically."""
    write_atomic(where, WRITER_META, json.dumps({
        "writer": writer_id, "host": socket.gethostname(), "created": time.time(),
        "version": FORMAT_VERSION, **extra}).encode() + b"\n")


class Dir:
    """A directory of a backing directory, held open: its files are opened, created, renamed
    and removed through the descriptor (openat and friends) with NOFOLLOW. Whoever owns the
    directory above can rename the path away and put a link in its place; the descriptor
    stays the directory that was opened. `path` is for messages and for the offline tools."""

    def __init__(self, path: str, fd: int | None = None) -> None:
        self.path = path
        self.fd = os.open(path, _DIR_FLAGS) if fd is None else fd

    @classmethod
    def at(cls, parent: "Dir", name: str, create: bool = False, mode: int = 0o700) -> "Dir":
        """Directory `name` of `parent` (created with `create`); FormatError when it is a
        symbolic link or not a directory."""
        if create:
            try:
                os.mkdir(name, mode, dir_fd=parent.fd)
            except FileExistsError:
                pass
        path = os.path.join(parent.path, name)
        try:
            fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent.fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise FormatError(f"{path} is a symbolic link or not a directory; ckptfs "
                                  "uses only real directories there") from None
            raise
        return cls(path, fd)

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def open(self, name: str, flags: int, mode: int = 0o600) -> int:
        try:
            return os.open(name, flags | NOFOLLOW, mode, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OSError(errno.ELOOP, f"{self.join(name)} is a symbolic link: ckptfs "
                              "opens no file of a backing directory through one") from None
            raise

    def exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def stat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def unlink(self, name: str, missing_ok: bool = False) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rename(self, old: str, new: str) -> None:
        os.rename(old, new, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def link(self, old: str, new: str) -> None:
        """A second name for `old` (never following a link)."""
        os.link(old, new, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)

    def sync(self) -> None:
        """fsync of the directory: the names created, renamed or removed in it are durable."""
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class WriterInUse(FormatError):
    """Another process holds the writer's lock."""


def data_log_name(log: int) -> str:
    return f"data-{log:06d}.log"


def write_atomic(where: Dir, name: str, data: bytes, mode: int = 0o600) -> None:
    """File `name` of `where` replaced by one holding `data`, durably (a fresh file, synced,
    renamed over it, the directory synced)."""
    tmp = f"{name}.tmp.{os.getpid()}"
    try:
        where.unlink(tmp)  # (a crash's leftover, or something planted: never written through)
    except FileNotFoundError:
        pass
    fd = where.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    where.rename(tmp, name)
    where.sync()


def check_backing(backing: str, create: bool) -> None:
    """Validate (and with `create`, initialise) a backing directory. Raises FormatError or
    OSError with a message fit for a one-line error."""
    if not os.path.exists(backing):
        raise FormatError(f"backing directory {backing} does not exist")
    if not os.path.isdir(backing):
        raise FormatError(f"backing path {backing} is not a directory")
    marker = os.path.join(backing, BACKING_MARKER)
    if os.path.exists(marker):
        try:
            with open(os.open(marker, os.O_RDONLY | NOFOLLOW)) as f:
                meta = json.load(f)
            version = int(meta["version"])
            fmt = meta["format"]
        except (ValueError, KeyError, TypeError, OSError) as exc:
            why = "a symbolic link" if getattr(exc, "errno", None) == errno.ELOOP else exc
            raise FormatError(f"{marker} is unreadable: {why}") from None
        if fmt != "ckptfs":
            raise FormatError(f"{marker} does not describe a ckptfs backing directory")
        if version > FORMAT_VERSION:
            raise FormatError(f"{backing} has format version {version}, newer than this ckptfs "
                              f"(supports {FORMAT_VERSION}); upgrade ckptfs")
        return
    if not create:
        if os.path.isdir(os.path.join(backing, WRITERS_DIR)):
            return
        raise FormatError(f"{backing} is not a ckptfs backing directory (no {BACKING_MARKER})")
    if not os.access(backing, os.W_OK | os.X_OK):
        raise FormatError(f"backing directory {backing} is not writable")
    top = Dir(backing)
    try:
        Dir.at(top, WRITERS_DIR, create=True).close()
        write_atomic(top, BACKING_MARKER, json.dumps({
            "format": "ckptfs", "version": FORMAT_VERSION, "created": time.time(),
            "host": socket.gethostname()}).encode() + b"\n", 0o644)
    finally:
        top.close()


WRITER_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
WRITER_ID_MAX = 128


def default_writer_id() -> str:
    """The host name, with characters outside [A-Za-z0-9._-] replaced by '_'."""
    name = socket.gethostname() or "localhost"
    return safe_writer_id("".join(c if c in WRITER_ID_CHARS else "_" for c in name)[:WRITER_ID_MAX])


def safe_writer_id(name: str) -> str:
    """`name` if it is a valid writer id (the name of a directory under writers/): 1 to 128
    characters of [A-Za-z0-9._-], not '.' or '..'. Anything else is refused, not rewritten:
    two different ids must never end up in the same directory."""
    if (not name or name in (".", "..") or len(name) > WRITER_ID_MAX
            or not WRITER_ID_CHARS.issuperset(name)):
        raise FormatError(f"invalid writer id {name!r}: use 1-{WRITER_ID_MAX} characters of "
                          "A-Z a-z 0-9 . _ -")
    return name


def writer_dirs(backing: str) -> list[str]:
    root = os.path.join(backing, WRITERS_DIR)
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    return [os.path.join(root, n) for n in names if os.path.isdir(os.path.join(root, n))]


def refresh_attributes(writer_dir: str) -> None:
    """Make the file system client fetch the current sizes of a writer's files before its
    index is read and its data logs are sized. A network file system's client may cache them:
    GlusterFS's FUSE client does for a second (in the kernel and in its md-cache), so right
    after another client commits, the index reads short (an older tree) and a data log looks
    shorter than the extents in it (docs/glusterfs.md, "Close-to-open"). Listing the directory
    brings every entry's attributes afresh (FUSE READDIRPLUS); on a local file system it costs
    one readdir."""
    try:
        os.listdir(writer_dir)
    except OSError:
        pass  # the read that follows reports what is wrong


def data_logs(writer_dir: str) -> dict[int, str]:
    out = {}
    for name in os.listdir(writer_dir):
        if name.startswith("data-") and name.endswith(".log"):
            try:
                out[int(name[5:-4])] = os.path.join(writer_dir, name)
            except ValueError:
                continue
    return out


class WriterDir:
    """This mount's own directory in the backing store, locked for the daemon's lifetime."""

    def __init__(self, backing: str, writer_id: str) -> None:
        self.backing = backing
        self.writer_id = writer_id
        self.path = os.path.join(backing, WRITERS_DIR, writer_id)
        self.dir: Dir | None = None  # (held open from open() on: every file goes through it)
        self.lock_fd = -1

    def open(self) -> None:
        top = Dir(self.backing)
        try:
            writers = Dir.at(top, WRITERS_DIR, create=True)
        finally:
            top.close()
        try:
            self.dir = Dir.at(writers, self.writer_id, create=True)
        finally:
            writers.close()
        if not self.dir.exists(WRITER_META):
            write_writer_meta(self.dir, self.writer_id)
        fd = self.dir.open("writer.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            os.close(fd)
            raise WriterInUse(
                f"writer '{self.writer_id}' of {self.backing} is in use ({holder or 'locked'}); "
                "mount with a distinct --writer-id to write from a second mount") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.lock_fd = fd

    def close(self) -> None:
        if self.lock_fd >= 0:
            os.ftruncate(self.lock_fd, 0)
            os.close(self.lock_fd)
            self.lock_fd = -1
        if self.dir is not None:
            self.dir.close()
            self.dir = None


def open_index(where: Dir, name: str, valid_bytes: int) -> tuple[int, int]:
    """Open the index for appending: create it with a header, or cut a torn tail off."""
    path = where.join(name)
    fd = where.open(name, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
    size = os.fstat(fd).st_size
    if size == 0 or valid_bytes == 0:
        os.ftruncate(fd, 0)
        os.write(fd, index_header())
        os.fsync(fd)
        return fd, INDEX_HEADER.size
    if size > valid_bytes:
        log.warning("%s: cutting %d bytes of torn or uncommitted tail", path, size - valid_bytes)
        os.ftruncate(fd, valid_bytes)
        os.fsync(fd)
    return fd, valid_bytes
