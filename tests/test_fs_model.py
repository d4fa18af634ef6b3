"""Randomized model test: random sparse writes, truncates, renames, unlinks, mkdirs/rmdirs and
remounts on a real mount, compared after every step with an in-memory model (path -> bytes),
errnos included."""

from __future__ import annotations

import errno
import os
import random

import pytest
from helpers import read_uncached
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

pytestmark = pytest.mark.timeout(180)

KiB, MiB = 1 << 10, 1 << 20
# Staging far larger than what is written (writers never wait for a free segment: backpressure
# is tested in test_fs_concurrency.py); small segments so that writes straddle segment
# boundaries.
OPTS = dict(staging_size="256M", segment_size="256K", idle_flush=0.3)
# Every path may become a file or a directory.
PATHS = ["a", "b", "x", "x/a", "x/b", "x/y", "x/y/a", "z", "z/a", "z/x"]


class Model:
    """What a POSIX file system must show: files (path -> bytearray) and directories."""

    def __init__(self) -> None:
        self.files: dict[str, bytearray] = {}
        self.dirs: set[str] = {""}

    @staticmethod
    def parent(p: str) -> str:
        return p.rpartition("/")[0]

    def exists(self, p: str) -> bool:
        return p in self.files or p in self.dirs

    def parent_errno(self, p: str) -> int:
        """The errno of resolving p's parent directory (0 when it is a directory)."""
        parts = p.split("/")[:-1]
        cur = ""
        for c in parts:
            cur = f"{cur}/{c}" if cur else c
            if cur in self.files:
                return errno.ENOTDIR
            if cur not in self.dirs:
                return errno.ENOENT
        return 0

    def children(self, d: str) -> list[str]:
        pre = d + "/" if d else ""
        return [p for p in list(self.files) + list(self.dirs)
                if p and p.startswith(pre) and "/" not in p[len(pre):]]

    # each op returns the errno it must fail with (0: success, model updated)
    def write(self, p: str, off: int, data: bytes) -> int:
        e = self.parent_errno(p)
        if e:
            return e
        if p in self.dirs:
            return errno.EISDIR
        f = self.files.setdefault(p, bytearray())
        if len(f) < off:
            f.extend(bytes(off - len(f)))
        f[off:off + len(data)] = data
        return 0

    def truncate(self, p: str, size: int) -> int:
        e = self.parent_errno(p)
        if e:
            return e
        if p in self.dirs:
            return errno.EISDIR
        if p not in self.files:
            return errno.ENOENT
        f = self.files[p]
        if size < len(f):
            del f[size:]
        else:
            f.extend(bytes(size - len(f)))
        return 0

    def unlink(self, p: str) -> int:
        e = self.parent_errno(p)
        if e:
            return e
        if p in self.dirs:
            return errno.EISDIR
        if p not in self.files:
            return errno.ENOENT
        del self.files[p]
        return 0

    def mkdir(self, p: str) -> int:
        e = self.parent_errno(p)
        if e:
            return e
        if self.exists(p):
            return errno.EEXIST
        self.dirs.add(p)
        return 0

    def rmdir(self, p: str) -> int:
        e = self.parent_errno(p)
        if e:
            return e
        if p in self.files:
            return errno.ENOTDIR
        if p not in self.dirs:
            return errno.ENOENT
        if self.children(p):
            return errno.ENOTEMPTY
        self.dirs.discard(p)
        return 0

    def rename(self, a: str, b: str) -> int:
        e = self.parent_errno(a) or self.parent_errno(b)
        if e:
            return e
        if not self.exists(a):
            return errno.ENOENT
        if a in self.dirs and b.startswith(a + "/"):
            return errno.EINVAL
        if b in self.dirs and a.startswith(b + "/"):
            return errno.ENOTEMPTY
        if a == b:
            return 0
        if b in self.dirs and a in self.files:
            return errno.EISDIR
        if b in self.files and a in self.dirs:
            return errno.ENOTDIR
        if b in self.dirs and self.children(b):
            return errno.ENOTEMPTY
        if a in self.files:
            self.files[b] = self.files.pop(a)
            return 0
        self.dirs.discard(b)
        for p in sorted(self.dirs):
            if p == a or p.startswith(a + "/"):
                self.dirs.discard(p)
                self.dirs.add(b + p[len(a):])
        for p in list(self.files):
            if p.startswith(a + "/"):
                self.files[b + p[len(a):]] = self.files.pop(p)
        return 0


def real_errno(fn, *args) -> int:
    try:
        fn(*args)
    except OSError as exc:
        return exc.errno
    return 0


def pwrite_path(path: str, off: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        n = os.pwrite(fd, data, off)
        assert n == len(data)
    finally:
        os.close(fd)


class Harness:
    """Runs the same op on the model and the mount and compares the outcomes."""

    def __init__(self, mounts, backing: str) -> None:
        self.mounts = mounts
        self.model = Model()
        self.m = mounts.mount(backing=backing, **OPTS)
        self.trace: list[str] = []

    def path(self, p: str) -> str:
        return os.path.join(self.m.mountpoint, p)

    def do(self, name: str, want: int, fn, *args) -> None:
        self.trace.append(f"{name}{tuple(a if not isinstance(a, bytes) else len(a) for a in args)}")
        got = real_errno(fn, *args)
        assert got == want, (f"{self.trace[-1]}: errno {errno.errorcode.get(got, got)}, "
                             f"model says {errno.errorcode.get(want, want)}; "
                             f"trace {self.trace[-30:]}")

    def write(self, p: str, off: int, n: int, seed: int) -> None:
        data = random.Random(seed).randbytes(n)
        self.do("write", self.model.write(p, off, data), pwrite_path, self.path(p), off, data)

    def truncate(self, p: str, size: int) -> None:
        self.do("truncate", self.model.truncate(p, size), os.truncate, self.path(p), size)

    def unlink(self, p: str) -> None:
        self.do("unlink", self.model.unlink(p), os.unlink, self.path(p))

    def mkdir(self, p: str) -> None:
        self.do("mkdir", self.model.mkdir(p), os.mkdir, self.path(p))

    def rmdir(self, p: str) -> None:
        self.do("rmdir", self.model.rmdir(p), os.rmdir, self.path(p))

    def rename(self, a: str, b: str) -> None:
        self.do("rename", self.model.rename(a, b), os.rename, self.path(a), self.path(b))

    def sync(self) -> None:
        self.trace.append("sync")
        self.m.sync()

    def remount(self) -> None:
        self.trace.append("remount")
        backing = self.m.backing
        assert self.m.stop() == 0
        self.m = self.mounts.mount(backing=backing, **OPTS)
        # Replay must not skip records or drop extents.
        bad = [line for line in self.mounts.log(self.m).splitlines()
               if "record skipped" in line or "dropped" in line or "Traceback" in line]
        assert not bad, bad

    def check_tree(self) -> None:
        root = self.m.mountpoint
        files, dirs = {}, {""}
        for dp, dns, fns in os.walk(root):
            rel = os.path.relpath(dp, root)
            rel = "" if rel == "." else rel
            for d in dns:
                dirs.add(f"{rel}/{d}" if rel else d)
            for f in fns:
                p = f"{rel}/{f}" if rel else f
                files[p] = os.stat(os.path.join(root, p)).st_size
        assert dirs == self.model.dirs, self.trace[-30:]
        assert files == {p: len(v) for p, v in self.model.files.items()}, self.trace[-30:]

    def check_contents(self, uncached: bool = True) -> None:
        self.check_tree()
        for p, want in self.model.files.items():
            got = read_uncached(self.path(p)) if uncached else open(self.path(p), "rb").read()
            if got != want:
                diff = next(i for i in range(min(len(got), len(want)) + 1)
                            if i >= min(len(got), len(want)) or got[i] != want[i])
                pytest.fail(f"{p}: {len(got)} bytes, model {len(want)}; first difference at "
                            f"{diff}; trace {self.trace[-40:]}")

    def close(self) -> None:
        self.check_contents()
        assert self.m.stop() == 0


def test_model_hypothesis(mounts):
    counter = [0]

    class FsMachine(RuleBasedStateMachine):
        @initialize()
        def start(self):
            counter[0] += 1
            self.h = Harness(mounts, mounts.backing(f"hyp{counter[0]}"))

        paths = st.sampled_from(PATHS)

        @rule(p=paths, off=st.one_of(st.integers(0, 5000), st.integers(0, 3 * MiB)),
              n=st.one_of(st.integers(1, 5000), st.integers(1, 600 * KiB)),
              seed=st.integers(0, 1 << 30))
        def write(self, p, off, n, seed):
            self.h.write(p, off, n, seed)

        @rule(p=paths, size=st.one_of(st.integers(0, 5000), st.integers(0, 4 * MiB)))
        def truncate(self, p, size):
            self.h.truncate(p, size)

        @rule(p=paths)
        def unlink(self, p):
            self.h.unlink(p)

        @rule(p=paths)
        def mkdir(self, p):
            self.h.mkdir(p)

        @rule(p=paths)
        def rmdir(self, p):
            self.h.rmdir(p)

        @rule(a=paths, b=paths)
        def rename(self, a, b):
            self.h.rename(a, b)

        @rule()
        def sync(self):
            self.h.sync()

        @rule()
        def remount(self):
            self.h.remount()
            self.h.check_contents()

        @rule()
        def contents(self):
            self.h.check_contents()

        @invariant()
        @precondition(lambda self: hasattr(self, "h"))
        def tree(self):
            self.h.check_tree()

        def teardown(self):
            if hasattr(self, "h"):
                self.h.close()

    run_state_machine_as_test(
        FsMachine,
        settings=settings(max_examples=5, stateful_step_count=25, deadline=None,
                          database=None, derandomize=False, print_blob=True,
                          suppress_health_check=list(HealthCheck)))


@pytest.mark.parametrize("seed", [1])
def test_model_seeded(mounts, seed):
    """A longer deterministic op sequence (reproducible from the seed in the test id)."""
    rng = random.Random(seed)
    h = Harness(mounts, mounts.backing(f"seeded{seed}"))
    h.mkdir("x")
    h.mkdir("z")
    for i in range(150):
        r = rng.random()
        p = rng.choice(PATHS)
        if r < 0.40:
            off = rng.choice([0, rng.randrange(5000), rng.randrange(3 * MiB)])
            n = rng.choice([rng.randrange(1, 5000), rng.randrange(1, 700 * KiB)])
            h.write(p, off, n, rng.randrange(1 << 30))
        elif r < 0.50:
            h.truncate(p, rng.choice([0, rng.randrange(5000), rng.randrange(4 * MiB)]))
        elif r < 0.60:
            h.rename(p, rng.choice(PATHS))
        elif r < 0.67:
            h.unlink(p)
        elif r < 0.80:
            h.mkdir(p)
        elif r < 0.85:
            h.rmdir(p)
        elif r < 0.90:
            h.sync()
        elif r < 0.94:
            h.remount()
            h.check_contents()
        else:
            h.check_contents()
        h.check_tree()
    h.close()
