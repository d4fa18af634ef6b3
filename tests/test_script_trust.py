"""The scripts of mount_scripts/ that run as root (Slurm prolog and epilog, glusterfs.sh,
install.sh) against what an unprivileged user can leave in a shared place first: a symlink or a
directory of their own in a world-writable sticky directory (as /var/tmp is), files with
commands in them, a PATH entry. The scripts run for real, as root, against real directories; the
user's things are made by root and handed to uid 65534 (nobody) with chown/lchown, which is
what the kernel would see had that user made them. Each test checks that the script refused
with a message naming the problem and that nothing outside was changed, mounted or stopped."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
from pathlib import Path

import pytest
from helpers import CKPTFS, SCRIPTS, SMALL_FLAGS, loopback_only, needs_fuse, needs_root, sh

from ckptfs import api


NOBODY = 65534
PROLOG = os.path.join(SCRIPTS, "slurm-prolog.sh")
EPILOG = os.path.join(SCRIPTS, "slurm-epilog.sh")
GLUSTER = os.path.join(SCRIPTS, "glusterfs.sh")
INSTALL = os.path.join(SCRIPTS, "install.sh")

pytestmark = [needs_root, pytest.mark.timeout(120)]


# ---------------------------------------------------------------- what a user leaves behind
def shared_dir(tmp_path) -> str:
    """A directory like /var/tmp: root's, world-writable, sticky."""
    d = tmp_path / "vartmp"
    d.mkdir(exist_ok=True)
    os.chmod(d, 0o1777)
    return str(d)


def users_dir(path) -> str:
    """A directory the user made (theirs, writable by them only)."""
    os.mkdir(path, 0o755)
    os.chown(path, NOBODY, NOBODY)
    return str(path)


def plant(link, target) -> str:
    """A symlink the user made."""
    os.symlink(target, link)
    os.lchown(link, NOBODY, NOBODY)
    return str(link)


def victim(tmp_path, empty: bool = False) -> str:
    """A directory of root's (a stand-in for /etc/something) the user wants to get at."""
    d = tmp_path / "etc-victim"
    d.mkdir()
    if not empty:
        (d / "keep.conf").write_text("root's\n")
    os.chmod(d, 0o755)
    return str(d)


def snapshot(path) -> dict:
    """Names, owners, modes and contents under path, and whether it is a mount point."""
    out = {"mounted": api.is_mounted(path)}
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [""] + dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            data = open(p, "rb").read() if stat.S_ISREG(st.st_mode) else None
            out[os.path.relpath(p, path)] = (st.st_uid, st.st_gid, st.st_mode, data)
    return out


def slurm_env(tmp_path, **kw) -> dict:
    env = {"SLURM_JOB_ID": "4242", "SLURM_JOB_UID": str(NOBODY), "SLURM_JOB_GID": str(NOBODY),
           "CKPTFS_BACKING_ROOT": str(tmp_path / "pfs"),
           "CKPTFS_MOUNTPOINT": str(tmp_path / "ckpt"), "CKPTFS_MOUNT_OPTS": SMALL_FLAGS,
           "CKPTFS_UMOUNT_TIMEOUT": "60"}
    env.update(kw)
    return env


def run_prolog(env, track, *watch, cwd=None):
    """The prolog; whatever it mounted (a refused run mounts nothing) is unmounted after."""
    r = sh(PROLOG, env=env, cwd=cwd)
    for path in (env["CKPTFS_MOUNTPOINT"],) + watch:
        track.add(path)
    return r


# ---------------------------------------------------------------- Slurm prolog
@needs_fuse
@pytest.mark.parametrize("how", ["symlink", "users_dir"])
def test_prolog_refuses_a_backing_root_a_user_planted(tmp_path, track, how):
    """A backing root in a shared place (say /var/tmp/ckptfs): a user who makes that name
    first, as a symlink to a directory of root's or as their own directory with
    the job's name in it pointing there, gets no directory of root's created, chmod-ed or
    handed over, and no mount."""
    etc = victim(tmp_path)
    before = snapshot(etc)
    root = os.path.join(shared_dir(tmp_path), "ckptfs")
    if how == "symlink":
        plant(root, etc)
    else:
        users_dir(root)
        plant(os.path.join(root, "4242"), etc)
    r = run_prolog(slurm_env(tmp_path, CKPTFS_BACKING_ROOT=root), track, etc)
    assert r.returncode != 0, r.stderr
    assert "refusing CKPTFS_BACKING_ROOT" in r.stderr, r.stderr
    want = "is a symlink of uid 65534" if how == "symlink" else "belongs to uid 65534, not root"
    assert want in r.stderr, r.stderr
    assert snapshot(etc) == before
    assert not api.is_mounted(str(tmp_path / "ckpt"))


@needs_fuse
@pytest.mark.parametrize("how", ["symlink", "users_dir"])
def test_prolog_refuses_a_job_directory_not_roots(tmp_path, track, how):
    """The per-job directory, where the daemon works as root: a symlink of a user's there is not
    followed, and a directory a user owns is not used (the user could put symlinks in it for
    the daemon to write through)."""
    etc = victim(tmp_path)
    before = snapshot(etc)
    root = tmp_path / "pfs"
    root.mkdir(mode=0o755)
    job = root / "4242"
    if how == "symlink":
        plant(job, etc)
    else:
        users_dir(job)
    r = run_prolog(slurm_env(tmp_path), track, etc)
    assert r.returncode != 0, r.stderr
    assert "refusing backing directory" in r.stderr and "uid 65534" in r.stderr, r.stderr
    assert snapshot(etc) == before
    assert not api.is_mounted(str(tmp_path / "ckpt"))
    if how == "users_dir":
        assert os.listdir(job) == []


@needs_fuse
@pytest.mark.parametrize("how", ["symlink", "users_dir"])
def test_prolog_refuses_a_mount_point_a_user_planted(tmp_path, track, how):
    """A mount point in a shared place: a symlink there (or a user's directory on the way)
    would have the job's store mounted over the directory it points to, and that directory's
    mount root handed to the user."""
    etc = victim(tmp_path, empty=True)  # (ckptfs mounts on empty directories only)
    before = snapshot(etc)
    shared = shared_dir(tmp_path)
    if how == "symlink":
        mnt = plant(os.path.join(shared, "ckpt"), etc)
    else:
        mnt = plant(os.path.join(users_dir(os.path.join(shared, "u")), "ckpt"), etc)
    r = run_prolog(slurm_env(tmp_path, CKPTFS_MOUNTPOINT=mnt), track, etc)
    assert r.returncode != 0, r.stderr
    assert "refusing mount point" in r.stderr, r.stderr
    assert not api.is_mounted(etc)
    assert snapshot(etc) == before


@needs_fuse
def test_prolog_default_root_is_roots_and_the_job_directory_stays_roots(tmp_path, track):
    """Without CKPTFS_BACKING_ROOT the per-job directory is made in /var/lib/ckptfs, not in a
    world-writable directory; it stays root's, mode 0700, while the mount root is the user's."""
    base, old_base = "/var/lib/ckptfs", "/var/tmp/ckptfs"
    made_base, made_old = not os.path.lexists(base), not os.path.lexists(old_base)
    job = f"trust-test-{os.getpid()}"
    env = slurm_env(tmp_path, SLURM_JOB_ID=job, CKPTFS_BACKING_ROOT="")  # "": the default
    try:
        r = run_prolog(env, track)
        assert r.returncode == 0, r.stderr
        backing = os.path.join(base, job)
        st = os.lstat(backing)
        assert stat.S_ISDIR(st.st_mode) and (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700)
        st = os.stat(base)
        assert st.st_uid == 0 and not st.st_mode & 0o022
        assert not os.path.lexists(os.path.join("/var/tmp/ckptfs", job))
        assert os.stat(tmp_path / "ckpt").st_uid == NOBODY
        r = sh(EPILOG, env=env)
        assert r.returncode == 0 and "everything durable" in r.stderr, r.stderr
    finally:
        track.cleanup()
        for d, made in ((base, made_base), (old_base, made_old)):
            shutil.rmtree(os.path.join(d, job), ignore_errors=True)
            if made:
                try:
                    os.rmdir(d)
                except OSError:
                    pass


@pytest.mark.parametrize("how", ["users_file", "world_writable"])
def test_prolog_and_epilog_refuse_a_configuration_others_can_change(tmp_path, track, how):
    """The configuration file is shell the scripts source as root: one a user owns or can
    write is not read."""
    marker = tmp_path / "ran-as-root"
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"touch {marker}\n")
    if how == "users_file":
        os.chown(conf, NOBODY, NOBODY)
    else:
        os.chmod(conf, 0o666)
    for script in (PROLOG, EPILOG):
        r = sh(script, env=slurm_env(tmp_path, CKPTFS_SLURM_CONF=str(conf)))
        track.add(tmp_path / "ckpt")
        assert r.returncode != 0, r.stderr
        assert f"not reading {conf}" in r.stderr, r.stderr
        assert not marker.exists(), script


def test_prolog_starts_ckptfs_from_root_with_a_clean_path(tmp_path):
    """ckptfs runs from / with a PATH of system directories (and the ckptfs directory), not
    with the working directory and PATH slurmd happened to have: a command of the same name
    in another PATH entry is not run."""
    marker = tmp_path / "fake-logger-ran"
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "logger").write_text(f"#!/bin/sh\ntouch {marker}\n")
    record = tmp_path / "seen"
    wrapper = tmp_path / "wrap" / "ckptfs"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nprintf "%s\\n%s\\n" "$PWD" "$PATH" > {record}\nexit 1\n')
    for f in (fake_bin / "logger", wrapper):
        os.chmod(f, 0o755)
    somewhere = tmp_path / "cwd"
    somewhere.mkdir()
    env = slurm_env(tmp_path, CKPTFS=str(wrapper), PATH=f"{fake_bin}:{os.environ['PATH']}")
    r = sh(PROLOG, env=env, cwd=somewhere)
    assert r.returncode != 0 and "ckptfs mount" in r.stderr, r.stderr
    cwd, path = record.read_text().splitlines()
    assert cwd == "/"
    assert path == f"/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:{wrapper.parent}"
    assert not marker.exists()


# ---------------------------------------------------------------- Slurm epilog
@needs_fuse
def test_epilog_refuses_a_mount_point_through_a_users_symlink(tmp_path, track):
    """Another mount (another job's) stays mounted when the configured mount point leads to it
    through a directory and symlink a user made."""
    other_backing, other = tmp_path / "other-backing", tmp_path / "other-ckpt"
    other_backing.mkdir()
    other.mkdir()
    sh(CKPTFS, "mount", other_backing, other, *SMALL_FLAGS.split(), check=True)
    track.add(other)
    mnt = plant(os.path.join(users_dir(os.path.join(shared_dir(tmp_path), "u")), "ckpt"), other)
    r = sh(EPILOG, env=slurm_env(tmp_path, CKPTFS_MOUNTPOINT=mnt))
    assert r.returncode != 0, r.stderr
    assert "refusing mount point" in r.stderr and "uid 65534" in r.stderr, r.stderr
    assert api.is_mounted(str(other))


# ---------------------------------------------------------------- glusterfs.sh
needs_gluster = pytest.mark.skipif(
    not (os.path.isdir("/etc/glusterfs") and os.path.exists("/usr/sbin/glusterd")
         and shutil.which("ss")),
    reason="needs the GlusterFS packages (make gluster-deps)")


def gluster_up_isolated(tmp_path, env) -> tuple[subprocess.CompletedProcess, str]:
    """`glusterfs.sh up` in mount and network namespaces of its own: /etc/glusterfs is a copy
    (the script edits glusterd.vol), glusterd is /bin/false (it starts nothing), and only the
    loopback of the namespace is there, so a glusterd running on the machine (the test
    suite's volume) is not seen and used. The run goes as far as configuring and starting
    glusterd, and the machine stays as it was."""
    etc = tmp_path / "etc-glusterfs"
    shutil.copytree("/etc/glusterfs", etc)
    glusterd = os.path.realpath("/usr/sbin/glusterd")
    inner = (f"mount --bind {etc} /etc/glusterfs; mount --bind /bin/false {glusterd}; "
             f"exec bash {GLUSTER} up")
    full = dict(os.environ, GLUSTER_VOLUME="trusttest", GLUSTER_RUN=str(tmp_path / "run"),
                GLUSTER_TIMEOUT="10", **env)
    r = subprocess.run(loopback_only(inner, "--mount", "--fork"), env=full,
                       capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL)
    return r, (etc / "glusterd.vol").read_text()


@needs_gluster
@pytest.mark.parametrize("how", ["users_dir", "symlink", "addr_injection", "bad_host",
                                 "host_off_loopback"])
def test_gluster_up_does_not_trust_its_state_directory(tmp_path, how):
    """The host recorded in GLUSTER_DIR/state/host decides what goes into `sed -i` on
    glusterd.vol (GNU sed can run commands: `e`) and where glusterd binds. A GLUSTER_DIR a user
    made first (in /var/tmp) is refused; a recorded host is checked like a new one: a plain
    host name or address resolving into 127.0.0.0/8, its address looked up again."""
    marker = tmp_path / "sed-ran-this"
    injection = f"127.0.0.2/;1e touch {marker};#"
    shared = shared_dir(tmp_path)
    gdir = os.path.join(shared, "ckptfs-gluster")
    if how in ("users_dir", "symlink"):
        target = users_dir(os.path.join(shared, "made-by-user") if how == "symlink" else gdir)
        users_dir(os.path.join(target, "state"))
        with open(os.path.join(target, "state", "host"), "w") as f:
            f.write(f"127.0.0.2 {injection}\n")
        if how == "symlink":
            plant(gdir, target)
    else:
        os.makedirs(os.path.join(gdir, "state"), mode=0o700)
        os.chmod(gdir, 0o755)
        host = {"addr_injection": f"127.0.0.2 {injection}",
                "bad_host": f"{injection} 127.0.0.2",
                "host_off_loopback": "8.8.8.8 127.0.0.2"}[how]
        with open(os.path.join(gdir, "state", "host"), "w") as f:
            f.write(host + "\n")
    vol_before = open("/etc/glusterfs/glusterd.vol").read()
    r, vol = gluster_up_isolated(tmp_path, {"GLUSTER_DIR": gdir})
    out = r.stdout + r.stderr
    assert not marker.exists(), out
    assert "touch" not in vol and "8.8.8.8" not in vol
    assert open("/etc/glusterfs/glusterd.vol").read() == vol_before
    if how in ("users_dir", "symlink"):
        assert r.returncode == 1 and "refusing GLUSTER_DIR" in r.stderr, out
        assert "uid 65534" in r.stderr, out
        assert vol == vol_before
    elif how == "addr_injection":
        # the recorded host is fine; its address is looked up again, not read from the file
        assert "glusterd binds to 127.0.0.2" in r.stdout, out
        assert "transport.socket.bind-address 127.0.0.2\n" in vol, vol
        assert r.returncode == 1 and "glusterd did not start" in r.stderr, out
    elif how == "bad_host":
        assert r.returncode == 4 and "does not hold a host name" in r.stderr, out
        assert vol == vol_before
    else:
        assert r.returncode == 4 and "outside 127.0.0.0/8" in r.stderr, out
        assert vol == vol_before


def test_gluster_down_does_not_act_on_a_state_directory_a_user_made(tmp_path):
    """`down` reads PIDs to stop and file systems to unmount from GLUSTER_DIR/state: from a
    GLUSTER_DIR a user made first it reads nothing, stops nothing and unmounts nothing."""
    victim_mnt = tmp_path / "victim-mount"
    victim_mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(victim_mnt)],
                   check=True, timeout=30)
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        gdir = users_dir(os.path.join(shared_dir(tmp_path), "ckptfs-gluster"))
        state = users_dir(os.path.join(gdir, "state"))
        with open(os.path.join(state, "client.pid"), "w") as f:
            f.write(f"{sleeper.pid}\n")
        with open(os.path.join(state, "loops"), "w") as f:
            f.write(f"{victim_mnt} tmpfs\n")
        env = dict(os.environ, GLUSTER_DIR=gdir, GLUSTER_VOLUME="trusttest",
                   GLUSTER_RUN=str(tmp_path / "run"), GLUSTER_TIMEOUT="10")
        r = subprocess.run(["bash", GLUSTER, "down"], env=env, capture_output=True, text=True,
                           timeout=60, stdin=subprocess.DEVNULL)
        assert r.returncode == 1 and "refusing GLUSTER_DIR" in r.stderr, r.stdout + r.stderr
        assert sleeper.poll() is None, "down stopped a process named in a user's file"
        assert os.path.ismount(victim_mnt), "down unmounted a file system named in a user's file"
        assert os.path.isdir(gdir)
    finally:
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait()
        if os.path.ismount(victim_mnt):
            subprocess.run(["umount", str(victim_mnt)], timeout=30)


# ---------------------------------------------------------------- install.sh
def test_install_writes_nothing_through_a_name_planted_in_destdir(tmp_path):
    """A staged install into a shared directory: the temporary file is a fresh name, so a
    symlink planted at a name guessed from the PID does not have root write and chmod the
    file it points to."""
    etc = victim(tmp_path)
    before = snapshot(etc)
    sbin = tmp_path / "stage" / "usr" / "sbin"
    sbin.mkdir(parents=True)
    os.chmod(sbin, 0o1777)
    # The user guesses the PID: the wrapper plants the link for its own PID, then becomes
    # install.sh (exec keeps the PID).
    inner = ('ln -s "$VICTIM/keep.conf" "$SBIN/mount.fuse.ckptfs.tmp.$$" && '
             'chown -h 65534:65534 "$SBIN/mount.fuse.ckptfs.tmp.$$" && '
             'exec sh "$INSTALL" --prefix /usr --ckptfs "$CKPTFS"')
    r = subprocess.run(["sh", "-c", inner], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, VICTIM=etc, SBIN=str(sbin), INSTALL=INSTALL,
                                CKPTFS=CKPTFS, DESTDIR=str(tmp_path / "stage")))
    assert snapshot(etc) == before, r.stdout + r.stderr
    assert r.returncode == 0, r.stderr
    helper = sbin / "mount.fuse.ckptfs"
    assert not helper.is_symlink() and "CKPTFS_INSTALLED=" in helper.read_text()


def test_install_refuses_a_ckptfs_path_sed_would_read_as_commands(tmp_path):
    """The ckptfs path goes into a sed expression: a path with sed's delimiter in it (here one
    that reads as a `w FILE` flag, writing FILE as root) is refused."""
    written = tmp_path / "w"
    written.mkdir()
    # read by sed: s|...|CKPTFS_INSTALLED="T/x|w T/w/ckptfs"| - the flag w, file 'T/w/ckptfs"|'
    exe = Path(f"{tmp_path}/x|w {written}/ckptfs")
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    os.chmod(exe, 0o755)
    r = sh(INSTALL, "--prefix", "/usr", "--ckptfs", exe, env={"DESTDIR": str(tmp_path / "d")})
    assert r.returncode != 0 and "unsupported characters" in r.stderr, r.stdout + r.stderr
    assert os.listdir(written) == []
    assert not (tmp_path / "d" / "usr" / "sbin" / "mount.fuse.ckptfs").exists()


@pytest.mark.parametrize("script", ["slurm-prolog.sh", "slurm-epilog.sh", "glusterfs.sh"])
def test_a_script_called_by_a_relative_name_finds_its_helpers(tmp_path, script):
    """`make gluster-up` calls mount_scripts/glusterfs.sh by a relative name, and a Slurm
    configuration may too: the script goes to / first, and must still read root-paths.sh
    from beside itself. The prolog and epilog are stopped right after it (a configuration
    file of another user's is refused with root-paths.sh's message); glusterfs.sh status
    only looks."""
    env = dict(os.environ, CKPTFS_SLURM_CONF=str(tmp_path / "slurm.conf"))
    conf = tmp_path / "slurm.conf"
    conf.write_text("CKPTFS_MOUNTPOINT=/nowhere\n")
    os.chown(conf, NOBODY, NOBODY)
    r = subprocess.run(["bash", script] + (["status"] if script == "glusterfs.sh" else []),
                       cwd=SCRIPTS, env=env, capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    assert "root-paths.sh" not in r.stderr, r.stderr
    if script == "glusterfs.sh":
        assert r.returncode in (0, 3), r.stdout + r.stderr
    else:
        assert r.returncode == 1 and "not reading" in r.stderr, r.stderr
