"""Writing an index: appending commit groups to a writer's live index, writing a fresh index
(an index snapshot, `ckptfs compact`), and putting a fresh index in place of the live one.

One thread at a time uses an IndexWriter (in a mount: the flusher thread). The file layout is
records.py's; backingdir.py names the files.

- `append(blob)` writes one or more complete commit groups and fdatasyncs; a failed write is
  cut off again (ftruncate to the last good size) so that later groups stay reachable.
- `write_fresh(path, blob)` writes a complete index to a new file and fsyncs it.
- `replace(fresh, upto)` finishes a fresh index made of the live one's first `upto` bytes: it
  copies the groups committed since (the live index's bytes from `upto` on) to its end,
  fsyncs it, renames it over the live index and fsyncs the directory, then appends there. A
  crash before the rename leaves the old index (and a stray fresh file, removed at the next
  mount); after it, the new one, which replays to the same tree.
"""

from __future__ import annotations

import errno
import os

from crc32c import crc32c

from ckptfs.format import records
from ckptfs.format.backingdir import NOFOLLOW, Dir, open_index

# The fresh index being made beside the live one (removed at mount if a crash left it).
FRESH_SUFFIX = ".fresh"


def discard_fresh(where: Dir, name: str) -> None:
    """Remove the fresh index beside index `name` of `where`, if there is one: what a crash,
    or a snapshot that did not end in its swap, left."""
    where.unlink(name + FRESH_SUFFIX, missing_ok=True)


DAMAGED_SUFFIX = ".damaged-"  # index.log.damaged-<crc32c>: a damaged index, kept for fsck


def keep_damaged(where: Dir, name: str) -> str:
    """A copy of index `name` of `where` beside it, before a writable mount cuts or rewrites
    what replay could not use: `ckptfs fsck` can still read it. Named by its CRC32C, so that
    each mount of the same damaged index keeps it once. Returns the copy's name."""
    tmp = f"{name}{DAMAGED_SUFFIX}tmp.{os.getpid()}"
    try:
        where.unlink(tmp)
    except FileNotFoundError:
        pass
    crc = 0
    src = where.open(name, os.O_RDONLY)
    try:
        dst = where.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            while True:
                chunk = os.read(src, 1 << 20)
                if not chunk:
                    break
                crc = crc32c(chunk, crc)
                _write_all(dst, chunk)
            os.fsync(dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    copy = f"{name}{DAMAGED_SUFFIX}{crc:08x}"
    if where.exists(copy):
        where.unlink(tmp)
    else:
        where.rename(tmp, copy)
    where.sync()
    return copy


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, blob: bytes) -> None:
    view = memoryview(blob)
    while view:
        view = view[os.write(fd, view):]


def write_fresh(path: str, blob: bytes, version: int = 1, where: Dir | None = None) -> int:
    """A complete index at `path` (created or replaced; with `where`, `path` is a name in
    that directory): header + `blob` (commit groups), fsynced. Returns its size."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = where.open(path, flags) if where is not None else os.open(path, flags | NOFOLLOW, 0o600)
    try:
        _write_all(fd, records.index_header(version) + blob)
        os.fsync(fd)
    finally:
        os.close(fd)
    return records.INDEX_HEADER.size + len(blob)


class IndexWriter:
    """The live index of a writer, open for appending."""

    def __init__(self, where: Dir, name: str, valid_bytes: int) -> None:
        """Open (create, or cut the torn tail off) the index `name` of `where`, whose first
        `valid_bytes` replayed (0: a new or unreadable index, started afresh)."""
        self.where, self.name = where, name
        self.path = where.join(name)
        self.fd, self.size = open_index(where, name, valid_bytes)
        _, self.version, _ = records.INDEX_HEADER.unpack(
            os.pread(self.fd, records.INDEX_HEADER.size, 0))

    def append(self, blob: bytes, version: int = 1) -> None:
        """Append complete commit groups and make them durable. `version`: the index version
        the groups need (RETIRE records: 2); the header is raised to it first."""
        if version > self.version:
            self._raise_version(version)
        try:
            _write_all(self.fd, blob)
            os.fdatasync(self.fd)
        except OSError:
            try:
                os.ftruncate(self.fd, self.size)
            except OSError:
                pass
            raise
        self.size += len(blob)

    def _raise_version(self, version: int) -> None:
        # (the append descriptor is O_APPEND: a pwrite through it would land at the end)
        fd = self.where.open(self.name, os.O_WRONLY)
        try:
            os.pwrite(fd, records.index_header(version), 0)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        self.version = version

    def replace(self, fresh: str, upto: int, version: int) -> None:
        """Put the fresh index `fresh` (a name beside this one, equivalent to this index's
        first `upto` bytes; of index `version`) in place of this one, with every group
        committed after `upto`."""
        tail = os.pread(self.fd, self.size - upto, upto)
        if len(tail) != self.size - upto:  # committed groups would be left out of the new one
            raise OSError(errno.EIO, f"{self.path}: short read of the index tail "
                          f"({len(tail)} of {self.size - upto} bytes); not replaced")
        version = max(version, self.version)
        fd = self.where.open(fresh, os.O_RDWR)
        try:
            end = os.fstat(fd).st_size
            view = memoryview(tail)
            while view:
                n = os.pwrite(fd, view, end)
                end += n
                view = view[n:]
            if version > 1:  # the tail may hold RETIRE records: the header says so
                os.pwrite(fd, records.index_header(version), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        # (opened before the rename: the descriptor follows the file, whatever happens next)
        nfd = self.where.open(fresh, os.O_RDWR | os.O_APPEND)
        try:
            self.where.rename(fresh, self.name)
        except BaseException:
            os.close(nfd)
            raise
        old, self.fd, self.size, self.version = self.fd, nfd, end, version
        os.close(old)
        self.where.sync()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
