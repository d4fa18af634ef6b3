"""Shared fixtures. Mount work always has a timeout (pytest-timeout, see pyproject) and every
mount is unmounted in teardown, `fusermount3 -uz` and SIGKILL by PID as the last resort.

CKPTFS_TEST_FUSE_URING=1 runs every mount made here with --fuse-uring (FUSE over io_uring:
fuse/ring.py), the kernel's switch turned on for the session and put back after (root; the
tests are skipped where this kernel has no such switch)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from ckptfs import api
from ckptfs.fuse import ring
from helpers import FUSE_URING, FailingDisk, FailingMount, Tracker, Volume, set_uring_switch


def pytest_configure(config):
    """With CKPTFS_TEST_FUSE_URING=1 the process that runs the session (pytest itself, or the
    controller of pytest-xdist's workers) turns the kernel's switch on once and puts it back
    at the end: the switch is one per machine, and a worker that put it back would take it
    from under the other's mounts."""
    if FUSE_URING and not hasattr(config, "workerinput"):
        config.uring_was, config.uring_why = set_uring_switch("Y")


def pytest_unconfigure(config):
    if getattr(config, "uring_was", None) is not None:
        set_uring_switch(config.uring_was)


@pytest.fixture(scope="session", autouse=FUSE_URING)
def fuse_uring_session(request):
    if FUSE_URING:  # (a worker of pytest-xdist finds the switch as its controller set it)
        why = getattr(request.config, "uring_why", None) or ring.enabled()
        if why:
            pytest.skip(why)
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


@pytest.fixture(scope="module")
def module_mounts(tmp_path_factory):
    """Mounts for a module's tests to share (what one mount left behind that several tests
    only look at, each checking that it stays so); unmounted after the module's last test."""
    ms = Mounts(tmp_path_factory.mktemp("module"))
    try:
        yield ms
    finally:
        ms.cleanup()


@pytest.fixture
def mnt(mounts):
    """One mounted ckptfs over a fresh backing directory: the Mount object."""
    return mounts.mount()


@pytest.fixture
def track():
    """Mount points a mount_scripts/ test made (Tracker): none is left behind."""
    t = Tracker()
    try:
        yield t
    finally:
        t.cleanup()


# ---------------------------------------------------------------- GlusterFS (root)
@pytest.fixture(scope="session")
def gluster():
    vol = Volume()
    try:
        vol.up()
        yield vol
    finally:
        if vol.started:
            vol.down()
        elif os.path.isdir(os.path.join(vol.mount, f"tests-{os.getpid()}")):
            shutil.rmtree(os.path.join(vol.mount, f"tests-{os.getpid()}"), ignore_errors=True)


@pytest.fixture
def gdir(gluster, request):
    """A fresh directory on the volume for this test (removed afterwards)."""
    path = gluster.subdir(request.node.name)
    yield path
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- a second client ("node")
def _client_attached(log: str, timeout: float = 20.0) -> bool:
    """Whether the gluster client writing `log` attached to every brick its volume file
    names. Now and then a client's handshake with one brick ends in "volume-id changed ...
    Needs remount" (the ids it prints equal): that brick stays unreachable (ENOTCONN) for
    the life of the mount, so the caller mounts again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(log, errors="replace") as f:
            text = f.read()
        if "Needs remount" in text:
            return False
        wanted = set(re.findall(r"\] 0-([\w.-]+-client-\d+): parent translators are ready", text))
        got = set(re.findall(r"\] 0-([\w.-]+-client-\d+): Connected, attached to remote", text))
        if wanted and wanted <= got:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def second_client(gluster, tmp_path):
    """The volume mounted a second time: another gluster client, with caches of its own, as
    on another node. Returns a function mapping a path on the first mount to the second.
    Request it before `mounts`, so the ckptfs mounts over it are gone when it is torn down."""
    mp2 = str(tmp_path / "client2")
    os.mkdir(mp2)
    src = api.mount_at(os.path.realpath(gluster.mount)).source
    for attempt in range(3):
        log = f"{tmp_path}/client2-{attempt}.log"  # (not in /var/log)
        subprocess.run(["mount", "-t", "glusterfs", "-o", f"log-file={log}", src, mp2],
                       check=True, timeout=60, capture_output=True)
        if _client_attached(log):
            break
        subprocess.run(["umount", "-l", mp2], timeout=30, capture_output=True)
    else:
        pytest.fail(f"the second gluster client did not reach every brick: {log}")
    try:
        yield lambda p: os.path.join(mp2, os.path.relpath(p, gluster.mount))
    finally:
        try:
            subprocess.run(["umount", mp2], timeout=60, capture_output=True)
        except subprocess.TimeoutExpired:
            pass
        if os.path.ismount(mp2):
            subprocess.run(["umount", "-l", mp2], timeout=30, capture_output=True)


@pytest.fixture
def failing(tmp_path):
    """A failing_fs mount over tmp_path/src. Requested before `mounts`, so the ckptfs mounts on
    top of it are gone when it is torn down."""
    src, mnt = tmp_path / "src", tmp_path / "ffs"
    src.mkdir()
    mnt.mkdir()
    fm = FailingMount(str(src), str(mnt), str(tmp_path / "failing_fs.log"))
    try:
        yield fm
    finally:
        fm.stop()


@pytest.fixture
def failing_disk(failing, tmp_path):
    """ext4 on a loop device whose writes fail with EIO on command (helpers.FailingDisk),
    mounted at tmp_path/disk. Needs root, losetup and mkfs.ext4. Requested before `mounts`."""
    if os.geteuid() != 0 or not (shutil.which("losetup") and shutil.which("mkfs.ext4")):
        pytest.skip("a loop device needs root, losetup and mkfs.ext4")
    disk = FailingDisk(failing, str(tmp_path / "disk"))
    try:
        yield disk
    finally:
        disk.stop()


# ---------------------------------------------------------------- pytest-xdist (make test: -n 2)
# `make test` runs the suite in two worker processes (pytest-xdist): it mostly waits on mounts,
# daemons and subprocesses, so two run in about the time of one. What is shared across the
# machine decides what runs in one worker, in order: a module's tests (its module-scoped
# mounts are made once); every test whose id names gluster (on a GlusterFS volume, or running
# glusterfs.sh: the session's volume has one owner, glusterd takes one volume command at a
# time, and the script's own tests need no glusterd beside them); the modules that set the
# kernel's FUSE over io_uring switch and check it is put back (one switch per machine).
URING_SWITCH_MODULES = ("tests/test_fuse_uring.py", "tests/test_bench_transport.py")


def scope_of(nodeid: str) -> str:
    """The unit of work of the test `nodeid`: the tests of one scope run in one worker."""
    path = nodeid.split("::", 1)[0]
    if "gluster" in nodeid.lower():
        return "gluster"
    if path in URING_SWITCH_MODULES:
        return "uring_switch"
    return path


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # (pytest alone: the suite runs in one process)
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:
    class SharedScopeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    def pytest_xdist_make_scheduler(config, log):
        return SharedScopeScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """A test on the volume must say so in its name (scope_of finds it by its id)."""
    unnamed = [item.nodeid for item in items
               if ("gluster" in item.fixturenames or item.get_closest_marker("glusterfs"))
               and scope_of(item.nodeid) != "gluster"]
    if unnamed:
        raise pytest.UsageError("tests on a GlusterFS volume must name gluster in their "
                                "module or function name: " + ", ".join(unnamed))
