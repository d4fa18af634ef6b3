"""The committed tree of a backing directory, read without mounting it, and a progress line.

The offline tools replay the indexes read-only (no lock taken, nothing written to the backing
directory), so they also work next to live mounts, seeing what is committed so far.
"""

from __future__ import annotations

import os
import sys
import time

from ckptfs.format import backingdir
from ckptfs.format.records import FormatError, check_index_header
from ckptfs.namespace import ROOT_INO, Inode, Namespace
from ckptfs.peers import load_foreign
from ckptfs.view import Union


class Snapshot:
    """The committed, merged tree of all writers of a backing directory (or of one)."""

    def __init__(self, backing: str, writer: str | None = None) -> None:
        backingdir.check_backing(backing, create=False)
        ids = [os.path.basename(d) for d in backingdir.writer_dirs(backing)]
        if writer and writer not in ids:
            raise FormatError(f"no writer '{writer}' in {backing} "
                                     f"(writers: {', '.join(ids) or 'none'})")
        for d in backingdir.writer_dirs(backing):
            if writer is None or os.path.basename(d) == writer:
                check_index_header(os.path.join(d, backingdir.INDEX_NAME))
        self.backing = backing
        self.union = Union()
        self.ns = Namespace(now_ns=0, layer_of=self.union.layer_of)
        load_foreign(self.ns, backing, None, self.union, only=writer)
        self.warnings = self.union.warnings

    @property
    def writer_dir(self) -> str | None:
        """The writer directory when the backing directory has exactly one writer."""
        dirs = list(self.union.writer_dirs.values())
        return dirs[0] if len(dirs) == 1 else None

    def lookup(self, path: str) -> Inode:
        x = self.ns.inodes[ROOT_INO]
        for part in [p for p in path.split("/") if p]:
            if x.children is None or part.encode() not in x.children:
                raise FileNotFoundError(f"{path}: no such file or directory in {self.backing}")
            x = self.ns.inodes[x.children[part.encode()]]
        return x

    def entries(self, top: Inode):
        """(depth, name, inode) for `top` (depth 0, no name) and everything below it, depth
        first, sorted by name; without recursion (a tree may be deeper than Python's
        recursion limit)."""
        stack = [(0, b"", top)]
        while stack:
            depth, name, x = stack.pop()
            yield depth, name, x
            if x.children is not None:
                stack.extend((depth + 1, n, self.ns.inodes[x.children[n]])
                             for n in sorted(x.children, reverse=True))

    def walk(self, top: Inode, prefix: str):
        """(path, inode) for `top` and everything below it, in the order of entries(); the
        paths start with `prefix` ("/" for `top` when it is empty)."""
        names: list[str] = []
        for depth, name, x in self.entries(top):
            if not depth:
                yield prefix or "/", x
                continue
            del names[depth - 1:]
            names.append(name.decode(errors="surrogateescape"))
            yield f"{prefix}/{'/'.join(names)}", x


class Progress:
    """A one-line progress display on stderr (only when it is a terminal, or forced)."""

    def __init__(self, total: int, label: str, force: bool = False) -> None:
        self.total = max(total, 1)
        self.label = label
        self.done = 0
        self.show = force or sys.stderr.isatty()
        self.t0 = time.monotonic()
        self.last = 0.0

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.show and (now - self.last > 0.2 or self.done >= self.total):
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9) / 1e6
            print(f"\r{self.label}: {100 * self.done / self.total:5.1f}% "
                  f"{self.done / 1e6:10.1f} MB  {rate:8.1f} MB/s", end="", file=sys.stderr)

    def finish(self) -> None:
        if self.show:
            print(file=sys.stderr)
