"""The queue threads on /dev/fuse (--queue-threads, the default with the fast path;
fuse/ring.c and ring_dev.c): a C thread per CPU reads the requests and serves a small file's
save and the WRITEs itself, handing the rest to the daemon, which answers on /dev/fuse; the
same bytes as the daemon's own loop (--no-queue-threads; --no-fast-path with them is refused:
test_fuse_uring.py); requests that get no answer
(FORGET, INTERRUPT) do not use up their entries; an unmount from outside ends the daemon
with everything durable. (The whole suite runs on them: they are the default.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import check_files

from ckptfs import api
from ckptfs.fuse import ring

pytestmark = pytest.mark.timeout(240)


def test_a_save_is_served_by_the_queue_threads_bit_exact(mounts):
    torch = pytest.importorskip("torch")
    m = mounts.mount()
    st = m.status()
    assert st["transport"] == "/dev/fuse, queue threads"
    assert st["ring_queues"] == min(len(os.sched_getaffinity(0)), ring.DEV_QUEUES)
    root = m.mountpoint
    os.mkdir(os.path.join(root, "step"))
    state = {f"t{i}": torch.rand(1 + 37 * i) for i in range(300)}
    for k, v in state.items():
        torch.save(v, os.path.join(root, "step", f"{k}.pt"))
    files = {}
    for i in range(3):  # (1 MiB WRITEs, landed in staging by the queue threads)
        p = os.path.join(root, f"big{i}")
        files[p] = os.urandom((3 << 20) + 4321 * i)
        with open(p, "wb") as f:
            f.write(files[p])
    m.sync()
    st = m.status()
    # a small file's GETATTR of its directory, LOOKUP, CREATE, WRITE, FLUSH and RELEASE
    assert st["ring_creates_answered_in_c"] >= 250, st
    assert st["ring_absent_answered_in_c"] >= 250, st
    assert st["ring_attrs_answered_in_c"] >= 250, st
    assert st["ring_answered_in_c"] >= 6 * 250, st
    assert st["writes_in_place"] >= 300 and st["bytes_in_place"] >= 9 << 20, st
    # (the kernel reading them straight into segments: more than the 1 MiB WRITEs; the others
    # were taken while another queue thread held the segment)
    assert st["ring_writes_read_in_place"] >= 9, st
    assert st["ring_creates_not_made"] == 0 and st["ring_queues_pinned"] >= 1
    for k, v in state.items():
        assert torch.equal(torch.load(os.path.join(root, "step", f"{k}.pt")), v)
    m.stop()
    m2 = mounts.mount(m.backing, queue_threads=False)  # (the daemon's loop reads them all)
    assert m2.status()["transport"] == "/dev/fuse"
    assert "ring_requests" not in m2.status()
    check_files(files, m.mountpoint, m2.mountpoint)
    for k, v in state.items():
        assert torch.equal(torch.load(os.path.join(m2.mountpoint, "step", f"{k}.pt")), v)


def test_requests_without_an_answer_do_not_use_up_the_entries(mounts):
    """FORGETs (the kernel forgetting inodes) and INTERRUPTs come through the queue threads
    and get no answer: their entries are free again once the daemon took them. More of them
    than there are entries, then the mount still serves everything."""
    if os.geteuid() != 0:
        pytest.skip("dropping the kernel's dentries needs root")
    m = mounts.mount()
    st = m.status()
    entries = st["ring_queues"] * st["ring_depth"]
    requests = st["ring_requests"]
    d = os.path.join(m.mountpoint, "d")
    os.mkdir(d)
    for i in range(50):
        open(os.path.join(d, f"f{i}"), "wb").close()
    # (in a child: were the entries used up, it would wait for ever on the mount)
    forgets = ("import os, sys\n"
               "d, n = sys.argv[1], int(sys.argv[2])\n"
               "for r in range(n):  # (each round: at least one FORGET)\n"
               "    os.stat(os.path.join(d, f'f{r % 50}'))\n"
               "    with open('/proc/sys/vm/drop_caches', 'w') as f:\n"
               "        f.write('2')\n"
               "    if r % 10 == 0:  # (and INTERRUPTs: a signal to a waiting lister)\n"
               "        import subprocess, time\n"
               "        p = subprocess.Popen([sys.executable, '-c', 'import os, sys\\n'\n"
               "                              'while True: os.listdir(sys.argv[1])', d])\n"
               "        time.sleep(0.05)\n"
               "        p.terminate()\n"
               "        p.wait(30)\n")
    try:
        subprocess.run([sys.executable, "-c", forgets, d, str(entries + 20)], check=True,
                       timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the mount stopped answering: its entries were used up")
    names = sorted(os.listdir(d))
    assert names == sorted(f"f{i}" for i in range(50))
    st = m.status()
    forgets = sum(st["forwarded_by_opcode"].get(op, 0) for op in ("2", "42"))
    assert forgets >= entries and st["ring_requests"] - requests >= entries, st
    with open(os.path.join(d, "last"), "wb") as f:
        f.write(b"still served")
    with open(os.path.join(d, "last"), "rb") as f:
        assert f.read() == b"still served"
    m.stop()


def test_an_unmount_from_outside_ends_the_daemon_with_everything_durable(mounts):
    """The queue threads see the connection end (the daemon does not read /dev/fuse itself
    then): the daemon finishes its last commit and exits; a remount has every byte."""
    m = mounts.mount()
    data = {os.path.join(m.mountpoint, f"f{i}"): os.urandom(1000 * i + 5) for i in range(20)}
    for p, b in data.items():
        with open(p, "wb") as f:
            f.write(b)
    pid = m.status()["pid"]
    res = api.fusermount(m.mountpoint)
    assert res.returncode == 0, res.stderr
    assert api.wait_pid_exit(pid, 30), "the daemon did not end after the unmount"
    m.proc.wait(10)
    assert m.proc.returncode == 0
    m2 = mounts.mount(m.backing, queue_threads=False)
    check_files(data, m.mountpoint, m2.mountpoint)
