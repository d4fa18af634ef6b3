"""Bad input to `ckptfs mount`, in daemon mode and in the foreground: a one-line error
(`ckptfs: ...` on stderr), a non-zero exit, nothing mounted and nothing written to the
backing directory (names, modes, sizes and mtimes compared before and after)."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import pytest
from crc32c import crc32c
from helpers import CLI, as_user, cli, tree_snapshot

from ckptfs import api
from ckptfs.format import backingdir, records

pytestmark = pytest.mark.timeout(120)

MODES = {"daemon": [], "foreground": ["-f"]}


def mount_fails(backing: str, mnt: str, *extra, mode: str, expect: str) -> None:
    before = tree_snapshot(backing)
    res = cli("mount", *MODES[mode], backing, mnt, *extra, timeout=60)
    if res.returncode == 0 and api.is_mounted(mnt):
        cli("umount", mnt)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode != 0, (res.stdout, res.stderr)
    assert len(lines) == 1 and lines[0].startswith("ckptfs"), res.stderr
    assert expect in lines[0], lines[0]
    assert tree_snapshot(backing) == before, "the failed mount changed the backing directory"


def _mounted_once(mounts) -> str:
    """A backing directory that has been mounted and unmounted once (writer 'w')."""
    b = mounts.backing("b")
    m = mounts.mount(b, writer_id="w")
    with open(os.path.join(m.mountpoint, "x"), "wb") as f:
        f.write(b"x" * 1000)
    m.stop()
    return b


@pytest.fixture
def fresh_backing(mounts):
    """_mounted_once, for a test that changes it."""
    return _mounted_once(mounts)


@pytest.fixture(scope="module")
def shared_backing(module_mounts):
    """_mounted_once, made once for the tests whose mounts fail (mount_fails checks that each
    leaves it as it was)."""
    return _mounted_once(module_mounts)


@pytest.mark.parametrize("mode", MODES)
def test_backing_missing_or_file(tmp_path, mode):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mount_fails(str(tmp_path / "nope"), str(mnt), mode=mode, expect="does not exist")
    assert not (tmp_path / "nope").exists()
    f = tmp_path / "file"
    f.write_bytes(b"abc")
    mount_fails(str(f), str(mnt), mode=mode, expect="not a directory")


def test_import_into_a_missing_backing_directory(tmp_path):
    """`ckptfs import` mounts the backing directory: its errors read like mount's."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_bytes(b"a")
    res = cli("import", str(src), str(tmp_path / "nope"), timeout=60)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert len(lines) == 1 and lines[0].startswith("ckptfs: "), res.stderr
    assert "does not exist" in lines[0] and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "nope").exists()


@pytest.mark.parametrize("mode", MODES)
def test_backing_read_only(tmp_path, mode):
    b = tmp_path / "ro"
    b.mkdir()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "--bind", str(b), str(b)]).returncode != 0:
        pytest.skip("bind mount not possible")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(b)], check=True)
        mount_fails(str(b), str(mnt), mode=mode, expect="not writable")
    finally:
        subprocess.run(["umount", str(b)])


@pytest.mark.parametrize("mode", MODES)
def test_backing_unwritable_for_user(mode):
    """A non-root user mounting a backing directory it cannot write."""
    top = tempfile.mkdtemp(prefix="ckptfs-bad-", dir="/tmp")
    os.chmod(top, 0o755)
    try:
        _unwritable(Path(top), mode)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _unwritable(top, mode):
    b = top / "b"
    b.mkdir(mode=0o755)
    mnt = top / "mnt"
    mnt.mkdir()
    os.chmod(mnt, 0o777)
    before = tree_snapshot(str(b))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    res = as_user(CLI + ["mount", *MODES[mode], str(b), str(mnt)], env=env, cwd="/")
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode != 0 and len(lines) == 1 and lines[0].startswith("ckptfs: "), \
        res.stderr
    assert "not writable" in lines[0], lines[0]
    assert tree_snapshot(str(b)) == before


@pytest.mark.parametrize("mode", MODES)
def test_mountpoint_problems(shared_backing, tmp_path, mode):
    b = shared_backing
    mount_fails(b, str(tmp_path / "missing"), mode=mode, expect="does not exist")
    f = tmp_path / "afile"
    f.write_bytes(b"")
    mount_fails(b, str(f), mode=mode, expect="not a directory")
    full = tmp_path / "full"
    full.mkdir()
    (full / "something").write_bytes(b"")
    mount_fails(b, str(full), mode=mode, expect="not empty")


@pytest.mark.parametrize("mode", [
    "daemon", "foreground"])
def test_already_mounted_and_second_writer(mounts, fresh_backing, tmp_path, mode):
    b = fresh_backing
    m = mounts.mount(b, writer_id="w")
    other = mounts.backing("other")
    mount_fails(other, m.mountpoint, mode=mode, expect="already a mount point")
    mnt2 = tmp_path / "second"
    mnt2.mkdir()
    # The same writer identity twice: refused, backing untouched.
    mount_fails(b, str(mnt2), "--writer-id", "w", mode=mode, expect="in use")
    # A distinct writer identity works.
    m2 = mounts.mount(b, str(mnt2), writer_id="w2")
    with open(os.path.join(m2.mountpoint, "y"), "wb") as f:
        f.write(b"y")
    m2.stop()
    m.stop()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("args,expect", [
    pytest.param(["--bogus"], "unrecognized arguments"),
    pytest.param(["--staging-size", "lots"], "not a size"),
    (["--staging-size", "1M", "--segment-size", "1M"], "at least two segments"),
    pytest.param(["--io", "sideways"], "invalid choice"),
    (["--request-spin", "-5"], "--request-spin must be between"),
    (["--checksum-block", "1000"], "--checksum-block must be a multiple of 4 KiB"),
    # writer ids name a directory: refused, never rewritten (a/b and a_b must not share one)
    (["--writer-id", "a/b"], "invalid writer id 'a/b'"),
    (["--writer-id", ".."], "invalid writer id '..'"),
    (["--writer-id", "x" * 129], "invalid writer id"),
    (["--writer-id", "caf\u00e9"], "invalid writer id"),
])
def test_bad_options(shared_backing, tmp_path, mode, args, expect):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mount_fails(shared_backing, str(mnt), *args, mode=mode, expect=expect)


@pytest.mark.parametrize("mode", MODES)
def test_newer_index_version(fresh_backing, tmp_path, mode):
    path = os.path.join(fresh_backing, "writers", "w", backingdir.INDEX_NAME)
    with open(path, "r+b") as f:
        head = struct.pack("<8sI", records.INDEX_MAGIC, records.INDEX_VERSION + 1)
        f.write(head + struct.pack("<I", crc32c(head)))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mount_fails(fresh_backing, str(mnt), "--writer-id", "w", mode=mode,
                expect="newer than this ckptfs")


def test_verify_newer_index_version(fresh_backing):
    path = os.path.join(fresh_backing, "writers", "w", backingdir.INDEX_NAME)
    with open(path, "r+b") as f:
        head = struct.pack("<8sI", records.INDEX_MAGIC, records.INDEX_VERSION + 1)
        f.write(head + struct.pack("<I", crc32c(head)))
    res = cli("verify", fresh_backing)
    assert "newer" in res.stderr
    assert res.returncode != 0, res.stdout


def test_writer_ids():
    assert backingdir.safe_writer_id("rank-0.host_1") == "rank-0.host_1"
    assert backingdir.safe_writer_id("x" * 128) == "x" * 128
    for bad in ("", ".", "..", "a/b", "a b", "x" * 129, "caf\u00e9", "n\u00b2"):
        with pytest.raises(records.FormatError):
            backingdir.safe_writer_id(bad)
    wid = backingdir.default_writer_id()  # the host name, made safe
    assert backingdir.safe_writer_id(wid) == wid
