"""`ckptfs bench mount` on a small tree: the backing directory it synthesises is one a mount
could have left (verify finds every file's bytes intact, a mount lists every file), and the
benchmark reports its figures and targets and leaves no mount behind. Speed is not tested."""

from __future__ import annotations

import json
import os

import pytest
from helpers import cli

from ckptfs import api
from ckptfs.bench import mount

pytestmark = pytest.mark.timeout(240)


def test_the_synthesised_tree_is_a_valid_backing_directory(tmp_path):
    backing, mnt = tmp_path / "b", tmp_path / "m"
    mnt.mkdir()
    built = mount.build(str(backing), 250, 100, 300, 40)
    # per file an INODE and an EXTENT, 3 directories, 7 COMMITs, and a SETATTR for the
    # last file of each directory in each group of 40 (8 of them: one group spans two)
    assert built["dirs"] == 3 and built["records"] == 2 * 250 + 3 + 7 + 8
    proc = cli("verify", backing)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with api.Mount(str(backing), str(mnt), writer_id=mount.WRITER) as m:
        st = m.status()  # (what the mount took to build the tree is a status figure)
        assert st["inodes"] >= 1 + 3 + 250 and 0 < st["replay_seconds"] < 60, st
        names = sorted(os.listdir(m.mountpoint))
        assert names == ["d000001", "d000002", "d000003"]
        files = [os.path.join(m.mountpoint, d, f) for d in names
                 for f in os.listdir(os.path.join(m.mountpoint, d))]
        assert len(files) == 250
        with open(files[7], "rb") as f:
            data = f.read()
        assert len(data) == 300 and data.endswith(b"x")


def test_files_read_while_the_mount_notes_its_runs_are_exact(tmp_path):
    """The reader learns the replayed tree's runs (for readahead checks and recycling) a
    slice of files at a time once the mount serves; reads that come first, in any order,
    are exact, and so is a second pass once every file is noted."""
    backing, mnt = tmp_path / "b", tmp_path / "m"
    mnt.mkdir()
    n, size = 9000, 700  # (three slices of note_replayed, 4,096 files each)
    mount.build(str(backing), n, 1000, size, 500)
    with api.Mount(str(backing), str(mnt), writer_id=mount.WRITER) as m:
        dirs = sorted(os.listdir(m.mountpoint), reverse=True)  # (the last noted first)
        for _ in range(2):
            seen = 0
            for d in dirs:
                for f in os.listdir(os.path.join(m.mountpoint, d)):
                    with open(os.path.join(m.mountpoint, d, f), "rb") as fh:
                        data = fh.read()
                    i = int(f[len("rank0_shard"):-len(".pt")])
                    assert data == i.to_bytes(8, "little").ljust(size, b"x"), f
                    seen += 1
            assert seen == n
        assert m.status()["read_runs_verified_ahead"] > 0


def test_a_small_run(tmp_path):
    out = tmp_path / "out.json"
    work = tmp_path / "work"
    work.mkdir()
    proc = cli("bench", "mount", "--files", "300,600", "--per-dir", "100", "--mounts", "1",
               "--dir", work, "--json", out, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [r["files"] for r in res["results"]] == [300, 600]
    for r in res["results"]:
        for name in ("tree", "empty"):
            assert len(r["runs"][name]) == 1
            assert r["median"][name]["ready_s"] > 0 and r["median"][name]["rss_bytes"] > 0
        assert r["median"]["tree"]["replay_s"] >= 0
        assert {t["target"] for t in r["targets"]} == {"mount", "memory"}
    assert "files (" in proc.stdout
    assert not list(work.iterdir())
    with open("/proc/self/mountinfo") as f:
        assert str(work) not in f.read()


def test_the_targets_scale_with_the_tree():
    small, large = mount.judge(1000, 0.9, 900), mount.judge(1_000_000, 10.5, 1100)
    assert [t["held"] for t in small] == [True, True] and small[0]["limit"] == 1.0
    assert [t["held"] for t in large] == [False, False] and large[0]["limit"] == 10.0
