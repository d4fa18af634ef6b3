"""`ckptfs bench transport`: its file system (transport.c, built with gcc) is mounted and served
over /dev/fuse and over FUSE's io_uring transport, the client's small files and 1 MiB writes
and reads are timed, every request of an io_uring run is served on the ring, and nothing is left
behind: no mount, no server, enable_uring as it was."""

from __future__ import annotations

import json
import os

import pytest
from helpers import cli

from ckptfs.bench import transport

pytestmark = pytest.mark.timeout(240)


def mounted() -> str:
    with open("/proc/self/mountinfo") as f:
        return "".join(line for line in f if "ckptfs-transport" in line)


def servers() -> list[int]:
    """PIDs of the benchmark's servers (`transport serve ...`) on this machine."""
    out = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if len(args) > 1 and args[0].endswith(b"/transport") and args[1] == b"serve":
            out.append(int(pid))
    return out


def test_the_transports_are_timed_and_nothing_is_left(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mount(2) needs root")
    allowed = os.sched_getaffinity(0)
    variants = (["dev-same"] if 0 in allowed else []) + (["dev-cross"] if {0, 1} <= allowed
                                                         else [])
    uring_was = transport._read(transport.ENABLE_URING)
    if uring_was is not None and os.access(transport.ENABLE_URING, os.W_OK):
        # (a kernel with FUSE over io_uring, and a /sys that lets the run turn it on)
        variants.append("uring-percpu")
    out = tmp_path / "t.json"
    proc = cli("bench", "transport", "--files", "300", "--writes", "10", "--rounds", "1",
               "--variants", ",".join(variants), "--enable-uring", "--json", out, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())["results"]
    assert sorted(res) == sorted(variants)
    for v in variants:
        for k in ("us_per_file", "us_per_mib_write", "us_per_file_read", "us_per_mib_read"):
            assert res[v][k] > 0, res
    assert res["dev-same"]["on_io_uring"] == 0
    if "uring-percpu" in res:
        # 300 files written (six requests each) and read (four), and the 1 MiB writes and
        # reads: on the ring's queues (the requests before the queues were ready come on
        # /dev/fuse)
        assert res["uring-percpu"]["on_io_uring"] >= 300 * 8, res
    assert "| dev-same |" in proc.stdout
    assert not mounted()
    assert not servers()
    assert transport._read(transport.ENABLE_URING) == uring_was


def test_bad_variants_are_refused():
    proc = cli("bench", "transport", "--variants", "dev,nonsense", timeout=60)
    assert proc.returncode == 2 and "nonsense" in proc.stderr
