"""The node tier's drain (ckptfs/datapath/drain.py) without a mount: a Drain over real directories
and the real io engine, told what a flusher would tell it (written ranges, commits), its trio
side a plain function. What must hold: written ranges are copied before their commit; the
backing index gets a commit's bytes only once everything that commit and those before it name
is copied and synced; a range written again is copied again; the copying steps aside while the
writers wait for staging room (and the time it waited is counted)."""

from __future__ import annotations

import os
import threading
import time

import pytest
from helpers import content, wait_for

from ckptfs.datapath.drain import Drain, DrainStats, Note, Written
from ckptfs.format.backingdir import INDEX_NAME, WriterDir, data_log_name
from ckptfs.format.records import INDEX_HEADER

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

    def make(step_aside=lambda: False) -> tuple[Drain, Side]:
        side = Side()
        d = Drain(local, backing.dir, DrainStats(), drained_index=0, logs=[], engine="auto",
                  depth=8, direct=False, io_chunk_bytes=MiB, local_direct=False,
                  call_soon=side.call_soon, on_drained=side.on_drained,
                  on_error=side.on_error, on_fatal=side.on_fatal, step_aside=step_aside)
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


def test_written_ranges_are_copied_before_their_commit_and_the_index_after(tier):
    local, backing, make = tier
    d, side = make()
    a = content("a", 3 * MiB)
    _write_log(local, 1, 0, a)
    d.put(Written({1: (0, len(a))}))
    wait_for(lambda: _backing(backing, data_log_name(1))[:len(a)] == a,
          "written bytes never reached the backing log")
    assert _backing(backing, INDEX_NAME) == b"", "no commit yet: no index"
    end = _append_index(local, b"commit-1")
    d.put(Note(1, end, {1: len(a)}))
    side.wait_drained(1)
    assert _backing(backing, INDEX_NAME)[INDEX_HEADER.size:] == b"commit-1"
    # a commit naming a log not yet copied in full waits for it; the one before it goes
    b = content("b", 2 * MiB)
    _write_log(local, 2, 0, b)
    end2 = _append_index(local, b"commit-2")
    d.put(Note(2, end2, {1: len(a), 2: len(b)}))
    side.wait_drained(2)
    assert _backing(backing, data_log_name(2))[:len(b)] == b
    assert _backing(backing, INDEX_NAME)[INDEX_HEADER.size:] == b"commit-1commit-2"
    assert not side.errors


def test_a_range_written_again_is_copied_again(tier):
    local, backing, make = tier
    d, side = make()
    first, second = content("x", 2 * MiB), content("y", 2 * MiB)
    _write_log(local, 1, 0, first)
    d.put(Written({1: (0, len(first))}))
    wait_for(lambda: _backing(backing, data_log_name(1))[:len(first)] == first, "not copied")
    _write_log(local, 1, 0, second)  # (a segment written again at its place)
    d.put(Written({1: (0, len(second))}))
    end = _append_index(local, b"c")
    d.put(Note(1, end, {1: len(second)}))
    side.wait_drained(1)
    assert _backing(backing, data_log_name(1))[:len(second)] == second


def test_the_copying_steps_aside_while_writers_wait_for_staging(tier):
    local, backing, make = tier
    waiting = threading.Event()
    waiting.set()
    d, side = make(step_aside=waiting.is_set)
    a = content("a", 4 * MiB)
    _write_log(local, 1, 0, a)
    d.put(Written({1: (0, len(a))}))
    end = _append_index(local, b"c")
    d.put(Note(1, end, {1: len(a)}))

    def yielded() -> float:
        return d.stats.yielded_seconds + (time.perf_counter() - d.aside_since
                                          if d.aside_since else 0.0)

    wait_for(lambda: yielded() >= 0.5, "the drain never looked at the writers")
    assert _backing(backing, data_log_name(1)) == b"" and not side.drained
    waiting.clear()
    side.wait_drained(1)
    assert _backing(backing, data_log_name(1))[:len(a)] == a
    assert d.stats.yielded_seconds >= 0.5
