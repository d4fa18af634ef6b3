"""The daemon's own wait for the next FUSE request (ckptfs/loop.py), on real mounts: it
serves every request (counts add up), takes queued requests without parking, catches a busy
client's next request by spinning (--request-spin), sums the checksums writes leave owing
while no request waits, ends the loop on SIGTERM (idle and under load) and on unmount, and
pyfuse3's own wait still works when asked for.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time

import pytest
from helpers import check_files, cli, content, read_all, write_file

from ckptfs import api
from ckptfs.io import uring

pytestmark = pytest.mark.timeout(180)


def _write_files(root: str, n: int, size: int = 1000, tag: str = "f") -> dict[str, bytes]:
    out = {}
    for i in range(n):
        data = os.urandom(size)
        p = os.path.join(root, f"{tag}{i}")
        with open(p, "wb") as f:
            f.write(data)
        out[p] = data
    return out


def test_every_request_goes_through_the_wait(mounts):
    m = mounts.mount()
    files = _write_files(m.mountpoint, 200)
    time.sleep(0.05)  # far longer than the spin: the next request finds the loop parked
    check_files(files, m.mountpoint)
    st = m.status()
    waited, queued = st["requests_waited_for"], st["requests_found_queued"]
    assert waited > 0
    # each request is taken after exactly one wait: at least the WRITEs and READs counted here
    assert waited + queued >= st["write_requests"] + st["read_requests"] >= 400


@pytest.mark.parametrize("fast_path", [True, pytest.param(  # (no fast path: no rings)
    False, marks=pytest.mark.either_transport)])
def test_checksums_are_summed_while_the_loop_waits_or_in_c(mounts, fast_path):
    """Writes leave their runs' CRC32C owing; the loop sums them once no request waits (here
    the writer pauses after each file), or, for the bytes a queue thread landed, they are
    summed in C before their records are taken (where the CPU has a CRC32C instruction); and
    every checksum in the index is right: `ckptfs verify` checks them all, and a remount
    reads every file back through them."""
    backing = mounts.backing()
    m = mounts.mount(backing, fast_path=fast_path)
    sizes = {f"f{i}": (3 << 20) + 4321 * i for i in range(4)}
    for name, size in sizes.items():
        write_file(os.path.join(m.mountpoint, name), content(name, size), chunk=1 << 20)
        time.sleep(0.05)
    st = m.status()
    total = sum(sizes.values())
    idle, landing = st["checksum_bytes_summed_idle"], st["checksum_bytes_summed_landing"]
    assert 0 < idle + landing <= total
    if st.get("ring_requests") and uring.lib.ck_crc32c_hw():  # (queue threads)
        assert landing >= total // 2  # (all but those it copied in itself)
    else:
        assert landing == 0 and idle > 0
    m.stop()
    res = cli("verify", backing)
    assert res.returncode == 0, res.stdout + res.stderr
    m = mounts.mount(backing, fast_path=fast_path)
    for name, size in sizes.items():
        assert read_all(os.path.join(m.mountpoint, name)) == content(name, size), name


def test_spinning_catches_a_busy_clients_requests(mounts):
    """One client writing back to back: while the loop spins, its next requests are caught
    before it sleeps; with --request-spin 0 none are, and the data is the same. (A long spin
    here, so that a loaded CI machine cannot make the client miss it; how many the default
    250 us catches is a matter of timing: benchmarks, not this test.)"""
    m = mounts.mount(request_spin=100_000)
    files = _write_files(m.mountpoint, 300)
    st = m.status()
    assert st["requests_caught_spinning"] > 0
    m2 = mounts.mount(mounts.backing("other"), request_spin=0)
    files2 = _write_files(m2.mountpoint, 300)
    st2 = m2.status()
    assert st2["requests_caught_spinning"] == 0 and st2["requests_waited_for"] > 0
    check_files(files, m.mountpoint)
    check_files(files2, m2.mountpoint)


def test_queued_requests_are_taken_without_parking(mounts):
    """Several writers keep requests queued while the daemon serves one: some are found
    waiting (the fast path, no spinning here), and every byte arrives."""
    m = mounts.mount(request_spin=0)
    results: dict[str, bytes] = {}
    errors = []

    def writer(k: int) -> None:
        try:
            d = os.path.join(m.mountpoint, f"w{k}")
            os.makedirs(d, exist_ok=True)
            results.update(_write_files(d, 150, size=3000))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert m.status()["requests_found_queued"] > 0
    m.sync()
    m.stop()
    m2 = mounts.mount(m.backing)
    check_files(results, m.mountpoint, m2.mountpoint)


def _sigterm_and_wait(m: api.Mount) -> int:
    m.proc.send_signal(signal.SIGTERM)
    assert api.wait_pid_exit(m.proc.pid, 60), "daemon did not exit after SIGTERM"
    rc = m.proc.wait(timeout=10)
    m.proc.stdout.close()
    m.proc = None
    return rc


def test_sigterm_when_idle_unmounts_and_keeps_everything(mounts):
    m = mounts.mount()
    files = _write_files(m.mountpoint, 50)
    time.sleep(0.3)  # the loop is parked in its wait
    assert _sigterm_and_wait(m) == 0
    assert not api.is_mounted(m.mountpoint)
    m2 = mounts.mount(m.backing)
    check_files(files, m.mountpoint, m2.mountpoint)


def test_signals_during_the_drain_do_not_cut_it_off(mounts):
    """A supervisor that repeats SIGTERM (or a second Ctrl-C) while the daemon drains after
    the first: noted, not obeyed; the daemon ends with everything durable."""
    m = mounts.mount()
    files = _write_files(m.mountpoint, 50)
    big = os.path.join(m.mountpoint, "big")
    data = os.urandom(24 << 20)
    with open(big, "wb") as f:
        f.write(data)
    files[big] = data
    pid = m.proc.pid
    deadline = time.monotonic() + 60
    for sig in itertools.cycle((signal.SIGTERM, signal.SIGINT, signal.SIGHUP)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
        if m.proc.poll() is not None:
            break
        assert time.monotonic() < deadline, "daemon did not exit under repeated signals"
        time.sleep(0.002)
    assert api.wait_pid_exit(pid, 60)
    rc = m.proc.wait(timeout=10)
    m.proc.stdout.close()
    m.proc = None
    assert rc == 0, rc
    assert not api.is_mounted(m.mountpoint)
    m2 = mounts.mount(m.backing)
    check_files(files, m.mountpoint, m2.mountpoint)


def test_sigterm_under_load_ends_the_loop(mounts):
    """SIGTERM while writers keep requests coming: the daemon exits (no task left waiting
    on /dev/fuse forever), and every file that was closed before is there afterwards."""
    m = mounts.mount()
    closed: dict[str, bytes] = {}
    stop = threading.Event()

    def writer(k: int) -> None:
        i = 0
        while not stop.is_set():
            p = os.path.join(m.mountpoint, f"t{k}_{i}")
            data = os.urandom(2000)
            try:
                with open(p, "wb") as f:
                    f.write(data)
            except OSError:
                return  # the mount went away under us: expected
            closed[p] = data
            i += 1

    threads = [threading.Thread(target=writer, args=(k,), daemon=True) for k in range(3)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    before = len(closed)
    assert before > 0
    rc = _sigterm_and_wait(m)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert rc == 0
    assert len(closed) >= before
    m2 = mounts.mount(m.backing)
    # every file whose write() and close() succeeded was acknowledged by the daemon, also
    # after the signal (the mount stays live until the daemon's end): all there
    check_files(dict(closed), m.mountpoint, m2.mountpoint)


def test_pyfuse3_own_wait_still_works(mounts):
    backing = mounts.backing()
    mp = os.path.join(mounts.tmp, "own")
    os.makedirs(mp)
    m = api.Mount(backing, mp, log_file=os.path.join(mounts.tmp, "own.log"),
                  env={"CKPTFS_PYFUSE3_WAIT": "1"}, staging_size="64M", segment_size="4M",
                  read_cache="64M", no_populate=True)
    m.start()
    mounts.live.append(m)
    files = _write_files(mp, 100)
    st = m.status()
    assert st["requests_waited_for"] == 0 and st["requests_found_queued"] == 0
    assert st["requests_caught_spinning"] == 0
    check_files(files, mp)
    m.stop()
    m2 = mounts.mount(backing)
    check_files(files, mp, m2.mountpoint)


def test_spin_backs_off_after_misses_and_resets_on_a_catch():
    """The spin itself, on a pipe instead of /dev/fuse: a miss polls for the whole spin time
    and makes the next waits skip spinning (1, 3, 7 ... at most 255 of them); a catch resets."""
    from ckptfs.fuse.loop import RequestWait

    r, w = os.pipe()
    try:
        wait = RequestWait(r, spin_s=0.002)
        t0 = time.perf_counter()
        assert not wait._spin()  # nothing to read: polled for the whole 2 ms
        assert time.perf_counter() - t0 >= 0.002
        assert (wait.misses, wait.skip) == (1, 1)
        assert not wait._spin()  # skipped: no poll, nothing counted
        assert (wait.misses, wait.skip) == (1, 0)
        assert not wait._spin()  # a second miss in a row
        assert (wait.misses, wait.skip) == (2, 3)
        for _ in range(40):
            wait.skip = 0
            wait._spin()
        assert wait.misses == 8 and wait.skip == 255
        wait.skip = 0
        os.write(w, b"x")  # a "request" is there: caught, back-off reset
        assert wait._spin()
        assert (wait.misses, wait.spun) == (0, 1)
        off = RequestWait(r, spin_s=0.0)
        assert not off._spin() and off.misses == 0  # --request-spin 0: never spins
    finally:
        os.close(r)
        os.close(w)


def test_work_held_back_is_done_by_a_task_that_parks_behind_the_sleeper():
    """Work held for later (FastPath's answered RELEASEs) is done before the loop sleeps.
    The task asleep on the fd did that before the work was held, and another task may take
    the request that made the fd readable without waking it: so the task that held the work
    and finds no request does it before it parks behind the sleeper. (Left until the next
    request, an idle mount's closed files stayed open: it kept looking at other writers.)"""
    import trio
    import trio.testing

    from ckptfs.fuse.loop import RequestWait

    class Holding(RequestWait):
        held = 0

        def sleep_work(self) -> None:
            self.held = 0

    r, w = os.pipe()

    async def main() -> None:
        wait = Holding(r, spin_s=0.0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)  # the sleeper: in wait_readable(r)
            await trio.testing.wait_all_tasks_blocked()
            assert wait.busy
            wait.held = 1  # a request taken and answered by another task, its work held
            nursery.start_soon(wait)  # that task finds no request: parks behind the sleeper
            await trio.testing.wait_all_tasks_blocked()
            assert wait.held == 0
            os.write(w, b"x")  # (both return: the sleeper finds it, the other one after)
        assert wait.slow == 2

    try:
        trio.run(main)
    finally:
        os.close(r)
        os.close(w)


def test_many_handlers_waiting_at_once_do_not_stall_the_mount(mounts):
    """More clients blocked in fsync at once than the loop has tasks (loop.MAX_TASKS):
    the others queue, nothing deadlocks, everything is durable and intact."""
    from ckptfs.fuse import loop

    m = mounts.mount()
    n = loop.MAX_TASKS + 16
    data = {os.path.join(m.mountpoint, f"s{i}"): os.urandom(50_000 + i) for i in range(n)}
    errors = []
    barrier = threading.Barrier(n)

    def client(p: str) -> None:
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.write(fd, data[p])
                barrier.wait(timeout=60)
                os.fsync(fd)
            finally:
                os.close(fd)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(p,)) for p in data]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "clients stuck"
    assert not errors
    assert m.status()["fsyncs"] >= n
    check_files(data, m.mountpoint)


def test_install_takes_only_a_session_fd_it_can_be_sure_of():
    """The wait is installed on the one /dev/fuse fd that appeared since `fds_before`, never on
    a guess, and made with what `attach` gives it; the hook the handlers were made with has
    it from then on. uninstall puts pyfuse3's own wait back."""
    import pyfuse3

    from ckptfs.datapath.staging import Checksums
    from ckptfs.fuse import loop

    own = pyfuse3._wait_fuse_readable
    hook = loop.WaitHook()
    assert hook.install(0.0, loop.fuse_fds()) is None  # nothing new
    before = loop.fuse_fds()
    a = os.open("/dev/fuse", os.O_RDWR)
    b = os.open("/dev/fuse", os.O_RDWR)
    owed = Checksums()
    try:
        assert hook.install(0.0, before) is None  # two candidates: not sure, not installed
        assert pyfuse3._wait_fuse_readable is own and hook.wait is None
        w = hook.install(0.0, before | {b},
                         lambda fd, spin_s: loop.RequestWait(fd, spin_s, idle_work=owed))
        assert w is not None and w.fd == a and pyfuse3._wait_fuse_readable is w
        assert hook.wait is w and w.idle_work is owed
    finally:
        hook.uninstall()
        os.close(a)
        os.close(b)
    assert pyfuse3._wait_fuse_readable is own
