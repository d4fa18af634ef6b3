"""`ckptfs fsck`: a damaged or lost index rebuilt from the copies of its commit groups in the
data logs; and the damage experiment: copies of a backing directory damaged at random, the
share of files absent before and after fsck, never a wrong byte."""

from __future__ import annotations

import os
import random
import shutil

import pytest
from helpers import cli, content

from ckptfs.format import backingdir, records
from ckptfs.format.logs import RunReader
from ckptfs.tools.fsck import fsck_writer
from ckptfs.tools.snapshot import Snapshot

pytestmark = pytest.mark.timeout(300)

DIRS = 10


def _save(mounts, backing: str, files: int) -> dict[str, bytes]:
    """`files` files in DIRS directories, a barrier after each directory (many commit
    groups, several segments)."""
    m = mounts.mount(backing, writer_id="w", segment_size="1M", staging_size="16M")
    want = {}
    for d in range(DIRS):
        os.makedirs(os.path.join(m.mountpoint, f"step_{d}", "shards"))
        for i in range(files // DIRS):
            rel = f"step_{d}/shards/t{i}.pt"
            want[rel] = content(rel, 1000 + (i * 7919) % 60000)
            with open(os.path.join(m.mountpoint, rel), "wb") as f:
                f.write(want[rel])
        m.sync()
    m.stop()
    return want


def _read(backing: str, want: dict[str, bytes]) -> tuple[int, int, int]:
    """(absent, wrong, unreadable) of the files in `want`, read offline as a mount would
    read them (replay, then each run checked)."""
    try:
        snap = Snapshot(backing, "w")
    except Exception:  # (nothing replays: every file is absent)
        return len(want), 0, 0
    logs = RunReader(snap.union.writer_dirs)
    absent = wrong = unreadable = 0
    try:
        for rel, data in want.items():
            try:
                x = snap.lookup("/" + rel)
            except (OSError, KeyError, ValueError):
                absent += 1
                continue
            if x.emap is None:
                absent += 1
                continue
            got = bytearray(x.size)
            try:
                for p in x.emap.pieces:
                    got[p.start:p.start + p.length] = \
                        logs.read_run(p.run)[p.roff:p.roff + p.length]
            except OSError:
                unreadable += 1  # (a damaged run: EIO, as a mount reports it)
                continue
            if bytes(got) != data:
                wrong += 1
    finally:
        logs.close()
    return absent, wrong, unreadable


def _index(backing: str) -> str:
    return os.path.join(backing, "writers", "w", backingdir.INDEX_NAME)


def test_fsck_rebuilds_a_lost_or_damaged_index_from_the_copies(mounts, tmp_path):
    backing = mounts.backing()
    want = _save(mounts, backing, 60)
    assert _read(backing, want) == (0, 0, 0)
    res = cli("fsck", backing)
    assert res.returncode == 0 and "clean" in res.stdout, res.stdout + res.stderr

    lost = str(tmp_path / "lost")  # the index deleted
    shutil.copytree(backing, lost)
    os.unlink(_index(lost))
    assert _read(lost, want)[0] == len(want)
    res = cli("fsck", lost)
    assert res.returncode == 1, res.stdout + res.stderr
    assert _read(lost, want) == (0, 0, 0)

    middle = str(tmp_path / "middle")  # a byte flipped in a group that made a directory
    shutil.copytree(backing, middle)
    data = bytearray(open(_index(middle), "rb").read())
    at = data.index(b"step_3") - 20
    data[at] ^= 0x40
    open(_index(middle), "wb").write(data)
    before = _read(middle, want)
    assert before[0] >= len(want) // DIRS, before  # (the directory and what it held)
    res = cli("fsck", middle)
    assert res.returncode == 1 and "from copies" in res.stdout, res.stdout + res.stderr
    assert _read(middle, want) == (0, 0, 0)
    kept = [n for n in os.listdir(os.path.dirname(_index(middle))) if ".damaged-" in n]
    assert len(kept) == 1  # (the damaged index, beside the rebuilt one)
    assert cli("fsck", middle).returncode == 0  # (and now it is clean)

    cut = str(tmp_path / "cut")  # truncated to a third
    shutil.copytree(backing, cut)
    os.truncate(_index(cut), os.path.getsize(_index(cut)) // 3)
    assert cli("fsck", cut).returncode == 1
    assert _read(cut, want) == (0, 0, 0)

    both = str(tmp_path / "both")  # a group damaged in the index and in its copy: LOST
    shutil.copytree(backing, both)
    data = bytearray(open(_index(both), "rb").read())
    data[data.index(b"step_3") - 20] ^= 0x40
    open(_index(both), "wb").write(data)
    wdir = os.path.join(both, "writers", "w")
    for number, path in backingdir.data_logs(wdir).items():
        with open(path, "r+b") as f:
            log = f.read()
            at = 0
            while (at := log.find(b"step_3", at + 1)) > 0:
                f.seek(at)
                f.write(b"XTEP_3")  # (its copy's checksum fails now)
    res = cli("fsck", both)
    assert res.returncode == 2 and "LOST" in res.stderr, res.stdout + res.stderr
    absent, wrong, _ = _read(both, want)
    assert wrong == 0 and 0 < absent <= 2 * len(want) // DIRS


def _damage(backing: str, rng: random.Random) -> str:
    """One of the kinds of damage of the experiment, at random: flipped bytes, a zeroed
    stretch, a truncated or garbage-appended index, flipped bytes in the data logs."""
    index = _index(backing)
    kind = rng.choice(["flip", "zero", "truncate", "append", "data", "flip+data"])
    data = bytearray(open(index, "rb").read())
    if "flip" in kind:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(records.INDEX_HEADER.size, len(data))] ^= 1 << rng.randrange(8)
    if kind == "zero":
        at = rng.randrange(records.INDEX_HEADER.size, len(data))
        n = rng.randint(16, 600)
        data[at:at + n] = bytes(len(data[at:at + n]))
    if kind == "truncate":
        del data[rng.randrange(records.INDEX_HEADER.size, len(data)):]
    if kind == "append":
        data += rng.randbytes(rng.randint(1, 5000))
    with open(index, "wb") as f:
        f.write(data)
    if "data" in kind:
        for path in backingdir.data_logs(os.path.dirname(index)).values():
            size = os.path.getsize(path)
            with open(path, "r+b") as f:
                for _ in range(rng.randint(1, 6)):
                    f.seek(rng.randrange(records.DATA_HEADER_BYTES, size))
                    f.write(bytes((rng.randrange(256),)))
    return kind


def test_the_damage_experiment(mounts, tmp_path):
    """Copies of a backing directory, each damaged at random; the files absent before and
    after fsck (offline, as a mount replays), and never a wrong byte. Bigger with
    CKPTFS_DAMAGE_COPIES / CKPTFS_DAMAGE_FILES (40 and 300: the figures in docs/reliability.md)."""
    copies = int(os.environ.get("CKPTFS_DAMAGE_COPIES", "12"))
    files = int(os.environ.get("CKPTFS_DAMAGE_FILES", "100"))
    backing = mounts.backing()
    want = _save(mounts, backing, files)
    rng = random.Random(int(os.environ.get("CKPTFS_DAMAGE_SEED", "46")))
    total = before_absent = after_absent = wrong = unreadable = 0
    for i in range(copies):
        d = str(tmp_path / f"copy{i}")
        shutil.copytree(backing, d)
        kind = _damage(d, rng)
        absent, bad, _ = _read(d, want)
        before_absent += absent
        wrong += bad
        if bad:
            print(f"copy {i}: {kind}: {bad} files with wrong bytes before fsck")
        fsck_writer(d, "w")
        absent, bad, eio = _read(d, want)
        after_absent += absent
        wrong += bad
        unreadable += eio
        total += len(want)
        print(f"copy {i}: {kind}: absent {absent} after fsck, wrong {bad}")
        shutil.rmtree(d)
    print(f"\ndamage experiment: {copies} copies of {len(want)} files: absent "
          f"{before_absent / total:.1%} before fsck, {after_absent / total:.1%} after; "
          f"unreadable (EIO) {unreadable / total:.1%}; wrong bytes in {wrong} files")
    assert wrong == 0
    assert after_absent <= 0.02 * total, (before_absent, after_absent, total)
