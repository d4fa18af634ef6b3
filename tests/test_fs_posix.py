"""POSIX behaviour of a real ckptfs mount, driven by shell tools and os calls; every result is
checked again after unmount + remount (names, sizes, modes, owners, times, links, contents)."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import mmap
import os
import random
import signal
import stat
import subprocess
import time

import pytest
from helpers import wait_for

from ckptfs import api

pytestmark = pytest.mark.timeout(120)

KiB, MiB = 1 << 10, 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
AT_FDCWD = -100
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


def sh(*args, check=True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=60, check=check,
                          **kw)


def renameat2(old: str, new: str, flags: int) -> None:
    r = _libc.renameat2(AT_FDCWD, old.encode(), AT_FDCWD, new.encode(), flags)
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), old)


def remount(mounts, m):
    m.stop()
    return mounts.mount(backing=m.backing)


def make_tree(root: str, seed: int = 1) -> None:
    rng = random.Random(seed)
    sizes = [0, 1, 7, 4095, 4096, 4097, 65536, 131071, 1 * MiB + 3, 5 * MiB + 1]
    for d in range(4):
        for sub in ("", "a", "a/b", "c/d/e"):
            p = os.path.join(root, f"d{d}", sub)
            os.makedirs(p, exist_ok=True)
            for i in range(3):
                n = rng.choice(sizes)
                with open(os.path.join(p, f"f{i}.bin"), "wb") as f:
                    f.write(rng.randbytes(n))
    os.symlink("d0/a/f0.bin", os.path.join(root, "link"))
    os.chmod(os.path.join(root, "d1", "a", "f1.bin"), 0o640)


def tree_digest(root: str) -> dict:
    out = {}
    for dp, dns, fns in os.walk(root):
        for n in sorted(dns + fns):
            p = os.path.join(dp, n)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("d", stat.S_IMODE(st.st_mode))
            else:
                with open(p, "rb") as f:
                    out[rel] = ("f", stat.S_IMODE(st.st_mode), st.st_size,
                                hashlib.sha256(f.read()).hexdigest())
    return out


def test_cp_tree_in_and_out(mounts, tmp_path):
    src = str(tmp_path / "src")
    make_tree(src)
    m = mounts.mount()
    dst = os.path.join(m.mountpoint, "tree")
    sh("cp", "-a", src, dst)
    assert sh("diff", "-r", "--no-dereference", src, dst).returncode == 0
    want = tree_digest(src)
    assert tree_digest(dst) == want
    m.sync()
    m = remount(mounts, m)
    dst = os.path.join(m.mountpoint, "tree")
    assert tree_digest(dst) == want
    out = str(tmp_path / "out")
    sh("cp", "-a", dst, out)
    assert sh("diff", "-r", "--no-dereference", src, out).returncode == 0
    assert tree_digest(out) == want
    # find sees every entry
    found = sh("find", dst).stdout.split("\n")
    assert len([x for x in found if x]) == len(want) + 1
    # du: apparent sizes add up to the bytes written
    total = sum(v[2] for v in want.values() if v[0] == "f")
    du = int(sh("du", "-s", "-b", "--exclude=*/", dst).stdout.split()[0])
    per_file = sh("du", "-a", "-b", dst).stdout.splitlines()
    file_sizes = {os.path.relpath(line.split("\t", 1)[1], dst): int(line.split("\t")[0])
                  for line in per_file}
    for rel, v in want.items():
        if v[0] == "f":
            assert file_sizes[rel] == v[2], rel
    assert du >= total
    # du (blocks): a file's block count covers its size
    st = os.stat(os.path.join(dst, "d0", "a", "f0.bin"))
    assert st.st_blocks * 512 >= st.st_size


def test_dd_odd_blocks_and_overwrites(mounts, tmp_path):
    m = mounts.mount()
    mp = m.mountpoint
    src = tmp_path / "src.bin"
    data = bytearray(random.Random(3).randbytes(3 * MiB + 12345))
    src.write_bytes(data)
    for bs in ("1", "4097", str(MiB + 7)):
        out = os.path.join(mp, f"dd_{bs}")
        if bs == "1":
            sh("dd", f"if={src}", f"of={out}", "bs=1", "count=20000", "status=none")
            want = bytes(data[:20000])
        else:
            sh("dd", f"if={src}", f"of={out}", f"bs={bs}", "status=none")
            want = bytes(data)
        with open(out, "rb") as f:
            assert f.read() == want, bs
    # overwrite in the middle, keeping the rest (conv=notrunc)
    target = os.path.join(mp, f"dd_{MiB + 7}")
    patch = b"\xab" * 10000
    p = tmp_path / "patch.bin"
    p.write_bytes(patch)
    sh("dd", f"if={p}", f"of={target}", "bs=1000", "seek=1234", "conv=notrunc", "status=none")
    data[1234000:1234000 + len(patch)] = patch
    # byte-granular overwrite with bs=1
    p2 = tmp_path / "patch2.bin"
    p2.write_bytes(b"XYZ")
    sh("dd", f"if={p2}", f"of={target}", "bs=1", f"seek={2 * MiB + 1}", "conv=notrunc",
       "status=none")
    data[2 * MiB + 1:2 * MiB + 4] = b"XYZ"
    # seek past the end: a hole then data
    tail = os.path.join(mp, "sparse")
    sh("dd", f"if={p2}", f"of={tail}", "bs=4097", "seek=3", "status=none")
    with open(target, "rb") as f:
        assert f.read() == bytes(data)
    with open(tail, "rb") as f:
        assert f.read() == bytes(3 * 4097) + b"XYZ"
    m = remount(mounts, m)
    with open(os.path.join(m.mountpoint, f"dd_{MiB + 7}"), "rb") as f:
        assert f.read() == bytes(data)
    with open(os.path.join(m.mountpoint, "sparse"), "rb") as f:
        assert f.read() == bytes(3 * 4097) + b"XYZ"
    with open(os.path.join(m.mountpoint, "dd_1"), "rb") as f:
        assert f.read() == bytes(data[:20000])


def test_ls_stat_chmod_chown_touch(mounts):
    m = mounts.mount()
    mp = m.mountpoint
    f = os.path.join(mp, "file")
    with open(f, "wb") as fh:
        fh.write(b"x" * 5000)
    os.mkdir(os.path.join(mp, "dir"))
    sh("chmod", "640", f)
    sh("chown", "1234:4321", f)
    sh("chmod", "2750", os.path.join(mp, "dir"))
    sh("chown", "55:66", os.path.join(mp, "dir"))
    sh("touch", "-d", "2001-02-03 04:05:06.789", f)
    os.utime(os.path.join(mp, "dir"), ns=(1_000_000_123, 2_000_000_456))

    def check(mp):
        st = os.stat(os.path.join(mp, "file"))
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640
        assert (st.st_uid, st.st_gid, st.st_size) == (1234, 4321, 5000)
        out = sh("stat", "-c", "%s %a %u %g %Y", os.path.join(mp, "file")).stdout.split()
        assert out[:4] == ["5000", "640", "1234", "4321"]
        assert int(out[4]) == int(sh("date", "-d", "2001-02-03 04:05:06", "+%s").stdout)
        assert st.st_mtime_ns % 1_000_000_000 == 789_000_000
        sd = os.stat(os.path.join(mp, "dir"))
        assert stat.S_ISDIR(sd.st_mode) and stat.S_IMODE(sd.st_mode) == 0o2750
        assert (sd.st_uid, sd.st_gid) == (55, 66)
        assert (sd.st_atime_ns, sd.st_mtime_ns) == (1_000_000_123, 2_000_000_456)
        ls = sh("ls", "-l", mp).stdout
        line = [x for x in ls.splitlines() if x.endswith(" file")][0]
        assert line.startswith("-rw-r-----") and " 1234 4321 " in line and " 5000 " in line
        line = [x for x in ls.splitlines() if x.endswith(" dir")][0]
        assert line.startswith("drwxr-s---")

    check(mp)
    m = remount(mounts, m)
    check(m.mountpoint)


def test_written_file_mtime_persists(mounts):
    """mtime/size of a file written (not touched) survive a remount."""
    m = mounts.mount()
    f = os.path.join(m.mountpoint, "w")
    with open(f, "wb") as fh:
        fh.write(b"a" * 100)
    os.utime(f, ns=(10**18, 10**18))  # a known old time...
    with open(f, "ab") as fh:  # ...then a write moves mtime forward
        fh.write(b"b" * 100)
    st = os.stat(f)
    assert st.st_mtime_ns != 10**18 and st.st_size == 200
    m = remount(mounts, m)
    st2 = os.stat(os.path.join(m.mountpoint, "w"))
    assert st2.st_size == 200
    assert st2.st_mtime_ns == st.st_mtime_ns


@pytest.mark.either_transport  # (on /dev/fuse only: see below)
def test_a_release_the_unmount_cut_off_still_makes_its_file_durable(mounts):
    """The kernel sends RELEASE after the last reference to an open file goes, without
    waiting for it, and an unmount aborts the requests the daemon has not read yet (for a
    FUSE mount it sends no DESTROY to wait for them). A file let go of just before the
    unmount keeps what its handle changed: the daemon ends every handle still open when its
    loop ends, as their RELEASEs would have. (On /dev/fuse: over FUSE's io_uring queues
    the unmount waits for the stopped daemon's queues instead.)"""
    m = mounts.mount(fuse_uring=False)
    f = os.path.join(m.mountpoint, "w")
    with open(f, "wb") as fh:
        fh.write(b"a" * 100)
    os.utime(f, ns=(10**18, 10**18))
    pid = m.status()["pid"]
    with open(f, "r+b") as fh:
        fh.seek(0, os.SEEK_END)
        fh.write(b"b" * 100)  # (moves mtime: journaled at the handle's release)
        fh.flush()
        mtime = os.fstat(fh.fileno()).st_mtime_ns
        # a mapping keeps the open file after close() (its FLUSH answered); unmapping it
        # then sends the RELEASE, which needs no answer (libc's mmap: Python's mmap object
        # holds a descriptor of its own, whose close() would send a FLUSH)
        addr = _libc.mmap(None, 200, mmap.PROT_READ, mmap.MAP_SHARED, fh.fileno(), 0)
    assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    assert mtime != 10**18 and ctypes.string_at(addr, 1) == b"a"
    os.kill(pid, signal.SIGSTOP)  # the daemon reads nothing until the unmount is done
    try:
        assert _libc.munmap(addr, 200) == 0
        # (the RELEASE now waits in the kernel, unread)
        res = api.fusermount(m.mountpoint)
        assert res.returncode == 0, res.stderr
    finally:
        os.kill(pid, signal.SIGCONT)
    assert api.wait_pid_exit(pid, 30), "the daemon did not end after the unmount"
    m.proc.wait(10)
    assert m.proc.returncode == 0
    m = mounts.mount(backing=m.backing)
    st = os.stat(os.path.join(m.mountpoint, "w"))
    assert st.st_size == 200
    assert st.st_mtime_ns == mtime


def test_mv_rm(mounts):
    m = mounts.mount()
    mp = m.mountpoint
    j = lambda *p: os.path.join(mp, *p)  # noqa: E731
    os.makedirs(j("a", "b"))
    os.makedirs(j("empty"))
    for name, data in (("f1", b"one"), ("f2", b"two" * 1000), ("a/b/f3", b"three")):
        with open(j(name), "wb") as fh:
            fh.write(data)
    sh("mv", j("f1"), j("a", "g1"))              # file into a dir, new name
    sh("mv", "-f", j("f2"), j("a", "g1"))        # over an existing file
    sh("mv", "-T", j("a", "b"), j("empty"))      # dir over an empty dir
    sh("mv", j("a"), j("moved"))                 # dir rename
    os.makedirs(j("gone", "x", "y"))
    with open(j("gone", "x", "y", "z"), "wb") as fh:
        fh.write(b"z" * 10000)
    sh("rm", "-r", j("gone"))

    def check(mp):
        j = lambda *p: os.path.join(mp, *p)  # noqa: E731
        assert sorted(os.listdir(mp)) == ["empty", "moved"]
        assert os.listdir(j("moved")) == ["g1"]
        assert open(j("moved", "g1"), "rb").read() == b"two" * 1000
        assert os.listdir(j("empty")) == ["f3"]
        assert open(j("empty", "f3"), "rb").read() == b"three"
        assert os.stat(mp).st_nlink == 4
        assert os.stat(j("moved")).st_nlink == 2

    check(mp)
    m = remount(mounts, m)
    check(m.mountpoint)


def test_truncate_up_and_down(mounts):
    m = mounts.mount()
    f = os.path.join(m.mountpoint, "t")
    data = random.Random(5).randbytes(3 * MiB)
    with open(f, "wb") as fh:
        fh.write(data)
    sh("truncate", "-s", "1000000", f)
    assert os.path.getsize(f) == 1000000
    sh("truncate", "-s", str(2 * MiB), f)  # grows with zeros, old bytes must not come back
    want = data[:1000000] + bytes(2 * MiB - 1000000)
    with open(f, "rb") as fh:
        assert fh.read() == want
    # os.truncate on an open file, then write after the end
    with open(f, "r+b") as fh:
        os.ftruncate(fh.fileno(), 10)
        fh.seek(20)
        fh.write(b"END")
    want = data[:10] + bytes(10) + b"END"
    with open(f, "rb") as fh:
        assert fh.read() == want
    g = os.path.join(m.mountpoint, "g")
    with open(g, "wb") as fh:
        fh.write(b"q" * 5000)
    os.truncate(g, 0)
    os.truncate(g, 100)
    m.sync()
    m = remount(mounts, m)
    with open(os.path.join(m.mountpoint, "t"), "rb") as fh:
        assert fh.read() == want
    with open(os.path.join(m.mountpoint, "g"), "rb") as fh:
        assert fh.read() == bytes(100)


def test_symlink_and_hardlink(mounts):
    m = mounts.mount()
    mp = m.mountpoint
    with open(os.path.join(mp, "target"), "wb") as fh:
        fh.write(b"T" * 777)
    os.symlink("target", os.path.join(mp, "rel"))
    os.symlink("/nonexistent/dangling" + "x" * 200, os.path.join(mp, "dangling"))
    sh("ln", "-s", "sub/../target", os.path.join(mp, "viash"))
    os.mkdir(os.path.join(mp, "sub"))
    os.link(os.path.join(mp, "target"), os.path.join(mp, "sub", "hard"))
    with open(os.path.join(mp, "sub", "hard"), "ab") as fh:
        fh.write(b"H")

    def check(mp):
        assert os.readlink(os.path.join(mp, "rel")) == "target"
        assert sh("readlink", os.path.join(mp, "viash")).stdout.strip() == "sub/../target"
        assert os.readlink(os.path.join(mp, "dangling")) == "/nonexistent/dangling" + "x" * 200
        assert os.lstat(os.path.join(mp, "dangling")).st_size == len(
            "/nonexistent/dangling" + "x" * 200)
        assert stat.S_ISLNK(os.lstat(os.path.join(mp, "rel")).st_mode)
        assert open(os.path.join(mp, "rel"), "rb").read() == b"T" * 777 + b"H"
        assert open(os.path.join(mp, "viash"), "rb").read() == b"T" * 777 + b"H"
        a, b = os.stat(os.path.join(mp, "target")), os.stat(os.path.join(mp, "sub", "hard"))
        assert a.st_ino == b.st_ino and a.st_nlink == b.st_nlink == 2 and a.st_size == 778

    check(mp)
    m = remount(mounts, m)
    check(m.mountpoint)
    os.unlink(os.path.join(m.mountpoint, "target"))
    st = os.stat(os.path.join(m.mountpoint, "sub", "hard"))
    assert st.st_nlink == 1 and st.st_size == 778
    m = remount(mounts, m)
    assert open(os.path.join(m.mountpoint, "sub", "hard"), "rb").read() == b"T" * 777 + b"H"
    assert not os.path.exists(os.path.join(m.mountpoint, "target"))


def _errno_of(fn, *args) -> int:
    try:
        fn(*args)
    except OSError as e:
        return e.errno
    return 0


def test_error_codes(mounts):
    m = mounts.mount()
    mp = m.mountpoint
    j = lambda *p: os.path.join(mp, *p)  # noqa: E731
    os.makedirs(j("full", "sub"))
    os.mkdir(j("emptyd"))
    with open(j("file"), "wb") as fh:
        fh.write(b"f")
    with open(j("file2"), "wb") as fh:
        fh.write(b"g")
    assert _errno_of(os.rename, j("emptyd"), j("full")) == errno.ENOTEMPTY
    assert _errno_of(os.rename, j("file"), j("emptyd")) == errno.EISDIR
    assert _errno_of(os.rename, j("emptyd"), j("file")) == errno.ENOTDIR
    assert _errno_of(os.rename, j("full"), j("full", "sub", "x")) == errno.EINVAL
    assert _errno_of(os.rename, j("nope"), j("x")) == errno.ENOENT
    assert _errno_of(renameat2, j("file"), j("file2"), RENAME_NOREPLACE) == errno.EEXIST
    # RENAME_EXCHANGE swaps a file and a directory
    assert _errno_of(renameat2, j("file"), j("emptyd"), RENAME_EXCHANGE) == 0
    assert os.path.isdir(j("file")) and open(j("emptyd"), "rb").read() == b"f"
    assert _errno_of(renameat2, j("file2"), j("newname"), RENAME_NOREPLACE) == 0
    long = "n" * 256
    assert _errno_of(os.open, j(long), os.O_CREAT | os.O_WRONLY, 0o644) == errno.ENAMETOOLONG
    assert _errno_of(os.mkdir, j(long)) == errno.ENAMETOOLONG
    assert _errno_of(os.stat, j(long)) == errno.ENAMETOOLONG
    assert _errno_of(os.rename, j("newname"), j(long)) == errno.ENAMETOOLONG
    ok = "n" * 255
    with open(j(ok), "wb") as fh:
        fh.write(b"255")
    assert _errno_of(os.mkdir, j("full")) == errno.EEXIST
    assert _errno_of(os.mkdir, j(ok)) == errno.EEXIST
    assert _errno_of(os.rmdir, j("full")) == errno.ENOTEMPTY
    assert _errno_of(os.rmdir, j(ok)) == errno.ENOTDIR
    assert _errno_of(os.unlink, j("missing")) == errno.ENOENT
    assert _errno_of(os.unlink, j("full")) == errno.EISDIR
    assert _errno_of(os.open, j("full"), os.O_WRONLY) == errno.EISDIR
    assert _errno_of(os.open, j("full"), os.O_RDWR) == errno.EISDIR
    assert _errno_of(os.open, j("newname", "x"), os.O_RDONLY) == errno.ENOTDIR
    assert _errno_of(os.open, j("newname"), os.O_CREAT | os.O_EXCL | os.O_WRONLY) == errno.EEXIST
    assert _errno_of(os.link, j("full"), j("hl")) == errno.EPERM
    assert _errno_of(os.symlink, "x", j("newname")) == errno.EEXIST
    assert _errno_of(os.readlink, j("newname")) == errno.EINVAL
    assert _errno_of(os.setxattr, j("newname"), "user.x", b"1") in (errno.ENOTSUP,
                                                                    errno.EOPNOTSUPP)
    sv = os.statvfs(mp)
    assert sv.f_namemax == 255 and sv.f_bsize > 0 and sv.f_blocks > 0
    assert sv.f_bavail <= sv.f_blocks
    m = remount(mounts, m)
    mp = m.mountpoint
    assert sorted(os.listdir(mp)) == sorted(["full", "emptyd", "file", "newname", ok])
    assert open(os.path.join(mp, ok), "rb").read() == b"255"
    assert open(os.path.join(mp, "emptyd"), "rb").read() == b"f"
    assert os.path.isdir(os.path.join(mp, "file"))
    assert open(os.path.join(mp, "newname"), "rb").read() == b"g"


@pytest.mark.parametrize("how", ["unlink", "rename_over", "write_after_unlink"])
def test_unlink_and_rename_over_leave_clean_index(mounts, how):
    """Deleting a file (rm, or the rotation pattern: write tmp, rename over the old file) must
    leave an index that replays without warnings."""
    m = mounts.mount()
    f = os.path.join(m.mountpoint, "ckpt")
    with open(f, "wb") as fh:
        fh.write(b"old" * 100)
    if how == "unlink":
        os.unlink(f)
    elif how == "rename_over":
        with open(f + ".tmp", "wb") as fh:
            fh.write(b"new")
        os.rename(f + ".tmp", f)
    else:
        with open(f, "r+b") as fh:
            os.unlink(f)
            fh.write(b"still open")
    assert m.stop() == 0
    m2 = mounts.mount(backing=m.backing)
    if how == "rename_over":
        assert open(os.path.join(m2.mountpoint, "ckpt"), "rb").read() == b"new"
    else:
        assert os.listdir(m2.mountpoint) == []
    log = mounts.log(m2)
    assert "record skipped" not in log, log
    assert m2.status()["replay_warnings"] == 0


def test_directory_times_after_unlink_rmdir_rename_survive_remount(mounts):
    """Removing or moving an entry changes its directory's mtime and ctime (as creating one
    does), and the new times are what a remount shows, for each way an entry leaves or
    enters a directory: unlink, rmdir, rename out, rename in, rename within, hard link."""
    m = mounts.mount()
    j = lambda *p: os.path.join(m.mountpoint, *p)  # noqa: E731
    for d in ("unlink", "rmdir", "out", "in", "within", "link"):
        os.mkdir(j(d))
    for name in ("unlink/f", "out/f", "within/f", "link/f", "top"):
        with open(j(name), "wb") as fh:
            fh.write(b"x")
    os.mkdir(j("rmdir", "sub"))
    old = 1_000_000_000 * 10**9  # 2001: any change below moves the times past it
    for d in ("unlink", "rmdir", "out", "in", "within", "link"):
        os.utime(j(d), ns=(old, old))
    os.unlink(j("unlink", "f"))
    os.rmdir(j("rmdir", "sub"))
    os.rename(j("out", "f"), j("moved_out"))
    os.rename(j("top"), j("in", "f"))
    os.rename(j("within", "f"), j("within", "g"))
    os.link(j("moved_out"), j("link", "h"))
    want = {}
    for d in ("unlink", "rmdir", "out", "in", "within", "link"):
        st = os.stat(j(d))
        assert st.st_mtime_ns > old and st.st_ctime_ns > old, d
        want[d] = (st.st_mtime_ns, st.st_ctime_ns, st.st_atime_ns)
    root = os.stat(m.mountpoint)
    m = remount(mounts, m)
    for d, times in want.items():
        st = os.stat(j(d))  # (j names the new mount: it reads m when called)
        assert (st.st_mtime_ns, st.st_ctime_ns, st.st_atime_ns) == times, d
    st = os.stat(m.mountpoint)  # the root: rename out of "out" into it was its last change
    assert (st.st_mtime_ns, st.st_ctime_ns) == (root.st_mtime_ns, root.st_ctime_ns)
    assert m.status()["replay_warnings"] == 0


@pytest.mark.parametrize("how", ["rename_over", "unlink"])
def test_other_hard_link_sees_nlink_and_ctime_at_once(mounts, how):
    """rename(a, b) over a b that has another name c (or unlink of b): stat(c) right away
    shows one link less and a new ctime, not the cached attributes; a remount shows the
    same."""
    m = mounts.mount()
    j = lambda *p: os.path.join(m.mountpoint, *p)  # noqa: E731
    os.mkdir(j("d"))
    for name in ("a", "b"):
        with open(j(name), "wb") as fh:
            fh.write(name.encode() * 10)
    os.link(j("b"), j("d", "c"))
    old = 1_000_000_000 * 10**9
    os.utime(j("d", "c"), ns=(old, old))  # mtime only; ctime is now
    before = os.stat(j("d", "c"))  # cached by the kernel from here on
    assert before.st_nlink == 2
    time.sleep(0.01)
    if how == "rename_over":
        os.rename(j("a"), j("b"))
        assert open(j("b"), "rb").read() == b"a" * 10
    else:
        os.unlink(j("b"))
    after = os.stat(j("d", "c"))
    assert after.st_nlink == 1
    assert after.st_ctime_ns > before.st_ctime_ns
    assert after.st_mtime_ns == old  # a name change is not a data change
    assert open(j("d", "c"), "rb").read() == b"b" * 10
    m = remount(mounts, m)
    st = os.stat(j("d", "c"))
    assert (st.st_nlink, st.st_ctime_ns, st.st_mtime_ns) == (1, after.st_ctime_ns, old)


def test_blocks_count_stored_data_and_directories_have_a_size(mounts):
    """st_blocks counts the bytes a file stores, not its apparent size: a 100 MB file made by
    truncate takes no blocks (du shows 0, as on ext4), data written into it counts once
    however often it is overwritten, and a truncate down gives the cut bytes back.
    Directories report a size of one block (4096), as on ext4."""
    m = mounts.mount()
    j = lambda *p: os.path.join(m.mountpoint, *p)  # noqa: E731
    sh("truncate", "-s", "100M", j("sparse"))
    os.mkdir(j("d"))
    with open(j("dense"), "wb") as fh:
        fh.write(b"z" * 5000)

    def blocks(name):
        st = os.stat(j(name))
        return st.st_size, st.st_blocks

    def du_kib(name):
        return int(sh("du", "-k", j(name)).stdout.split()[0])

    assert blocks("sparse") == (100 * MiB, 0) and du_kib("sparse") == 0
    assert blocks("dense") == (5000, 10)  # 5000 bytes in 512-byte units, rounded up
    with open(j("sparse"), "r+b") as fh:
        for _ in range(3):  # the same MiB three times
            fh.seek(50 * MiB)
            fh.write(b"d" * MiB)
            fh.flush()
    assert blocks("sparse") == (100 * MiB, 2048) and du_kib("sparse") == 1024
    os.truncate(j("sparse"), 50 * MiB + 512 * KiB)
    assert blocks("sparse") == (50 * MiB + 512 * KiB, 1024)
    for d in ("d", ""):
        st = os.stat(j(d))
        assert st.st_size == 4096, d
    m = remount(mounts, m)
    assert blocks("sparse") == (50 * MiB + 512 * KiB, 1024)
    assert blocks("dense") == (5000, 10)
    assert os.stat(j("d")).st_size == 4096 and os.stat(m.mountpoint).st_size == 4096
    assert "4096" in sh("ls", "-ld", j("d")).stdout


def test_blocks_of_another_writers_file(mounts):
    """A file another writer wrote shows its stored blocks in this mount too: when the mount
    starts, and after that writer changed it."""
    backing = mounts.backing()
    m1 = mounts.mount(backing, writer_id="w1")
    f1 = os.path.join(m1.mountpoint, "f")
    with open(f1, "wb") as fh:
        fh.write(b"x" * 100_000)
    m1.sync()
    m2 = mounts.mount(backing, writer_id="w2")
    f2 = os.path.join(m2.mountpoint, "f")
    st = os.stat(f2)
    assert (st.st_size, st.st_blocks) == (100_000, 196)
    with open(f1, "r+b") as fh:
        fh.seek(1_000_000)
        fh.write(b"y" * 50_000)  # a hole, then data
    m1.sync()
    wait_for(lambda: os.stat(f2).st_size == 1_050_000, "the other mount to see the size")
    st = os.stat(f2)
    assert (st.st_size, st.st_blocks) == (1_050_000, 293)  # 150,000 bytes stored
