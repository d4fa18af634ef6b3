"""Close-to-open visibility across a peer's restart (docs/scaling.md, the visibility contract):
two writers of one backing directory, a writes files and fsyncs half of them while b removes
a's older steps and runs `ckptfs sync` (a rotation from another node); a's daemon, b's or both
are killed with SIGKILL and mounted again. A restarted writer cuts its index's torn tail (the
test leaves one), and a writer whose history is mostly dead rewrites its index (an index
snapshot: another file), which b then reads whole again. Throughout, b opens a's files, each
once its fsync returned --refresh seconds before: every one opens, with its bytes, at the
first try; so do those a made durable before the kill, 1.2 s after the remount, and the one a
makes durable right after it, --refresh seconds after its fsync.

CKPTFS_CRASH_ITERS sets the number of kill/remount rounds (default 6: b, a, both, twice)."""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import threading
import time

import pytest
from helpers import content, read_all

from ckptfs import api
from ckptfs.format import backingdir, records
from ckptfs.format.records import InodeRec

ROUNDS = int(os.environ.get("CKPTFS_CRASH_ITERS", "6"))
REFRESH = 1.0
# (a small index is snapshotted as soon as it is twice the size of a fresh one: b's removals
# leave most of a's history dead, so a rewrites its index in most rounds, and after its
# restart)
OPTS = dict(staging_size="16M", segment_size="1M", read_cache="16M", idle_flush=0.1,
            refresh=REFRESH, no_populate=True, index_snapshot_min="8K")
KEEP_STEPS = 3  # the rotation keeps a's newest steps


def saver(mnt: str, rnd: int, seed: int, journal: str) -> None:
    """Mount a's job: step directories r<rnd>s<step>/ of 8 files each, every second file
    fsynced; journal line 'D name size time' once its fsync returned (time.monotonic())."""
    rng = random.Random(seed)
    jfd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:  # (through the mount's root: never into the directory under a detached mount)
        root = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
        for step in range(100000):
            d = f"r{rnd:02d}s{step:04d}"
            os.mkdir(d, dir_fd=root)
            for j in range(8):
                name = f"{d}/f{j}"
                data = content(name, rng.choice([0, 100, 5000, 70000]))
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=root)
                try:
                    os.write(fd, data)
                    if j % 2 == 0:
                        os.fsync(fd)
                        os.write(jfd, f"D {name} {len(data)} {time.monotonic()}\n".encode())
                finally:
                    os.close(fd)
    except OSError:
        pass  # the daemon is gone: that is the point
    finally:
        os.close(jfd)


def rotator(mnt: str, seed: int, journal: str) -> None:
    """Mount b's job: remove a's steps but the newest KEEP_STEPS, then `ckptfs sync`; journal
    line 'R step' before a step's removal starts."""
    rng = random.Random(seed)
    jfd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        root = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
        while True:
            steps = sorted(n for n in os.listdir(root) if n.startswith("r"))
            for step in steps[:-KEEP_STEPS]:
                os.write(jfd, f"R {step}\n".encode())
                shutil.rmtree(step, dir_fd=root)
            api.sync(mnt)
            time.sleep(rng.uniform(0.02, 0.2))
    except (OSError, api.CkptfsError):
        pass
    finally:
        os.close(jfd)


def journal_lines(path: str, kind: str) -> list[list[str]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [ln.split()[1:] for ln in f if ln.endswith("\n") and ln.startswith(kind + " ")]


def save_durable(m, name: str, size: int) -> float:
    """Write `name` on mount m and fsync it; the time its fsync returned."""
    path = os.path.join(m.mountpoint, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(content(name, size))
        f.flush()
        os.fsync(f.fileno())
    return time.monotonic()


def opens_as(m, name: str, size: int) -> str | None:
    """None if `name` reads back on mount m as written, else what went wrong."""
    try:
        got = read_all(os.path.join(m.mountpoint, name))
    except OSError as exc:
        return f"{name}: {os.strerror(exc.errno)}"
    return None if got == content(name, size) else f"{name}: {len(got)} bytes differ"


def seen_after(m, name: str, size: int, since: float, limit: float = 10.0) -> str:
    """How long after `since` the file read back on m (for the failure message)."""
    while time.monotonic() - since < limit:
        if opens_as(m, name, size) is None:
            return f"read back {time.monotonic() - since:.2f} s after"
        time.sleep(0.05)
    return f"not read back within {limit:.0f} s after"


def until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


class Reader(threading.Thread):
    """Opens a's durable files on mount b one after the other, each once --refresh seconds
    have passed since its fsync: every open must find it (a LOOKUP in a directory b's kernel
    holds a name of, while a's tree is read again under it). Counts its opens."""

    def __init__(self, m, files: dict[str, tuple[int, float]]):
        super().__init__(daemon=True)
        self.m, self.files = m, files
        self.stop = threading.Event()
        self.opens = 0
        self.failed: list[str] = []

    def run(self) -> None:
        names = sorted(self.files)
        while names and not self.stop.is_set():
            for name in names:
                size, durable_at = self.files[name]
                if self.stop.is_set() or time.monotonic() < durable_at + REFRESH:
                    continue
                bad = opens_as(self.m, name, size)
                self.opens += 1
                if bad:
                    self.failed.append(f"{bad} {time.monotonic() - durable_at:.2f} s after "
                                       "its fsync")
                time.sleep(0.002)


def tear_tail(backing: str, writer: str) -> None:
    """A commit group being appended when the daemon died: records without their COMMIT,
    the last one cut short (what the restarted writer cuts off)."""
    index = os.path.join(backing, backingdir.WRITERS_DIR, writer, backingdir.INDEX_NAME)
    recs = [records.encode(InodeRec(10**9 + i, 1, b"torn%d" % i, 0o100644, 0, 0, 0, 1, 1, 1))
            for i in range(3)]
    with open(index, "ab") as f:
        f.write(b"".join(recs)[:-5])


@pytest.mark.timeout(60 + 12 * ROUNDS)
def test_durable_files_show_on_the_peer_around_its_restarts(mounts, tmp_path):
    backing = mounts.backing()
    mp = {w: str(tmp_path / f"mnt_{w}") for w in "ab"}
    for p in mp.values():
        os.mkdir(p)
    m = {w: mounts.mount(backing, mp[w], writer_id=w, **OPTS) for w in "ab"}
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(4321)
    failures: list[str] = []
    checked = rereads = opens = 0
    for rnd in range(ROUNDS):
        who = ("b", "a", "both")[rnd % 3]
        saves, removals = str(tmp_path / f"saved{rnd}"), str(tmp_path / f"removed{rnd}")
        jobs = [ctx.Process(target=saver, args=(mp["a"], rnd, rnd, saves)),
                ctx.Process(target=rotator, args=(mp["b"], rnd, removals))]
        for j in jobs:
            j.start()
        time.sleep(rng.uniform(0.8, 1.6))
        victims = "ab" if who == "both" else who
        if "b" in victims:  # (its counters go with it)
            rereads += m["b"].status()["writers_reread"]
        for w in victims:
            os.kill(m[w].pid, signal.SIGKILL)
        for j in jobs:  # (the survivor's job too: what is durable is known from here on)
            j.join(0.5)
            if j.is_alive():
                j.terminate()
                j.join(10)
            assert not j.is_alive(), "a job hung on a dead mount"
        for w in victims:
            m[w]._reap(kill=False)  # (the stale mount detached)
            assert not api.is_mounted(mp[w])
        if "a" in victims:
            tear_tail(backing, "a")
        removed = {step for (step,) in journal_lines(removals, "R")}
        durable = {name: (int(size), float(t)) for name, size, t in journal_lines(saves, "D")
                   if name.split("/")[0] not in removed}  # (b's rotation removed the others)
        for w in victims:
            m[w] = mounts.mount(backing, mp[w], writer_id=w, **OPTS)
        ready = time.monotonic()
        errors: list[str] = []
        reader = Reader(m["b"], durable)
        reader.start()

        def opens_after_refresh(f: tuple[str, int]) -> None:
            """a makes f durable; b's first open of it --refresh seconds after its fsync."""
            t = save_durable(m["a"], *f)
            until(t + REFRESH)
            bad = opens_as(m["b"], *f)
            if bad:
                errors.append(f"{bad}, {seen_after(m['b'], *f, t)} its fsync")

        try:
            # a file a makes durable at once, beside the newest of its steps (a directory
            # b's kernel may hold), and b's first open of it --refresh seconds after its fsync
            newest = max((n.split("/")[0] for n in durable), default=f"r{rnd:02d}s0000")
            opens_after_refresh((f"{newest}/late", 3000))
            # everything a had made durable before the kill, 1.2 s after the remount
            until(ready + 1.2)
            for name, (size, _) in sorted(durable.items()):
                checked += 1
                bad = opens_as(m["b"], name, size)
                if bad:
                    errors.append(f"{bad} at the remount + 1.2 s, "
                                  f"{seen_after(m['b'], name, size, ready)} the remount")
                    break
            # and one in a directory b has not seen yet
            opens_after_refresh((f"r{rnd:02d}new/f", 70000))
        finally:
            reader.stop.set()
            reader.join(30)
        opens += reader.opens
        if reader.failed:
            errors.append(f"{len(reader.failed)} of {reader.opens} opens while it remounted "
                          f"failed, the first: {reader.failed[0]}")
        failures += [f"round {rnd} ({who} killed): {e}" for e in errors]
    rereads += m["b"].status()["writers_reread"]
    logs = "".join(mounts.log(x) for x in mounts.live)
    print(f"\n{ROUNDS} rounds: {checked} files durable before a kill opened on the peer at the "
          f"remount + 1.2 s, {opens} opens while it remounted; a's index read whole again by "
          f"b {rereads} times, {logs.count('torn or uncommitted tail')} torn tails cut; "
          f"{len({f.split(':')[0] for f in failures})} rounds failed")
    assert not failures, "\n".join(failures)
    assert "Traceback" not in logs, logs[logs.index("Traceback") - 2000:][:6000]
    assert checked > 0 and opens > 0
    # (what the rounds were for happened)
    assert rereads > 0, "a's index was never rewritten while b was mounted"
    assert logs.count("torn or uncommitted tail") >= (ROUNDS + 1) // 3


def test_a_request_during_a_look_waits_for_it_once_the_view_is_older_than_refresh(tmp_path):
    """A look brings nothing until its changes are in the view: an open, lookup or listing
    that comes while one is reading (or applying) and finds the view older than --refresh
    waits for it, rather than being answered from the older view, which lacks what became
    durable since the look before it started. No mount: the refresher alone, a look that
    takes 0.3 s."""
    trio = pytest.importorskip("trio")
    from ckptfs.datapath.journal import Journal
    from ckptfs.fuse.refresh import Refresher
    from ckptfs.namespace import ChangeNotices, Namespace
    from ckptfs.peers import Peers
    from ckptfs.view import Union

    looks = []

    def slow_look(known, names, unread):  # (a worker thread, as a look on a slow store)
        looks.append(time.monotonic())
        time.sleep(0.3)
        return []

    async def main() -> None:
        r = Refresher(Peers(Namespace(now_ns=0), Union(), str(tmp_path), "w0"), Journal(), None,
                      ChangeNotices(), str(tmp_path), REFRESH)
        r._look = slow_look
        r.last = r.fresh = trio.current_time() - REFRESH  # (the view is --refresh old)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(r.refresh, False)  # the background look
            while not looks:
                await trio.sleep(0.01)
            assert r.due()  # (it has brought nothing yet)
            t0 = trio.current_time()
            await r.refresh()  # a request: waits for the running look, starts none
            waited = trio.current_time() - t0
        assert len(looks) == 1 and 0.15 < waited < 1.0, (looks, waited)
        assert not r.due() and r.waits == 1

    trio.run(main)


def test_the_background_looks_go_on_while_something_is_open_and_pause_while_nothing_is(
        tmp_path):
    """Nobody asks (no open, lookup or listing): the background looker goes on looking every
    --refresh while the mount has something open, which the refresher is told by the
    function it is made with, and pauses at the first period while nothing is. No mount: the
    refresher alone, its looks counted (a pause is counted too: the looker had its chance)."""
    trio = pytest.importorskip("trio")
    from ckptfs.datapath.journal import Journal
    from ckptfs.fuse.refresh import Refresher
    from ckptfs.namespace import ChangeNotices, Namespace
    from ckptfs.peers import Peers
    from ckptfs.view import Union

    async def looks_while(open_now: bool) -> tuple[int, int]:
        looks = []
        r = Refresher(Peers(Namespace(now_ns=0), Union(), str(tmp_path), "w0"), Journal(), None,
                      ChangeNotices(), str(tmp_path), 0.05, in_use=lambda: open_now)
        r._look = lambda known, names, unread: looks.append(1) or []
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(r.run)
                while len(looks) < 3 and r.idle_pauses == 0:
                    await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
        return len(looks), r.idle_pauses

    assert trio.run(looks_while, True) == (3, 0)
    assert trio.run(looks_while, False) == (0, 1)


def test_the_kernels_invalidations_go_to_the_descriptor_their_channel_is_given(tmp_path):
    """Once the fast path has /dev/fuse (libfuse's descriptor is a socket toward it) it gives
    the refresher's invalidations channel a descriptor of it: from then on they are written
    there, in order, each counted. No mount: a pipe stands in for /dev/fuse."""
    trio = pytest.importorskip("trio")
    from ckptfs.datapath.journal import Journal
    from ckptfs.fuse.refresh import ATTRS, Invalidations, Refresher, notification
    from ckptfs.namespace import ChangeNotices, Namespace
    from ckptfs.peers import Peers
    from ckptfs.view import ENTRY, INODE, Union

    changes = [(ENTRY, 1, b"step_9"), (INODE, 12), (ATTRS, 13)]
    r_fd, w_fd = os.pipe()

    async def main() -> None:
        invalidations = Invalidations()
        r = Refresher(Peers(Namespace(now_ns=0), Union(), str(tmp_path), "w0"), Journal(), None,
                      ChangeNotices(), str(tmp_path), REFRESH, invalidations=invalidations)
        invalidations.write_to(w_fd)
        r.send(changes)
        assert r.notifications == 3

    try:
        trio.run(main)
        assert os.read(r_fd, 4096) == b"".join(notification(*c) for c in changes)
    finally:
        os.close(r_fd)
        os.close(w_fd)
