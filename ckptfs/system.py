"""What ckptfs asks of Linux beyond the os module: one handle on the C library (fallocate,
syncfs, madvise, statfs, statx, prctl, malloc_trim); a process's memory and CPU time from
/proc (the snapshot process and the benchmarks report them); the host's steal time; the
idle-CPU polling of a KVM guest (the daemon's status). Standard library only: the offline
tools, the daemon and the benchmarks all import it."""

from __future__ import annotations

import ctypes
import os
import sys


def _load_libc() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # (not glibc: ask; ctypes.util runs the linker's tools, so only then)
        from ctypes.util import find_library

        return ctypes.CDLL(find_library("c"), use_errno=True)


libc = _load_libc()

# The directory that holds the ckptfs package the running code came from.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The PATH a child of the daemon gets (the daemon may run as root, started from anywhere)
CHILD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def child_command(module: str) -> tuple[list[str], dict, str]:
    """(argv, environment, working directory) that run `python -m module` of this ckptfs in a
    child of the daemon that trusts nothing of where the daemon was started: the interpreter
    isolated (-I: no current directory or script directory on sys.path, no PYTHON*
    variables, no user site), the package root first on sys.path, a clean PATH, cwd `/`. A
    `ckptfs/` directory planted where a root daemon was started then runs nothing."""
    boot = ("import sys, runpy; sys.path.insert(0, sys.argv.pop(1)); "
            "runpy.run_module(sys.argv[1], run_name='__main__', alter_sys=True)")
    env = {"PATH": CHILD_PATH, "LC_ALL": "C.UTF-8"}
    return [sys.executable, "-I", "-c", boot, PACKAGE_ROOT, module], env, "/"


def status_bytes(field: str, pid: int | str = "self") -> int | None:
    """A memory field of /proc/PID/status (VmRSS, VmHWM, ...) in bytes; None when the process
    is gone or the kernel does not have the field."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def cpu_seconds(pid: int | str = "self") -> float | None:
    """CPU seconds (user + system, all threads) a process has used so far; None when it is
    gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def steal_seconds() -> float:
    """CPU seconds the hypervisor ran something else while this machine's CPUs wanted to run
    (/proc/stat `steal`, summed over the CPUs; 0 on bare metal)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0


def cpu_seconds_named(prefix: str) -> float:
    """CPU seconds the running processes whose name (comm) starts with `prefix` have used so
    far (e.g. "gluster": a GlusterFS client's and its bricks' on this machine)."""
    total = 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                if not f.read().startswith(prefix):
                    continue
        except OSError:
            continue
        total += cpu_seconds(pid) or 0.0
    return total


def disk_busy_seconds() -> dict[str, float]:
    """Seconds each disk of this machine has been busy so far (/proc/diskstats io_ticks: time
    with at least one request in flight), by device name; loop, RAM and zram devices left out
    (their work is some other device's or memory's). A difference over a step near its wall
    time says that disk bound the step."""
    out = {}
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            name = fields[2]
            if name.startswith(("loop", "ram", "zram")) or not os.path.isdir(f"/sys/block/{name}"):
                continue  # (partitions: their disk counts them)
            out[name] = int(fields[12]) / 1000
    return out


def busy_seconds() -> float:
    """CPU seconds all of this machine's CPUs have spent busy so far (/proc/stat: everything
    but idle and iowait); a difference over a wall-clock interval is the average number of
    busy CPUs in it, which says whether a run was bound by the CPUs."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]  # (not steal: the host's)
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def guest_halt_poll_ns(sys_root: str = "/sys") -> int | None:
    """How long an idle vCPU of this KVM guest polls for work before it halts (the cpuidle
    haltpoll driver's guest_halt_poll_ns: 0 means it halts at once, and waking it is then a
    round through the hypervisor); None where that driver is not in use (bare metal, other
    hypervisors)."""
    try:
        with open(f"{sys_root}/devices/system/cpu/cpuidle/current_driver") as f:
            if f.read().strip() != "haltpoll":
                return None
        with open(f"{sys_root}/module/haltpoll/parameters/guest_halt_poll_ns") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None
