"""mount_scripts/: the mount(8)/umount(8) helpers and their installer, the Slurm prolog/epilog
pair and the torchrun example, run for real (root and /dev/fuse are needed for the mounts).
Every test unmounts in teardown (`ckptfs umount`, then `fusermount3 -uz`, then SIGKILL of the
daemon by PID) and has a timeout."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from helpers import CKPTFS, SCRIPTS, SMALL, SMALL_FLAGS, as_user, needs_fuse, needs_root, sh

from ckptfs import api


@pytest.fixture
def helpers(tmp_path):
    """The helpers installed into a temporary prefix (DESTDIR), as install.sh does."""
    r = sh(os.path.join(SCRIPTS, "install.sh"), "--prefix", "/usr", "--ckptfs", CKPTFS,
           env={"DESTDIR": str(tmp_path / "dest")}, check=True)
    sbin = tmp_path / "dest" / "usr" / "sbin"
    assert "installed" in r.stdout
    return str(sbin / "mount.fuse.ckptfs"), str(sbin / "umount.fuse.ckptfs")


# ---------------------------------------------------------------- static checks, installer
@pytest.mark.timeout(60)
def test_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    files = sorted(os.path.join(SCRIPTS, f) for f in os.listdir(SCRIPTS)
                   if f.endswith(".sh") or f in ("mount.ckptfs", "umount.ckptfs"))
    assert len(files) >= 6
    r = sh("shellcheck", *files)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.timeout(60)
def test_install_idempotent_uninstall_and_foreign_files(tmp_path):
    inst = os.path.join(SCRIPTS, "install.sh")
    env = {"DESTDIR": str(tmp_path / "d")}
    sh(inst, "--prefix", "/", "--ckptfs", CKPTFS, env=env, check=True)
    helper = tmp_path / "d" / "sbin" / "mount.fuse.ckptfs"
    text = helper.read_text()
    assert f'CKPTFS_INSTALLED="{os.path.realpath(os.path.dirname(CKPTFS))}/ckptfs"' in text \
        or f'CKPTFS_INSTALLED="{CKPTFS}"' in text
    assert os.access(helper, os.X_OK)
    mtime = helper.stat().st_mtime_ns
    r = sh(inst, "--prefix", "/", "--ckptfs", CKPTFS, env=env, check=True)
    assert r.stdout.count("up to date") == 2 and helper.stat().st_mtime_ns == mtime
    # the default ckptfs is the current venv's
    r = sh(inst, "--prefix", "/", env=dict(env, VIRTUAL_ENV=os.path.dirname(
        os.path.dirname(CKPTFS))), check=True)
    assert "ckptfs: " in r.stdout
    sh(inst, "--prefix", "/", "--uninstall", env=env, check=True)
    assert not helper.exists()
    assert sh(inst, "--prefix", "/", "--uninstall", env=env).returncode == 0
    # a helper we did not install is neither replaced nor removed
    helper.write_text("#!/bin/sh\necho someone else\n")
    r = sh(inst, "--prefix", "/", "--ckptfs", CKPTFS, env=env)
    assert r.returncode != 0 and "not installed by ckptfs" in r.stderr
    sh(inst, "--prefix", "/", "--uninstall", env=env, check=True)
    assert helper.read_text().endswith("someone else\n")
    assert sh(inst, "--ckptfs", "/nonexistent/ckptfs", env=env).returncode != 0


@pytest.mark.timeout(60)
def test_helper_translates_and_rejects_options(helpers):
    mount_helper, _ = helpers
    r = sh(mount_helper, "/b", "/m", "-f", "-n", "-o",
           "rw,defaults,staging_size=2G,segment-size=8M,queue_depth=32,io=direct,writer_id=x,"
           "allow_other,engine=posix,_netdev,noauto,x-systemd.automount,nouser,dev,suid,exec,"
           "auto,no_writeback_cache,idle_flush=0.5", "-t", "fuse.ckptfs")
    assert r.returncode == 0, r.stderr
    assert (f"{CKPTFS} mount /b /m --staging-size 2G --segment-size 8M --queue-depth 32 "
            "--io direct --writer-id x --allow-other --engine posix --no-writeback-cache "
            "--idle-flush 0.5") in r.stderr
    r = sh(mount_helper, "/b", "/m", "-f", "-o", "ro,readahead=8M")
    assert r.returncode == 0 and "--ro --readahead 8M" in r.stderr, r.stderr
    r = sh(mount_helper, "/b", "/m", "-f", "-o",
           "ro,direct_reads,data_logs=4,stripe-size=1M,request_spin=0,no_fast_path")
    assert r.returncode == 0, r.stderr
    assert ("--ro --direct-reads --data-logs 4 --stripe-size 1M --request-spin 0 "
            "--no-fast-path" in r.stderr), r.stderr
    for bad, words in [("bogus=1", "unknown option 'bogus=1'"),
                       ("sync", "not supported"), ("staging_size", "needs a value"),
                       ("allow_other=1", "takes no value")]:
        r = sh(mount_helper, "/b", "/m", "-f", "-o", bad)
        assert r.returncode != 0 and words in r.stderr, (bad, r.stderr)
    r = sh(mount_helper, "/b", "/m", "-s", "-f", "-o", "bogus=1")  # sloppy: warn, go on
    assert r.returncode == 0 and "ignored" in r.stderr
    # the executable: ckptfs= option, then $CKPTFS, then the installed one
    r = sh(mount_helper, "/b", "/m", "-f", "-o", "ckptfs=/bin/true")
    assert "/bin/true mount /b /m" in r.stderr
    r = sh(mount_helper, "/b", "/m", "-f", env={"CKPTFS": "/bin/echo"})
    assert "/bin/echo mount /b /m" in r.stderr
    r = sh(mount_helper, "/b", "/m", "-f", "-o", "ckptfs=/nonexistent")
    assert r.returncode != 0 and "not found" in r.stderr
    assert sh(mount_helper).returncode != 0


# ---------------------------------------------------------------- real mounts via the helpers
@needs_fuse
@pytest.mark.timeout(120)
def test_helper_called_like_mount8(helpers, tmp_path, track):
    mount_helper, umount_helper = helpers
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    mnt.mkdir()
    r = sh(mount_helper, backing, mnt, "-o", f"rw,{SMALL},queue_depth=4,io=buffered,"
           "engine=posix,writer_id=w7,noauto,_netdev", "-t", "fuse.ckptfs", env={"CKPTFS": ""})
    assert r.returncode == 0 and r.stdout.startswith("ready:"), r.stdout + r.stderr
    track.add(mnt)
    st = api.status(str(mnt))
    assert st["engine"] == "posix" and st["io_mode"] == "buffered" and st["queue_depth"] == 4
    assert (backing / "writers" / "w7").is_dir()
    data = os.urandom(3 << 20)
    (mnt / "d").mkdir()
    (mnt / "d" / "f.bin").write_bytes(data)
    # the umount helper waits for durability, like `ckptfs umount`
    r = sh(umount_helper, mnt, "-n", env={"CKPTFS": ""})
    assert r.returncode == 0 and "everything durable" in r.stdout, r.stdout + r.stderr
    assert not api.is_mounted(str(mnt))
    assert api.wait_pid_exit(st["pid"], 10)
    assert sh(CKPTFS, "verify", backing).returncode == 0
    r = sh(mount_helper, backing, mnt, "-o", SMALL + ",writer_id=w7")
    assert r.returncode == 0, r.stderr
    track.add(mnt)
    assert (mnt / "d" / "f.bin").read_bytes() == data


@pytest.fixture
def sbin_helpers():
    """Install the helpers where mount(8) looks (/sbin) for the test, remove them afterwards.
    Only when that is safe: root, and no mount.fuse.ckptfs there that we did not put there."""
    if os.geteuid() != 0:
        pytest.skip("needs root to install into /sbin")
    if shutil.which("mount") is None:
        pytest.skip("no mount(8)")
    for name in ("mount.fuse.ckptfs", "umount.fuse.ckptfs"):
        if os.path.exists(f"/sbin/{name}"):
            pytest.skip(f"/sbin/{name} already exists: not touching it")
    inst = os.path.join(SCRIPTS, "install.sh")
    try:
        sh(inst, "--ckptfs", CKPTFS, check=True)
        yield "/sbin"
    finally:
        sh(inst, "--uninstall")
        assert not os.path.exists("/sbin/mount.fuse.ckptfs")


@needs_fuse
@pytest.mark.timeout(120)
def test_real_mount_t_fuse_ckptfs_and_fstab(sbin_helpers, tmp_path, track):
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    mnt.mkdir()
    r = sh("mount", "-t", "fuse.ckptfs", backing, mnt, "-o", SMALL + ",x-systemd.automount")
    assert r.returncode == 0 and "ready:" in r.stdout, r.stdout + r.stderr
    track.add(mnt)
    with open("/proc/self/mountinfo") as f:
        assert any(f" {mnt} " in line and "fuse.ckptfs" in line for line in f)
    (mnt / "a.bin").write_bytes(b"x" * 100000)
    r = sh("umount", mnt)  # through umount.fuse.ckptfs: waits until durable
    assert r.returncode == 0 and "everything durable" in r.stdout + r.stderr, r.stdout + r.stderr
    assert not api.is_mounted(str(mnt))
    # an /etc/fstab line (here an alternative fstab, mount -T)
    fstab = tmp_path / "fstab"
    fstab.write_text(f"# test\n{backing}  {mnt}  fuse.ckptfs  {SMALL},_netdev,noauto,"
                     "x-systemd.requires=network-online.target  0 0\n")
    r = sh("mount", "-T", fstab, mnt)
    assert r.returncode == 0, r.stdout + r.stderr
    track.add(mnt)
    assert (mnt / "a.bin").read_bytes() == b"x" * 100000
    r = sh("mount", "-t", "fuse.ckptfs", backing, tmp_path, "-o", "bogus")
    assert r.returncode != 0 and "unknown option" in r.stderr
    assert sh("umount", mnt).returncode == 0


# ---------------------------------------------------------------- Slurm prolog / epilog
def _slurm_env(tmp_path, job="4242", **kw):
    env = {"SLURM_JOB_ID": job, "CKPTFS_BACKING_ROOT": str(tmp_path / "pfs"),
           "CKPTFS_MOUNTPOINT": str(tmp_path / "ckpt"), "CKPTFS_MOUNT_OPTS": SMALL_FLAGS,
           "CKPTFS_UMOUNT_TIMEOUT": "60"}
    env.update(kw)
    return env


@needs_fuse
@needs_root
@pytest.mark.timeout(180)
def test_slurm_prolog_epilog_around_torch_save(tmp_path, track):
    torch = pytest.importorskip("torch")
    env = _slurm_env(tmp_path, SLURM_JOB_UID="65534", SLURM_JOB_GID="65534")
    mnt = tmp_path / "ckpt"
    r = sh(os.path.join(SCRIPTS, "slurm-prolog.sh"), env=env)
    assert r.returncode == 0, r.stderr
    assert "ready:" in r.stderr
    track.add(mnt)
    backing = tmp_path / "pfs" / "4242"
    assert backing.is_dir() and api.is_mounted(str(mnt))
    st = os.stat(mnt)
    assert (st.st_uid, st.st_gid) == (65534, 65534)  # handed to the job's user
    # the job's user can write there (allow_other + ownership), via setpriv as uid 65534
    if shutil.which("setpriv"):
        # (cwd: pytest's tmp_path is not traversable by other users)
        r = as_user(["sh", "-c", "echo hi > user.txt && mkdir own"], timeout=30, cwd=mnt)
        assert r.returncode == 0, r.stderr
        assert os.stat(mnt / "own").st_uid == 65534
    # the job: plain torch.save into the mount
    tensors = {f"t{i}": torch.randn(1000 + i) for i in range(20)}
    os.makedirs(mnt / "step_1" / "rank_0")
    for k, t in tensors.items():
        torch.save(t, mnt / "step_1" / "rank_0" / f"{k}.pt")
    r = sh(os.path.join(SCRIPTS, "slurm-epilog.sh"), env=env)
    assert r.returncode == 0, r.stderr
    assert "everything durable" in r.stderr
    assert not api.is_mounted(str(mnt))
    assert sh(CKPTFS, "verify", backing).returncode == 0
    # the next job of the same id (a requeue) sees the same tree
    r = sh(os.path.join(SCRIPTS, "slurm-prolog.sh"), env=env)
    assert r.returncode == 0, r.stderr
    track.add(mnt)
    for k, t in tensors.items():
        assert torch.equal(torch.load(mnt / "step_1" / "rank_0" / f"{k}.pt"), t)
    assert sh(os.path.join(SCRIPTS, "slurm-epilog.sh"), env=env).returncode == 0


@needs_fuse
@needs_root
@pytest.mark.timeout(120)
def test_slurm_epilog_fails_when_not_mounted_or_not_durable(tmp_path, track):
    env = _slurm_env(tmp_path, job="77")
    (tmp_path / "ckpt").mkdir()
    r = sh(os.path.join(SCRIPTS, "slurm-epilog.sh"), env=env)
    assert r.returncode != 0 and "is not mounted" in r.stderr and "job 77" in r.stderr
    r = sh(os.path.join(SCRIPTS, "slurm-prolog.sh"), env={"SLURM_JOB_ID": ""})
    assert r.returncode != 0 and "SLURM_JOB_ID" in r.stderr
    # the daemon dies mid-job: the epilog detaches the dead mount and reports the loss
    mnt = tmp_path / "ckpt"
    r = sh(os.path.join(SCRIPTS, "slurm-prolog.sh"), env=env)
    assert r.returncode == 0, r.stderr
    track.add(mnt)
    (mnt / "unsynced.bin").write_bytes(b"y" * 4096)
    pid = api.status(str(mnt))["pid"]
    os.kill(pid, signal.SIGKILL)
    assert api.wait_pid_exit(pid, 10)
    r = sh(os.path.join(SCRIPTS, "slurm-epilog.sh"), env=env)
    assert r.returncode != 0, r.stderr
    assert "NOT everything was made durable" in r.stderr and "daemon is gone" in r.stderr
    assert not api.is_mounted(str(mnt))


# ---------------------------------------------------------------- torchrun example
@pytest.mark.slow
@needs_fuse
@pytest.mark.timeout(180)
def test_torchrun_example_end_to_end(tmp_path, track):
    pytest.importorskip("torch")
    mnt = tmp_path / "ckpt"
    env = {"CKPTFS_BACKING": str(tmp_path / "backing"), "CKPTFS_MOUNTPOINT": str(mnt),
           "CKPTFS_MOUNT_OPTS": SMALL_FLAGS + " --idle-flush 0.2", "NPROC": "2",
           "WIDTH": "128", "DEPTH": "2"}
    track.mountpoints.append(str(mnt))
    r = sh(os.path.join(SCRIPTS, "torchrun-example.sh"), env=env, timeout=150, cwd=tmp_path)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert "saved" in out and "step_4" in out
    assert "OK:" in out and "0 damaged files" in out
    assert "every tensor matches its manifest digest" in out
    assert "restored step 4" in out and "step 5: loss" in out
    assert not api.is_mounted(str(mnt))
    # the tree is there offline: 2 ranks x tensors per step, a manifest per step
    ls = sh(CKPTFS, "ls", "-R", tmp_path / "backing", check=True).stdout
    assert "/step_4/rank_1/" in ls and "/step_2/manifest.json" in ls


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_train_example_plain_python_without_fuse(tmp_path):
    """The example is plain torch: it also runs (1 process, no torchrun) on a normal dir."""
    pytest.importorskip("torch")
    script = os.path.join(SCRIPTS, "train_example.py")
    r = subprocess.run([sys.executable, script, "--ckpt-dir", str(tmp_path), "--steps", "2",
                        "--width", "32", "--depth", "1"], capture_output=True, text=True,
                       timeout=100)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, script, "--ckpt-dir", str(tmp_path), "--restore",
                        "--width", "32", "--depth", "1"], capture_output=True, text=True,
                       timeout=100)
    assert r.returncode == 0 and "restored step 2" in r.stdout, r.stderr
    manifest = json.loads((tmp_path / "step_2" / "manifest.json").read_text())
    assert manifest["world"] == 1 and len(manifest["tensors"]) >= 4
