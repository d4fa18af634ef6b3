"""`ckptfs bench profile`: a run with alternating option sets measures every phase, verifies
the restore and leaves no mount behind; the readers of perf's and py-spy's output put
samples, requests and system calls where docs/benchmarks.md says."""

from __future__ import annotations

import json

import pytest
from helpers import cli

from ckptfs.bench import profile
from ckptfs.fuse import ring as fring


def test_alternating_variants_are_measured_and_verified(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "p.json"
    proc = cli("bench", "profile", "--small", "200", "--staging", "64M", "--variants",
               "request_spin=0;", "--dir", tmp_path, "--json", out, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [(r["phase"], r["options"].get("request_spin")) for r in runs] == [
        ("save", "0"), ("restore", "0"), ("save", None), ("restore", None)]
    for r in runs:
        assert r["verified"] and r["wall_s"] > 0 and r["user_s"] >= 0 and r["sys_s"] >= 0
        assert r["waits"]["requests_answered_here"] > 0
        # (the request thread's own CPU is part of the daemon's, and it slept between
        # requests: a save and a restore each wait for the caller)
        rt = r["request_thread"]
        assert 0 <= rt["cpu_s"] <= r["user_s"] + r["sys_s"] + 0.02 and rt["wakeups"] > 0, rt
        py = r["python_side"]  # (the default transport: queue threads on /dev/fuse)
        if fring.threads_unavailable() is not None:
            assert py == {}
            continue
        # (a request a queue thread took last may be on its way still: at most that many)
        assert py["handed"] == sum(py["by_opcode"].values()) <= py["requests"] - py[
            "answered_in_c"], py
        assert 0 < py["handed"] < py["answered_in_c"], py
    # /proc counts CPU in clock ticks (10 ms): one short phase may read 0, a whole run does not
    assert sum(r["user_s"] + r["sys_s"] for r in runs) > 0
    assert runs[0]["waits"]["requests_caught_spinning"] == 0  # (--request-spin 0)
    with open("/proc/self/mountinfo") as f:
        assert str(tmp_path) not in f.read()


def test_requests_are_read_from_the_fuse_tracepoints():
    text = """\
 p 11 [1] 1.000010: fuse:fuse_request_send: connection 41 req 2 opcode 16 (FUSE_WRITE) len 1048656
 p 12 [0] 1.000290:  fuse:fuse_request_end: connection 41 req 2 len 24 error 0
 o 13 [1] 1.000300: fuse:fuse_request_send: connection 40 req 2 opcode 3 (FUSE_GETATTR) len 56
 p 11 [1] 1.000400: fuse:fuse_request_send: connection 41 req 4 opcode 1 (FUSE_LOOKUP) len 65
 p 12 [0] 1.000407:  fuse:fuse_request_end: connection 41 req 4 len 16 error -2
"""
    t = profile.request_table(text)
    assert t["connection"] == "41" and set(t["opcodes"]) == {"WRITE", "LOOKUP"}
    w = t["opcodes"]["WRITE"]
    assert (w["n"], w["in_len_max"], w["out_len_max"]) == (1, 1048656, 24)
    assert w["round_trip_us_median"] == pytest.approx(280, abs=1)
    assert t["opcodes"]["LOOKUP"]["round_trip_us_median"] == pytest.approx(7, abs=1)


def test_system_calls_split_a_request_into_copy_work_and_reply():
    text = """\
  python 7 [000] 10.000000:  syscalls:sys_enter_readv: fd: 0x0000000c, vec: 0x1, vlen: 0x4
  python 7 [000] 10.000235:   syscalls:sys_exit_readv: 0x100050
  python 7 [000] 10.000240:  syscalls:sys_enter_write: fd: 0x00000003, buf: 0x1, count: 0x10
  python 7 [000] 10.000241:   syscalls:sys_exit_write: 0x10
  python 7 [000] 10.000348:  syscalls:sys_enter_write: fd: 0x0000000c, buf: 0x1, count: 0x18
  python 7 [000] 10.000355:   syscalls:sys_exit_write: 0x18
  python 7 [000] 10.001000:  syscalls:sys_enter_readv: fd: 0x0000000c, vec: 0x1, vlen: 0x4
  python 7 [000] 10.001002:   syscalls:sys_exit_readv: 0x50
  python 7 [000] 10.001049:  syscalls:sys_enter_writev: fd: 0x0000000c, vec: 0x1, vlen: 0x2
  python 7 [000] 10.001222:   syscalls:sys_exit_writev: 0x100010
"""
    t = profile.syscall_table(text)
    w, r = t["WRITE of 1 MiB or more"], t["READ, reply >= 512 KiB"]
    assert w["n"] == r["n"] == 1
    # (the write to descriptor 3 in between is not the reply)
    assert (round(w["readv_us_median"]), round(w["to_reply_us_median"]),
            round(w["reply_us_median"])) == (235, 113, 7)
    assert (round(r["to_reply_us_median"]), round(r["reply_us_median"])) == (47, 173)


def test_perf_samples_fall_into_their_categories():
    text = """\
python 7
\t    ffff __pi_memcpy+0x10 ([kernel.kallsyms])
\t    ffff fuse_copy_folio+0x20 ([kernel.kallsyms])
\t    ffff fuse_dev_do_read+0x30 ([kernel.kallsyms])
\t    ffff readv+0x5 (/lib/libc.so.6)

python 7
\t    1234 _PyEval_EvalFrameDefault+0x1 (/usr/lib/libpython3.11.so.1.0)

worker 9
\t    1234 _crc32c_hw_adler+0x1 (/venv/_crc32c.cpython-311-x86_64-linux-gnu.so)

python 7
\t    ffff do_sys_poll+0x1 ([kernel.kallsyms])
"""
    samples = profile.parse_perf_samples(text)
    assert [t for t, _ in samples] == ["python 7", "python 7", "worker 9", "python 7"]
    assert [profile.perf_category(f) for _, f in samples] == [
        "k: readv /dev/fuse: WRITE payload copy", "u: Python interpreter", "u: CRC32C",
        "k: poll (request spin)"]


def test_pyspy_busy_shares_leave_out_the_parked_samples(tmp_path):
    raw = tmp_path / "x.pyspy"
    raw.write_text(
        "thread (7): MainThread;run (trio/_core/_run.py:1);get_events (_io_epoll.py:243) 50\n"
        "thread (7): MainThread;FastPath.serve_one (fastpath.py:309);os_readv (x) 30\n"
        "thread (7): MainThread;RequestWait._spin (loop.py:120) 20\n"
        "thread (8): ckptfs-flusher;Flusher._loop (flusher.py:1) 99\n")
    s = profile.pyspy_shares(str(raw))
    assert s["samples"] == 100
    assert s["busy_shares"] == {"readv /dev/fuse (the kernel's copy)": 0.6, "request spin": 0.4}
