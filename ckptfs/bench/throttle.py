"""A node's share of a busy parallel file system, emulated on one machine: the loopback traffic
to and from a GlusterFS volume's bricks limited to a rate (`ckptfs bench e2e --throttle`).

An htb qdisc on `lo` with two classes: the bricks' TCP ports (both directions: writes go to
them, reads come from them) share one class of the rate asked for; everything else goes
through a class far faster than loopback itself, so glusterd, the tests' other sockets and
the rest of the machine are untouched. Needs root and `tc` (iproute2); the qdisc is removed
when the context ends, whatever happened, and a leftover one of an interrupted run is
replaced. This kernel has htb and u32 (not netem, prio or flower)."""

from __future__ import annotations

import subprocess
from xml.etree import ElementTree

from ckptfs import api

DEV = "lo"
OPEN_RATE = "100gbit"  # (the class of everything else: never the bound)


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=60, check=check,
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, cwd="/")


def brick_ports(path: str) -> list[int]:
    """The TCP ports of the bricks of the GlusterFS volume that holds `path`."""
    entry = api.mount_holding(path)
    if entry is None or entry.fstype != "fuse.glusterfs":
        raise RuntimeError(f"{path} is not on a GlusterFS volume: --throttle limits the "
                           "loopback traffic of a volume's bricks")
    volume = entry.source.rsplit(":", 1)[-1].strip("/")
    # (the XML: the plain table wraps a long brick path onto a line of its own)
    out = _run("gluster", "--mode=script", "volume", "status", volume, "--xml").stdout
    try:
        nodes = ElementTree.fromstring(out).iter("node")
        ports = [int(n.findtext("ports/tcp") or n.findtext("port")) for n in nodes
                 if n.findtext("path", "").startswith("/")]  # (bricks, not daemons)
    except (ElementTree.ParseError, TypeError, ValueError):
        ports = []
    if not ports:
        raise RuntimeError(f"no brick ports in `gluster volume status {volume}`")
    return ports


class Throttle:
    """`with Throttle(path, bytes_per_s):` the volume holding `path` at that rate."""

    def __init__(self, path: str, bytes_per_s: int) -> None:
        self.ports = brick_ports(path)
        self.rate = f"{max(1, bytes_per_s * 8 // 1_000_000)}mbit"

    def __enter__(self) -> "Throttle":
        _run("tc", "qdisc", "del", "dev", DEV, "root", check=False)
        try:
            _run("tc", "qdisc", "add", "dev", DEV, "root", "handle", "1:", "htb", "default", "10")
            _run("tc", "class", "add", "dev", DEV, "parent", "1:", "classid", "1:10", "htb",
                 "rate", OPEN_RATE)
            _run("tc", "class", "add", "dev", DEV, "parent", "1:", "classid", "1:20", "htb",
                 "rate", self.rate, "ceil", self.rate)
            for port in self.ports:
                for way in ("dport", "sport"):
                    _run("tc", "filter", "add", "dev", DEV, "protocol", "ip", "parent", "1:",
                         "prio", "1", "u32", "match", "ip", way, str(port), "0xffff",
                         "flowid", "1:20")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        _run("tc", "qdisc", "del", "dev", DEV, "root", check=False)
