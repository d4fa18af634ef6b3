"""The node tier's drain (ckptfs/datapath/drain.py) without a mount: a Drain over real directories
and the real io engine, told what a flusher would tell it (its commits), its trio side a plain
function. What must hold: a commit's data logs are copied up to where the commit left them,
not further, and the backing index gets the commit's bytes after them; a log closed since is
copied whole; the commits come out in order."""

from __future__ import annotations

import os
import threading

import pytest
from helpers import content

from ckptfs.datapath import tier as node_tier
from ckptfs.datapath.drain import Drain, DrainStats, Note
from ckptfs.format import records
from ckptfs.format.backingdir import INDEX_NAME, WriterDir, data_log_name
from ckptfs.format.records import INDEX_HEADER, CommitRec, InodeRec, encode

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20


class Side:
    """What the trio thread would get: the sequence numbers drained, the errors."""

    def __init__(self) -> None:
        self.drained: list[int] = []
        self.errors: list[BaseException] = []
        self.cv = threading.Condition()

    def call_soon(self, fn, *args) -> None:
        with self.cv:
            fn(*args)
            self.cv.notify_all()

    def on_drained(self, seq: int) -> None:
        self.drained.append(seq)

    def on_error(self, exc) -> None:
        self.errors.append(exc)

    def on_fatal(self, exc, where) -> None:
        self.errors.append(exc)

    def wait_drained(self, seq: int, timeout: float = 20) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: self.drained and self.drained[-1] >= seq,
                                    timeout), (self.drained, self.errors)


@pytest.fixture
def tier(tmp_path):
    for name in ("local", "b"):
        os.mkdir(tmp_path / name)
    local, backing = WriterDir(str(tmp_path / "local"), "w"), WriterDir(str(tmp_path / "b"), "w")
    local.open()
    backing.open()
    made = []

    def make(drained_index: int = 0) -> tuple[Drain, Side]:
        side = Side()
        d = Drain(local, backing.dir, DrainStats(), drained_index=drained_index, logs=[],
                  engine="auto",
                  depth=8, direct=False, io_chunk_bytes=MiB, local_direct=False,
                  call_soon=side.call_soon, on_drained=side.on_drained,
                  on_error=side.on_error, on_fatal=side.on_fatal)
        d.start()
        made.append(d)
        return d, side

    yield local, backing, make
    for d in made:
        d.join()
    local.close()
    backing.close()


def _write_log(local: WriterDir, lg: int, off: int, data: bytes) -> None:
    fd = local.dir.open(data_log_name(lg), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, data, off)
    finally:
        os.close(fd)


def _append_index(local: WriterDir, data: bytes) -> int:
    fd = local.dir.open(INDEX_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        if os.fstat(fd).st_size == 0:
            os.write(fd, b"\0" * INDEX_HEADER.size)
        os.write(fd, data)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _backing(backing: WriterDir, name: str) -> bytes:
    try:
        with open(os.path.join(backing.path, name), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


def test_a_commit_is_copied_up_to_its_ends_then_its_index(tier):
    local, backing, make = tier
    d, side = make()
    a = content("a", 3 * MiB)
    later = content("later", MiB)
    _write_log(local, 1, 0, a + later)  # (written past what the commit names)
    end = _append_index(local, b"commit-1")
    d.put(Note(1, end, {1: len(a)}))
    side.wait_drained(1)
    assert _backing(backing, data_log_name(1)) == a, "copied up to the commit's end, not past"
    assert _backing(backing, INDEX_NAME)[INDEX_HEADER.size:] == b"commit-1"
    assert d.stats.bytes == len(a) + len(b"commit-1"), d.stats.bytes  # (what was copied)
    # the log closed since (None: its size is final) and a second one: both copied whole
    b = content("b", 2 * MiB)
    _write_log(local, 2, 0, b)
    end2 = _append_index(local, b"commit-2")
    d.put(Note(2, end2, {1: None, 2: len(b)}))
    side.wait_drained(2)
    assert _backing(backing, data_log_name(1)) == a + later
    assert _backing(backing, data_log_name(2)) == b
    assert _backing(backing, INDEX_NAME)[INDEX_HEADER.size:] == b"commit-1commit-2"
    assert not side.errors


def test_commits_drain_in_order_the_newest_covering_the_older(tier):
    local, backing, make = tier
    d, side = make()
    data = b""
    for seq in range(1, 21):
        piece = content(f"p{seq}", 256 * 1024)
        _write_log(local, 1, len(data), piece)
        data += piece
        end = _append_index(local, f"c{seq:02d}".encode())
        d.put(Note(seq, end, {1: len(data)}))
    side.wait_drained(20)
    assert side.drained == sorted(side.drained) and side.drained[-1] == 20
    assert _backing(backing, data_log_name(1)) == data
    assert _backing(backing, INDEX_NAME)[INDEX_HEADER.size:] == b"".join(
        f"c{i:02d}".encode() for i in range(1, 21))


def test_a_remount_parses_the_index_once_and_the_drain_completes_a_torn_group(tier,
                                                                                monkeypatch):
    """A remount with the tier whose backing index is the local index's first bytes (here up
    to the middle of a group the drain was copying) compares their bytes and parses neither:
    the replay parses the local index after, and a large index takes seconds to parse. The
    drain then goes on from the backing index's end, and the two are the same."""
    local, backing, make = tier
    groups = [encode(InodeRec(10 + i, 1, b"f%d" % i, 0o100644, 0, 0, 0, 1, 1, 1))
              + encode(CommitRec(i + 1, 1)) for i in range(3)]
    full = records.index_header() + b"".join(groups)
    with open(os.path.join(local.path, INDEX_NAME), "wb") as f:
        f.write(full)
    torn = len(records.index_header()) + len(groups[0]) + len(groups[1]) // 2
    with open(os.path.join(backing.path, INDEX_NAME), "wb") as f:
        f.write(full[:torn])
    scans = []
    real_scan = records.scan_index
    monkeypatch.setattr(records, "scan_index", lambda *a, **k: scans.append(a[0]) or
                        real_scan(*a, **k))
    assert node_tier.reconcile(local.dir, backing.dir) == torn
    assert scans == []
    d, side = make(drained_index=torn)
    d.put(Note(3, len(full), {}))
    side.wait_drained(3)
    assert _backing(backing, INDEX_NAME) == full and not side.errors
