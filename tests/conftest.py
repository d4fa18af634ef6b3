"""Shared fixtures. Mount work always has a timeout (pytest-timeout, see pyproject) and every
mount is unmounted in teardown, `fusermount3 -uz` and SIGKILL by PID as the last resort.

CKPTFS_TEST_FUSE_URING=1 runs every mount made here with --fuse-uring (FUSE over io_uring:
fuse/ring.py), the kernel's switch turned on for the session and put back after (root; the
tests are skipped where this kernel has no such switch)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import pytest

from ckptfs import api
from ckptfs.fuse import ring

FUSE_URING = os.environ.get("CKPTFS_TEST_FUSE_URING") == "1"


@contextlib.contextmanager
def uring_switch(value: str = "Y"):
    """The kernel's FUSE over io_uring switch set to `value` for the block, then put back.
    Skips the test where the kernel has none or it cannot be written."""
    try:
        with open(ring.ENABLE_URING) as f:
            was = f.read().strip()
    except OSError:
        pytest.skip("this kernel has no FUSE over io_uring")
    if value == "Y":  # (io_uring itself may be off here: a sysctl, seccomp, a stub build)
        from ckptfs.io.uring import ffi, lib
        if lib is None or not lib.ck_have_uring():
            pytest.skip("ckptfs was built without io_uring")
        err, features = ffi.new("int *"), ffi.new("unsigned int *")
        r = lib.ck_ring_open(1, err, features)
        if r == ffi.NULL:
            pytest.skip(f"io_uring is not usable here: {os.strerror(err[0])}")
        lib.ck_ring_close(r)
    try:
        with open(ring.ENABLE_URING, "w") as f:
            f.write(value)
    except OSError as exc:
        pytest.skip(f"cannot set {ring.ENABLE_URING}: {exc}")
    try:
        yield
    finally:
        with open(ring.ENABLE_URING, "w") as f:
            f.write(was)


@pytest.fixture(scope="session", autouse=FUSE_URING)
def fuse_uring_session():
    if not FUSE_URING:
        yield
        return
    with uring_switch("Y"):
        yield


class Mounts:
    """Factory for real ckptfs mounts; tracks them so teardown can clean up."""

    def __init__(self, tmp_path) -> None:
        self.tmp = tmp_path
        self.live: list[api.Mount] = []
        self.n = 0

    def backing(self, name: str = "backing") -> str:
        path = os.path.join(self.tmp, name)
        os.makedirs(path, exist_ok=True)
        return path

    def mount(self, backing: str | None = None, mountpoint: str | None = None,
              **options) -> api.Mount:
        self.n += 1
        backing = backing or self.backing()
        mountpoint = mountpoint or os.path.join(self.tmp, f"mnt{self.n}")
        os.makedirs(mountpoint, exist_ok=True)
        options.setdefault("staging_size", "64M")
        options.setdefault("segment_size", "4M")
        options.setdefault("read_cache", "64M")
        if FUSE_URING and options.get("fast_path", True) and not options.get("no_fast_path"):
            options.setdefault("fuse_uring", True)
        # (the staging memory is faulted in and registered with io_uring as in a user's
        # mount: the fixed-buffer writes are the ones tested; a few tests pass no_populate)
        log_file = os.path.join(self.tmp, f"daemon{self.n}.log")
        m = api.Mount(backing, mountpoint, log_file=log_file, **options)
        m.start()
        self.live.append(m)
        return m

    def log(self, m: api.Mount) -> str:
        with open(m.log_file, errors="replace") as f:
            return f.read()

    def cleanup(self) -> None:
        for m in self.live:
            if m.proc is not None:
                try:
                    m.stop()
                except Exception:
                    pass
            if m.proc is not None:
                try:
                    os.kill(m.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if api.is_mounted(m.mountpoint):
                api.fusermount(m.mountpoint, lazy=True)
            if m.proc is not None:
                try:  # (reaped: its status socket, named after the reused device number,
                    # must be gone before the next test's daemon binds it)
                    m.proc.wait(timeout=10)
                except (subprocess.TimeoutExpired, ChildProcessError):
                    pass


@pytest.fixture
def mounts(tmp_path):
    ms = Mounts(tmp_path)
    try:
        yield ms
    finally:
        ms.cleanup()


@pytest.fixture
def mnt(mounts):
    """One mounted ckptfs over a fresh backing directory: the Mount object."""
    return mounts.mount()
