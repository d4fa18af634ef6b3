"""A full backing store: a 64 MiB tmpfs holds the backing directory and a filler file.
Writers get ENOSPC (from write, fsync or close, as the kernel allows), the daemon stays up,
durable data stays readable; after the filler is deleted, staged data lands and new checkpoints
and fsync succeed. EIO needs device-mapper (dm-error), skipped when the kernel lacks it."""

from __future__ import annotations

import errno
import os
import subprocess
import time

import pytest
from helpers import (
    MiB, cli, content, fill, read_all, read_fd, sync_until_ok, verify_and_remount, write_ckpt,
)

from ckptfs import api

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def small_fs(tmp_path):
    d = tmp_path / "small"
    d.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(d)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {res.stderr.strip()}")
    try:
        yield str(d)
    finally:
        # the ckptfs mounts (fixture `mounts`, set up after us) are gone by now
        for _ in range(50):
            if subprocess.run(["umount", str(d)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        else:
            subprocess.run(["umount", "-l", str(d)], capture_output=True)


def fill_store(small_fs, mounts, opts):
    """A mount on the small store with one durable file 'a', then the store filled up and
    a checkpoint that failed with ENOSPC."""
    backing = os.path.join(small_fs, "b")
    os.mkdir(backing)
    m = mounts.mount(backing, **opts)
    assert write_ckpt(os.path.join(m.mountpoint, "a"), content("a", 2 * MiB)) == ""
    free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
    fill(os.path.join(small_fs, "filler"), free - 256 * 1024)
    for i in range(10):
        if write_ckpt(os.path.join(m.mountpoint, f"x{i}"), content("x", 4 * MiB)):
            break
    else:
        raise AssertionError("the store never ran full")
    return m


def test_readonly_close_while_full(small_fs, mounts):
    m = fill_store(small_fs, mounts, dict(staging_size="8M", segment_size="1M",
                                          log_size="8M"))
    data, err = read_fd(os.path.join(m.mountpoint, "a"))
    assert data == content("a", 2 * MiB)
    assert err == 0, f"close() of a read-only file: {os.strerror(err)}"


def test_small_backing_store_default_log_size(small_fs, mounts):
    backing = os.path.join(small_fs, "b")
    os.mkdir(backing)
    m = mounts.mount(backing, staging_size="8M", segment_size="1M")
    assert write_ckpt(os.path.join(m.mountpoint, "w"), content("w", 4 * MiB)) == ""
    m.stop()


def test_enospc_then_recovery(small_fs, mounts):
    backing = os.path.join(small_fs, "b")
    os.mkdir(backing)
    filler = os.path.join(small_fs, "filler")
    fill(filler, 24 * MiB)
    # --log-size bounds the data log preallocation (a regression test above: preallocation on
    # a nearly full store).
    opts = dict(staging_size="8M", segment_size="1M", log_size="8M", idle_flush=0.2)
    m = mounts.mount(backing, **opts)
    mnt = m.mountpoint
    durable = {"a": 6 * MiB}
    assert write_ckpt(os.path.join(mnt, "a"), content("a", durable["a"])) == ""
    # Fill the store: 4 MiB checkpoints until one fails.
    failed_at = ""
    attempts = {}
    for i in range(40):
        name = f"b{i}"
        attempts[name] = 4 * MiB
        step = write_ckpt(os.path.join(mnt, name), content(name, 4 * MiB))
        if step:
            failed_at = step
            break
        durable[name] = 4 * MiB
    assert failed_at, "the 64 MiB store never ran full"
    assert m.proc.poll() is None, "daemon died on ENOSPC"
    st = m.status()
    assert "No space" in st["current_error"] or "ENOSPC" in st["current_error"] \
        or "28" in st["current_error"], st
    # A sync barrier reports the error too, and the CLI says so in one line.
    with pytest.raises(OSError) as ei:
        m.sync()
    assert ei.value.errno == errno.ENOSPC
    res = cli("sync", mnt)
    assert res.returncode != 0 and res.stderr.startswith("ckptfs: "), res.stderr
    # What was durable stays readable while the store is full (close() of these read-only
    # descriptors is checked in test_readonly_close_while_full).
    for name, size in durable.items():
        assert read_fd(os.path.join(mnt, name))[0] == content(name, size), name
    # Free the space: the retry (every second) lands the staged data.
    os.unlink(filler)
    sync_until_ok(m, errno.ENOSPC, 20, "staged data never landed after space was freed")
    assert write_ckpt(os.path.join(mnt, "c"), content("c", 4 * MiB)) == ""
    durable["c"] = 4 * MiB
    assert m.status()["current_error"] == ""
    m = verify_and_remount(mounts, m, backing, opts, durable)
    for name, size in attempts.items():  # the one that failed: nothing or a prefix
        if name not in durable and os.path.exists(os.path.join(m.mountpoint, name)):
            got = read_all(os.path.join(m.mountpoint, name))
            assert got == content(name, size)[:len(got)], name
    print(f"\nENOSPC reported at {failed_at}; {len(durable)} checkpoints durable")
    m.stop()


# EIO from the backing store: tests/test_eio.py (a failing FUSE file system as the store).


def test_unmount_while_full_reports_failure(small_fs, mounts):
    """Unmount with data that cannot be made durable: the daemon exits non-zero (does not
    claim durability), `api.Mount.stop` raises; what was durable before is still there."""
    opts = dict(staging_size="16M", segment_size="1M", log_size="8M")
    m = fill_store(small_fs, mounts, opts)
    assert m.proc.poll() is None, "daemon died on ENOSPC"
    with pytest.raises(api.CkptfsError):
        m.stop()
    os.unlink(os.path.join(small_fs, "filler"))
    m = mounts.mount(os.path.join(small_fs, "b"), **opts)
    assert read_fd(os.path.join(m.mountpoint, "a")) == (content("a", 2 * MiB), 0)
    m.stop()
