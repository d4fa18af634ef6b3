"""ckptfs over a real parallel file system: a GlusterFS volume (two bricks on this machine,
loopback only) stood up by mount_scripts/glusterfs.sh, with the backing directories on it.

The session fixture (`gluster`, tests/conftest.py) uses a volume that is already up (and
leaves it up), else brings one up and tears it down at the end, whatever happened (the
script's `down`; after a timeout, a lazy unmount and the recorded PIDs killed). Skipped when
not root or when the packages cannot be installed. Run just these: `pytest -m glusterfs`."""

from __future__ import annotations

import errno
import ipaddress
import mmap
import multiprocessing
import os
import random
import re
import shutil
import socket
import subprocess
import time

import pytest

from ckptfs import api
from ckptfs.bench import throttle
from helpers import (
    CRASH_WRITER_OPTS, DAEMONS, MiB, RANKS, Volume, backing_files, check_all, check_rank,
    check_tree, cli, content, dcp_save_load, fill, four_writers, gpt_state_dict, kill_mid_write,
    kill_quietly,
    listed, listed_mount, md5_tree, pids_in, rank_paths, read_all, read_fd, read_journal,
    save_all, save_ranks, sync_until_ok, verify_and_remount, verify_ok, wait_for, write_ckpt,
    writer_main,
)

torch = pytest.importorskip("torch")


pytestmark = [pytest.mark.glusterfs, pytest.mark.timeout(300)]

HERE = os.path.dirname(os.path.abspath(__file__))
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


# ---------------------------------------------------------------- loopback only
def _listening(proc: str) -> set[str]:
    out = subprocess.run(["ss", "-Htlnp"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[3].rsplit(":", 1)[0].strip("[]") for line in out.splitlines()
            if f'(("{proc}"' in line}


def _gluster_sockets() -> list[tuple[str, str, str]]:
    """(process, local address, peer address) of every TCP socket of gluster's processes."""
    out = subprocess.run(["ss", "-Htanp"], capture_output=True, text=True, timeout=30).stdout
    socks = []
    for line in out.splitlines():
        for proc in ("glusterd", "glusterfsd", "glusterfs"):
            if f'(("{proc}"' in line:
                f = line.split()
                socks.append((proc, f[3], f[4]))
    return socks


def _is_loopback(addr: str) -> bool:
    """'127.0.0.1:24007', '[::ffff:127.0.0.1]:49152' ... (a wildcard '0.0.0.0:N' is not)."""
    host = addr.rsplit(":", 1)[0].strip("[]")
    if host.startswith("::ffff:"):
        host = host[len("::ffff:"):]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def test_everything_gluster_uses_is_loopback(gluster):
    info = subprocess.run(["gluster", "--mode=script", "volume", "info", gluster.name],
                          capture_output=True, text=True, timeout=60)
    assert info.returncode == 0, info.stderr
    hosts = {m.group(1) for m in re.finditer(r"^Brick\d+: ([^:\s]+):/", info.stdout, re.M)}
    assert hosts, info.stdout
    entry = api.mount_at(os.path.realpath(gluster.mount))
    assert entry is not None and entry.fstype == "fuse.glusterfs", entry
    hosts.add(entry.source.split(":", 1)[0])  # HOST:/VOLUME: where the client gets its volfile
    addrs = set()
    for h in hosts:
        for *_, sa in socket.getaddrinfo(h, 24007, proto=socket.IPPROTO_TCP):
            assert ipaddress.ip_address(sa[0]).is_loopback, f"{h} resolves to {sa[0]}"
            addrs.add(sa[0])
    v4 = {a for a in addrs if ipaddress.ip_address(a).version == 4}
    assert all(ipaddress.ip_address(a) in LOOPBACK for a in v4), v4
    # glusterd listens on the brick host's loopback address only (127.0.0.1 where the host
    # name resolves there), not on 0.0.0.0
    listen = _listening("glusterd")
    assert listen and listen <= v4, f"glusterd listens on {listen}, brick host is {v4}"
    if socket.gethostbyname(socket.gethostname()) == "127.0.0.1":
        assert listen == {"127.0.0.1"}, listen
    with open("/etc/glusterfs/glusterd.vol") as f:
        assert f"transport.socket.bind-address {sorted(listen)[0]}" in f.read()
    # and every socket of glusterd, the bricks and the client: both ends on loopback
    socks = _gluster_sockets()
    assert any(p == "glusterfsd" for p, _, _ in socks), socks
    assert any(p == "glusterfs" for p, _, _ in socks), socks
    for proc, local, peer in socks:
        assert _is_loopback(local), (proc, local, peer)
        assert peer.endswith(":*") or _is_loopback(peer), (proc, local, peer)


# ---------------------------------------------------------------- torch save / restore
def test_gpt_state_save_remount_restore(gdir, mounts):
    sd = gpt_state_dict()  # ~80 MB: GPT-2-shaped weights + Adam state, 300 small tensors
    m = mounts.mount(backing=gdir, staging_size="256M")
    save_all(m.mountpoint, sd)
    check_all(m.mountpoint, sd)
    m.sync()
    st = m.status()
    assert st["bytes_durable"] >= sum(t.numel() * t.element_size() for t in sd.values())
    assert st["uncommitted_changes"] == 0 and st["errors"] == 0
    check_all(m.mountpoint, sd)
    assert m.stop() == 0
    assert "NOT everything" not in mounts.log(m)
    files = backing_files(gdir)
    assert len(files) <= 12, files  # a handful of files on the volume, not one per tensor
    m2 = mounts.mount(backing=gdir)
    check_all(m2.mountpoint, sd)
    n = sum(len(fns) for _, _, fns in os.walk(os.path.join(m2.mountpoint, "step_100")))
    assert n == len(sd)
    assert m2.stop() == 0


def test_dcp_save_load(gdir, mounts):
    dcp_save_load(mounts, gdir)


# ---------------------------------------------------------------- crash
def test_kill_9_fsynced_files_exact_after_remount(gdir, mounts, tmp_path):
    """The local crash test's writer and checks (tests/py), 3 kills, the backing
    directory on the volume."""
    mnt = str(tmp_path / "mnt")
    os.mkdir(mnt)
    rng = random.Random(4321)
    planned, durable, seen = {}, set(), {}
    ctx = multiprocessing.get_context("fork")
    m = mounts.mount(gdir, mnt, **CRASH_WRITER_OPTS)
    iters = 3
    for it in range(iters):
        jpath = str(tmp_path / f"journal{it}")
        w = ctx.Process(target=writer_main,
                        args=(mnt, it, rng.randrange(1 << 30), jpath))
        w.start()
        time.sleep(rng.uniform(0.5, 1.5))
        kill_mid_write(m, w, mnt)
        p, d = read_journal(jpath)
        planned.update(p)
        durable |= d
        res = cli("verify", gdir)
        assert res.returncode == 0, f"verify after kill {it}: {res.stdout}{res.stderr}"
        m = mounts.mount(gdir, mnt, **CRASH_WRITER_OPTS)
        check_tree(mnt, planned, durable, seen, full=True)
        assert "Traceback" not in mounts.log(m)
    m.stop()
    assert cli("verify", gdir).returncode == 0
    assert durable and len(planned) > len(durable)


# ---------------------------------------------------------------- full backing store
@pytest.fixture
def small_gluster(gluster):
    """A second volume, one brick on a 64 MiB loop-mounted ext4 image."""
    vol = Volume(GLUSTER_DIR="/var/tmp/ckptfs-gluster-small", GLUSTER_VOLUME="ckptfs-small",
                 GLUSTER_BRICKS="1", GLUSTER_BRICK_SIZE="64M")
    try:
        vol.up()
        yield vol
    finally:
        if vol.started:
            vol.down()


def _brick_ports_listening() -> set[int]:
    out = subprocess.run(["ss", "-Htlnp"], capture_output=True, text=True, timeout=30).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines()
            if '(("glusterfsd"' in line}


def test_bench_throttle_limits_the_gluster_bricks_traffic_then_goes(small_gluster):
    """`bench e2e --throttle`'s limit (bench/throttle.py) on a volume whose brick path is
    long (the plain `gluster volume status` table wraps it onto a line of its own): the
    brick's port found, its traffic held to the rate (16 MiB O_DIRECT at 8 MB/s cannot take
    under ~2 s; unthrottled loopback takes a fraction of that), the qdisc gone after."""
    path = small_gluster.subdir("throttle")
    ports = throttle.brick_ports(path)
    assert len(ports) == 1 and set(ports) <= _brick_ports_listening(), ports
    buf = mmap.mmap(-1, 16 * MiB)
    buf.write(content("t", 16 * MiB))
    fd = os.open(os.path.join(path, "f"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        with throttle.Throttle(path, 8_000_000):
            qdisc = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True,
                                   text=True, timeout=30).stdout
            assert "htb" in qdisc, qdisc
            t0 = time.monotonic()
            assert os.pwrite(fd, buf, 0) == 16 * MiB
            os.fsync(fd)
            took = time.monotonic() - t0
        assert took >= 0.75 * 16 * MiB / 8e6, f"16 MiB in {took:.2f} s: not throttled"
    finally:
        os.close(fd)
        buf.close()
    qdisc = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True,
                           text=True, timeout=30).stdout
    assert "htb" not in qdisc, qdisc


def test_full_volume_enospc_then_recovery(small_gluster, mounts):
    store = small_gluster.mount
    backing = small_gluster.subdir("b")
    filler = os.path.join(store, "filler")
    opts = dict(staging_size="8M", segment_size="1M", log_size="8M", idle_flush=0.2)
    m = mounts.mount(backing, **opts)
    mnt = m.mountpoint
    durable = {"a": 6 * MiB}
    assert write_ckpt(os.path.join(mnt, "a"), content("a", durable["a"])) == ""
    st = os.statvfs(store)
    try:
        fill(filler, st.f_bavail * st.f_frsize - 2 * MiB)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc  # gluster keeps a reserve: full before the end
    failed_at = ""
    for i in range(20):
        name = f"b{i}"
        step = write_ckpt(os.path.join(mnt, name), content(name, 4 * MiB))
        if step:
            failed_at = step
            break
        durable[name] = 4 * MiB
    assert failed_at, "the small volume never ran full"
    assert m.proc.poll() is None, "daemon died on ENOSPC"
    with pytest.raises(OSError) as ei:
        m.sync()
    assert ei.value.errno == errno.ENOSPC
    for name, size in durable.items():
        assert read_fd(os.path.join(mnt, name))[0] == content(name, size), name
    os.unlink(filler)
    sync_until_ok(m, errno.ENOSPC, 60, "staged data never landed after space was freed")
    assert write_ckpt(os.path.join(mnt, "c"), content("c", 4 * MiB)) == ""
    durable["c"] = 4 * MiB
    m = verify_and_remount(mounts, m, backing, opts, durable)
    print(f"\nENOSPC on the volume reported at {failed_at}; {len(durable)} checkpoints durable")
    m.stop()


# ---------------------------------------------------------------- several writers
def test_four_writers_one_backing_directory(gdir, mounts):
    ms = four_writers(mounts, gdir)
    save_ranks(ms, 1)
    for m in ms:
        assert m.stop() == 0
    assert sorted(os.listdir(os.path.join(gdir, "writers"))) == [f"w{i}" for i in range(4)]
    ro = mounts.mount(gdir, ro=True)
    assert ro.status()["writers"] == DAEMONS
    for r in range(RANKS):
        check_rank(ro.mountpoint, 1, r)
    verify_ok(gdir)
    names = listed(gdir)
    for r in range(RANKS):
        assert rank_paths(1, r) <= names, r


# ---------------------------------------------------------------- verify / export / compact
def test_verify_export_compact(gdir, mounts, tmp_path):
    m = mounts.mount(backing=gdir)
    mp = m.mountpoint
    for s in (1, 2, 3):
        os.makedirs(f"{mp}/step_{s}")
        for k in range(5):
            with open(f"{mp}/step_{s}/t{k}.pt", "wb") as f:
                f.write(content(f"{s}/{k}", 300_000 * (k + 1)))
    with open(f"{mp}/step_3/t0.pt", "r+b") as f:  # an overwrite leaves dead bytes
        f.seek(1000)
        f.write(os.urandom(5000))
    before = md5_tree(mp)
    assert m.stop() == 0
    r = cli("verify", gdir)
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout + r.stderr
    exp = os.path.join(gdir, "..", "export")  # onto the volume too
    shutil.rmtree(exp, ignore_errors=True)
    r = cli("export", gdir, exp)
    assert r.returncode == 0, r.stderr
    assert md5_tree(exp) == before
    r = cli("compact", gdir)
    assert r.returncode == 0 and "MB live" in r.stdout, r.stdout + r.stderr
    assert cli("verify", gdir).returncode == 0
    m2 = mounts.mount(backing=gdir)
    assert md5_tree(m2.mountpoint) == before
    assert m2.stop() == 0
    shutil.rmtree(exp, ignore_errors=True)


def test_restore_on_another_client_right_after_sync(gdir, second_client, mounts):
    """A writer saves and syncs step after step; right after each sync a read-only mount over
    the second client (another node) restores it. That client's caches still hold the sizes
    of the index and data logs from before (it looked at them for the previous step): every
    file of the step must be there, bit-exact."""
    w = mounts.mount(gdir, writer_id="trainer")
    ro_backing = second_client(gdir)
    for step in range(4):
        files = {}
        d = os.path.join(w.mountpoint, f"step_{step}")
        os.mkdir(d)
        for k in range(6):
            name = f"step_{step}/t{k}"
            files[name] = content(name, 200_000 * (k + 1) + step)
            with open(os.path.join(w.mountpoint, name), "wb") as f:
                f.write(files[name])
        w.sync()
        ro = mounts.mount(ro_backing, ro=True)
        try:
            for name, data in files.items():
                p = os.path.join(ro.mountpoint, name)
                assert os.path.exists(p), f"{name} missing on the other client after sync"
                assert read_all(p) == data, f"{name} differs on the other client after sync"
            assert "beyond the log" not in mounts.log(ro), mounts.log(ro)
        finally:
            ro.stop()
    assert w.stop() == 0


def _warm(path: str) -> None:
    """Look at everything below `path` (stat, read): the client caches what it saw."""
    for d, _, files in os.walk(path):
        for f in files:
            p = os.path.join(d, f)
            os.stat(p)
            if f.startswith("index"):
                read_all(p)


def test_offline_view_on_another_client_right_after_sync(gdir, second_client, mounts):
    """The same, without the start-up time of a mount: the second client has just looked at
    the backing directory (its cached sizes are the old ones) when a writer's sync returns,
    and the committed tree is read there at once (what `ckptfs ls/verify/export` and a mount's
    replay do). Every file of the step is in it, with its size, and reads back bit-exact."""
    from ckptfs.format.logs import RunReader
    from ckptfs.tools.snapshot import Snapshot

    w = mounts.mount(gdir, writer_id="trainer")
    other = second_client(gdir)
    for step in range(12):
        files = {}
        os.mkdir(os.path.join(w.mountpoint, f"step_{step}"))
        for k in range(3):
            name = f"step_{step}/t{k}"
            files[name] = content(name, 300_000 * (k + 1) + step)
            with open(os.path.join(w.mountpoint, name), "wb") as f:
                f.write(files[name])
        _warm(other)
        w.sync()
        snap = Snapshot(other)
        logs = RunReader(snap.union.writer_dirs)
        try:
            assert not [x for x in snap.warnings if "beyond" in x], snap.warnings
            for name, data in files.items():
                x = snap.lookup(name)
                assert x.size == len(data), f"step {step}: {name} has {x.size} bytes"
                got = bytearray(x.size)
                for start, length, run, roff in x.emap.pieces:
                    got[start:start + length] = logs.read_run(run)[roff:roff + length]
                assert bytes(got) == data, f"step {step}: {name} differs"
        finally:
            logs.close()
    assert w.stop() == 0


def test_what_differs_on_the_volume(gdir, second_client):
    """tests/netfs_probe.py on the volume, through two clients: what ckptfs relies on holds
    (docs/glusterfs.md lists the figures)."""
    import netfs_probe

    res = netfs_probe.probe_all(gdir, second_client(gdir), quick=True)
    print("\n" + "\n".join(f"{k}: {v}" for k, v in res.items()))
    # O_DIRECT: the aligned block ckptfs writes works; a misaligned one fails by fsync at the
    # latest (the client's write-behind reports the brick's EINVAL late), never silently
    assert res["O_DIRECT"]["aligned 4 KiB"] == {"write": "ok", "fsync": "ok", "close": "ok"}
    for case in ("100 B at 0", "4 KiB at offset 7"):
        r = res["O_DIRECT"][case]
        assert r.get("write") != "ok" or r.get("fsync") != "ok", (case, r)
    assert res["fallocate"]["mode 0"].startswith("ok"), res["fallocate"]
    # locks reach across clients (the bricks' locks translator): a writer id held on one
    # node is refused on another
    for kind in ("flock", "fcntl"):
        assert res["locks"][kind]["same client"] == "refused", res["locks"]
        assert res["locks"][kind]["second client"] == "refused", res["locks"]
        assert res["locks"][kind]["second client, after the holder closed"] == "acquired"
    # rename over a file being read: never a mix of old and new
    assert all(r["torn"] == 0 and r["reads"] > 0 for r in res["rename"].values()), res["rename"]
    # close-to-open: listing the directory first (what replay does) sees every append
    fresh = res["close-to-open"]["after listing the directory"]
    assert fresh["stat"] == fresh["buffered read"] == fresh["O_DIRECT read"] == 0, fresh


def test_writer_id_locked_across_clients(gdir, second_client, mounts):
    """A second mount with a writer id that is in use is refused through another client as
    well (flock reaches across gluster clients); once the first is unmounted it works."""
    m = mounts.mount(gdir, writer_id="node1")
    with pytest.raises(api.CkptfsError) as ei:
        mounts.mount(second_client(gdir), writer_id="node1")
    assert "in use" in str(ei.value), ei.value
    assert m.stop() == 0
    m2 = mounts.mount(second_client(gdir), writer_id="node1")
    assert m2.stop() == 0


# ---------------------------------------------------------------- the script itself
def test_script_idempotent_and_refuses_hosts_outside_loopback(gluster, tmp_path):
    before = subprocess.run(["ss", "-Htlnp"], capture_output=True, text=True,
                            timeout=30).stdout
    res = gluster.script("up", 120)  # up again: nothing changes
    assert res.returncode == 0 and "up:" in res.stdout, res.stdout + res.stderr
    assert "started" not in res.stdout and "created" not in res.stdout, res.stdout
    assert _listening("glusterd") <= {a.split()[3].rsplit(":", 1)[0] for a in
                                      before.splitlines() if '"glusterd"' in a}
    assert gluster.script("status", 60).returncode == 0
    for host, why in (("8.8.8.8", "outside 127.0.0.0/8"), ("localhost", "refuses localhost")):
        other = Volume(GLUSTER_DIR=str(tmp_path / "other"), GLUSTER_VOLUME="other",
                       GLUSTER_HOST=host)
        res = other.script("up", 120)
        assert res.returncode == 4 and why in res.stderr, (host, res.stdout, res.stderr)
        assert not os.path.exists(other.dir), "a refused up left files behind"
    res = Volume(GLUSTER_DIR=str(tmp_path / "none"), GLUSTER_VOLUME="none").script("down", 120)
    assert res.returncode == 0, res.stderr  # down with nothing up


def test_script_recovers_from_a_run_killed_halfway(gluster):
    """What a killed run leaves does not break the next one. A gluster client killed (or
    crashed) leaves its mount dead: every access fails with ENOTCONN, `mountpoint` and
    os.path.ismount say it is not mounted; `up` and `down` detach it. A `down` stopped
    halfway leaves glusterd a volume whose bricks are gone; `up` makes it anew."""
    vol = Volume(GLUSTER_DIR="/var/tmp/ckptfs-gluster-dead", GLUSTER_VOLUME="ckptfs-dead",
                 GLUSTER_BRICKS="1")

    def dead() -> bool:
        try:
            os.stat(vol.mount)
        except OSError as exc:
            assert exc.errno == errno.ENOTCONN, exc
            return True
        return False

    def kill_client() -> None:
        (client,) = pids_in(os.path.join(vol.dir, "state", "client.pid"))
        kill_quietly(client)
        wait_for(dead, "the mount to fail with ENOTCONN once its client died", timeout=30,
                 step=0.1)
        assert listed_mount(vol.mount) and not os.path.ismount(vol.mount)
        res = vol.script("status", 60)
        assert res.returncode == 1 and "mounted: dead" in res.stdout, res.stdout + res.stderr

    vol.up()
    try:
        kill_client()
        res = vol.script("up", 300)
        assert res.returncode == 0 and "dead mount" in res.stdout, res.stdout + res.stderr
        with open(os.path.join(vol.mount, "after"), "wb") as f:
            f.write(b"mounted again")
        with open(os.path.join(vol.mount, "after"), "rb") as f:
            assert f.read() == b"mounted again"
        # a `down` stopped halfway: the volume stopped, its bricks removed, still defined
        res = subprocess.run(["gluster", "--mode=script", "volume", "stop", vol.name, "force"],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        subprocess.run(["umount", "-l", vol.mount], capture_output=True, timeout=30)
        shutil.rmtree(os.path.join(vol.dir, "bricks"))
        res = vol.script("up", 300)
        assert res.returncode == 0 and "lost its bricks" in res.stdout, res.stdout + res.stderr
        assert not os.path.exists(os.path.join(vol.mount, "after"))  # a new, empty volume
        kill_client()
        res = vol.script("down", 300)
        assert res.returncode == 0, res.stdout + res.stderr
        assert not listed_mount(vol.mount), "down left the dead mount"
        assert not os.path.exists(vol.dir), "down left the volume's directory"
    finally:
        if vol.started:
            vol.down()
