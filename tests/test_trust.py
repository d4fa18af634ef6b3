"""Trust boundaries of a daemon that runs as root over a backing directory a user owns (the
Slurm prolog's setup), and of the children the daemon starts: links planted in the backing
directory are never written through, a backing directory swapped under a live mount is not
followed, and a `ckptfs/` package where the daemon was started never runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from helpers import cli, wait_for

from ckptfs import api
from ckptfs.format import backingdir

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(os.geteuid() != 0, reason="the daemon runs as root here")]

USER = 65534  # nobody: the job's user who owns the backing directory


def _victims(tmp_path) -> dict[str, bytes]:
    """Root-owned files a user would like root to truncate, append to or punch holes in."""
    d = tmp_path / "etc"
    d.mkdir()
    out = {}
    for name in ("index.log", "writer.lock", "daemon.log", "data-000001.log", "writer.json",
                 "ckptfs.json"):
        p = d / name
        p.write_bytes(b"precious " + name.encode() + b"\n" * 5000)
        out[str(p)] = p.read_bytes()
    return out


def _unchanged(victims: dict[str, bytes]) -> None:
    for path, data in victims.items():
        assert not os.path.islink(path)
        with open(path, "rb") as f:
            assert f.read() == data, f"{path} was written through a planted link"


def _user_backing(tmp_path) -> str:
    b = tmp_path / "backing"
    b.mkdir()
    os.chown(b, USER, USER)
    return str(b)


@pytest.mark.parametrize("planted", ["marker", "writer files"])
def test_links_planted_in_a_user_owned_backing_directory_are_never_written_through(
        tmp_path, mounts, planted):
    victims = _victims(tmp_path)
    backing = _user_backing(tmp_path)
    wdir = os.path.join(backing, "writers", "w")
    os.makedirs(wdir)
    for d in (os.path.join(backing, "writers"), wdir):
        os.chown(d, USER, USER)
    for path in victims:
        name = os.path.basename(path)
        if (name == "ckptfs.json") != (planted == "marker"):
            continue
        where = backing if name == "ckptfs.json" else wdir
        os.symlink(path, os.path.join(where, name))
        os.lchown(os.path.join(where, name), USER, USER)
    (tmp_path / "mnt").mkdir()
    res = cli("mount", backing, str(tmp_path / "mnt"), "--writer-id", "w", timeout=60)
    try:
        assert res.returncode != 0, res.stdout
        assert "symbolic link" in res.stderr, res.stderr
    finally:
        if api.is_mounted(str(tmp_path / "mnt")):
            cli("umount", str(tmp_path / "mnt"))
    _unchanged(victims)


def test_a_writer_directory_swapped_for_a_link_under_a_live_mount_is_not_followed(
        tmp_path, mounts):
    """The user renames writers/ away and puts a link to a directory of root's in its
    place: the mount goes on writing into the directory it opened (new data logs too),
    and creates nothing in root's."""
    victims = _victims(tmp_path)
    backing = _user_backing(tmp_path)
    m = mounts.mount(backing, writer_id="w", index_snapshot_ratio=0, log_size="16M")
    with open(os.path.join(m.mountpoint, "before.pt"), "wb") as f:
        f.write(b"b" * 100_000)
    m.sync()
    writers = os.path.join(backing, "writers")
    os.rename(writers, writers + ".moved")
    decoy = tmp_path / "decoy"
    (decoy / "w").mkdir(parents=True)
    for path in victims:  # the names the daemon writes, as links to root's files
        os.symlink(path, decoy / "w" / os.path.basename(path))
    before = sorted(os.listdir(decoy / "w"))
    os.symlink(decoy, writers)
    data = os.urandom(1 << 20) * 40  # (past --log-size: the next data logs are created)
    with open(os.path.join(m.mountpoint, "after.pt"), "wb") as f:
        f.write(data)
    m.sync()
    os.unlink(os.path.join(m.mountpoint, "before.pt"))
    m.sync()
    m.stop()
    _unchanged(victims)
    assert sorted(os.listdir(decoy / "w")) == before
    os.unlink(writers)
    os.rename(writers + ".moved", writers)
    assert len(backingdir.data_logs(os.path.join(writers, "w"))) >= 3
    m = mounts.mount(backing, m.mountpoint, writer_id="w")
    with open(os.path.join(m.mountpoint, "after.pt"), "rb") as f:
        assert f.read() == data
    assert not os.path.exists(os.path.join(m.mountpoint, "before.pt"))
    m.stop()


def test_a_ckptfs_package_where_the_daemon_starts_never_runs(tmp_path, mounts):
    """A read plan's `.metadata` is parsed in a child process: started from a directory that
    holds a `ckptfs/` package, neither the daemon nor the child imports it."""
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    m = mounts.mount()
    sd = {f"w{i}": torch.randn(262144) for i in range(8)}  # (8 MB: a file that gets a plan)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(
        os.path.join(m.mountpoint, "ckpt"), single_file_per_rank=True, thread_count=1),
        no_dist=True)
    m.stop()
    evil = tmp_path / "cwd"
    (evil / "ckptfs" / "datapath").mkdir(parents=True)
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'a').write('ran\\n')\n"
    for init in ("ckptfs/__init__.py", "ckptfs/datapath/__init__.py",
                 "ckptfs/datapath/readplan.py", "ckptfs/datapath/mover.py"):
        (evil / init).write_text(code)
    mnt = tmp_path / "mnt-evil"
    mnt.mkdir()
    ckptfs = os.path.join(os.path.dirname(sys.executable), "ckptfs")
    res = subprocess.run([ckptfs, "mount", m.backing, str(mnt)], cwd=evil, capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, PYTHONPATH=""))
    assert res.returncode == 0, res.stderr
    try:
        out = {k: torch.empty_like(v) for k, v in sd.items()}
        dcp.load(out, storage_reader=dcp.FileSystemReader(os.path.join(mnt, "ckpt")),
                 no_dist=True)
        assert all(torch.equal(out[k], sd[k]) for k in sd)
        st = api.status(str(mnt))
        assert st["read_plans"] == 1, st  # (the child ran, and answered)
    finally:
        assert cli("umount", str(mnt), timeout=60).returncode == 0
    assert not marker.exists(), marker.read_text()
    shutil.rmtree(evil)


_SQUATTER = r"""
import json, os, select, socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(b"\0ckptfs-status-" + sys.argv[1].encode())
s.listen(8)
print("bound", flush=True)
if sys.argv[2] == "ends":  # a daemon ending: its listener closes with a client unanswered
    select.select([s], [], [])
    s.close()
    time.sleep(3600)
while True:
    c, _ = s.accept()
    c.sendall(json.dumps({"pid": int(sys.argv[2]) if sys.argv[2] != "self" else os.getpid(),
                          "mountpoint": sys.argv[3], "bytes_durable": 0, "backing": "/",
                          "uncommitted_changes": 0}).encode() + b"\n")
    c.close()
"""


def _next_anon_dev(tmp_path) -> str:
    """The device number the next mount is likely to get (the lowest free anonymous one)."""
    probe = tmp_path / "probe"
    probe.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "none", str(probe)], check=True)
    try:
        return api.mount_at(str(probe)).dev
    finally:
        subprocess.run(["umount", str(probe)], check=True)


@pytest.mark.parametrize("who", ["another_user", "a_detached_mounts_daemon",
                                 "a_detached_mounts_daemon_that_ends"])
def test_a_status_socket_bound_first_is_not_believed(tmp_path, mounts, who):
    """The status socket's name of the next mount is bound before its daemon binds it: by a
    user, who answers "pid 4194304, nothing uncommitted"; or by root's daemon of a mount
    detached earlier (a hung daemon serves on; the next mount may get its device number),
    which answers with its own pid for its own mount point, or which ends while the client
    waits (its listener closes unanswered: the client's read fails with ECONNRESET). Status
    and umount ask the mount instead."""
    as_user = (lambda: (os.setgid(USER), os.setuid(USER))) if who == "another_user" else None
    pid, where = {"another_user": ("4194304", "/"),
                  "a_detached_mounts_daemon": ("self", str(tmp_path)),
                  "a_detached_mounts_daemon_that_ends": ("ends", "")}[who]
    for _ in range(5):
        dev = _next_anon_dev(tmp_path)
        squatter = subprocess.Popen(["/usr/bin/python3", "-c", _SQUATTER, dev, pid, where],
                                    cwd="/", stdout=subprocess.PIPE, text=True,
                                    preexec_fn=as_user)
        try:
            if squatter.stdout.readline().strip() != "bound":
                continue  # (a mount that came meanwhile holds that device number's name)
            m = mounts.mount()
            if api.mount_device_of(m.mountpoint) != dev:  # (another mount came between)
                m.stop()
                continue
            st = api.status(m.mountpoint)
            assert st["pid"] == m.proc.pid, st
            res = cli("status", m.mountpoint)
            assert res.returncode == 0 and f"pid {m.proc.pid}" in res.stdout, res.stdout
            # once the name is free again the mount's own daemon takes it (tried every 5 s)
            squatter.kill()
            squatter.wait()
            wait_for(lambda: api._status_socket(m.mountpoint, 10) is not None, timeout=30,
                     what="the daemon's own status socket")
            assert api._status_socket(m.mountpoint, 10)["pid"] == m.proc.pid
            res = cli("umount", m.mountpoint, timeout=60)
            assert res.returncode == 0, res.stderr
            assert m.proc.wait(timeout=30) == 0
            return
        finally:
            squatter.kill()
            squatter.wait()
    pytest.skip("no mount got the device number foreseen (other mounts meanwhile)")
