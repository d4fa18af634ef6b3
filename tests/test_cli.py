"""The ckptfs command line: mount/umount daemonized, sync, status, ls, verify, demo."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess

import pytest
from helpers import cli, content, md5_tree, wait_for, walk_fds

from ckptfs import api, system
from ckptfs.tools.fdtree import remove_tree


@pytest.fixture
def daemon_mount(tmp_path):
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    mnt.mkdir()
    r = cli("mount", backing, mnt, "--staging-size", "32M", "--segment-size", "1M",
            "--no-populate", "--log-file", tmp_path / "daemon.log", check=True)
    assert r.stdout.startswith("ready:"), r.stdout
    try:
        yield backing, mnt
    finally:
        if api.is_mounted(str(mnt)):
            st = None
            try:
                st = api.status(str(mnt))
            except OSError:
                pass
            cli("umount", mnt)
            if api.is_mounted(str(mnt)):
                api.fusermount(str(mnt), lazy=True)
            if st:
                api.wait_pid_exit(st["pid"], 10)


def test_mount_sync_status_umount_cycle(daemon_mount, tmp_path):
    backing, mnt = daemon_mount
    (mnt / "step_1").mkdir()
    data = os.urandom(3 << 20)
    (mnt / "step_1" / "w.bin").write_bytes(data)
    cli("sync", mnt, check=True)
    st = json.loads(cli("status", mnt, "--json", check=True).stdout)
    for key in ("pid", "engine", "io_mode", "bytes_written", "bytes_durable", "bytes_staged",
                "segments_flushed", "flush_gbps", "errors", "queue_depth"):
        assert key in st, key
    assert st["bytes_durable"] >= len(data)
    assert st["bytes_written"] >= len(data)
    assert st["errors"] == 0
    # this machine's idle-CPU polling, as the daemon read it (None off a KVM haltpoll guest)
    assert st["guest_halt_poll_ns"] == system.guest_halt_poll_ns()
    text = cli("status", mnt, check=True).stdout
    assert "bytes_durable" in text and "engine" in text
    # a summary first: where, how much is durable (after the sync: all of it), errors
    head = text.splitlines()[:5]
    assert head[0].startswith(f"{mnt}: writer ") and f"pid {st['pid']}" in head[0], head
    assert f"durable {len(data) / (1 << 20):.1f} MiB" in head[1], head
    assert head[4].strip() == "errors 0, now: none", head
    # status comes from the daemon's socket (not through the mount), the same figures as the
    # mount's status xattr, which is what a daemon without that socket is asked
    via_socket = api._status_socket(str(mnt), 10)
    via_mount = json.loads(os.getxattr(mnt, api.XATTR_STATUS))
    assert via_socket is not None and sorted(via_socket) == sorted(via_mount)
    assert via_socket["pid"] == st["pid"] and via_socket["bytes_durable"] >= len(data)
    out = cli("umount", mnt, check=True).stdout
    assert "unmounted" in out
    assert not api.is_mounted(str(mnt))
    assert api.mount_device_of(str(mnt)) is None and api._status_socket(str(mnt), 10) is None
    assert api.wait_pid_exit(st["pid"], 10)
    # the backing directory holds a few files, and ls/verify see the tree unmounted
    ls = cli("ls", "-lR", backing, check=True).stdout
    assert "/step_1/w.bin" in ls and str(len(data)) in ls
    v = cli("verify", backing, check=True)
    assert v.stdout.startswith("OK")
    # remount: same content
    cli("mount", backing, mnt, "--no-populate", "--staging-size", "32M", "--segment-size", "1M",
        "--log-file", tmp_path / "daemon2.log", check=True)
    assert (mnt / "step_1" / "w.bin").read_bytes() == data


def test_verify_names_damaged_file(tmp_path, mounts):
    m = mounts.mount()
    mp = m.mountpoint
    good, bad = os.urandom(100_000), os.urandom(200_000)
    with open(os.path.join(mp, "good"), "wb") as f:
        f.write(good)
    with open(os.path.join(mp, "bad"), "wb") as f:
        f.write(bad)
    m.stop()
    wdir = os.path.join(m.backing, "writers", os.listdir(os.path.join(m.backing, "writers"))[0])
    log = os.path.join(wdir, "data-000001.log")
    # "good" was written first: 4096-byte header, then good's bytes, then bad's
    off = 4096 + len(good) + 1000
    with open(log, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x55]))
    r = cli("verify", m.backing)
    assert r.returncode == 1
    assert "DAMAGED /bad" in r.stdout
    assert "/good" not in r.stdout.replace("DAMAGED /bad", "")


def test_umount_of_dead_daemon_detaches(mounts):
    m = mounts.mount()
    m.proc.kill()
    m.proc.wait()
    r = cli("umount", m.mountpoint)
    assert r.returncode != 0
    assert "daemon is gone" in r.stderr
    assert not api.is_mounted(m.mountpoint)
    m.proc = None


def test_a_stuck_daemon_is_reported_and_left_mounted(mounts):
    """A daemon that is alive but does not answer (here: stopped) is reported as such by
    `status` and `umount` within their timeouts, and its mount is left alone: not taken for a
    dead daemon and detached, which would lose what is staged. Running again, all is well."""
    m = mounts.mount()
    with open(os.path.join(m.mountpoint, "f"), "wb") as f:
        f.write(b"x" * 1000)
    os.kill(m.pid, signal.SIGSTOP)
    try:
        r = cli("status", "--timeout", "2", m.mountpoint, timeout=60)
        assert r.returncode != 0 and "does not answer" in r.stderr, r.stderr
        assert f"(pid {m.pid})" in r.stderr, r.stderr  # which process holds the socket
        r = cli("umount", "--timeout", "2", m.mountpoint, timeout=60)
        assert r.returncode != 0 and "not unmounted" in r.stderr, r.stderr
        assert api.is_mounted(m.mountpoint)
    finally:
        os.kill(m.pid, signal.SIGCONT)
    assert json.loads(cli("status", "--json", m.mountpoint, check=True).stdout)["pid"] == m.pid
    m.stop()
    m2 = mounts.mount(m.backing)
    with open(os.path.join(m2.mountpoint, "f"), "rb") as f:
        assert f.read() == b"x" * 1000


def test_help_lists_commands_and_defaults():
    top = cli("--help", check=True).stdout
    for cmd in ("mount", "umount", "sync", "status", "ls", "verify", "demo", "bench"):
        assert cmd in top
    h = cli("mount", "--help", check=True).stdout
    assert "--staging-size" in h and "default: 512M" in h
    assert "--queue-depth" in h and "--io" in h and "--writer-id" in h


def test_bad_size_and_unknown_option_are_one_line_errors(tmp_path):
    r = cli("mount", tmp_path, tmp_path / "m", "--staging-size", "lots")
    assert r.returncode == 2 and "not a size" in r.stderr
    r = cli("mount", tmp_path, tmp_path / "m", "--frobnicate")
    assert r.returncode == 2 and "unrecognized arguments" in r.stderr


@pytest.mark.slow
def test_demo_runs(tmp_path):
    r = cli("demo", "--size", "64M", "--dir", tmp_path, timeout=300, check=True)
    assert "restored and verified" in r.stdout
    assert "time until durable, ckptfs vs straight" in r.stdout
    assert os.listdir(tmp_path) == []


def test_gc_compact_export_keep_content(mounts, tmp_path):
    m = mounts.mount()
    mp = m.mountpoint
    for s in (1, 2, 9, 10):
        os.makedirs(f"{mp}/step_{s}")
        with open(f"{mp}/step_{s}/w", "wb") as f:
            f.write(os.urandom(700_000))
    with open(f"{mp}/step_10/w", "r+b") as f:  # an overwrite leaves dead bytes
        f.seek(1000)
        f.write(os.urandom(5000))
    os.truncate(f"{mp}/step_9/w", 2_000_000)  # a trailing hole
    os.symlink("step_10", f"{mp}/latest")
    r = cli("gc", mp, "--keep", "2", "--dry-run", check=True)
    assert "would remove" in r.stdout and os.path.exists(f"{mp}/step_1")
    r = cli("gc", mp, "--keep", "2", check=True)
    assert sorted(os.listdir(mp)) == ["latest", "step_10", "step_9"]  # natural order: 9 < 10
    before = md5_tree(mp)
    assert cli("compact", m.backing).returncode == 1  # mounted: refused
    m.stop()
    wdir = os.path.join(m.backing, "writers")
    def size():
        return sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(wdir)
                           for f in fs if f.startswith("data-"))
    size_before = size()
    r = cli("compact", m.backing, check=True)
    assert "MB live" in r.stdout
    assert size() < size_before - 1_000_000  # the two deleted steps are gone
    assert cli("verify", m.backing, check=True).returncode == 0
    exp = tmp_path / "export"
    cli("export", m.backing, exp, check=True)
    assert md5_tree(exp) == before
    # and back in: import into a fresh backing directory gives the same tree
    b2 = tmp_path / "reimported"
    b2.mkdir()
    cli("import", exp, b2, "copy", check=True)
    exp2 = tmp_path / "export2"
    cli("export", b2, exp2, "copy", check=True)
    assert md5_tree(exp2) == before
    # a second writer, then everything merged into one writer
    m2 = mounts.mount(m.backing, writer_id="second")
    with open(f"{m2.mountpoint}/other", "wb") as f:
        f.write(b"x" * 10)
    m2.stop()
    cli("compact", "--merge", "--into", "all", m.backing, check=True)
    assert os.listdir(wdir) == ["all"]
    m3 = mounts.mount(m.backing, writer_id="all")
    after = md5_tree(m3.mountpoint)
    assert after.pop("other") == __import__("hashlib").md5(b"x" * 10).hexdigest()
    assert after == before
    assert os.stat(f"{m3.mountpoint}/step_9/w").st_size == 2_000_000


def test_compaction_cuts_long_runs_into_checksum_blocks(mounts):
    """A backing directory written with runs as long as a segment (before --checksum-block,
    or with a large one) comes out of `ckptfs compact` with runs of the default block size,
    its content the same."""
    from ckptfs.datapath.staging import CHECKSUM_BLOCK_BYTES
    from ckptfs.tools.snapshot import Snapshot

    m = mounts.mount(segment_size="8M", checksum_block="8M")
    data = os.urandom(7 << 20)
    with open(f"{m.mountpoint}/big", "wb") as f:
        f.write(data)
    m.stop()
    assert max(r.length for r in Snapshot(m.backing).lookup("/big").emap.runs()) > 4 << 20
    cli("compact", m.backing, check=True)
    runs = Snapshot(m.backing).lookup("/big").emap.runs()
    assert sum(r.length for r in runs) == len(data)
    assert max(r.length for r in runs) == CHECKSUM_BLOCK_BYTES
    m2 = mounts.mount(m.backing)
    with open(f"{m2.mountpoint}/big", "rb") as f:
        assert f.read() == data


# levels: past Python's recursion limit (1,000), so a walk with a call per level fails; the
# full paths ("dir/" a level) pass PATH_MAX (4,096 bytes) near level 1,010
DEEP = 1100
ODD_MODE_LEVEL = 1050  # (a directory past PATH_MAX whose mode is not the default)


def _deep_tree(root: str) -> None:
    """A tree 1,100 directories deep under `root`, made level by level through descriptors:
    a file at every 500th level and at the bottom, a link, a directory mode and times set."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in range(DEEP + 1):
            if level % 500 == 0 or level == DEEP:
                wfd = os.open(f"f{level}", os.O_WRONLY | os.O_CREAT, 0o640, dir_fd=fd)
                os.write(wfd, content(f"f{level}", 70_000 + level))
                os.close(wfd)
            if level == DEEP:
                os.symlink(f"f{level}", "link", dir_fd=fd)
                break
            os.mkdir("dir", 0o750 if level == ODD_MODE_LEVEL else 0o755, dir_fd=fd)
            nfd = os.open("dir", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        os.utime(fd, ns=(10**18, 10**18 + 7))
    finally:
        os.close(fd)


def _tree(root: str) -> dict:
    """{relative path: (mode, size, mtime_ns, link target, bytes)} of everything under root,
    read through directory descriptors."""
    snap, _ = walk_fds(root, {})
    files = {p: [(0, v[3])] for p, v in snap.items() if stat.S_ISREG(v[0])}
    snap, got = walk_fds(root, files)
    return {p: (v[0], v[3], v[8], v[10], got.get(p)) for p, v in snap.items()}


@pytest.mark.timeout(600)
def test_export_import_and_gc_of_a_tree_deeper_than_path_max(mounts, tmp_path):
    """`ckptfs export` of a tree 1,100 directories deep, whose paths are longer than PATH_MAX,
    writes it out whole; `ckptfs import` of that brings back the same tree, bit-exact;
    `ckptfs gc` removes it."""
    m = mounts.mount()
    os.mkdir(f"{m.mountpoint}/step_1")
    _deep_tree(f"{m.mountpoint}/step_1")
    want = _tree(m.mountpoint)
    assert max(map(len, want)) > 4096, "deeper than PATH_MAX"
    m.stop()
    exp = str(tmp_path / "export")
    try:
        r = cli("export", m.backing, exp, check=True)
        assert f"exported {len(range(0, DEEP, 500)) + 1} files" in r.stdout, r.stdout
        assert _tree(exp) == want
        b2 = tmp_path / "reimported"
        b2.mkdir()
        cli("import", exp, b2, check=True)
    finally:  # (pytest's own clean-up of old temporary directories recurses per level)
        if os.path.isdir(exp):
            remove_tree(exp)
    m2 = mounts.mount(str(b2))
    assert _tree(m2.mountpoint) == want
    with open(f"{m2.mountpoint}/step_2", "wb") as f:
        f.write(b"kept")
    r = cli("gc", m2.mountpoint, "--keep", "1", check=True)
    assert "removed" in r.stdout, r.stdout
    assert os.listdir(m2.mountpoint) == ["step_2"]
    m2.stop()
    m3 = mounts.mount(str(b2))
    assert os.listdir(m3.mountpoint) == ["step_2"]


def test_stats_file_and_prometheus(mounts, tmp_path):
    prom = tmp_path / "ckptfs.prom"
    m = mounts.mount(prometheus=str(prom))
    mp = m.mountpoint
    with open(f"{mp}/x", "wb") as f:
        f.write(b"y" * 12345)
    m.sync()
    with open(f"{mp}/.ckptfs/stats.json") as f:
        st = json.load(f)
    assert st["bytes_durable"] >= 12345 and st["pid"] == m.pid
    assert ".ckptfs" not in os.listdir(mp)  # not listed: cp -r / du never see it
    with pytest.raises(OSError):
        open(f"{mp}/.ckptfs/stats.json", "w")
    with pytest.raises(FileExistsError):
        os.mkdir(f"{mp}/.ckptfs")
    # the file, read by Prometheus's own parser: every figure of the status under its type,
    # with help, the mount's labels; one written after the sync counts the file's bytes
    from prometheus_client.parser import text_string_to_metric_families

    from ckptfs.metrics import METRICS, NOT_METRICS
    def exported() -> tuple[dict, dict] | None:
        fams = {f.name: f for f in text_string_to_metric_families(
            prom.read_text() if prom.exists() else "")}
        samples = {s.name: (f, s) for f in fams.values() for s in f.samples}
        durable = samples.get("ckptfs_durable_bytes_total")
        return (fams, samples) if durable and durable[1].value >= 12345 else None

    fams, samples = wait_for(exported, "the file's bytes in the exported figures", step=0.2)
    figures = {k for k, v in st.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)} - NOT_METRICS
    assert figures <= METRICS.keys(), f"status figures without a metric: {figures - METRICS.keys()}"
    labels = {"mountpoint": os.path.realpath(mp), "writer": st["writer"]}
    for key in figures:
        name, kind = METRICS[key][:2]
        fam, sample = samples[f"ckptfs_{name}"]
        assert (fam.type, sample.labels) == (kind, labels), key
        assert fam.documentation and sample.name.endswith("_total") == (kind == "counter")
    assert all(f.type != "unknown" for f in fams.values())
    assert samples["ckptfs_info"][1].labels["pid"] == str(m.pid)


def test_several_data_logs_and_stripe_alignment(mounts):
    """--data-logs spreads segments over several logs; --stripe-size aligns their starts."""
    m = mounts.mount(data_logs=3, stripe_size="1M", segment_size="2M", staging_size="16M",
                     log_size="32M")
    data = os.urandom(40 << 20)
    with open(f"{m.mountpoint}/big", "wb") as f:
        f.write(data)
    m.stop()
    wdir = os.path.join(m.backing, "writers", os.listdir(os.path.join(m.backing, "writers"))[0])
    logs = sorted(n for n in os.listdir(wdir) if n.startswith("data-"))
    assert len(logs) >= 3
    from ckptfs.tools.snapshot import Snapshot

    snap = Snapshot(m.backing)
    runs = snap.lookup("/big").emap.runs()
    assert len({r.log for r in runs}) >= 3
    assert all((r.loff - r.soff) % (1 << 20) == 0 for r in runs)  # segment starts aligned
    m2 = mounts.mount(m.backing)
    with open(f"{m2.mountpoint}/big", "rb") as f:
        assert f.read() == data


def test_one_option_table_makes_the_parser_the_config_the_api_and_the_docs():
    """Every option of ckptfs/options.py set through api.Mount's keywords reaches
    MountConfig with the value given (through the real argparse of `ckptfs mount`), an
    unknown keyword is refused before anything starts, and docs/operations.md's table is the
    table's own rendering."""
    import argparse

    from ckptfs import cli, options
    from ckptfs.daemon import MountConfig

    given = {"writer_id": "w7", "staging_size": "96M", "segment_size": "2M",
             "checksum_block": "1M", "queue_depth": 7, "io": "buffered", "engine": "posix",
             "log_size": "2G", "clean_below": 0.25, "clean_idle": 3.5,
             "index_snapshot_ratio": 4.0, "index_snapshot_min": "1M", "data_logs": 3,
             "stripe_size": "1M", "io_chunk": "4M",
             "read_cache": "32M", "prefetch": "16M", "readahead": "1M", "idle_flush": 0.25,
             "refresh": 0.5, "request_spin": 10, "fast_path": False, "queue_threads": False,
             "fuse_uring": True,
             "writeback_cache": True,
             "direct_writes": False, "direct_reads": True, "allow_other": True,
             "prometheus": "/tmp/p.prom", "ro": True, "no_populate": True, "debug": True,
             "local_dir": "/nvme/ckptfs", "local_size": "200G", "durability": "node"}
    # a new option gets a case here; log_file is api.Mount's own keyword (the daemon's log)
    assert set(given) | {"log_file"} == {o.dest for o in options.OPTIONS}
    sub = argparse.ArgumentParser().add_subparsers(dest="command")
    cli._add_mount(sub)
    a = sub.choices["mount"].parse_args(
        ["B", "M", *api.Mount("B", "M", **given).command()[7:], "--log-file", "/tmp/d.log"])
    cfg = MountConfig("B", "M", **options.config_values(a))
    expect = dict(writer_id="w7", staging_bytes=96 << 20, segment_bytes=2 << 20,
                  checksum_block_bytes=1 << 20, queue_depth=7, io_mode="buffered",
                  engine="posix", log_bytes=2 << 30, clean_below=0.25, clean_idle_s=3.5,
                  index_snapshot_ratio=4.0, index_snapshot_min_bytes=1 << 20, data_logs=3,
                  stripe_bytes=1 << 20,
                  io_chunk_bytes=4 << 20, read_cache_bytes=32 << 20, prefetch_bytes=16 << 20,
                  readahead_kb=1024, idle_flush_s=0.25, refresh_s=0.5, request_spin_us=10,
                  fast_path=False, fuse_uring=True,
                  writeback_cache=True, direct_writes=False, direct_reads=True,
                  allow_other=True, prometheus_file="/tmp/p.prom", readonly=True,
                  populate=False, debug=True, log_file="/tmp/d.log")
    assert {k: getattr(cfg, k) for k in expect} == expect
    defaults = MountConfig("B", "M", **options.config_values(sub.choices["mount"].parse_args(
        ["B", "M"])))
    assert defaults == MountConfig("B", "M")  # the parser's defaults are the table's
    assert api.Mount("B", "M", no_fast_path=True).command()[7:] == ["--no-fast-path"]
    with pytest.raises(TypeError, match="staging"):
        api.Mount("B", "M", staging="32M")  # not an option name: refused, not guessed
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "operations.md")) as f:
        doc = f.read()
    table = doc.split("<!-- options table: ckptfs options --markdown -->\n", 1)[1]
    assert table.split("\n\n", 1)[0] + "\n" == options.markdown_table()


@pytest.mark.timeout(120)
def test_mount_table_lookups_with_a_space_in_the_path(tmp_path):
    """api.mounts() / mount_holding() / mount_device_of() read /proc/self/mountinfo, which
    escapes a space as \\040: a mount point with one is found, by the mount itself and for a
    path under it, and the bench's file system description sees the same entry."""
    from ckptfs.bench import e2e
    base = tmp_path / "with space"
    backing, mnt = base / "backing", base / "mnt"
    backing.mkdir(parents=True)
    mnt.mkdir()
    holder = api.mount_holding(str(tmp_path))
    assert holder is not None and holder.fstype != "fuse.ckptfs"
    with api.Mount(str(backing), str(mnt), staging_size="32M") as m:
        (mnt / "d").mkdir()
        here = api.mount_holding(str(mnt / "d"))
        assert here is not None and here.mountpoint == str(mnt), here
        assert here.fstype == "fuse.ckptfs"
        assert api.mount_device_of(str(mnt)) == here.dev
        assert os.stat(mnt).st_dev == os.makedev(*map(int, here.dev.split(":")))
        assert api.is_mounted(str(mnt)) and not api.is_mounted(str(base))
        assert e2e.fs_type(str(mnt / "d"))[0] == "fuse.ckptfs"
        # the backing directory is on the file system around it, not on the mount
        assert api.mount_holding(str(backing)) == holder
        assert m.status()["errors"] == 0
    assert api.mount_holding(str(mnt)) == holder
    assert api.mount_device_of(str(mnt)) is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["backing", "a, b\\c", "bäck"])
def test_mount_and_df_show_the_backing_directory(tmp_path, name):
    """`mount` and `df` name what is mounted, the backing directory (as sshfs and S3QL do),
    type fuse.ckptfs; a comma or backslash in the path (libfuse's option syntax) and
    non-ASCII names come through, and ckptfs's own mount table lookups still find it."""
    backing, mnt = tmp_path / name, tmp_path / "mnt"
    backing.mkdir()
    mnt.mkdir()
    with api.Mount(str(backing), str(mnt), staging_size="32M") as m:
        e = api.mount_at(str(mnt))
        assert e is not None and (e.source, e.fstype) == (str(backing), "fuse.ckptfs"), e
        out = subprocess.run(["mount"], capture_output=True, text=True, check=True).stdout
        assert any(line.startswith(f"{backing} on {mnt} type fuse.ckptfs (")
                   for line in out.splitlines()), out
        df = subprocess.run(["df", "--output=source,target", str(mnt)], capture_output=True,
                            text=True, check=True).stdout.splitlines()
        assert df[1].split() == [*str(backing).split(), str(mnt)], df
        assert api.is_mounted(str(mnt)) and api.mount_device_of(str(mnt)) == e.dev
        assert api._status_socket(str(mnt), 10)["backing"] == str(backing)  # not the xattr
        assert m.status()["errors"] == 0
    assert not api.is_mounted(str(mnt))


@pytest.mark.timeout(120)
def test_a_taken_status_socket_name_is_reported(daemon_mount):
    """The status socket's name belongs to the mount's device number; a second listener for
    the same device (what a hung daemon of a detached mount would be, for a later mount with
    a reused number) gets no socket, told the name is held (the daemon tries it again later:
    test_trust's squatter), and status keeps working."""
    from ckptfs import daemon
    _, mnt = daemon_mount
    sock, held = daemon.open_status_socket(str(mnt))  # the daemon holds the name
    assert sock is None and held == api.mount_device_of(str(mnt))
    assert api._status_socket(str(mnt), 10)["errors"] == 0
