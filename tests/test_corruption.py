"""Damaged and hostile backing directories.

- A flipped byte in a data log: reads of that file fail with EIO, other files read fine,
  `ckptfs verify` names exactly the damaged file and exits non-zero.
- A corrupt or truncated index record: skipped with a warning (daemon log, verify stderr).
- Hostile indexes built by hand with ckptfs.format.records: the mount refuses the bad records with a
  warning, never crashes, never shows a name that is not a sane single path component."""

from __future__ import annotations

import errno
import os
import stat
import struct

import pytest
from helpers import KiB, MiB, cli, content, damage_run, read_all

from ckptfs.daemon import replay
from ckptfs.format import backingdir, records
from ckptfs.format.records import (
    CommitRec,
    ExtentRec,
    InodeRec,
    LinkRec,
    RenameRec,
    SetattrRec,
    SizeRec,
    UnlinkRec,
    encode,
    encode_unchecked,
)
from ckptfs.namespace import Namespace
from ckptfs.tools.snapshot import Snapshot

pytestmark = pytest.mark.timeout(120)

OPTS = dict(writer_id="w", segment_size="1M", staging_size="8M")


def _files(m, names_sizes):
    for name, size in names_sizes.items():
        with open(os.path.join(m.mountpoint, name), "wb") as f:
            f.write(content(name, size))


def test_flipped_byte_in_data_log(mounts):
    backing = mounts.backing()
    m = mounts.mount(backing, **OPTS)
    files = {"a": 300 * KiB, "b": 300 * KiB, "c": 2 * MiB + 5, "d": 10}
    _files(m, files)
    m.stop()
    snap = Snapshot(backing)
    run = damage_run(backing, "/c", 1)  # the second extent of c
    res = cli("verify", backing)
    assert res.returncode != 0, res.stdout
    damaged = [ln for ln in res.stdout.splitlines() if ln.startswith("DAMAGED /")]
    assert damaged and all(ln.startswith("DAMAGED /c:") for ln in damaged), res.stdout
    assert "1 damaged files" in res.stdout, res.stdout
    m = mounts.mount(backing, **OPTS)
    for name in ("a", "b", "d"):
        assert read_all(os.path.join(m.mountpoint, name)) == content(name, files[name]), name
    with pytest.raises(OSError) as ei:
        read_all(os.path.join(m.mountpoint, "c"))
    assert ei.value.errno == errno.EIO
    # The undamaged first piece of c still reads; the damaged range keeps failing. Unbuffered:
    # a buffered reader would fetch st_blksize (512 KiB) and so reach into the damaged run.
    with open(os.path.join(m.mountpoint, "c"), "rb", buffering=0) as f:
        first = snap.lookup("/c").emap.pieces[0]
        assert f.read(first.length) == content("c", files["c"])[:first.length]
        f.seek(first.length + run.length // 2)
        with pytest.raises(OSError) as ei:
            f.read(100)
        assert ei.value.errno == errno.EIO
    assert "checksum mismatch" in mounts.log(m)
    for name in ("a", "b", "d"):  # still fine after the failures
        assert read_all(os.path.join(m.mountpoint, name)) == content(name, files[name]), name


def _commit_offsets(index: bytes) -> list[tuple[int, int, int]]:
    """(offset, type, total length) of every record of an index."""
    out = []
    pos = records.INDEX_HEADER.size
    while pos < len(index):
        blen, _, rtype = records.REC_HEADER.unpack_from(index, pos)
        out.append((pos, rtype, records.REC_HEADER.size + blen))
        pos += records.REC_HEADER.size + blen
    return out


def _synced_groups(mounts, backing: str, names: list[str]):
    """One 100 KiB file per name, a sync between them (one commit group each, the last one
    committed by the unmount). Returns (index path, index bytes as a bytearray, its records)."""
    m = mounts.mount(backing, **OPTS)
    for i, name in enumerate(names):
        if i:
            m.sync()
        _files(m, {name: 100 * KiB})
    m.stop()
    index_path = os.path.join(backing, "writers", "w", backingdir.INDEX_NAME)
    index = bytearray(read_all(index_path))
    return index_path, index, _commit_offsets(bytes(index))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_index_record(mounts, damage):
    backing = mounts.backing()
    index_path, index, recs = _synced_groups(mounts, backing, ["early", "late"])
    first_commit = next(i for i, r in enumerate(recs) if r[1] == records.R_COMMIT)
    pos, rtype, n = recs[first_commit + 1]  # the first record of the second group
    if damage == "flip":
        index[pos + n - 1] ^= 0xFF
    else:
        index = index[:pos + n - 3]
    with open(index_path, "wb") as f:
        f.write(index)
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "warning:" in res.stderr and str(pos) in res.stderr, res.stderr
    m = mounts.mount(backing, **OPTS)
    assert sorted(os.listdir(m.mountpoint)) == ["early"]
    assert read_all(os.path.join(m.mountpoint, "early")) == content("early", 100 * KiB)
    log = mounts.log(m)
    assert "WARNING" in log and f"at byte {pos}" in log, log
    m.stop()


# ---------------------------------------------------------------- hostile indexes
T0 = 1_700_000_000 * 10**9
F, D = stat.S_IFREG | 0o644, stat.S_IFDIR | 0o755


def ino(i, parent, name, mode=F, target=b""):
    return InodeRec(i, parent, name, mode, 0, 0, 0, T0, T0, T0, target)


def raw(rtype: int, body: bytes, blen: int | None = None, crc: int | None = None) -> bytes:
    """A record framed by hand (any length field, any checksum)."""
    from crc32c import crc32c
    c = crc32c(body, crc32c(bytes((rtype,)))) if crc is None else crc
    return records.REC_HEADER.pack(len(body) if blen is None else blen, c, rtype) + body


def bad_inode_name(name: bytes) -> bytes:
    body = struct.pack("<QQIIIIqqqH", 50, 1, F, 0, 0, 0, T0, T0, T0, len(name)) + name
    return raw(records.R_INODE, body)


# name -> (records after the good prefix (bytes), what the warning says)
HOSTILE = {
    "slash": (bad_inode_name(b"a/../../etc"), "invalid entry name"),
    "dotdot": (bad_inode_name(b".."), "invalid entry name"),
    "dot": (bad_inode_name(b"."), "invalid entry name"),
    "nul": (bad_inode_name(b"x\0y"), "invalid entry name"),
    "long": (bad_inode_name(b"n" * 256), "max 255"),
    "empty": (bad_inode_name(b""), "invalid entry name"),
    "name_len_past_body": (raw(records.R_INODE, struct.pack(
        "<QQIIIIqqqH", 50, 1, F, 0, 0, 0, T0, T0, T0, 200) + b"abc"), "bad record"),
    "rename_to_slash": (encode(RenameRec(1, b"ok", 1, b"../x")), "invalid entry name"),
    "unlink_dotdot": (encode(UnlinkRec(1, b"..")), "invalid entry name"),
    "link_slash": (encode(LinkRec(2, 1, b"a/b")), "invalid entry name"),
    "extent_absurd_offset": (encode_unchecked(ExtentRec(2, 1 << 60, 4096, 1, 4096, 0)),
                             "out of range"),
    "extent_in_header": (encode_unchecked(ExtentRec(2, 0, 4096, 1, 0, 0)), "out of range"),
    "size_absurd": (encode_unchecked(SizeRec(2, 1 << 62, T0, T0)), "out of range"),
    "size_negative": (encode_unchecked(SizeRec(2, -5, T0, T0)), "out of range"),
    "unknown_type": (raw(99, b"\0" * 20), "unknown record type"),
    "short_body": (raw(records.R_EXTENT, b"\0" * 7), "bad record"),
    "huge_length": (raw(records.R_INODE, b"\0" * 60, blen=0xFFFFFFFF), "oversized"),
    "length_past_end": (raw(records.R_INODE, b"\0" * 60, blen=5000), "oversized"),
    "bad_crc": (raw(records.R_INODE, encode(ino(50, 1, b"evil"))[9:], crc=1234), "checksum"),
}

# records that parse but do not fit the tree: skipped one by one, replay goes on
MISFIT = {
    "unknown_inode_extent": (encode(ExtentRec(777, 0, 10, 1, 4096, 0)), "unknown inode"),
    "extent_on_dir": (encode(ExtentRec(3, 0, 10, 1, 4096, 0)), "not a regular file"),
    "extent_past_log_end": (encode(ExtentRec(5, 0, 4096, 1, 1 << 40, 0)), "beyond the log"),
    "extent_missing_log": (encode(ExtentRec(5, 0, 4096, 9, 4096, 0)), "beyond the log"),
    "parent_is_file": (encode(ino(60, 2, b"under_file")), "not a directory"),
    "parent_unknown": (encode(ino(61, 999, b"orphan")), "unknown inode"),
    "root_recreated": (encode(ino(1, 1, b"root2", D)), "created twice"),
    "ino_twice": (encode(ino(2, 1, b"again")), "created twice"),
    "name_twice": (encode(ino(62, 1, b"ok")), "created twice"),
    "bad_type": (encode(ino(63, 1, b"typeless", 0o644)), "bad file type"),
    "dir_into_itself": (encode(RenameRec(1, b"d", 3, b"inside")), "into itself"),
    "dir_into_child": (encode(RenameRec(1, b"d", 4, b"inside")), "into itself"),
    "rename_missing": (encode(RenameRec(1, b"nope", 1, b"x")), "missing"),
    "link_dir": (encode(LinkRec(3, 1, b"dirlink")), "bad link"),
    "link_into_self": (encode(LinkRec(4, 4, b"loop")), "bad link"),
    "unlink_nonempty": (encode(UnlinkRec(1, b"d")), "non-empty"),
    "setattr_unknown": (encode(SetattrRec(888, 0o777, 0, 0, T0, T0, T0)), "unknown inode"),
}


def _good_prefix(log: int, loff: int, crc: int) -> bytes:
    """root/ok (a 4096-byte file in data log `log`), root/d/e (directories 3, 4), root/v
    (an empty file, 5)."""
    recs = [ino(2, 1, b"ok"), ExtentRec(2, 0, 4096, log, loff, crc), ino(3, 1, b"d", D),
            ino(4, 3, b"e", D), ino(5, 1, b"v"), CommitRec(5, T0)]
    return records.index_header() + b"".join(encode(r) for r in recs)


@pytest.fixture
def hostile_backing(mounts):
    """A real backing directory with one data log holding 4096 known bytes at offset 4096."""
    backing = mounts.backing()
    m = mounts.mount(backing, **OPTS)
    with open(os.path.join(m.mountpoint, "seed"), "wb") as f:
        f.write(content("ok", 4096))
    m.stop()
    snap = Snapshot(backing)
    run = snap.lookup("/seed").emap.runs()[0]
    return backing, _good_prefix(run.log, run.loff, run.crc)


def _sane_walk(mnt: str) -> list[str]:
    out = []
    for d, dirs, files in os.walk(mnt):
        assert d.count("/") - mnt.count("/") < 10, f"a cycle in the tree at {d}"
        for n in dirs + files:
            assert n and "/" not in n and "\0" not in n and n not in (".", "..") \
                and len(n.encode()) <= 255, repr(n)
            p = os.path.join(d, n)
            assert os.path.realpath(os.path.dirname(p)).startswith(os.path.realpath(mnt))
            out.append(os.path.relpath(p, mnt))
    return sorted(out)


def _mount_hostile(mounts, backing, index: bytes):
    path = os.path.join(backing, "writers", "w", backingdir.INDEX_NAME)
    with open(path, "wb") as f:
        f.write(index)
    return mounts.mount(backing, **OPTS)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_record_replay(tmp_path, case):
    """Every hostile record, through the replay the mount uses (in process, fast)."""
    rec, why = HOSTILE[case]
    path = tmp_path / "index.log"
    path.write_bytes(_good_prefix(1, 4096, 0) + rec + encode(ino(70, 1, b"after"))
                     + encode(CommitRec(99, T0)))
    ns = Namespace(now_ns=0)
    _, valid, warnings = replay(ns, str(path))
    root = ns.inodes[1]
    assert sorted(root.children) == [b"d", b"ok", b"v"], root.children
    assert len(ns.inodes) == 5
    assert any(why in w for w in warnings), warnings
    # its commit group (with "after") is skipped, replay resumes after its COMMIT
    assert valid == path.stat().st_size


MOUNTED = ["slash", "dotdot", "nul", "long", "huge_length", "unknown_type",
           "extent_absurd_offset"]


@pytest.mark.parametrize("case", MOUNTED)
def test_hostile_record_stops_replay(mounts, hostile_backing, case):
    backing, prefix = hostile_backing
    rec, why = HOSTILE[case]
    tail = encode(ino(70, 1, b"after")) + encode(CommitRec(99, T0))
    m = _mount_hostile(mounts, backing, prefix + rec + tail + encode(CommitRec(100, T0)))
    assert m.proc.poll() is None
    assert _sane_walk(m.mountpoint) == ["d", "d/e", "ok", "v"]
    assert read_all(os.path.join(m.mountpoint, "ok")) == content("ok", 4096)
    log = mounts.log(m)
    assert "WARNING" in log and why in log, log
    assert "Traceback" not in log, log
    # The mount stays usable.
    with open(os.path.join(m.mountpoint, "new"), "wb") as f:
        f.write(b"x" * 100)
    m.stop()


def test_misfit_records_skipped(mounts, hostile_backing):
    """All records that parse but do not fit, in one index, each in its own commit group,
    then a good record: each one is skipped with its own warning, replay continues."""
    backing, prefix = hostile_backing
    body = b"".join(rec + encode(CommitRec(10 + i, T0))
                    for i, (rec, _) in enumerate(MISFIT.values()))
    tail = encode(ino(70, 1, b"after")) + encode(CommitRec(99, T0))
    m = _mount_hostile(mounts, backing, prefix + body + tail)
    names = _sane_walk(m.mountpoint)
    log = mounts.log(m)
    assert "Traceback" not in log, log
    assert names == ["after", "d", "d/e", "ok", "v"], (names, log)
    assert read_all(os.path.join(m.mountpoint, "ok")) == content("ok", 4096)
    for case, (_, why) in MISFIT.items():
        assert why in log, f"{case}: no warning containing {why!r}\n{log}"
    assert os.stat(os.path.join(m.mountpoint, "d")).st_nlink == 3
    m.stop()
    res = cli("verify", backing)
    assert "warning:" in res.stderr


def test_exchange_creating_a_cycle(mounts, hostile_backing):
    """RENAME_EXCHANGE of directory d with its own child d/e would make d its own
    descendant: must be refused like a plain rename into itself (tree unchanged)."""
    backing, prefix = hostile_backing
    rec = encode(RenameRec(3, b"e", 1, b"d", 2)) + encode(CommitRec(10, T0))
    m = _mount_hostile(mounts, backing, prefix + rec)
    names = _sane_walk(m.mountpoint)
    assert names == ["d", "d/e", "ok", "v"], names
    assert "into itself" in mounts.log(m)
    m.stop()


def test_exchange_cycle_then_rename_does_not_hang(mounts, hostile_backing):
    backing, prefix = hostile_backing
    rec = (encode(RenameRec(3, b"e", 1, b"d", 2)) + encode(CommitRec(10, T0))
           + encode(RenameRec(1, b"d", 3, b"x")) + encode(CommitRec(11, T0)))
    path = os.path.join(backing, "writers", "w", backingdir.INDEX_NAME)
    with open(path, "wb") as f:
        f.write(prefix + rec)
    # `ckptfs verify` runs the same replay as the mount; (api.Mount.start cannot time out a
    # daemon that hangs before its first line: it blocks in readline)
    res = cli("verify", backing, timeout=30)  # TimeoutExpired when replay hangs
    assert "into itself" in res.stderr


def test_huge_inode_numbers(mounts, hostile_backing):
    """An inode number at the top of the u64 range must not make the mount unusable."""
    backing, prefix = hostile_backing
    rec = encode_unchecked(ino((1 << 64) - 1, 1, b"big")) + encode(CommitRec(10, T0))
    m = _mount_hostile(mounts, backing, prefix + rec)
    _sane_walk(m.mountpoint)
    with open(os.path.join(m.mountpoint, "new"), "wb") as f:
        f.write(b"x")
    assert os.path.getsize(os.path.join(m.mountpoint, "new")) == 1
    m.stop()


def test_damage_in_the_middle_keeps_later_commits(mounts):
    """A corrupt record in the middle of an index costs its own commit group, not the commits
    after it, and a read-write mount does not cut them off."""
    backing = mounts.backing()
    index_path, index, recs = _synced_groups(mounts, backing, ["early", "middle", "late"])
    commits = [i for i, r in enumerate(recs) if r[1] == records.R_COMMIT]
    pos, _, n = recs[commits[0] + 1]  # a record of the second group ("middle")
    index[pos + n - 1] ^= 0xFF
    with open(index_path, "wb") as f:
        f.write(index)
    size = len(index)
    res = cli("verify", backing)
    assert "resumes" in res.stderr, res.stderr
    for _ in range(2):  # a read-write mount must not cut the later commits off
        m = mounts.mount(backing, **OPTS)
        names = sorted(os.listdir(m.mountpoint))
        assert "early" in names and "late" in names, names
        assert read_all(os.path.join(m.mountpoint, "late")) == content("late", 100 * KiB)
        m.stop()
        assert os.path.getsize(index_path) >= size
