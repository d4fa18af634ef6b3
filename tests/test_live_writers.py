"""Many writers, one live tree: what one mount makes durable shows on the others while they
stay mounted (within --refresh), and changes to other writers' entries (delete, rename,
overwrite, truncate, chmod, rmdir) made on any read-write mount hold everywhere: on the other
mounts, after remounts, and in `ckptfs ls`, `verify` and `export`.

Real mounts over one backing directory, writer ids w0, w1, ... (docs/scaling.md)."""

from __future__ import annotations

import errno
import os
import time

import pytest

from test_multiwriter import bits

torch = pytest.importorskip("torch")

SLACK_S = 1.5  # a loaded 2-CPU machine: the look itself, the daemon's scheduling


def wait_for(cond, limit: float, step: float = 0.02) -> float:
    """Seconds until cond() holds; fails past `limit`."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > limit:
            pytest.fail(f"not within {limit:.1f} s")
        time.sleep(step)
    return time.monotonic() - t0


def save(m, rel: str, t) -> str:
    p = os.path.join(m.mountpoint, rel)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    torch.save(t, p)
    return p


def load(m, rel: str):
    return torch.load(os.path.join(m.mountpoint, rel), weights_only=True)


def exists(m, rel: str) -> bool:
    return os.path.exists(os.path.join(m.mountpoint, rel))


@pytest.mark.timeout(90)
def test_durable_on_one_mount_shows_on_the_others_within_the_delay(mounts):
    backing = mounts.backing()
    a = mounts.mount(backing, writer_id="w0", refresh=1.0)
    now = mounts.mount(backing, writer_id="w2", refresh=0)  # looks at every open and lookup
    b = mounts.mount(backing, writer_id="w1")  # joins after both: a new writer directory
    v1, v2 = torch.arange(5000, dtype=torch.float32), torch.full((3000,), 7.0)
    assert not exists(a, "step_1/x.pt")  # (a negative lookup, nothing cached)
    save(b, "step_1/x.pt", v1)
    b.sync()  # durable on b
    assert bits(load(now, "step_1/x.pt")) == bits(v1)  # at once with --refresh 0
    dt = wait_for(lambda: exists(a, "step_1/x.pt"), 1.0 + SLACK_S)
    assert bits(load(a, "step_1/x.pt")) == bits(v1)
    # an overwrite (same name, same inode on b): the new bytes on the next open, although a
    # has the file's attributes and pages cached
    save(b, "step_1/x.pt", v2)
    b.sync()
    wait_for(lambda: bits(load(a, "step_1/x.pt")) == bits(v2), 1.0 + SLACK_S)
    assert bits(load(now, "step_1/x.pt")) == bits(v2)
    # a listing shows new entries; a name b removes or renames goes from a's cached entries
    save(b, "step_1/y.pt", v1)
    os.rename(os.path.join(b.mountpoint, "step_1/x.pt"), os.path.join(b.mountpoint,
                                                                     "step_1/z.pt"))
    b.sync()
    wait_for(lambda: sorted(os.listdir(os.path.join(a.mountpoint, "step_1"))) ==
             ["y.pt", "z.pt"], 1.0 + SLACK_S)
    assert not exists(a, "step_1/x.pt")
    assert bits(load(a, "step_1/z.pt")) == bits(v2)
    os.unlink(os.path.join(b.mountpoint, "step_1/y.pt"))
    b.sync()
    assert not exists(now, "step_1/y.pt")
    wait_for(lambda: not exists(a, "step_1/y.pt"), 1.0 + SLACK_S)
    st = a.status()
    assert st["writers"] == 3 and st["refresh_polls"] > 0 and st["writers_joined"] == 2
    print(f"visible on the 1 s mount after {dt:.2f} s")


@pytest.mark.timeout(60)
def test_an_idle_mount_looks_with_a_few_calls_per_second(mounts):
    """While nothing changes, a mount's looks cost one listing of writers/ and, per other
    writer, a listing of its directory and a stat of its index, per --refresh; no read."""
    backing = mounts.backing()
    a = mounts.mount(backing, writer_id="w0", refresh=0.2)
    b = mounts.mount(backing, writer_id="w1")
    save(b, "f.pt", torch.zeros(10))
    b.sync()
    wait_for(lambda: exists(a, "f.pt"), 0.2 + SLACK_S)
    s0 = a.status()
    time.sleep(2.0)
    s1 = a.status()
    polls = s1["refresh_polls"] - s0["refresh_polls"]
    assert 5 <= polls <= 11, polls
    assert s1["refresh_reads"] == s0["refresh_reads"]
    assert s1["refresh_stats"] - s0["refresh_stats"] == polls  # one other writer
    assert s1["refresh_listdirs"] - s0["refresh_listdirs"] == 2 * polls


@pytest.mark.timeout(60)
def test_refresh_option_is_checked(mounts):
    with pytest.raises(Exception, match="--refresh"):
        mounts.mount(mounts.backing(), writer_id="w0", refresh=-1)
    assert errno.ESTALE  # (the error an open of a vanished entry gives once, then retried)
