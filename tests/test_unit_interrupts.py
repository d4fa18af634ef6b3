"""The interrupt state without a mount (ckptfs/fuse/interrupts.py): which waits are held, what
an early answer does to each, and that only a caller being killed is answered early. The mount
tests (tests/test_eio.py) kill real processes blocked on a hung store."""

from __future__ import annotations

import errno

import pytest
import trio
import trio.testing

from ckptfs.fuse import interrupts as interrupts_module
from ckptfs.fuse.interrupts import Interrupts


@pytest.fixture
def dying_pids(monkeypatch):
    """The callers taken for being killed (instead of a look at /proc)."""
    pids: set[int] = set()
    monkeypatch.setattr(interrupts_module, "dying", lambda pid: pid in pids)
    return pids


def started() -> tuple[Interrupts, list]:
    irq, replies = Interrupts(), []
    irq.start(lambda unique, err: replies.append((unique, err)))
    return irq, replies


def test_a_fast_path_wait_is_held_while_it_waits_and_cancelled_for_a_dying_caller(dying_pids):
    async def main():
        irq, replies = started()
        outcome = {}

        async def read(unique: int, pid: int) -> None:
            token = irq.serve(unique, pid)
            try:
                with irq.waiting() as scope:
                    await trio.sleep_forever()
                outcome[unique] = scope.cancelled_caught
            finally:
                irq.served(token)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read, 10, 100)
            nursery.start_soon(read, 12, 200)
            await trio.testing.wait_all_tasks_blocked()
            assert set(irq.held) == {10, 12}
            irq.interrupt(10)  # a signal that does not kill: nothing happens
            await trio.testing.wait_all_tasks_blocked()
            assert set(irq.held) == {10, 12} and not outcome
            dying_pids.add(100)
            irq.interrupt(10)
            await trio.testing.wait_all_tasks_blocked()
            assert outcome == {10: True} and set(irq.held) == {12}
            dying_pids.add(200)  # no INTERRUPT: the sweep finds it
            with trio.fail_after(5):
                while 12 not in outcome:
                    await trio.sleep(0.05)
        assert not irq.held and irq.count == 2
        assert replies == []  # (the fast path answers its own requests)

    trio.run(main)


def test_a_barrier_is_answered_here_and_its_wait_ends(dying_pids):
    async def main():
        irq, replies = started()
        outcome = []

        async def barrier(unique: int, pid: int, started: trio.Event) -> None:
            irq.forwarded(unique, pid)  # (the fast path, in the task pyfuse3 then serves it in)
            started.set()
            with irq.waiting() as scope:
                assert not scope.cancel_called
                await trio.sleep_forever()
            outcome.append(scope.cancelled_caught)

        async with trio.open_nursery() as nursery:
            ev = trio.Event()
            nursery.start_soon(barrier, 20, 300, ev)
            await ev.wait()
            await trio.testing.wait_all_tasks_blocked()
            dying_pids.add(300)
            irq.interrupt(20)
        assert replies == [(20, errno.EINTR)] and outcome == [True]
        assert 20 not in irq.held and irq.count == 1
        assert irq.replied(20)  # libfuse's late answer is dropped
        assert not irq.replied(20) and not irq.answered

    trio.run(main)


def test_a_barrier_answered_before_its_wait_does_not_wait(dying_pids):
    async def main():
        irq, replies = started()
        irq.forwarded(30, 400)
        dying_pids.add(400)
        irq.interrupt(30)
        assert replies == [(30, errno.EINTR)]
        with irq.waiting() as scope:
            assert scope.cancel_called  # (ops._barrier answers EINTR without waiting)
        irq.done()
        with irq.waiting() as scope:  # the task serves nothing now: nobody cancels this
            assert not scope.cancel_called and not irq.held

    trio.run(main)


def test_nothing_is_answered_early_unless_started(dying_pids):
    async def main():
        irq = Interrupts()
        dying_pids.add(500)
        token = irq.serve(40, 500)
        try:
            with irq.waiting() as scope:
                assert not irq.held
                irq.interrupt(40)
                await trio.sleep(0)
        finally:
            irq.served(token)
        assert not scope.cancelled_caught and irq.count == 0
        irq.forwarded(41, 500)
        assert not irq.held

    trio.run(main)
