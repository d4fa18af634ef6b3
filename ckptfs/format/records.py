"""The on-disk format's bytes: index records, the index header and scan, the data log header
(docs/format.md describes them for people; backingdir.py names the files that hold them).

Index record: <u32 body length> <u32 crc32c(type + body)> <u8 type> <body>, little endian.
Replay applies complete commit groups (records up to a COMMIT record). A torn record ends it
(the tail of a commit a crash interrupted, never acknowledged); a damaged record (its checksum,
its length, or its fields) with a valid COMMIT after it is damage in the middle: that commit
group is skipped with a warning and replay goes on after that COMMIT (docs/format.md).
"""

from __future__ import annotations

import errno
import json
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Callable

from crc32c import crc32c

FORMAT_VERSION = 1  # of the backing directory, the writers and the data logs
# The newest index version this code reads. An index gets the version-2 header when its first
# RETIRE record is written (IndexWriter): code that knows only version 1 refuses it then,
# instead of ending its replay at the unknown record and cutting the rest off.
INDEX_VERSION = 3
RETIRE_INDEX_VERSION = 2  # the index version that may hold RETIRE and NUMBERS records
# An index gets the version-3 header when its first record about another writer's entry
# (XUNLINK, XEXTENT) is written (Flusher): code that reads only versions 1-2 refuses it.
CROSS_INDEX_VERSION = 3
INDEX_MAGIC = b"CKPTIDX\0"
DATA_MAGIC = b"CKPTDAT\0"
DATA_HEADER_BYTES = 4096
INDEX_HEADER = struct.Struct("<8sII")  # magic, version, crc32c(magic + version)
REC_HEADER = struct.Struct("<IIB")  # body length, crc32c(type + body), type
MAX_RECORD_BODY = 64 * 1024  # the largest record is a rename with two 255-byte names
NAME_MAX = 255
MAX_FILE_BYTES = 1 << 50  # 1 PiB: anything larger in an index is garbage

# Record types.
R_INODE = 1  # new inode linked into a directory (file, dir, symlink, node)
R_EXTENT = 2  # file bytes [foff, foff + length) live at data log `log`, offset `loff`
R_SETATTR = 3  # mode, uid, gid, times
R_SIZE = 4  # truncate (up or down) to size
R_RENAME = 5
R_UNLINK = 6  # unlink or rmdir
R_COMMIT = 7  # end of a commit group: sequence number, wall time
R_LINK = 8  # hard link of an existing inode
R_RETIRE = 9  # data log `log` holds no live byte; its file is removed after this commit
R_XUNLINK = 10  # another writer's entry removed from the tree (a whiteout)
R_XEXTENT = 11  # file bytes that live in a run of a (possibly other) writer's data log
R_NUMBERS = 12  # the inode and data log numbers used so far (an index snapshot starts so)

_INODE = struct.Struct("<QQIIIIqqqH")
_EXTENT = struct.Struct("<QQIIQI")
_SETATTR = struct.Struct("<QIIIqqq")
_SIZE = struct.Struct("<Qqqq")
_RENAME = struct.Struct("<QQIH")
_UNLINK = struct.Struct("<Q")
_COMMIT = struct.Struct("<Qq")
_LINK = struct.Struct("<QQ")
_RETIRE = struct.Struct("<I")
_NUMBERS = struct.Struct("<QI")
_XUNLINK = struct.Struct("<QQH")  # parent, ino (the other writer's numbers), writer id length
_XEXTENT = struct.Struct("<QQIIQIIIH")  # ino foff length log loff run_length crc roff wlen

# ---------------------------------------------------------------- limits
# What a record field may hold: the one table the encoder and the decoder both apply, so that
# whatever is written can be read back. The live handlers apply the same limits first (fuse/
# ops.py: EFBIG for a size or offset past MAX_FILE_BYTES, times clamped to TIME_MIN_NS ..
# TIME_MAX_NS, as ext4 clamps them to its range), so a record out of range is a bug that
# fails its request, never the flusher.
U32 = (0, (1 << 32) - 1)
U64 = (0, (1 << 64) - 1)
TIME_MIN_NS = -(1 << 63)  # 1677-09-21: a signed 64-bit count of nanoseconds
TIME_MAX_NS = (1 << 63) - 1  # 2262-04-11
TIMES = (TIME_MIN_NS, TIME_MAX_NS)
INODE_NUMBERS = (0, 1 << 44)  # (more than any index can hold: 2**44 records)
FILE_BYTES = (0, MAX_FILE_BYTES)
LIMITS: dict[str, tuple[int, int]] = {
    "ino": INODE_NUMBERS, "parent": INODE_NUMBERS, "old_parent": INODE_NUMBERS,
    "new_parent": INODE_NUMBERS, "next_ino": INODE_NUMBERS,
    "mode": U32, "uid": U32, "gid": U32, "rdev": U32, "flags": U32, "crc": U32,
    "log": U32, "next_log": U32,
    "atime_ns": TIMES, "mtime_ns": TIMES, "ctime_ns": TIMES, "time_ns": TIMES,
    "seq": U64,
    "size": FILE_BYTES, "foff": FILE_BYTES,
    "length": (1, U32[1]), "run_length": (1, U32[1]), "roff": U32,  # (within one run)
    "loff": (DATA_HEADER_BYTES, (1 << 63) - 1),
}


class RecordRangeError(ValueError):
    """A record holds a value its field cannot (LIMITS): never encoded, never applied."""


def in_range(rec) -> bool:
    """Whether every field of `rec` lies inside LIMITS (and its names inside NAME_MAX)."""
    ok = _IN_RANGE.get(type(rec))
    if ok is None:
        raise TypeError(f"not an index record: {rec!r}")
    return ok(rec)


def out_of_range(rec) -> str | None:
    """What in `rec` lies outside LIMITS (or a name past NAME_MAX), None if nothing."""
    if in_range(rec):
        return None
    for name in rec.__slots__:
        v = getattr(rec, name)
        if type(v) is not int and type(v) is not bytes:
            return f"{type(rec).__name__}.{name} = {v!r} is not a number or bytes"
        if type(v) is int:
            lo, hi = LIMITS[name]
            if not lo <= v <= hi:
                return f"{type(rec).__name__}.{name} = {v} outside [{lo}, {hi}]"
        elif name != "target" and len(v) > NAME_MAX:
            return f"{type(rec).__name__}.{name} of {len(v)} bytes (max {NAME_MAX})"
    return f"{type(rec).__name__}: a sum of its offsets lies past its bound"


def _in_range_test(cls) -> Callable[[object], bool]:
    """One function per record type that tests LIMITS field by field (records are encoded by
    the thousand per second: a generic loop over the fields would cost more than the
    encoding)."""
    terms = []
    for name in cls.__slots__:
        if name in LIMITS:
            lo, hi = LIMITS[name]
            terms.append(f"type(r.{name}) is int and {lo} <= r.{name} <= {hi}")
        elif name in ("name", "old_name", "new_name"):
            terms.append(f"type(r.{name}) is bytes and len(r.{name}) <= {NAME_MAX}")
        elif name == "target":
            terms.append(f"type(r.{name}) is bytes")
    names = set(cls.__slots__)
    if {"foff", "length"} <= names:
        terms.append(f"r.foff + r.length <= {MAX_FILE_BYTES}")
    if {"roff", "length", "run_length"} <= names:
        terms.append("r.roff + r.length <= r.run_length")
    scope: dict = {}
    exec(f"def ok(r):\n    return {' and '.join(terms) or 'True'}\n", scope)
    return scope["ok"]


_IN_RANGE: dict[type, Callable[[object], bool]] = {}


def check(rec) -> None:
    """RecordRangeError when `rec` cannot be encoded and read back (out_of_range)."""
    problem = out_of_range(rec)
    if problem is not None:
        raise RecordRangeError(problem)


class FormatError(Exception):
    """The backing directory or an index is not something this version can use."""


class Damage(str):
    """A problem replay found: the one line a tool prints, with its `kind` for what to do
    about it. Kinds:
      TORN_TAIL       the end of the index was being written when a crash came (never
                      acknowledged; nothing is lost)
      GROUP_SKIPPED   a commit group failed its checksum and was skipped; replay went on
      INDEX_ENDED     a record does not parse or is torn before the end: the rest is unused
      RECORD_SKIPPED  a record that does not fit the tree (an unknown inode, a name twice)
      EXTENT_DROPPED  an extent points past its data log or into a missing one: the file
                      reads as a hole there (data lost)
      WRITER_SKIPPED  a writer's index cannot be read at all
    """

    kind: str

    def __new__(cls, kind: str, message: str) -> "Damage":
        d = super().__new__(cls, message)
        d.kind = kind
        return d


TORN_TAIL = "torn-tail"
GROUP_SKIPPED = "group-skipped"
INDEX_ENDED = "index-ended"
RECORD_SKIPPED = "record-skipped"
EXTENT_DROPPED = "extent-dropped"
WRITER_SKIPPED = "writer-skipped"
# what `ckptfs verify` reports as a damaged backing directory
DATA_LOSS = frozenset({EXTENT_DROPPED})


# ---------------------------------------------------------------- records
@dataclass(slots=True)
class InodeRec:
    ino: int
    parent: int
    name: bytes
    mode: int
    uid: int
    gid: int
    rdev: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    target: bytes = b""


@dataclass(slots=True)
class ExtentRec:
    ino: int
    foff: int
    length: int
    log: int
    loff: int
    crc: int


@dataclass(slots=True)
class SetattrRec:
    ino: int
    mode: int
    uid: int
    gid: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int


@dataclass(slots=True)
class SizeRec:
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


@dataclass(slots=True)
class RenameRec:
    old_parent: int
    old_name: bytes
    new_parent: int
    new_name: bytes
    flags: int = 0


@dataclass(slots=True)
class UnlinkRec:
    parent: int
    name: bytes


@dataclass(slots=True)
class LinkRec:
    ino: int
    parent: int
    name: bytes


@dataclass(slots=True)
class CommitRec:
    seq: int
    time_ns: int


@dataclass(slots=True)
class RetireRec:
    """Data log `log` is retired: no live extent points into it any more (every one was
    overwritten, truncated, unlinked or moved by the cleaner, in records before this one), so
    its file is removed once this record is committed. Replay tells such a log from a lost
    one, and a writer never reuses its number."""

    log: int


@dataclass(slots=True)
class NumbersRec:
    """Inode numbers below `next_ino` and data log numbers below `next_log` were used before
    and are never used again: an index snapshot says so, since the records that used them are
    gone from it (index version 2)."""

    next_ino: int
    next_log: int


@dataclass(slots=True)
class XUnlinkRec:
    """This writer removed the entry `name` of directory `parent` in writer `writer`'s tree,
    which was that writer's inode `ino` (numbers of that writer): an unlink, rmdir, rename
    over or away from it, or the replacement of another writer's file by a copy of its own.
    Every reader hides the entry while it still names `ino` (a directory only once nothing
    in it is left visible); the writer that owns it removes it from its own tree (with an
    UNLINK record of its own) when it next sees this record."""

    writer: str
    parent: int
    ino: int
    name: bytes


@dataclass(slots=True)
class XExtentRec:
    """File bytes [foff, foff + length) of this writer's inode `ino` are bytes
    [roff, roff + length) of a run of writer `writer`'s data log `log`: the run at `loff` of
    `run_length` bytes whose CRC32C is `crc` (the whole run is what a reader checks). Written
    when a writer takes over another writer's file (copy-up) without copying its bytes; the
    owner of the log must keep the run while such a record names it."""

    ino: int
    foff: int
    length: int
    writer: str
    log: int
    loff: int
    run_length: int
    crc: int
    roff: int


Record = (InodeRec | ExtentRec | SetattrRec | SizeRec | RenameRec | UnlinkRec | LinkRec
          | CommitRec | RetireRec | NumbersRec | XUnlinkRec | XExtentRec)
CROSS_WRITER_RECORDS = (XUnlinkRec, XExtentRec)  # need an index of CROSS_INDEX_VERSION
_IN_RANGE.update((cls, _in_range_test(cls)) for cls in Record.__args__)


# The CRC32C of each type byte, where a record's checksum starts (it covers type + body).
_TYPE_CRC = tuple(crc32c(bytes((t,))) for t in range(256))


def _frame(rtype: int, body: bytes) -> bytes:
    return REC_HEADER.pack(len(body), crc32c(body, _TYPE_CRC[rtype]), rtype) + body


def encode(rec: Record) -> bytes:
    """One record, framed and checksummed; RecordRangeError for one outside LIMITS."""
    ok = _IN_RANGE.get(type(rec))
    if ok is None or not ok(rec):
        check(rec)
    return encode_unchecked(rec)


def encode_unchecked(rec: Record) -> bytes:
    """encode() without LIMITS: only for tests that write what a damaged or hostile index
    holds."""
    t = type(rec)
    if t is ExtentRec:
        return _frame(R_EXTENT, _EXTENT.pack(rec.ino, rec.foff, rec.length, rec.log, rec.loff,
                                             rec.crc))
    if t is InodeRec:
        return _frame(R_INODE, _INODE.pack(rec.ino, rec.parent, rec.mode, rec.uid, rec.gid,
                                           rec.rdev, rec.atime_ns, rec.mtime_ns, rec.ctime_ns,
                                           len(rec.name)) + rec.name + rec.target)
    if t is SetattrRec:
        return _frame(R_SETATTR, _SETATTR.pack(rec.ino, rec.mode, rec.uid, rec.gid, rec.atime_ns,
                                               rec.mtime_ns, rec.ctime_ns))
    if t is SizeRec:
        return _frame(R_SIZE, _SIZE.pack(rec.ino, rec.size, rec.mtime_ns, rec.ctime_ns))
    if t is RenameRec:
        return _frame(R_RENAME, _RENAME.pack(rec.old_parent, rec.new_parent, rec.flags,
                                             len(rec.old_name)) + rec.old_name + rec.new_name)
    if t is UnlinkRec:
        return _frame(R_UNLINK, _UNLINK.pack(rec.parent) + rec.name)
    if t is LinkRec:
        return _frame(R_LINK, _LINK.pack(rec.ino, rec.parent) + rec.name)
    if t is CommitRec:
        return _frame(R_COMMIT, _COMMIT.pack(rec.seq, rec.time_ns))
    if t is RetireRec:
        return _frame(R_RETIRE, _RETIRE.pack(rec.log))
    if t is NumbersRec:
        return _frame(R_NUMBERS, _NUMBERS.pack(rec.next_ino, rec.next_log))
    if t is XUnlinkRec:
        w = rec.writer.encode()
        return _frame(R_XUNLINK, _XUNLINK.pack(rec.parent, rec.ino, len(w)) + w + rec.name)
    if t is XExtentRec:
        w = rec.writer.encode()
        return _frame(R_XEXTENT, _XEXTENT.pack(rec.ino, rec.foff, rec.length, rec.log, rec.loff,
                                               rec.run_length, rec.crc, rec.roff, len(w)) + w)
    raise TypeError(f"not an index record: {rec!r}")


_INODE_SIZE = _INODE.size
_NOT_NAMES = frozenset((b"", b".", b".."))


def check_name(name: bytes) -> bytes:
    """A directory entry name as POSIX allows it; raises FormatError otherwise."""
    if not name or name in (b".", b"..") or b"/" in name or b"\0" in name:
        raise FormatError(f"invalid entry name {name!r}")
    if len(name) > NAME_MAX:
        raise FormatError(f"entry name of {len(name)} bytes (max {NAME_MAX})")
    return name


def decode(rtype: int, body: bytes) -> Record:
    """Parse one record body; FormatError when it does not make sense (a field outside
    LIMITS, a name POSIX does not allow, a body of the wrong length)."""
    try:
        rec = _parse(rtype, body)
    except struct.error as exc:
        raise FormatError(f"record type {rtype} of {len(body)} bytes: {exc}") from None
    ok = _IN_RANGE.get(type(rec))
    if ok is None or not ok(rec):
        problem = out_of_range(rec)
        if problem is not None:
            raise FormatError(f"field out of range: {problem}")
    return rec


def _parse(rtype: int, body: bytes) -> Record:
    if rtype == R_EXTENT:
        return ExtentRec(*_EXTENT.unpack(body))
    if rtype == R_INODE:
        (ino, parent, mode, uid, gid, rdev, at, mt, ct, nlen) = _INODE.unpack_from(body)
        name = body[_INODE_SIZE:_INODE_SIZE + nlen]
        if len(name) != nlen:
            raise FormatError("truncated name")
        if b"/" in name or b"\0" in name or nlen > NAME_MAX or name in _NOT_NAMES:
            check_name(name)  # (raises, saying what is wrong)
        return InodeRec(ino, parent, name, mode, uid, gid, rdev, at, mt, ct,
                        body[_INODE_SIZE + nlen:])
    if rtype == R_SETATTR:
        return SetattrRec(*_SETATTR.unpack(body))
    if rtype == R_SIZE:
        return SizeRec(*_SIZE.unpack(body))
    if rtype == R_RENAME:
        fixed = _RENAME.size
        op, np_, flags, olen = _RENAME.unpack_from(body)
        old = check_name(body[fixed:fixed + olen])
        new = check_name(body[fixed + olen:])
        return RenameRec(op, old, np_, new, flags)
    if rtype == R_UNLINK:
        (parent,) = _UNLINK.unpack_from(body)
        return UnlinkRec(parent, check_name(body[_UNLINK.size:]))
    if rtype == R_LINK:
        ino, parent = _LINK.unpack_from(body)
        return LinkRec(ino, parent, check_name(body[_LINK.size:]))
    if rtype == R_COMMIT:
        return CommitRec(*_COMMIT.unpack(body))
    if rtype == R_RETIRE:
        return RetireRec(*_RETIRE.unpack(body))
    if rtype == R_NUMBERS:
        return NumbersRec(*_NUMBERS.unpack(body))
    if rtype == R_XUNLINK:
        parent, ino, wlen = _XUNLINK.unpack_from(body)
        writer = _writer_id(body[_XUNLINK.size:_XUNLINK.size + wlen])
        return XUnlinkRec(writer, parent, ino, check_name(body[_XUNLINK.size + wlen:]))
    if rtype == R_XEXTENT:
        (ino, foff, length, log, loff, run_length, crc, roff, wlen) = _XEXTENT.unpack_from(body)
        writer = _writer_id(body[_XEXTENT.size:])
        if len(writer) != wlen:
            raise FormatError(f"cross-writer extent with a writer id of {len(writer)} bytes, "
                              f"not {wlen}")
        return XExtentRec(ino, foff, length, writer, log, loff, run_length, crc, roff)
    raise FormatError(f"unknown record type {rtype}")


_WRITER_ID_CHARS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def _writer_id(raw: bytes) -> str:
    """A writer id named in a record: the rules of backingdir.safe_writer_id."""
    if not 1 <= len(raw) <= 128 or raw in (b".", b"..") or not _WRITER_ID_CHARS.issuperset(raw):
        raise FormatError(f"invalid writer id {raw!r} in a record")
    return raw.decode()


def index_header(version: int = 1) -> bytes:
    """The 16 header bytes of an index of `version` (1 unless it holds RETIRE records)."""
    v = struct.pack("<8sI", INDEX_MAGIC, version)
    return INDEX_HEADER.pack(INDEX_MAGIC, version, crc32c(v))


@dataclass
class IndexScan:
    """What replay found in one index file."""

    groups: list[list[Record]] = field(default_factory=list)  # complete commit groups
    group_times: list[int] = field(default_factory=list)  # each group's COMMIT wall time (ns)
    group_seqs: list[int] = field(default_factory=list)  # each group's COMMIT sequence number
    # for each group: whether damage was skipped right before it (its start is not known)
    group_after_damage: list[bool] = field(default_factory=list)
    valid_bytes: int = INDEX_HEADER.size  # where the next record may be appended
    warnings: list[str] = field(default_factory=list)
    # the byte ranges [start, end) skipped as damaged: a commit group from its start to where
    # replay resumed, or from there to the end of the index when it could not
    damaged: list[tuple[int, int]] = field(default_factory=list)
    last_seq: int = 0
    version: int = 1  # the header's
    stopped: bool = False  # ended at scan_index's stop_at, before the end of the bytes


def open_index_file(path: str):
    """An index opened for reading, never through a symbolic link (FormatError for one: a
    backing directory's owner may plant links where a daemon running as root reads)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FormatError(f"{path} is a symbolic link, not a ckptfs index") from None
        raise
    return open(fd, "rb")


def check_index_header(path: str) -> None:
    """FormatError when `path` exists and is not a ckptfs index this version can read."""
    try:
        with open_index_file(path) as f:
            head = f.read(INDEX_HEADER.size)
    except FileNotFoundError:
        return
    if len(head) >= INDEX_HEADER.size:  # a shorter, torn header: replay treats it as empty
        _check_header(path, head)


def _check_header(path: str, data: bytes) -> int:
    magic, version, crc = INDEX_HEADER.unpack_from(data)
    if magic != INDEX_MAGIC or crc != crc32c(struct.pack("<8sI", magic, version)):
        raise FormatError(f"{path}: not a ckptfs index (bad magic or header checksum)")
    if version > INDEX_VERSION:
        raise FormatError(f"{path}: index format version {version} is newer than this ckptfs "
                          f"(supports {INDEX_VERSION}); upgrade ckptfs")
    return version


_COMMIT_FRAME = re.compile(re.escape(struct.pack("<I", _COMMIT.size)) + rb".{4}" +
                           re.escape(bytes((R_COMMIT,))), re.S)


def _resync(data: bytes, pos: int) -> int | None:
    """End of the first valid COMMIT record that starts after `pos`, or None."""
    for m in _COMMIT_FRAME.finditer(data, pos + 1):
        c = m.start()
        body = data[c + REC_HEADER.size:c + REC_HEADER.size + _COMMIT.size]
        if len(body) < _COMMIT.size:
            return None
        _, crc, _ = REC_HEADER.unpack_from(data, c)
        if crc32c(body, _TYPE_CRC[R_COMMIT]) == crc:
            return c + REC_HEADER.size + _COMMIT.size
    return None


def _problem(data: bytes, pos: int) -> tuple[str, int]:
    """What is wrong with the record at `pos` (one scan_index did not take): (the problem,
    the body length its header gives, 0 without a header)."""
    end = len(data)
    if pos + REC_HEADER.size > end:
        return "torn record header", 0
    blen, crc, rtype = REC_HEADER.unpack_from(data, pos)
    if blen > MAX_RECORD_BODY or pos + REC_HEADER.size + blen > end:
        return "torn or oversized record", blen
    body = data[pos + REC_HEADER.size:pos + REC_HEADER.size + blen]
    if crc32c(body, _TYPE_CRC[rtype]) != crc:
        return "record checksum mismatch", blen
    try:
        decode(rtype, body)
    except FormatError as exc:
        return f"bad record ({exc})", blen
    raise AssertionError("scan_index left a good record")  # (its own test would be wrong)


INDEX_PIECE_BYTES = 1 << 20  # an index is read this much at a time


def read_index(path: str, on_group: OnGroup | None = None) -> IndexScan:
    """Read an index file; complete commit groups only, a torn or corrupt tail is reported
    in `warnings` and excluded. Raises FormatError for a foreign file or a newer version.
    `on_group`: as scan_index's (then the bytes in memory at once are a piece of the file
    and one commit group, whatever its size)."""
    with open_index_file(path) as f:
        return scan_index_file(path, f, on_group=on_group)


def scan_index_file(path: str, f, tail: bool = False, on_group: OnGroup | None = None,
                    head: bytes = b"", stop_at: int | None = None) -> IndexScan:
    """scan_index of the bytes of file object `f` from its position on (after `head`: an
    index header for a tail), read INDEX_PIECE_BYTES at a time."""
    return scan_index(path, head + f.read(INDEX_PIECE_BYTES), tail, on_group,
                      more=lambda: f.read(INDEX_PIECE_BYTES), stop_at=stop_at)


def read_index_tail(path: str, offset: int) -> tuple[IndexScan, int]:
    """The commit groups appended to an index since byte `offset` (the end of a commit group
    read before): (scan, the file's size as read). `scan.valid_bytes` is where the next read
    starts: the end of the last complete commit group (a group being written is left for the
    next read). Raises FormatError as read_index, OSError if the file is gone."""
    with open_index_file(path) as f:
        head = f.read(INDEX_HEADER.size)
        f.seek(offset)
        scan = scan_index_file(path, f, tail=True, head=head)
        size = f.tell()
    if scan.valid_bytes >= INDEX_HEADER.size:
        scan.valid_bytes = offset + scan.valid_bytes - INDEX_HEADER.size
    return scan, size


OnGroup = Callable[[list[Record], int], None]


def scan_index(path: str, data: bytes, tail: bool = False, on_group: OnGroup | None = None,
               more=None, stop_at: int | None = None) -> IndexScan:
    """The records of `data`: an index header followed by records (the whole index, or with
    `tail` the records from some commit boundary on, where a group still being written at
    the end is expected and not reported). With `on_group`, each complete commit group is
    handed to `on_group(records, commit time)` as soon as it is read instead of being kept in
    `groups` (replay: the records of a large index are never all in memory at once). With
    `more`, `data` is only the first piece of the bytes: more() gives the next (b"" at their
    end), and the bytes before the record being read are let go (offsets in the scan count
    from the start of `data`). With `stop_at`, the scan ends after the first commit group
    that ends there or later (`stopped`: a read in pieces goes on from `valid_bytes`)."""
    scan = IndexScan()
    eof = more is None
    while not eof and len(data) < INDEX_HEADER.size:
        piece = more()
        eof = not piece
        data += piece
    if len(data) < INDEX_HEADER.size:
        if data:
            scan.warnings.append(Damage(TORN_TAIL, f"{path}: index header torn ({len(data)} "
                                               "bytes), treated as empty"))
        scan.valid_bytes = 0
        return scan
    scan.version = _check_header(path, data)
    pos = INDEX_HEADER.size
    base = 0  # the offset of data[0] in the bytes scanned
    group: list[Record] = []
    after_damage = False
    end = len(data)
    header, hsize, type_crc = REC_HEADER.unpack_from, REC_HEADER.size, _TYPE_CRC
    while True:
        if pos >= end:
            if eof:
                break
            data, base, pos, eof = _read_on(data, base, pos, more)
            end = len(data)
            continue
        # The way of a well-formed record first (a replay reads a few per file); anything
        # else is looked at again below.
        if pos + hsize <= end:
            blen, crc, rtype = header(data, pos)
            b = pos + hsize
            e = b + blen
            if e <= end and blen <= MAX_RECORD_BODY:
                body = data[b:e]
                if crc32c(body, type_crc[rtype]) == crc:
                    try:
                        rec = decode(rtype, body)
                    except FormatError:
                        pass
                    else:
                        pos = e
                        if rtype != R_COMMIT:
                            group.append(rec)
                            continue
                        if on_group is None:
                            scan.groups.append(group)
                            scan.group_times.append(rec.time_ns)
                            scan.group_seqs.append(rec.seq)
                            scan.group_after_damage.append(after_damage)
                        else:
                            on_group(group, rec.time_ns)
                        after_damage = False
                        group = []
                        scan.valid_bytes = base + pos
                        scan.last_seq = rec.seq
                        if stop_at is not None and base + pos >= stop_at:
                            scan.stopped = True
                            return scan
                        continue
            elif not eof and blen <= MAX_RECORD_BODY:  # (the rest of it is still to read)
                data, base, pos, eof = _read_on(data, base, pos, more)
                end = len(data)
                continue
        elif not eof:
            data, base, pos, eof = _read_on(data, base, pos, more)
            end = len(data)
            continue
        problem, blen = _problem(data, pos)
        at = base + pos
        # A torn tail (a crash during a commit) is the usual case: nothing after it was
        # acknowledged. But damage in the middle (a flipped or zeroed byte, a length that
        # runs past the end, a record that does not parse) must not cost the commits after
        # it: look for the next valid COMMIT record, drop the damaged group, resume after it.
        # (Records after it are checked one by one as any others: nothing in them is
        # trusted more than before.)
        resume = _resync(data, pos)
        while resume is None and not eof:  # (read on, keeping where a COMMIT may start)
            keep = max(pos + 1, len(data) - _COMMIT_BYTES)
            data, base, pos, eof = _read_on(data, base, keep, more)
            pos -= 1  # (_resync looks after pos)
            resume = _resync(data, pos)
        end = len(data)
        if resume is None:
            if tail and problem.startswith("torn"):
                break  # (being appended to right now)
            torn = problem.startswith("torn") and blen <= MAX_RECORD_BODY
            scan.warnings.append(Damage(
                TORN_TAIL if torn else INDEX_ENDED,
                f"{path}: {problem} at byte {at}; the rest of the index ({base + end - at} "
                "bytes) is ignored"))
            if not torn:
                scan.damaged.append((scan.valid_bytes, base + end))
            break
        scan.warnings.append(Damage(
            GROUP_SKIPPED, f"{path}: {problem} at byte {at}; {len(group)} records before "
            f"it and the bytes up to {base + resume} (the damaged commit group) skipped, "
            "replay resumes there"))
        scan.damaged.append((scan.valid_bytes, base + resume))
        group = []
        after_damage = True
        pos = resume
        scan.valid_bytes = base + pos
    if group and not tail:
        scan.warnings.append(Damage(TORN_TAIL, f"{path}: {len(group)} records after the last "
                                           "commit ignored (interrupted commit)"))
    return scan


_COMMIT_BYTES = REC_HEADER.size + _COMMIT.size


def _read_on(data: bytes, base: int, pos: int, more) -> tuple[bytes, int, int, bool]:
    """The bytes from `pos` on with the next piece after them: (data, base, pos, at the
    end)."""
    piece = more()
    return data[pos:] + piece, base + pos, 0, not piece


# ---------------------------------------------------------------- copies of commit groups
# Every commit group appended to the index is also written into the data logs, in a copy
# block placed right after a segment (at the next segment's write, or at the unmount): the
# logs then say whose bytes they hold and which names were created, and `ckptfs fsck`
# rebuilds what a damaged or lost index no longer has (docs/format.md, "Copies").
COPY_MAGIC = b"CKPTCPY\0"
COPY_VERSION = 1
# magic, version, body length, data log, offset in it, the sequence number before the first
# group, crc32c of the 32 bytes after the magic's and the body
COPY_HEADER = struct.Struct("<8sIIQQQI4x")


def copy_block(log: int, loff: int, from_seq: int, body: bytes) -> bytes:
    """The copy block of `body` (framed records: whole commit groups, each ending with its
    COMMIT; the first follows commit `from_seq`) that lies at offset `loff` of data log `log`.
    Not padded: the writer pads it to its alignment with zeros."""
    fields = struct.pack("<IIQQQ", COPY_VERSION, len(body), log, loff, from_seq)
    return COPY_HEADER.pack(COPY_MAGIC, COPY_VERSION, len(body), log, loff, from_seq,
                            crc32c(body, crc32c(fields[:32]))) + body


def parse_copy_header(head: bytes, log: int, loff: int) -> tuple[int, int, int] | None:
    """(body length, from_seq, crc) of a copy block header read at `loff` of data log `log`;
    None when it is not one (a copy's header names where it lies: one found elsewhere, in a
    file's bytes, is not taken)."""
    if len(head) < COPY_HEADER.size or head[:8] != COPY_MAGIC:
        return None
    _, version, blen, at_log, at_off, from_seq, crc = COPY_HEADER.unpack_from(head)
    if version != COPY_VERSION or at_log != log or at_off != loff or blen > 1 << 30:
        return None
    return blen, from_seq, crc


def copy_body_ok(head: bytes, body: bytes, crc: int) -> bool:
    return crc32c(body, crc32c(head[8:40])) == crc


def data_log_header(writer: str, log: int) -> bytes:
    meta = json.dumps({"writer": writer, "log": log, "version": FORMAT_VERSION}).encode()
    head = DATA_MAGIC + struct.pack("<II", FORMAT_VERSION, len(meta)) + meta
    return head.ljust(DATA_HEADER_BYTES, b"\0")
