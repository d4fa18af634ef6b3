"""Ownership and permissions: files get the caller's uid/gid and mode, default_permissions is
enforced, other users cannot see the mount unless --allow-other, backing files are 0600 and
directories 0700."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile

import pytest
from helpers import NOBODY, cli, py_as_user, wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def public():
    """A directory other users can traverse (pytest's tmp_path parents are 0700)."""
    d = tempfile.mkdtemp(prefix="ckptfs-perm-", dir="/tmp")
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_other_users_locked_out_without_allow_other(public, mounts):
    os.mkdir(os.path.join(public, "mnt"))
    r = py_as_user(f"R = os.stat({public!r} + '/mnt').st_ino > 0")
    assert r is True  # the plain directory is visible to nobody
    m = mounts.mount(mountpoint=os.path.join(public, "mnt"))
    r = py_as_user(f"""
try:
    os.stat({m.mountpoint!r}); R = 0
except OSError as e:
    R = e.errno
""")
    assert r in (13, 1), f"nobody could stat the mount: {r}"


def test_ownership_modes_and_default_permissions(public, mounts):
    backing = mounts.backing()
    mp = os.path.join(public, "mnt")
    os.mkdir(mp)
    m = mounts.mount(backing, mp, allow_other=True)
    mnt = m.mountpoint
    os.mkdir(os.path.join(mnt, "pub"), 0o777)
    os.chmod(os.path.join(mnt, "pub"), 0o777)
    with open(os.path.join(mnt, "root.txt"), "wb") as f:
        f.write(b"root")
    os.chmod(os.path.join(mnt, "root.txt"), 0o644)
    r = py_as_user(f"""
R = {{}}
mnt = {mnt!r}
R["stat"] = os.stat(mnt).st_ino > 0
fd = os.open(mnt + "/pub/n.txt", os.O_WRONLY | os.O_CREAT, 0o660)
os.write(fd, b"nobody"); os.close(fd)
os.mkdir(mnt + "/pub/d", 0o775)
st = os.stat(mnt + "/pub/n.txt"); R["file"] = [st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)]
st = os.stat(mnt + "/pub/d"); R["dir"] = [st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)]
def err(fn):
    try:
        fn(); return 0
    except OSError as e:
        return e.errno
R["write_root"] = err(lambda: os.open(mnt + "/root.txt", os.O_WRONLY))
R["create_in_root"] = err(lambda: os.open(mnt + "/mine", os.O_WRONLY | os.O_CREAT, 0o644))
R["chmod_root"] = err(lambda: os.chmod(mnt + "/root.txt", 0o666))
R["chown_own"] = err(lambda: os.chown(mnt + "/pub/n.txt", 0, 0))
R["unlink_root"] = err(lambda: os.unlink(mnt + "/root.txt"))
R["read_root"] = open(mnt + "/root.txt").read()
""", umask=0o022)
    assert r["stat"]
    assert r["file"] == [NOBODY, NOBODY, 0o640], r
    assert r["dir"] == [NOBODY, NOBODY, 0o755], r
    assert r["write_root"] == 13 and r["create_in_root"] == 13, r
    assert r["chmod_root"] == 1 and r["chown_own"] == 1, r
    assert r["unlink_root"] == 13 and r["read_root"] == "root", r
    m.stop()
    # Persisted across a remount.
    m = mounts.mount(backing, mp)
    st = os.stat(os.path.join(m.mountpoint, "pub", "n.txt"))
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (NOBODY, NOBODY, 0o640)
    with open(os.path.join(m.mountpoint, "pub", "n.txt"), "rb") as f:
        assert f.read() == b"nobody"
    m.stop()


def test_backing_file_modes(tmp_path):
    """Daemon mode (creates daemon.log too), under umask 0: files 0600, directories 0700
    (ckptfs.json 0644 by design)."""
    b, mnt = tmp_path / "b", tmp_path / "mnt"
    b.mkdir()
    mnt.mkdir()
    old = os.umask(0)
    try:
        res = cli("mount", b, mnt, "--staging-size", "16M", "--no-populate")
    finally:
        os.umask(old)
    assert res.returncode == 0, res.stderr
    try:
        with open(mnt / "f", "wb") as f:
            f.write(b"z" * 100000)
    finally:
        res = cli("umount", mnt)
        assert res.returncode == 0, res.stderr
    bad = []
    for d, dirs, files in os.walk(b):
        for n in dirs:
            mode = stat.S_IMODE(os.stat(os.path.join(d, n)).st_mode)
            if mode != 0o700:
                bad.append((os.path.join(d, n), oct(mode)))
        for n in files:
            p = os.path.join(d, n)
            mode = stat.S_IMODE(os.stat(p).st_mode)
            want = 0o644 if n == "ckptfs.json" else 0o600
            if mode != want:
                bad.append((p, oct(mode)))
    assert not bad, bad
    names = {n for _, _, fs in os.walk(b) for n in fs}
    assert {"index.log", "daemon.log", "writer.json"} <= names, names


@pytest.mark.parametrize("fast_path", [True, False])
def test_write_by_other_user_clears_setuid(public, mounts, fast_path):
    """A write by a process without CAP_FSETID clears S_ISUID, and S_ISGID where group
    execution is on (as on ext4), whether the write goes through the page cache or straight
    to the daemon (write-only opens: direct I/O); root's writes keep them. The cleared mode
    survives a remount."""
    backing = mounts.backing()
    mp = os.path.join(public, "mnt")
    os.mkdir(mp)
    m = mounts.mount(backing, mp, allow_other=True, fast_path=fast_path)
    cases = {  # name: (mode, writer, open flags, mode after the write)
        "suid_wronly": (0o4777, "nobody", "wb", 0o777),
        "suid_rdwr": (0o4777, "nobody", "r+b", 0o777),
        "sgid_gx": (0o2777, "nobody", "ab", 0o777),
        "sgid_no_gx": (0o2767, "nobody", "ab", 0o2767),  # not set-group-ID execution
        "both": (0o6777, "nobody", "ab", 0o777),
        "root": (0o6777, "root", "ab", 0o6777),
    }
    for name, (mode, who, how, _) in cases.items():
        p = os.path.join(mp, name)
        with open(p, "wb") as f:
            f.write(b"x")
        os.chmod(p, mode)
        if who == "root":
            with open(p, how) as f:
                f.write(b"y")
        else:
            assert py_as_user(f"f = open({p!r}, {how!r}); f.write(b'y'); f.close(); R = 1") == 1
    got = {n: stat.S_IMODE(os.stat(os.path.join(mp, n)).st_mode) for n in cases}
    want = {n: c[3] for n, c in cases.items()}
    assert got == want
    m.stop()
    m = mounts.mount(backing, mp)
    got = {n: stat.S_IMODE(os.stat(os.path.join(mp, n)).st_mode) for n in cases}
    assert got == want


def test_control_xattrs_are_for_the_mounts_owner_and_root(public, mounts):
    """On an --allow-other mount another user may not force barriers (user.ckptfs.sync) nor
    read the daemon's figures; the owner of the mount's root (a prolog hands it to the job's
    user) may, and so may root."""
    mp = os.path.join(public, "mnt")
    os.mkdir(mp)
    m = mounts.mount(mountpoint=mp, allow_other=True)
    probe = f"""
R = {{}}
for name in ("user.ckptfs.sync", "user.ckptfs.status"):
    try:
        R[name] = len(os.getxattr({mp!r}, name))
    except OSError as e:
        R[name] = -e.errno
"""
    assert py_as_user(probe) == {"user.ckptfs.sync": -13, "user.ckptfs.status": -13}
    assert os.getxattr(mp, "user.ckptfs.sync") == b"ok"  # (root)
    os.chown(mp, NOBODY, NOBODY)  # (the mount's root, handed to the job's user)
    r = py_as_user(probe)
    assert r["user.ckptfs.sync"] == 2 and r["user.ckptfs.status"] > 100, r
    m.stop()


def test_what_open_directory_handles_hold_is_bounded(mounts):
    """Handles of an unchanged directory share one listing; listings of a directory changed
    between opens add up to at most LISTING_ENTRIES_MAX entries, then opendir fails with
    ENFILE, and every entry comes back once the handles are closed."""
    from ckptfs.fuse.listings import LISTING_ENTRIES_MAX

    m = mounts.mount()
    d = os.path.join(m.mountpoint, "d")
    os.mkdir(d)
    n = 20_000
    for i in range(n):
        os.mknod(os.path.join(d, f"f{i:05d}"))
    fds = [os.open(d, os.O_RDONLY | os.O_DIRECTORY) for _ in range(50)]
    assert m.status()["listing_entries"] == n
    refused = None
    for i in range(LISTING_ENTRIES_MAX // n + 5):
        os.mknod(os.path.join(d, f"g{i:05d}"))
        try:
            fds.append(os.open(d, os.O_RDONLY | os.O_DIRECTORY))
        except OSError as exc:
            refused = exc
            break
    assert refused is not None and refused.errno == errno.ENFILE, refused
    assert m.status()["listing_entries"] <= LISTING_ENTRIES_MAX
    assert os.listdir(m.mountpoint) == ["d"]  # (a small listing still fits)
    for fd in fds:
        os.close(fd)
    # (the kernel sends RELEASEDIR after close returns)
    wait_for(lambda: m.status()["listing_entries"] == 0, "the listings to be released",
             timeout=30)
    assert len(os.listdir(d)) == n + i + 1
    m.stop()


@pytest.mark.parametrize("fast_path", [True, False])
def test_a_write_by_another_user_clears_set_user_id_at_once(public, mounts, fast_path):
    """A write by a user without CAP_FSETID clears S_ISUID (as on ext4), and `stat` right
    after it shows the mode without it: the kernel's cached attributes are forgotten before
    the write returns (it would otherwise show 4777, and exec would honour it, until they
    time out)."""
    mp = os.path.join(public, "mnt")
    os.mkdir(mp)
    m = mounts.mount(mountpoint=mp, allow_other=True, fast_path=fast_path)
    p = os.path.join(mp, "tool")
    with open(p, "wb") as f:
        f.write(b"#!/bin/sh\n")
    os.chmod(p, 0o4777)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o4777  # (cached by the kernel now)
    r = py_as_user(f"""
fd = os.open({p!r}, os.O_WRONLY)
os.write(fd, b"echo hi\\n")
R = [oct(stat.S_IMODE(os.stat({p!r}).st_mode))]
os.pwrite(fd, b"#", 0)
R.append(oct(stat.S_IMODE(os.fstat(fd).st_mode)))
os.close(fd)
""")
    assert r == ["0o777", "0o777"], r
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o777
    m.stop()
