"""The index format without a mount: every record type encodes and decodes to itself, bodies
that make no sense are refused, and the index scan reports each kind of damage as
docs/format.md describes it (torn tail, checksum damage in the middle, oversized record, a
record that does not parse, a foreign or newer header)."""

from __future__ import annotations

import json
import os
import struct

import pytest
from crc32c import crc32c

from ckptfs.format import records
from ckptfs.format.records import (
    INDEX_HEADER,
    MAX_RECORD_BODY,
    REC_HEADER,
    CommitRec,
    ExtentRec,
    FormatError,
    InodeRec,
    LinkRec,
    RenameRec,
    SetattrRec,
    SizeRec,
    UnlinkRec,
)

ONE_OF_EACH = [
    InodeRec(2, 1, b"file", 0o100644, 1000, 100, 0, 1, 2, 3),
    InodeRec(3, 1, b"d" * 255, 0o40755, 0, 0, 0, -5, 10**18, 2**62),
    InodeRec(4, 3, b"link", 0o120777, 7, 8, 0, 4, 5, 6, b"../file"),
    InodeRec(5, 1, b"dev", 0o20600, 0, 0, (8 << 8) | 1, 0, 0, 0),
    ExtentRec(2, 0, 4096, 1, 4096, 0xDEADBEEF),
    ExtentRec(2, (1 << 40) + 7, 2 << 20, 7, 1 << 33, 0),
    SetattrRec(2, 0o104755, 0, 65534, 11, 12, 13),
    SizeRec(2, 0, 1, 2),
    SizeRec(2, records.MAX_FILE_BYTES, -1, -2),
    RenameRec(1, b"a", 3, b"b"),
    RenameRec(3, b"x" * 255, 1, b"y" * 255, 2),
    UnlinkRec(1, b"file"),
    LinkRec(2, 3, b"hard"),
    CommitRec(42, 1_700_000_000_123_456_789),
]


def _split(frame: bytes) -> tuple[int, bytes]:
    blen, crc, rtype = REC_HEADER.unpack_from(frame)
    body = frame[REC_HEADER.size:]
    assert len(body) == blen
    assert crc == crc32c(body, crc32c(bytes((rtype,))))
    return rtype, body


@pytest.mark.parametrize("rec", ONE_OF_EACH, ids=lambda r: type(r).__name__)
def test_round_trip(rec):
    rtype, body = _split(records.encode(rec))
    assert records.decode(rtype, body) == rec


def test_record_types_are_the_documented_numbers():
    want = {InodeRec: 1, ExtentRec: 2, SetattrRec: 3, SizeRec: 4, RenameRec: 5, UnlinkRec: 6,
            CommitRec: 7, LinkRec: 8}
    for rec in ONE_OF_EACH:
        assert _split(records.encode(rec))[0] == want[type(rec)]


def test_encode_refuses_other_objects():
    with pytest.raises(TypeError):
        records.encode(("not", "a", "record"))


@pytest.mark.parametrize("rtype, body, why", [
    (records.R_UNLINK, struct.pack("<Q", 1) + b"", "empty name"),
    (records.R_UNLINK, struct.pack("<Q", 1) + b".", "dot"),
    (records.R_UNLINK, struct.pack("<Q", 1) + b"..", "dot dot"),
    (records.R_UNLINK, struct.pack("<Q", 1) + b"a/b", "slash"),
    (records.R_UNLINK, struct.pack("<Q", 1) + b"a\0b", "nul"),
    (records.R_LINK, struct.pack("<QQ", 2, 1) + b"n" * 256, "name too long"),
    (records.R_RENAME, struct.pack("<QQIH", 1, 1, 0, 10) + b"short", "old name past the body"),
    (records.R_INODE, records.encode(InodeRec(2, 1, b"abc", 0o100644, 0, 0, 0, 0, 0, 0))[
        REC_HEADER.size:REC_HEADER.size + records._INODE.size + 1], "name cut short"),
    (records.R_INODE, b"\0" * 20, "short fixed part"),
    (records.R_EXTENT, struct.pack("<QQIIQI", 2, records.MAX_FILE_BYTES, 1, 1, 4096, 0),
     "extent past the largest file"),
    (records.R_EXTENT, struct.pack("<QQIIQI", 2, 0, 1, 1, 100, 0), "extent inside the header"),
    (records.R_SIZE, struct.pack("<Qqqq", 2, -1, 0, 0), "negative size"),
    (records.R_SIZE, struct.pack("<Qqqq", 2, records.MAX_FILE_BYTES + 1, 0, 0), "huge size"),
    (records.R_SETATTR, b"\0" * 10, "short body"),
    (records.R_COMMIT, b"\0" * 17, "long body"),
    (99, b"", "unknown type"),
])
def test_decode_refuses(rtype, body, why):
    with pytest.raises(FormatError):
        records.decode(rtype, body)


# ---------------------------------------------------------------- the index scan
def _index(tmp_path, *parts: bytes, header: bytes | None = None) -> str:
    p = tmp_path / "index.log"
    p.write_bytes((records.index_header() if header is None else header) + b"".join(parts))
    return str(p)


def _group(seq: int, *recs) -> bytes:
    return b"".join(records.encode(r) for r in recs) + records.encode(CommitRec(seq, seq * 10))


G1 = (InodeRec(2, 1, b"a", 0o100644, 0, 0, 0, 1, 1, 1), ExtentRec(2, 0, 10, 1, 4096, 5))
G2 = (InodeRec(3, 1, b"b", 0o40755, 0, 0, 0, 2, 2, 2), SetattrRec(2, 0o600, 0, 0, 3, 3, 3))
G3 = (UnlinkRec(1, b"a"),)


def test_scan_of_clean_index(tmp_path):
    data = _group(1, *G1) + _group(2, *G2) + _group(3, *G3)
    scan = records.read_index(_index(tmp_path, data))
    assert scan.groups == [list(G1), list(G2), list(G3)]
    assert scan.group_times == [10, 20, 30]
    assert scan.last_seq == 3
    assert scan.valid_bytes == INDEX_HEADER.size + len(data)
    assert scan.warnings == [] and scan.damaged == []


def test_scan_of_empty_and_torn_header(tmp_path):
    scan = records.read_index(_index(tmp_path, header=b""))
    assert (scan.groups, scan.valid_bytes, scan.warnings) == ([], 0, [])
    scan = records.read_index(_index(tmp_path, header=records.index_header()[:9]))
    assert scan.groups == [] and scan.valid_bytes == 0
    assert len(scan.warnings) == 1 and "header torn" in scan.warnings[0]
    assert scan.warnings[0].kind == records.TORN_TAIL


def test_scan_refuses_foreign_and_newer_headers(tmp_path):
    bad = bytearray(records.index_header())
    bad[0] ^= 1
    with pytest.raises(FormatError, match="not a ckptfs index"):
        records.read_index(_index(tmp_path, header=bytes(bad)))
    v = struct.pack("<8sI", records.INDEX_MAGIC, records.INDEX_VERSION + 1)
    newer = INDEX_HEADER.pack(records.INDEX_MAGIC, records.INDEX_VERSION + 1, crc32c(v))
    with pytest.raises(FormatError, match="newer"):
        records.read_index(_index(tmp_path, header=newer))
    with pytest.raises(FormatError, match="newer"):
        records.check_index_header(_index(tmp_path, header=newer))
    records.check_index_header(str(tmp_path / "missing"))  # no index yet: fine


@pytest.mark.parametrize("cut", [1, REC_HEADER.size - 1, REC_HEADER.size + 3])
def test_torn_tail_ends_the_scan(tmp_path, cut):
    """A crash in the middle of a commit: the complete groups stay, the tail is reported and
    the next append goes where the tail starts."""
    good = _group(1, *G1)
    tail = _group(2, *G2)
    scan = records.read_index(_index(tmp_path, good, tail[:cut]))
    assert scan.groups == [list(G1)]
    assert scan.valid_bytes == INDEX_HEADER.size + len(good)
    assert scan.last_seq == 1
    assert len(scan.warnings) == 1
    assert "torn" in scan.warnings[0] and f"byte {INDEX_HEADER.size + len(good)}" in \
        scan.warnings[0]
    assert scan.warnings[0].kind == records.TORN_TAIL  # nothing acknowledged is lost
    assert scan.damaged == []  # (a tear is not damage)


def test_records_after_the_last_commit_are_not_applied(tmp_path):
    good = _group(1, *G1)
    scan = records.read_index(_index(tmp_path, good, records.encode(G3[0])))
    assert scan.groups == [list(G1)]
    assert scan.valid_bytes == INDEX_HEADER.size + len(good)
    assert len(scan.warnings) == 1 and "after the last commit" in scan.warnings[0]
    assert scan.warnings[0].kind == records.TORN_TAIL


def test_checksum_damage_in_the_middle_skips_one_group(tmp_path):
    """Bit rot inside the second group: that group is lost, the third survives, and the
    warning names where the damage is and where replay resumed."""
    g1, g2, g3 = _group(1, *G1), _group(2, *G2), _group(3, *G3)
    bad = bytearray(g2)
    bad[REC_HEADER.size + 3] ^= 0x40  # inside the first record's body
    scan = records.read_index(_index(tmp_path, g1, bytes(bad), g3))
    assert scan.groups == [list(G1), list(G3)]
    assert scan.last_seq == 3
    assert scan.valid_bytes == INDEX_HEADER.size + len(g1) + len(g2) + len(g3)
    assert len(scan.warnings) == 1
    w = scan.warnings[0]
    assert "checksum mismatch" in w and f"byte {INDEX_HEADER.size + len(g1)}" in w
    assert f"up to {INDEX_HEADER.size + len(g1) + len(g2)}" in w
    assert w.kind == records.GROUP_SKIPPED
    # (the bytes skipped: the damaged group whole, from its start)
    assert scan.damaged == [(INDEX_HEADER.size + len(g1), INDEX_HEADER.size + len(g1) + len(g2))]


def test_checksum_damage_in_the_last_group_ends_the_scan(tmp_path):
    g1, g2 = _group(1, *G1), _group(2, *G2)
    bad = bytearray(g2)
    bad[-1] ^= 1  # the COMMIT record itself: no valid COMMIT after the damage
    scan = records.read_index(_index(tmp_path, g1, bytes(bad)))
    assert scan.groups == [list(G1)]
    assert scan.valid_bytes == INDEX_HEADER.size + len(g1)
    assert "checksum mismatch" in scan.warnings[0]
    assert "the rest of the index" in scan.warnings[0]
    assert scan.damaged == [(INDEX_HEADER.size + len(g1), INDEX_HEADER.size + len(g1) + len(g2))]
    assert scan.warnings[1:] and "2 records after the last commit" in scan.warnings[1]


def test_an_oversized_record_costs_the_records_up_to_the_next_commit(tmp_path):
    """A length field beyond the largest record is damage, not a tear, when a valid COMMIT
    comes after it: the records up to that COMMIT are skipped, the scan goes on after it."""
    g1, g3, g4 = _group(1, *G1), _group(3, *G3), _group(4, *G2)
    # (the body is there in full: only the length limit refuses it, not the file's end)
    huge = REC_HEADER.pack(MAX_RECORD_BODY + 1, 0, records.R_UNLINK) + bytes(MAX_RECORD_BODY + 1)
    path = _index(tmp_path, g1, huge, g3, g4)
    scan = records.read_index(path)
    assert scan.groups == [list(G1), list(G2)]  # (g3 ends the damaged stretch: its COMMIT)
    assert scan.valid_bytes == os.path.getsize(path) and scan.last_seq == 4
    start = INDEX_HEADER.size + len(g1)
    assert scan.damaged == [(start, start + len(huge) + len(g3))]
    assert len(scan.warnings) == 1 and "oversized" in scan.warnings[0]
    assert scan.warnings[0].kind == records.GROUP_SKIPPED


def test_a_well_formed_record_that_does_not_parse_costs_its_group_only(tmp_path):
    """A checksummed record with a bad name (damage that kept the checksum, or a broken
    writer): its commit group is skipped, the later groups are read, record by record
    checked as any others."""
    g1, g3 = _group(1, *G1), _group(3, *G3)
    body = struct.pack("<Q", 1) + b"a/b"
    rec = REC_HEADER.pack(len(body), crc32c(body, crc32c(bytes((records.R_UNLINK,)))),
                          records.R_UNLINK) + body
    path = _index(tmp_path, g1, rec + records.encode(CommitRec(2, 0)), g3)
    scan = records.read_index(path)
    assert scan.groups == [list(G1), list(G3)]
    assert scan.valid_bytes == os.path.getsize(path)
    assert len(scan.warnings) == 1 and "bad record" in scan.warnings[0]
    assert scan.warnings[0].kind == records.GROUP_SKIPPED


def test_damage_right_after_the_header(tmp_path):
    g1, g2 = _group(1, *G1), _group(2, *G2)
    bad = bytearray(g1)
    bad[4] ^= 0xFF  # the first record's checksum field
    scan = records.read_index(_index(tmp_path, bytes(bad), g2))
    assert scan.groups == [list(G2)]
    assert scan.last_seq == 2 and len(scan.warnings) == 1


def test_data_log_header():
    head = records.data_log_header("w1", 7)
    assert len(head) == records.DATA_HEADER_BYTES
    assert head.startswith(records.DATA_MAGIC)
    version, n = struct.unpack_from("<II", head, len(records.DATA_MAGIC))
    assert version == records.FORMAT_VERSION
    meta = head[len(records.DATA_MAGIC) + 8:len(records.DATA_MAGIC) + 8 + n]
    assert json.loads(meta) == {"writer": "w1", "log": 7,
                                              "version": records.FORMAT_VERSION}
    assert head[len(records.DATA_MAGIC) + 8 + n:] == bytes(len(head) - n - 16)


def _pieces(data: bytes, size: int):
    """scan_index's `more` over `data` cut into pieces of `size` bytes."""
    at = [0]

    def more() -> bytes:
        piece = data[at[0]:at[0] + size]
        at[0] += len(piece)
        return piece
    return more


@pytest.mark.parametrize("seed", range(40))
def test_a_scan_in_pieces_finds_what_a_scan_of_the_whole_finds(seed):
    """An index read a piece at a time (pieces of a few bytes up to a few records) gives the
    groups, commit times, damage reports (with their byte offsets), end and last sequence
    number a scan of all its bytes gives: clean, damaged in the middle (flipped or zeroed
    bytes, garbage), torn at the end, as a whole index and as a tail; with `stop_at`, the
    scan ends after the first group that ends there or later."""
    import random

    rng = random.Random(seed)
    groups = [G1, G2, G3, (SetattrRec(3, 0o700, 1, 1, 4, 4, 4),)]
    data = bytearray(b"".join(_group(i + 1, *rng.choice(groups)) for i in range(30)))
    for _ in range(rng.randrange(4)):
        at = rng.randrange(len(data))
        kind = rng.randrange(3)
        if kind == 0:
            data[at] ^= 1 << rng.randrange(8)
        elif kind == 1:
            data[at:at + rng.randrange(1, 80)] = bytes(rng.randrange(1, 80))
        else:
            data[at:at] = os.urandom(rng.randrange(1, 300))
    if rng.random() < 0.5:
        del data[len(data) - rng.randrange(1, 40):]
    whole = records.index_header() + bytes(data)
    for tail in (False, True):
        want = records.scan_index("i", whole, tail=tail)
        for size in (1, 7, 25, 64, 1000):
            more = _pieces(whole, size)
            got = records.scan_index("i", more(), tail=tail, more=more)
            assert (got.groups, got.group_times, got.group_seqs, got.group_after_damage,
                    list(map(str, got.warnings)), got.valid_bytes, got.last_seq) == (
                    want.groups, want.group_times, want.group_seqs, want.group_after_damage,
                    list(map(str, want.warnings)), want.valid_bytes, want.last_seq), size
    if want.groups:
        stop_at = rng.randrange(INDEX_HEADER.size, want.valid_bytes + 1)
        more = _pieces(whole, 9)
        got = records.scan_index("i", more(), more=more, stop_at=stop_at)
        assert got.stopped and got.valid_bytes >= stop_at
        assert got.groups == want.groups[:len(got.groups)]
