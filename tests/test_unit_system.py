"""ckptfs/system.py: what ckptfs reads of Linux beyond the os module."""

from __future__ import annotations

import os
import time

from ckptfs import system


def _sysfs(root, driver: str | None, ns: str | None) -> str:
    if driver is not None:
        d = root / "devices/system/cpu/cpuidle"
        d.mkdir(parents=True)
        (d / "current_driver").write_text(driver + "\n")
    if ns is not None:
        p = root / "module/haltpoll/parameters"
        p.mkdir(parents=True)
        (p / "guest_halt_poll_ns").write_text(ns + "\n")
    return str(root)


def test_guest_halt_poll_is_read_only_where_the_haltpoll_driver_runs(tmp_path):
    assert system.guest_halt_poll_ns(_sysfs(tmp_path / "a", "haltpoll", "0")) == 0
    assert system.guest_halt_poll_ns(_sysfs(tmp_path / "b", "haltpoll", "200000")) == 200000
    # bare metal (intel_idle, acpi_idle) with the module's parameter still there: not polling
    # that this driver does
    assert system.guest_halt_poll_ns(_sysfs(tmp_path / "c", "intel_idle", "0")) is None
    assert system.guest_halt_poll_ns(_sysfs(tmp_path / "d", None, None)) is None
    assert system.guest_halt_poll_ns(_sysfs(tmp_path / "e", "haltpoll", None)) is None
    assert system.guest_halt_poll_ns(_sysfs(tmp_path / "f", "haltpoll", "lots")) is None


def test_memory_and_cpu_of_a_process():
    rss = system.status_bytes("VmRSS")
    assert rss is not None and rss > 1 << 20
    assert system.status_bytes("VmHWM", os.getpid()) >= rss
    assert system.status_bytes("NoSuchField") is None
    assert system.status_bytes("VmRSS", 2 ** 22 + 12345) is None  # (above pid_max)
    t0 = system.cpu_seconds()
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    assert system.cpu_seconds(os.getpid()) >= t0 + 0.03
    assert system.cpu_seconds(2 ** 22 + 12345) is None
    assert system.steal_seconds() >= 0


def test_one_c_library_handle():
    from ckptfs import api
    from ckptfs.format import logs
    from ckptfs.io import buffers

    assert logs.libc is system.libc and api.libc is system.libc and buffers.libc is system.libc
    assert system.libc.getpid() == os.getpid()
