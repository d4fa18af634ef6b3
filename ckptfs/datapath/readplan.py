"""Read plans: the order a reader will read a big file's pieces in, known before it reads them.

A checkpoint saved by torch.distributed.checkpoint (DCP) with its FileSystemWriter is a
`.metadata` file beside one `.distcp` file per rank. DCP's reader loads the items of a `.distcp`
file one after the other, in the order `dcp.load` gives them (the state dict's top-level keys
sorted, the names under each in the order they were saved), each at its offset: a zip per
item, read at its end first (the zip's directory), then its start, then its data. The writer
put the items in the file by size, so readahead in file order guesses wrong at every item: a
2.1 GB DCP restore read 5.1 GB from disk and waited for one disk read per item
(docs/performance-notes.md, "DCP's order known").

With the order known (`dcp_plans`, from the `.metadata` the reader has just read itself), the
read cache loads the rest of the item being read and the next items in DCP's order while DCP
deserialises the current one (reader.Reader._plan_ahead), nothing past an item's end and of each
chunk only the part those items need, and when full
lets go first of the chunks the plan does not read again, else of the one it reads again
last (readcache.ReadCache._evict).

The `.metadata` is a pickle. It is read in a child process (`python -m` this module: its
memory and CPU time bounded) by an unpickler that builds every object it names as an inert
record (`_Record`: its state kept, no code of the pickle's run), so a file a user wrote can
neither make the daemon run anything nor exhaust its memory or stack; anything unexpected in
it (another format, another torch version's fields, a file that is not DCP's, items outside
the data file) means no plan, and the reads go as they would without one. A plan only decides
what is loaded ahead: the bytes every READ returns never depend on it.
"""
from __future__ import annotations

import array
import io
import pickle
import resource
import struct
import subprocess
import sys
from bisect import bisect_right

from ckptfs import system

# The file names DCP's FileSystemWriter uses.
DCP_METADATA = b".metadata"
DCP_DATA_SUFFIX = b".distcp"
# A larger `.metadata` is not read for a plan (a 7B model's is ~100 KB per rank).
METADATA_MAX_BYTES = 64 << 20
# How many items ahead of the one being read a plan looks at most (besides the readahead
# window): a state dict's small items (norms, biases) would otherwise make one READ walk
# hundreds.
AHEAD_ITEMS_MAX = 32


# The child that reads a `.metadata` (dcp_plans): what it may use, and how long it may take.
CHILD_MEMORY_BYTES = 1 << 30
CHILD_CPU_S = 10
CHILD_TIMEOUT_S = 15
# The most items one `.metadata` may list for a plan (a 70B model's optimizer state across
# thousands of ranks stays below it).
ITEMS_MAX = 1 << 21
_HEAD = struct.Struct("<IQ")  # a data file's name length and item count, in the child's answer


class _Record:
    """Any object a pickle names, as data: its state (how it was made is dropped)."""

    __slots__ = ("state",)

    def __init__(self, *args, **kwargs) -> None:
        self.state = None

    def __setstate__(self, state) -> None:
        self.state = state

    def field(self, name: str, default=ValueError):
        """Its field `name`; `default` when it has none (ValueError: raised)."""
        st = self.state
        if isinstance(st, tuple) and len(st) == 2:  # (dict, slots) of a class with __slots__
            st = {**(st[0] or {}), **(st[1] or {})}
        if not isinstance(st, dict) or name not in st:
            if default is ValueError:
                raise ValueError(f"no field {name!r}")
            return default
        return st[name]


class _InertUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        return _Record  # (whatever it names: nothing of it is looked up, let alone run)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids")


def _parse(metadata: bytes) -> dict[bytes, list[tuple[int, int]]]:
    """dcp_plans's work, in the child."""
    try:
        md = _InertUnpickler(io.BytesIO(metadata)).load()
        if not isinstance(md, _Record):
            raise ValueError("not DCP metadata")
        order = md.field("state_dict_metadata")
        storage = md.field("storage_data")
        if not isinstance(order, dict) or not isinstance(storage, dict):
            raise ValueError("not DCP metadata")
        if len(storage) > ITEMS_MAX:
            raise ValueError(f"more than {ITEMS_MAX} items")
        rank = _load_order(order, md.field("planner_data", None))
        items = []
        for n, (index, info) in enumerate(storage.items()):
            if not isinstance(index, _Record) or not isinstance(info, _Record):
                raise ValueError("not DCP metadata")
            fqn = index.field("fqn")
            path, off, length = (info.field("relative_path"), info.field("offset"),
                                 info.field("length"))
            if (not isinstance(path, str) or type(off) is not int or type(length) is not int
                    or not 0 <= off < 1 << 62 or not 0 < length < 1 << 62):
                raise ValueError("not DCP metadata")
            items.append((rank.get(fqn, len(rank)), n, path, off, length))
    except Exception as exc:  # noqa: BLE001 - any file can be there: whatever fails, no plan
        raise ValueError(f"not DCP metadata: {type(exc).__name__}: {exc}") from None
    items.sort()
    plans: dict[bytes, list[tuple[int, int]]] = {}
    for _, _, path, off, length in items:
        plans.setdefault(path.encode(), []).append((off, length))
    return plans


def dcp_plans(metadata: bytes) -> dict[bytes, list[tuple[int, int]]]:
    """The items of each data file a DCP `.metadata` lists, (offset, length) in the order DCP
    loads them, by the file's name; ValueError when it is not a DCP metadata file this
    understands. Read in a child process with its memory and CPU time bounded: an unpickler
    that runs nothing can still be made to allocate without end or to recurse in C (a
    memo index near 2**31, a tuple nested a million deep), which in the daemon would take
    the mount down. Blocks for the child's time (~30 ms): call it from a worker thread."""
    if len(metadata) > METADATA_MAX_BYTES:
        raise ValueError("metadata too large for a read plan")
    try:
        cmd, env, cwd = system.child_command(__name__)
        done = subprocess.run(cmd, input=metadata, env=env, cwd=cwd, capture_output=True,
                              timeout=CHILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise ValueError(f"reading the metadata: {exc}") from None
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        raise ValueError(why[-1] if why else f"the child ended with {done.returncode}")
    out, at, plans = done.stdout, 0, {}
    try:
        while at < len(out):
            nlen, count = _HEAD.unpack_from(out, at)
            at += _HEAD.size
            name = bytes(out[at:at + nlen])
            at += nlen
            pairs = array.array("q")
            pairs.frombytes(out[at:at + 16 * count])
            at += 16 * count
            if len(pairs) != 2 * count:
                raise ValueError("short")
            plans[name] = list(zip(pairs[0::2], pairs[1::2]))
    except (struct.error, ValueError) as exc:
        raise ValueError(f"the child's answer: {exc}") from None
    return plans


def _child() -> int:
    """`python -m ckptfs.datapath.readplan`: a `.metadata` on stdin, its plans on stdout."""
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_BYTES, CHILD_MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (CHILD_CPU_S, CHILD_CPU_S))
    data = sys.stdin.buffer.read(METADATA_MAX_BYTES + 1)
    try:
        if len(data) > METADATA_MAX_BYTES:
            raise ValueError("metadata too large for a read plan")
        plans = _parse(data)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    w = sys.stdout.buffer
    for name, items in plans.items():
        w.write(_HEAD.pack(len(name), len(items)))
        w.write(name)
        w.write(array.array("q", [v for item in items for v in item]).tobytes())
    w.flush()
    return 0


def _load_order(fqns: dict, paths) -> dict:
    """The position DCP's load gives each item name: `dcp.load` sorts the top-level keys of
    the state dict it fills, and a flattened name (`planner_data`: name -> its path in the
    nested state dict) comes in the order it was saved under its top-level key."""
    def top(fqn):
        p = paths.get(fqn) if isinstance(paths, dict) else None
        return p[0] if isinstance(p, (tuple, list)) and p else fqn

    tops = {fqn: top(fqn) for fqn in fqns}
    if not all(isinstance(t, str) for t in tops.values()):
        raise ValueError("not DCP metadata")
    ranked = sorted(enumerate(fqns), key=lambda ifqn: (tops[ifqn[1]], ifqn[0]))
    return {fqn: i for i, (_, fqn) in enumerate(ranked)}


class ReadPlan:
    """One file's items, (offset, length) in the order they will be read; ValueError when
    they do not lie apart inside a file of `size` bytes (a plan of another file)."""

    __slots__ = ("items", "size", "reach", "starts", "at", "before", "now", "cur", "parts",
                 "uses", "soon")

    def __init__(self, items: list[tuple[int, int]], size: int, reach: int = 0) -> None:
        self.items = items
        self.size = size
        # how far past an item's end its reader's READs go (a buffered reader fills its
        # buffer: Python's is the file's st_blksize), so loaded with the item
        self.reach = reach
        by_offset = sorted(range(len(items)), key=lambda i: items[i][0])
        end = 0
        for i in by_offset:
            s, n = items[i]
            if s < end or s + n > size:
                raise ValueError("the items overlap or lie past the file's end")
            end = s + n
        self.starts = [items[i][0] for i in by_offset]
        self.at = by_offset  # (the plan position of the i-th item by offset)
        self.before = [0]  # (the bytes of the items before each position)
        for _, n in items:
            self.before.append(self.before[-1] + n)
        self.now = -1  # the furthest position read
        self.cur = -1  # the position the last look ahead was for
        # (set by the reader once: per position, its chunks and where their parts end in the
        # file; per chunk, the positions that read it)
        self.parts: list | None = None
        self.uses: dict = {}
        self.soon: dict = {}  # (the chunks the last look ahead wanted: the item's rest, next)

    def next_use(self, uses: list[int]) -> int | None:
        """How many bytes of items its reader reads before the first of the plan positions
        `uses` (sorted) after the item read last; None when none is after it."""
        i = bisect_right(uses, self.now)
        if i == len(uses):
            return None
        return self.before[uses[i]] - self.before[self.now + 1]

    def locate(self, off: int) -> int | None:
        """The plan position of the item byte `off` is in (None: in none), which is read now:
        `now` becomes the furthest position read (READs accounted together come by offset,
        not in the order they were read)."""
        i = bisect_right(self.starts, off) - 1
        if i < 0:
            return None
        p = self.at[i]
        s, n = self.items[p]
        if off >= s + n:
            return None
        if p > self.now:
            self.now = p
        return p

    def clear(self) -> None:
        """No plan from now on (a look ahead by it failed): no item is found any more."""
        self.items, self.starts, self.at, self.parts = [], [], [], []

    def after(self, p: int) -> range:
        """The plan positions read after position p, as far as a look ahead goes."""
        return range(p + 1, min(len(self.items), p + 1 + AHEAD_ITEMS_MAX))


if __name__ == "__main__":
    sys.exit(_child())
