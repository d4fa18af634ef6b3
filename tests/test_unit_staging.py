"""Staging without a mount: the extent map (newest wins, punch, truncate, find, stored bytes),
the segment pool (appends across segments, sealing, backpressure, in-place landing), the
checksums writes leave owing (summed later, bounded, settled before a buffer is reused) or
bring along (a queue thread's, fuse/crc32c.c: taken in, split where a block ends) and the
journal's committable prefix (never past an extent whose segment is not durable)."""

from __future__ import annotations

import copy
import random

import pytest
import trio
import trio.testing
from crc32c import crc32c

from ckptfs.datapath.journal import ExtentEntry, Journal, fold_setattrs
from ckptfs.datapath import writes
from ckptfs.datapath.staging import (
    Checksums,
    ExtentMap,
    Run,
    Segment,
    Staging,
    round_up,
)
from ckptfs.io import uring
from ckptfs.format import records
from ckptfs.format.records import CommitRec, ExtentRec, InodeRec, SetattrRec, SizeRec, UnlinkRec
from ckptfs.namespace import Inode, Namespace

pytestmark = pytest.mark.timeout(30)  # a pool that never seals spins without yielding

SEG = 64 << 10


def run(n: int, tag: int = 0) -> Run:
    return Run(None, 0, n, log=tag, loff=4096)


def layout(m: ExtentMap) -> list[tuple]:
    """(start, length, run tag, offset in run) of every piece."""
    return [(s, n, r.log, o) for s, n, r, o in m.pieces]


class Model:
    """The map's meaning, byte by byte: which (run tag, offset in run) holds each byte."""

    def __init__(self) -> None:
        self.b: dict[int, tuple[int, int]] = {}

    def insert(self, start, n, tag, roff):
        for i in range(n):
            self.b[start + i] = (tag, roff + i)

    def punch(self, lo, hi):
        for i in range(lo, hi):
            self.b.pop(i, None)

    def of(self, m: ExtentMap) -> dict:
        out = {}
        for s, n, r, o in m.pieces:
            for i in range(n):
                assert s + i not in out, "pieces overlap"
                out[s + i] = (r.log, o + i)
        return out


# ---------------------------------------------------------------- ExtentMap
def test_append_and_overwrite_newest_wins():
    m = ExtentMap()
    m.insert(0, 100, run(100, 1), 0)
    m.insert(100, 50, run(50, 2), 0)
    assert layout(m) == [(0, 100, 1, 0), (100, 50, 2, 0)] and m.end() == 150
    m.insert(80, 40, run(40, 3), 0)  # over the end of one piece and the start of the next
    assert layout(m) == [(0, 80, 1, 0), (80, 40, 3, 0), (120, 30, 2, 20)]
    m.insert(10, 5, run(5, 4), 0)  # inside one piece: it splits
    assert layout(m) == [(0, 10, 1, 0), (10, 5, 4, 0), (15, 65, 1, 15), (80, 40, 3, 0),
                         (120, 30, 2, 20)]
    m.insert(0, 150, run(150, 5), 0)  # over everything
    assert layout(m) == [(0, 150, 5, 0)]
    assert m.stored_bytes() == 150


def test_holes_and_writes_past_the_end():
    m = ExtentMap()
    m.insert(1000, 10, run(10, 1), 0)
    m.insert(0, 10, run(10, 2), 0)  # before the first piece
    assert layout(m) == [(0, 10, 2, 0), (1000, 10, 1, 0)]
    assert m.stored_bytes() == 20 and m.end() == 1010
    assert m.find(10, 1000) == []  # the hole
    assert [(p.start, p.length) for p in m.find(5, 1005)] == [(5, 5), (1000, 5)]


def test_truncate_clips_and_never_grows():
    m = ExtentMap()
    m.insert(0, 100, run(100, 1), 0)
    m.insert(200, 100, run(100, 2), 0)
    m.truncate(250)
    assert layout(m) == [(0, 100, 1, 0), (200, 50, 2, 0)] and m.stored_bytes() == 150
    m.truncate(1000)  # growing adds a hole, not bytes
    assert m.end() == 250 and m.stored_bytes() == 150
    m.truncate(249)  # one byte off the end
    assert layout(m) == [(0, 100, 1, 0), (200, 49, 2, 0)] and m.stored_bytes() == 149
    m.truncate(50)
    assert layout(m) == [(0, 50, 1, 0)]
    m.truncate(0)
    assert m.pieces == [] and m.stored_bytes() == 0 and m.end() == 0


def test_punch_keeps_offsets_into_the_run():
    m = ExtentMap()
    r = run(100, 1)
    m.insert(0, 100, r, 0)
    m.punch(20, 30)
    assert layout(m) == [(0, 20, 1, 0), (30, 70, 1, 30)]
    assert m.runs() == [r]  # one run, two pieces
    m.punch(0, 1000)
    assert m.pieces == [] and m.runs() == []


def test_grow_lengthens_the_last_piece_only():
    m = ExtentMap()
    a, b = run(100, 1), run(100, 2)
    m.insert(0, 10, a, 0)
    m.insert(10, 10, b, 0)
    m.grow(5)
    assert layout(m) == [(0, 10, 1, 0), (10, 15, 2, 0)] and m.stored_bytes() == 25


def test_a_shared_map_sees_the_other_maps_changes_but_counts_its_own_bytes():
    own, view = ExtentMap(), ExtentMap()
    own.insert(0, 100, run(100, 1), 0)
    view.share(own)
    own.insert(50, 100, run(100, 2), 0)  # an overwrite and an append, in place
    assert layout(view) == [(0, 50, 1, 0), (50, 100, 2, 0)]
    assert view.stored_bytes() == 100 and own.stored_bytes() == 150  # until shared again
    view.drop()
    assert view.pieces == [] and layout(own) == [(0, 50, 1, 0), (50, 100, 2, 0)]


def test_find_clips_to_the_range():
    m = ExtentMap()
    m.insert(0, 100, run(100, 1), 0)
    m.insert(100, 100, run(100, 2), 7)
    got = [(s, n, r.log, o) for s, n, r, o in m.find(50, 150)]
    assert got == [(50, 50, 1, 50), (100, 50, 2, 7)]
    assert m.find(200, 300) == [] and m.find(0, 0) == []


def test_random_operations_match_a_byte_model():
    rng = random.Random(7)
    m, model = ExtentMap(), Model()
    for step in range(400):
        op = rng.random()
        lo = rng.randrange(0, 800)
        n = rng.randrange(1, 120)
        if op < 0.7:
            roff = rng.randrange(0, 50)
            m.insert(lo, n, run(roff + n, step), roff)
            model.insert(lo, n, step, roff)
        elif op < 0.85:
            m.punch(lo, lo + n)
            model.punch(lo, lo + n)
        else:
            m.truncate(lo)
            model.punch(lo, 1 << 20)
        ends = [p.start + p.length for p in m.pieces]
        assert all(e <= p.start for e, p in zip(ends, m.pieces[1:])), "unsorted or overlapping"
        assert all(p.length > 0 for p in m.pieces)
        assert model.of(m) == model.b, f"step {step}"
        assert m.stored_bytes() == len(model.b)
        assert m.end() == (max(model.b) + 1 if model.b else 0)


# ---------------------------------------------------------------- Staging
def run_trio(main) -> None:
    """Run `main` in trio with a deadline: a writer that waits forever fails the test."""
    async def bounded():
        with trio.fail_after(10):
            await main()
    trio.run(bounded)


def staging(n_segments: int = 2, sealed=None) -> Staging:
    return Staging(SEG, n_segments * SEG, (sealed if sealed is not None else []).append)


def test_append_packs_files_back_to_back_and_seals_full_segments():
    async def main():
        sealed = []
        st = staging(3, sealed)
        pieces = []
        data_a = bytes(range(256)) * 100  # 25,600 bytes
        data_b = b"\xee" * (SEG + 100)

        def rec(name):
            return lambda seg, dpos, soff, k: pieces.append((name, seg.number, dpos, soff, k))

        await st.append(data_a, rec("a"))
        await st.append(data_b, rec("b"), base=5)
        assert pieces == [("a", 1, 0, 0, 25600),
                          ("b", 1, 5, 25600, SEG - 25600),
                          ("b", 2, 5 + SEG - 25600, 0, 25600 + 100)]
        assert [s.number for s in sealed] == [1] and sealed[0].sealed
        seg1 = sealed[0]
        assert bytes(seg1.view[:25600]) == data_a
        assert bytes(seg1.view[25600:]) == data_b[:SEG - 25600]
        assert st.open.number == 2 and st.open.used == 25700
        assert st.staged_segments() == 2 and st.capacity_bytes == 3 * SEG
        seg2 = st.open
        assert st.seal() is seg2 and seg2.sealed
        assert [s.number for s in sealed] == [1, 2] and st.open is None
        assert st.seal() is None  # nothing open: nothing to seal
        st.close()

    run_trio(main)


def test_full_pool_makes_writers_wait_until_a_segment_is_released():
    async def main():
        sealed = []
        st = staging(2, sealed)
        await st.append(bytes(2 * SEG), lambda *a: None)  # both buffers full and sealed
        assert len(sealed) == 2 and not st.free
        done = []

        async def writer():
            await st.append(b"x" * 10, lambda seg, dpos, soff, k: done.append(seg.number))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            await trio.testing.wait_all_tasks_blocked()
            assert done == [] and st.waiting_writers == 1
            st.release(sealed[0])  # the buffer went back to the pool, its bytes kept
            assert sealed[0].released and sealed[0].buf is not None
        assert done == [3] and st.waiting_writers == 0
        assert sealed[0].buf is None  # the writer took the buffer: the bytes are gone
        st.close()

    run_trio(main)


def _written(st: Staging, seg: Segment, log: int, lfrom: int) -> None:
    """What the flusher does with a sealed segment: placed in `log` after the bytes up to
    `lfrom`, written, its buffer back to the pool."""
    seg.log, seg.loff, seg.lfrom = log, lfrom, lfrom
    seg.lend = lfrom + round_up(seg.used, 4096)
    for r in seg.runs:
        r.log, r.loff = seg.log, seg.loff + r.soff
    st.release(seg)


def test_written_segments_stay_readable_until_their_buffer_is_reused_oldest_first():
    async def main():
        sealed = []
        st = staging(4, sealed)
        x = _file(1)
        data = random.Random(1).randbytes(3 * SEG)
        journal = Journal()
        await _write(st, journal, x, 0, data, 1 << 20)
        assert [s.number for s in sealed] == [1, 2, 3]
        for seg in sealed:
            _written(st, seg, 7, (seg.number - 1) * SEG)
        runs = x.emap.runs()
        assert b"".join(bytes(r.memory()) for r in runs) == data  # all three, from memory
        assert st.kept_bytes() == 3 * SEG
        assert st.in_memory(7, 0, 3 * SEG) and st.in_memory(7, SEG // 2, SEG + 10)
        assert not st.in_memory(7, 0, 3 * SEG + 1) and not st.in_memory(8, 0, 1)
        # the never used buffer goes first, then the one written longest ago (segment 1)
        await st.append(bytes(SEG), lambda *a: None)
        assert [s.buf is not None for s in sealed[:3]] == [True, True, True]
        await st.append(bytes(SEG), lambda *a: None)
        assert [s.buf is not None for s in sealed[:3]] == [False, True, True]
        assert runs[0].memory() is None and bytes(runs[1].memory()) == data[SEG:2 * SEG]
        assert st.kept_bytes() == 2 * SEG
        assert not st.in_memory(7, 0, 2 * SEG) and st.in_memory(7, SEG, 3 * SEG)
        st.close()
        assert all(s.buf is None for s in sealed[:3])  # (kept ones let go at the end)

    run_trio(main)


def test_offered_tails_take_the_bytes_from_a_written_segment():
    """Another thread may land bytes in the tails offered (the queue threads): a written
    segment whose buffer is offered is no longer read from memory."""
    async def main():
        sealed = []
        st = staging(3, sealed)
        await st.append(b"a" * (3 * SEG), lambda *a: None)
        for seg in sealed:
            _written(st, seg, 0, (seg.number - 1) * SEG)
        assert all(s.buf is not None for s in sealed)
        t1, t2 = st.offered_tails()  # nothing open: the first two free buffers
        assert [s.buf is not None for s in sealed] == [False, False, True]
        assert st.in_memory(0, 2 * SEG, 3 * SEG) and not st.in_memory(0, SEG, 3 * SEG)
        st.landed(SEG // 2, lambda *a: None)  # half of the first is a segment's now
        t1, t2 = st.offered_tails()  # the open segment's rest, the next free buffer
        assert len(t1) == SEG // 2 and len(t2) == SEG
        assert sealed[2].buf is not None and st.kept_bytes() == SEG  # (not offered)
        st.close()

    run_trio(main)


def test_waiting_writer_gets_the_flusher_error():
    async def main():
        st = staging(2)
        await st.append(bytes(2 * SEG), lambda *a: None)
        st.error = OSError(28, "No space left on device")
        with pytest.raises(OSError) as e:
            await st.append(b"x", lambda *a: None)
        assert e.value.errno == 28
        st.close()

    run_trio(main)


def test_tails_and_landed_read_in_place():
    async def main():
        sealed = []
        st = staging(3, sealed)
        t1, t2 = st.tails()  # nothing open yet: the first two free buffers
        assert len(t1) == SEG and len(t2) == SEG and st.open is None
        t1[:5] = b"hello"
        got = []
        st.landed(5, lambda seg, dpos, soff, k: got.append((seg.number, dpos, soff, k)))
        assert got == [(1, 0, 0, 5)] and bytes(st.open.view[:5]) == b"hello"
        t1, t2 = st.tails()
        assert len(t1) == SEG - 5 and len(t2) == SEG
        st.landed(SEG - 5, lambda *a: None)  # fills it: sealed, the next buffer is first
        assert [s.number for s in sealed] == [1] and st.open is None
        st.close()

    run_trio(main)


def test_every_change_of_the_tails_claims_them_first():
    """Another thread may copy payloads into the offered tails (FUSE over io_uring's queue
    threads): whatever changes the open segment or takes a free buffer calls the claim hook
    first, so what that thread landed is recorded before, at the place it landed, and once:
    the claimer is let go before it runs, so what it records claims nothing again. Simulated
    here: the "other thread" lands bytes into the offered tails, and the claimer records them
    as Landing.claim does."""
    async def main():
        sealed = []
        st = staging(4, sealed)
        got = []
        other = []  # (bytes) the other thread landed and the hook has not recorded yet
        claims = []

        def hook():
            claims.append(len(other))
            while other:
                data = other.pop(0)
                st.landed(len(data), lambda seg, dpos, soff, k: got.append(
                    (seg.number, soff, bytes(seg.view[soff:soff + k]))))

        def land(data: bytes) -> None:  # the other thread, into what was offered
            t1, _ = st.offered_tails()
            st.offer(hook)
            t1[:len(data)] = data
            other.append(data)

        land(b"AAAA")
        await st.append(b"BB", lambda *a: got.append(("append",) + a[2:]))
        assert got[0] == (1, 0, b"AAAA") and got[1] == ("append", 4, 2)
        land(b"CCC")
        st.seal()  # (the idle sealer, a barrier)
        assert got[2] == (1, 6, b"CCC") and sealed[-1].used == 9
        land(b"DD")
        st.tails()  # (a /dev/fuse read into the tails)
        assert got[3] == (2, 0, b"DD")
        land(b"E")
        await st._open_segment()  # (the cleaner moving data)
        assert got[4] == (2, 2, b"E") and st.open.used == 3
        assert claims == [1, 1, 1, 1]
        st.close()

    run_trio(main)


# ---------------------------------------------------------------- owed checksums
def _file(ino: int = 5) -> Inode:
    x = Inode(ino, 0o100644, 0, 0)
    x.nlink = 1
    return x


def _write(st: Staging, journal: Journal, x: Inode, off: int, data: bytes, block: int):
    """A write through the real recorder, as the handlers and the fast path make it."""
    return st.append(data, writes.piece_recorder(journal, st.checksums, x, off, block))


def _runs_are_summed(x: Inode, payload: bytes) -> None:
    for p in x.emap.pieces:
        run = p.run
        assert run.summed == run.length
        assert run.crc == crc32c(payload[p.start - p.roff:p.start - p.roff + run.length])


def test_writes_owe_their_checksums_until_summed_in_slices():
    async def main():
        st = staging(4)
        journal = Journal()
        x = _file()
        payload = random.Random(3).randbytes(SEG + 5000)
        at = 0
        for n in (100, 3000, 20_000, SEG + 5000 - 23_100):  # runs grow, then a segment ends
            await _write(st, journal, x, at, payload[at:at + n], 1 << 20)
            at += n
        ck = st.checksums
        assert ck.owed == len(payload) and [r.summed for r in ck.runs] == [0, 0]
        while ck.owed:  # the request loop's idle slices, oldest run first
            ck.pay_idle()
        assert ck.paid_idle == len(payload) and not ck.runs
        _runs_are_summed(x, payload)
        st.close()

    run_trio(main)


needs_crc_c = pytest.mark.skipif(uring.lib is None, reason="ckptfs.io._uring_cffi not built")


@needs_crc_c
def test_the_queue_threads_crc32c_is_the_packages_and_joins():
    """fuse/crc32c.c against the crc32c package: any length and alignment, continued from any
    value; a shift joins two checksums into their concatenation's."""
    lib, ffi = uring.lib, uring.ffi
    rnd = random.Random(11)
    buf = rnd.randbytes(300_000)
    mv = memoryview(buf)
    for n in [0, 1, 7, 8, 9, 4095, 12_288, 12_289, 36_871, 200_003] + [
            rnd.randrange(300_000) for _ in range(40)]:
        at = rnd.randrange(len(buf) - n + 1)
        c0 = rnd.getrandbits(32) if rnd.random() < 0.5 else 0
        assert lib.ck_crc32c(c0, ffi.from_buffer(mv[at:at + n]), n) == crc32c(mv[at:at + n], c0)
    for _ in range(50):
        a, b = rnd.randbytes(rnd.randrange(5000)), rnd.randbytes(rnd.randrange(70_000))
        whole = crc32c(a + b)
        assert uring.crc32c_shift(crc32c(a), len(b)) ^ crc32c(b) == whole


@needs_crc_c
def test_landed_checksums_are_taken_in_where_they_fit_a_block():
    """Writes landed in place with their CRC32C (as they are summed in C), some without
    (taken before they were summed): every run ends with its own bytes' checksum, the known
    ones taken in at once (never queued), a write larger than a checksum block owed like
    one without, one that a segment's end splits landed as two pieces, and a run that owes
    bytes owes what follows."""
    async def main():
        st = staging(8)
        journal = Journal()
        x = _file()
        rnd = random.Random(12)
        payload = rnd.randbytes(3 * SEG + 777)
        block = 10_000  # not a divisor of the segment: blocks end inside writes
        rec = writes.piece_recorder(journal, st.checksums, x, 0, block)
        at = 0
        while at < len(payload):
            n = min(rnd.choice([1, 500, 4096, 9999, 9999, 25_000]), len(payload) - at)
            t1, t2 = st.tails()
            k1 = min(n, len(t1))
            t1[:k1] = payload[at:at + k1]
            k2 = n - k1
            if k2:
                t2[:k2] = payload[at + k1:at + n]
            known = rnd.random() < 0.8
            st.landed(k1, rec, base=at, crc=crc32c(payload[at:at + k1]) if known else None)
            if k2:
                st.landed(k2, rec, base=at + k1,
                          crc=crc32c(payload[at + k1:at + n]) if known else None)
            at += n
        ck = st.checksums
        assert ck.taken_landing > len(payload) // 4
        assert ck.taken_landing + ck.owed == len(payload)
        assert all(r.summed < r.length for r in ck.runs)  # (only runs that owe are queued)
        assert len({p.run.seg.number for p in x.emap.pieces}) == 4
        ck.pay(ck.owed)
        _runs_are_summed(x, payload)
        st.close()

    run_trio(main)


@needs_crc_c
def test_a_landed_piece_that_fits_a_block_starts_a_run_rather_than_split_its_checksum():
    """A piece that comes with its checksum and fits in a checksum block but not in the rest
    of the file's last run starts a run of its own: nothing is summed here, every byte's
    checksum is the one taken in C, and no run is longer than a block."""
    async def main():
        st = staging(8)
        journal = Journal()
        x = _file()
        rnd = random.Random(13)
        payload = rnd.randbytes(2 * SEG)
        block = 10_000
        rec = writes.piece_recorder(journal, st.checksums, x, 0, block)
        at = 0
        while at < len(payload):
            t1, _ = st.tails()
            n = min(rnd.choice([1, 700, 3000, 6001, 9999, 10_000]), len(payload) - at,
                    len(t1))
            t1[:n] = payload[at:at + n]
            st.landed(n, rec, base=at, crc=crc32c(payload[at:at + n]))
            at += n
        ck = st.checksums
        assert ck.taken_landing == len(payload) and ck.owed == 0 and not ck.runs
        runs = {id(p.run): p.run for p in x.emap.pieces}.values()
        assert max(r.length for r in runs) <= block
        assert len(runs) < len(payload) // 3000  # (pieces still join into runs)
        _runs_are_summed(x, payload)
        st.close()

    run_trio(main)


def test_checksum_blocks_and_partial_payments_give_each_runs_own_crc():
    async def main():
        st = staging(4)
        journal = Journal()
        x = _file()
        payload = random.Random(4).randbytes(40_000)
        for at in range(0, len(payload), 7000):  # 7 kB writes, 16 kB checksum blocks
            await _write(st, journal, x, at, payload[at:at + 7000], 16 << 10)
            st.checksums.pay(3333)  # sums a part, then more lands on the same run
        st.checksums.pay(st.checksums.owed)
        assert [p.run.length for p in x.emap.pieces] == [16 << 10, 16 << 10, 40_000 - (32 << 10)]
        _runs_are_summed(x, payload)
        st.close()

    run_trio(main)


def test_owed_bytes_are_bounded():
    async def main():
        st = staging(4)
        st.checksums = Checksums(cap=10_000)
        journal = Journal()
        x = _file()
        payload = random.Random(5).randbytes(50_000)
        for at in range(0, len(payload), 4000):
            await _write(st, journal, x, at, payload[at:at + 4000], 1 << 20)
            assert st.checksums.owed <= 10_000
        assert st.checksums.owed == 10_000  # the oldest were summed on the writes' path
        st.checksums.pay(st.checksums.owed)
        _runs_are_summed(x, payload)
        st.close()

    run_trio(main)


def test_a_segment_is_summed_before_its_buffer_goes_back_to_the_pool():
    async def main():
        sealed = []
        st = staging(3, sealed)
        journal = Journal()
        a, b = _file(5), _file(6)
        pa = random.Random(6).randbytes(SEG)  # fills segment 1
        pb = random.Random(7).randbytes(1000)  # segment 2, still open
        await _write(st, journal, a, 0, pa, 1 << 20)
        await _write(st, journal, b, 0, pb, 1 << 20)
        assert st.checksums.owed == SEG + 1000 and sealed[0].number == 1
        st.release(sealed[0])  # (the flusher wrote it)
        assert st.checksums.owed == 1000  # segment 1's runs summed, segment 2's still owed
        _runs_are_summed(a, pa)
        assert b.emap.pieces[0].run.summed == 0
        # more lands, across segments; every run ends up with the CRC32C of its own bytes
        await _write(st, journal, b, 1000, bytes(2 * SEG - 1000), 1 << 20)
        st.checksums.pay(st.checksums.owed)
        _runs_are_summed(b, pb + bytes(2 * SEG - 1000))
        st.close()

    run_trio(main)


def test_segment_size_must_be_aligned():
    async def main():
        with pytest.raises(ValueError):
            Staging(SEG + 1, 4 * SEG, lambda seg: None)

    run_trio(main)


def test_run_memory_only_while_staged():
    buf = bytearray(b"abcdefgh")
    seg = Segment(buf, 1)
    r = Run(seg, 2, 3)
    assert bytes(r.memory()) == b"cde"
    seg.buf = None
    assert r.memory() is None
    assert Run(None, 0, 3, 1, 4096).memory() is None
    assert round_up(1, 4096) == 4096 and round_up(4096, 4096) == 4096 and round_up(0, 8) == 0


# ---------------------------------------------------------------- Journal
def frames(data: bytes) -> list:
    out, pos = [], 0
    while pos < len(data):
        blen, _, rtype = records.REC_HEADER.unpack_from(data, pos)
        body = data[pos + records.REC_HEADER.size:pos + records.REC_HEADER.size + blen]
        out.append(records.decode(rtype, body))
        pos += records.REC_HEADER.size + blen
    return out


def test_journal_commits_only_a_prefix_whose_extents_are_durable():
    j = Journal(committed_seq=10)
    seg1, seg2 = Segment(bytearray(16), 1), Segment(bytearray(16), 2)
    r1, r2 = Run(seg1, 0, 100, crc=5), Run(seg2, 0, 50, crc=6)
    first = SetattrRec(2, 0o644, 0, 0, 1, 1, 1)
    unlink = UnlinkRec(1, b"x")  # made after the write: must wait for it
    j.add(first)
    j.add(ExtentEntry(2, 0, r1))
    j.add(unlink)
    j.add(ExtentEntry(3, 0, r2))
    assert j.last_seq == 14 and j.pending()

    data, upto = j.take_committable()  # no segment durable: only the first record
    got = frames(data)
    assert upto == 11 and got[:-1] == [first]
    assert type(got[-1]) is CommitRec and got[-1].seq == 11

    # the index write failed (no confirm): the same records are taken again, first
    seg1.durable, r1.log, r1.loff = True, 1, 4096
    data, upto = j.take_committable()
    got = frames(data)
    assert upto == 13 and got[:-1] == [first, ExtentRec(2, 0, 100, 1, 4096, 5), unlink]
    assert got[-1].seq == 13
    j.confirm(upto)
    assert j.committed_seq == 13 and j.unsent == b"" and j.pending()

    assert j.take_committable() == (b"", 13)  # the last extent still waits for its segment
    seg2.durable, r2.log, r2.loff = True, 1, 8192
    data, upto = j.take_committable()
    assert upto == 14 and frames(data)[:-1] == [ExtentRec(3, 0, 50, 1, 8192, 6)]
    j.confirm(upto)
    assert not j.pending() and j.take_committable() == (b"", 14)


def test_a_files_setattr_goes_into_its_inode_record_within_a_group_where_replay_agrees():
    j = Journal()
    seg = Segment(bytearray(16), 1)
    r1, r2 = Run(seg, 0, 100, crc=5), Run(seg, 0, 50, crc=6)
    j.add(InodeRec(2, 1, b"f", 0o100600, 0, 0, 0, 1, 1, 1))
    j.add(ExtentEntry(2, 0, r1))
    j.add(SetattrRec(2, 0o100644, 7, 8, 1, 5, 5))  # the close after the write: folded, as
    j.add(InodeRec(3, 1, b"g", 0o100600, 0, 0, 0, 6, 6, 6))  # this sets the root's times
    j.add(ExtentEntry(3, 0, r2))
    j.add(SetattrRec(3, 0o100600, 0, 0, 6, 7, 7))  # g's INODE would set the root's times
    j.add(InodeRec(4, 1, b"h", 0o100600, 0, 0, 0, 8, 8, 8))  # h: a SIZE in between
    j.add(SizeRec(4, 0, 9, 9))
    j.add(SetattrRec(4, 0o100600, 0, 0, 8, 9, 10))
    j.add(SetattrRec(1, 0o40755, 0, 0, 1, 11, 11))  # (the root's: no fold of g's before it)
    seg.durable, r1.log, r1.loff, r2.log, r2.loff = True, 1, 4096, 1, 8192
    data, upto = j.take_committable()
    assert upto == j.last_seq
    assert frames(data)[:-1] == [InodeRec(2, 1, b"f", 0o100644, 7, 8, 0, 1, 5, 5),
                                 ExtentRec(2, 0, 100, 1, 4096, 5),
                                 InodeRec(3, 1, b"g", 0o100600, 0, 0, 0, 6, 7, 7),
                                 ExtentRec(3, 0, 50, 1, 8192, 6),
                                 InodeRec(4, 1, b"h", 0o100600, 0, 0, 0, 8, 8, 8),
                                 SizeRec(4, 0, 9, 9),
                                 SetattrRec(4, 0o100600, 0, 0, 8, 9, 10),
                                 SetattrRec(1, 0o40755, 0, 0, 1, 11, 11)]


def test_without_a_later_record_for_its_directory_the_setattr_stays():
    j = Journal()
    j.add(InodeRec(2, 1, b"f", 0o100600, 0, 0, 0, 1, 1, 1))
    j.add(SetattrRec(2, 0o100644, 0, 0, 1, 5, 5))  # f's INODE is the root's last change
    data, _ = j.take_committable()
    assert [type(r).__name__ for r in frames(data)[:-1]] == ["InodeRec", "SetattrRec"]


def test_folding_keeps_the_replayed_tree():
    """The records of a group replay to the same tree folded or not (random groups)."""
    rng = random.Random(3)
    folds = 0
    for trial in range(200):
        group, ino, dirs, files = [], 2, [1], []
        for k in range(rng.randrange(1, 30)):
            op = rng.random()
            if op < 0.15:
                group.append(InodeRec(ino, rng.choice(dirs), b"d%d" % ino, 0o40755, 0, 0, 0,
                                      k, k, k))
                dirs.append(ino)
                ino += 1
            elif op < 0.5 or not files:
                group.append(InodeRec(ino, rng.choice(dirs), b"f%d" % ino, 0o100600, 0, 0, 0,
                                      k, k, k))
                files.append(ino)
                ino += 1
            elif op < 0.85:
                x = rng.choice(files + dirs)
                mode = 0o40700 if x in dirs else 0o100000 | rng.choice((0o600, 0o644))
                group.append(SetattrRec(x, mode, rng.randrange(3), 0, k, k + 100, k + 200))
            else:
                group.append(SizeRec(rng.choice(files), rng.randrange(100), k + 300, k + 300))
        want, got = Namespace(now_ns=0), Namespace(now_ns=0)
        for rec in group:
            want.apply(rec)
        mine = copy.deepcopy(group)
        folded = fold_setattrs(list(enumerate(mine)))
        folds += len(folded)
        for i, rec in enumerate(mine):
            if i not in folded:
                got.apply(rec)

        def tree(ns):
            return {i: (x.mode, x.uid, x.gid, x.size, x.atime_ns, x.mtime_ns, x.ctime_ns,
                        x.nlink, dict(x.children or {})) for i, x in ns.inodes.items()}

        assert tree(got) == tree(want), f"trial {trial}"
    assert folds > 100  # (the groups do fold)
