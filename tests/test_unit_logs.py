"""The one run reader (format/logs.RunReader) without a mount: a run reads back checked, and a
damaged run, a run past its log's end and a missing log each fail with the one error
(RunError, EIO) naming the log and the run; the mount's reader (datapath/reader.Reader, and
its chunk cache, datapath/readcache.ReadCache, over the same code) fails with the same error
and keeps failing."""

from __future__ import annotations

import errno
import os

import pytest
import trio
from crc32c import crc32c
from helpers import flip_byte

from ckptfs.datapath.readcache import CHUNK_BYTES, ReadCache
from ckptfs.datapath.reader import Reader
from ckptfs.datapath.staging import ExtentMap, Run
from ckptfs.format import records
from ckptfs.format.backingdir import data_log_name
from ckptfs.format.logs import RunError, RunReader


def _log(wdir, number: int, payload: bytes) -> int:
    """A data log holding `payload` after its header; the payload's log offset."""
    os.makedirs(wdir, exist_ok=True)
    with open(os.path.join(wdir, data_log_name(number)), "wb") as f:
        f.write(records.data_log_header(os.path.basename(wdir), number))
        f.write(payload)
    return records.DATA_HEADER_BYTES


def _runs(tmp_path):
    wdir = str(tmp_path / "writers" / "w1")
    a, b = os.urandom(5000), os.urandom(CHUNK_BYTES + 3000)  # b spans two chunks
    base = _log(wdir, 1, a + b)
    ra = Run(None, 0, len(a), log=1, loff=base, crc=crc32c(a))
    rb = Run(None, 0, len(b), log=1, loff=base + len(a), crc=crc32c(b))
    return wdir, (ra, a), (rb, b)


def _flip(wdir, number: int, offset: int) -> None:
    flip_byte(os.path.join(wdir, data_log_name(number)), offset, 0x40)


def test_runs_read_back_checked(tmp_path):
    wdir, (ra, a), (rb, b) = _runs(tmp_path)
    logs = RunReader({0: wdir})
    try:
        assert logs.read_run(ra) == a
        assert logs.read_run(rb) == b
        assert logs.logs_of(0) == {1}  # one descriptor per log, kept
        buf = bytearray(100)
        assert logs.read_into(0, 1, buf, ra.loff) == 100 and bytes(buf) == a[:100]
    finally:
        logs.close()
    assert logs.logs_of(0) == set()


def test_damage_short_read_and_missing_log_are_one_error(tmp_path):
    wdir, (ra, a), (rb, b) = _runs(tmp_path)
    _flip(wdir, 1, rb.loff + 10)
    past = Run(None, 0, 8192, log=1, loff=rb.loff + len(b) - 100, crc=0)
    gone = Run(None, 0, 10, log=7, loff=4096, crc=0)
    logs = RunReader({0: wdir})
    try:
        assert logs.read_run(ra) == a  # the others stay readable
        cases = [(rb, "data log w1/data-000001.log offset %d length %d: checksum mismatch"
                  % (rb.loff, rb.length)),
                 (past, "data log w1/data-000001.log offset %d length 8192: short read (the "
                  "log ends 100 bytes into the run)" % past.loff),
                 (gone, "data log w1/data-000007.log: missing")]
        for run, msg in cases:
            with pytest.raises(RunError) as ei:
                logs.read_run(run)
            assert ei.value.errno == errno.EIO and ei.value.strerror == msg
    finally:
        logs.close()


def _read(reader: Reader, emap: ExtentMap, off: int, size: int):
    async def main():
        return bytes(await reader.read(emap, off, size, emap.end(), ahead=0))
    return trio.run(main)


def test_the_mount_reader_fails_with_the_same_error(tmp_path):
    """Reader (no readahead, no checks ahead: a READ checks what it loaded) over runs of one
    log: a damaged run spanning two chunks fails with RunReader's error on every READ of it,
    a READ of the other run succeeds, and a run whose log is gone fails with the missing-log
    error."""
    wdir, (ra, a), (rb, b) = _runs(tmp_path)
    _flip(wdir, 1, rb.loff + CHUNK_BYTES)
    logs = RunReader({0: wdir})
    with pytest.raises(RunError) as ei:
        logs.read_run(rb)
    logs.close()
    expected = ei.value.strerror
    emap = ExtentMap()
    emap.insert(0, ra.length, ra, 0)
    emap.insert(ra.length, rb.length, rb, 0)
    reader = Reader(ReadCache(RunReader({0: wdir}), 64 << 20), prefetch_bytes=0)
    try:
        assert _read(reader, emap, 0, ra.length) == a
        for _ in range(2):  # the first READ checks, the next one knows
            with pytest.raises(RunError) as ei:
                _read(reader, emap, ra.length + 5, 10)
            assert ei.value.errno == errno.EIO and ei.value.strerror == expected
        gone = Run(None, 0, 10, log=9, loff=4096, crc=0)
        other = ExtentMap()
        other.insert(0, 10, gone, 0)
        with pytest.raises(RunError) as ei:
            _read(reader, other, 0, 10)
        assert ei.value.strerror == "data log w1/data-000009.log: missing"
    finally:
        reader.cache.close()


def test_the_offline_tools_load_no_fuse_binding():
    """`ckptfs verify/export/compact/ls/gc/import` and the run reader they share work where
    pyfuse3 cannot load: importing them (and the command line) loads no FUSE binding."""
    import subprocess
    import sys

    code = ("import sys, ckptfs.cli, ckptfs.format.logs, ckptfs.datapath.mover\n"
            "from ckptfs.tools import compact, export, gc, importer, ls, verify\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pyfuse3', '_pyfuse3')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out
