"""FUSE over io_uring (--fuse-uring, fuse/ring.py): requests on the kernel's per-CPU queues,
served by the fast path's handlers, answered through the queue threads' ring entries; the same
bytes as through /dev/fuse; a clear fallback where the kernel does not offer it; a clear error
for an option it cannot work with. (The data-path tests run on it as a whole with
CKPTFS_TEST_FUSE_URING=1: `make test` does.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import uring_switch
from helpers_reliability import check_files
from test_fastpath import _write_tree

from ckptfs.fuse import ring

pytestmark = pytest.mark.timeout(240)

MiB = 1 << 20


def test_requests_are_served_on_the_rings_bit_exact(mounts):
    torch = pytest.importorskip("torch")
    with uring_switch("Y"):
        m = mounts.mount(fuse_uring=True)
        st = m.status()
        assert st["transport"] == "io_uring", mounts.log(m)
        assert st["ring_queues"] == ring.queues()
        files = _write_tree(m.mountpoint)
        state = {f"layer{i}.weight": torch.randn(257, 129 + i) for i in range(20)}
        state["big"] = torch.arange(3 * MiB, dtype=torch.int32)
        path = os.path.join(m.mountpoint, "sub", "model.pt")
        torch.save(state, path)
        # namespace changes go to pyfuse3 and come back through the ring entries
        os.rename(os.path.join(m.mountpoint, "sub"), os.path.join(m.mountpoint, "moved"))
        files = {p.replace("/sub/", "/moved/"): d for p, d in files.items()}
        path = path.replace("/sub/", "/moved/")
        os.mkdir(os.path.join(m.mountpoint, "d"))
        assert os.listdir(os.path.join(m.mountpoint, "d")) == []
        # (a barrier: the sync xattr answers once everything written is durable)
        os.getxattr(m.mountpoint, "user.ckptfs.sync")
        with open(os.path.join(m.mountpoint, "moved", "s3"), "r+b") as f:
            os.fsync(f.fileno())
        check_files(files, m.mountpoint, m.mountpoint)
        back = torch.load(path)
        assert back.keys() == state.keys()
        assert all(torch.equal(back[k], state[k]) for k in state)
        st = m.status()
        # (a save's and a load's requests: nearly all of them on the rings)
        assert st["ring_requests"] > 300, st
        assert st["ring_queues_pinned"] >= 1
        assert st["writes_in_place"] > 0
        # WRITEs that landed whole on a handle open for writing, FLUSH and IOCTL: answered by
        # the queue threads
        assert st["ring_answered_in_c"] > 0
        m.stop()
    m2 = mounts.mount(m.backing, fuse_uring=False)  # (through /dev/fuse: the same bytes)
    assert m2.status()["transport"] == "/dev/fuse"
    check_files(files, m.mountpoint, m2.mountpoint)
    back = torch.load(path.replace(m.mountpoint, m2.mountpoint))
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_without_the_kernels_switch_requests_stay_on_dev_fuse(mounts):
    with uring_switch("N"):
        m = mounts.mount(fuse_uring=True)
        with open(os.path.join(m.mountpoint, "f"), "wb") as f:
            f.write(b"x" * 5000)
        with open(os.path.join(m.mountpoint, "f"), "rb") as f:
            assert f.read() == b"x" * 5000
        st = m.status()
        assert st["transport"] == "/dev/fuse"
        assert "ring_requests" not in st
        log = mounts.log(m)
        assert "--fuse-uring: requests stay on /dev/fuse" in log
        assert "enable_uring is N" in log
        m.stop()


def test_fuse_uring_without_the_fast_path_is_refused(tmp_path):
    os.makedirs(tmp_path / "b")
    os.makedirs(tmp_path / "m")
    proc = subprocess.run([sys.executable, "-m", "ckptfs", "mount", "--fuse-uring",
                           "--no-fast-path", "--foreground", str(tmp_path / "b"),
                           str(tmp_path / "m")], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "--fuse-uring needs the fast path" in proc.stderr
    assert not os.listdir(tmp_path / "b")  # (nothing written)
