"""The queue threads: requests served from their caller's CPU, on FUSE over io_uring
(`--fuse-uring`: per-CPU queues) or on /dev/fuse (`--queue-threads`, the default).

On /dev/fuse every request goes through one file: the daemon's request thread on one vCPU
reads it, the caller on the other vCPU halts while it waits, and the reply has to wake it
through the hypervisor (~85 us per waited request on this VM without halt polling; the
request spin saves the daemon's side of it, not the caller's: docs/benchmarks.md, "What the
FUSE transport costs"). With FUSE_OVER_IO_URING negotiated (Linux 6.14+, the module switch
/sys/module/fuse/parameters/enable_uring = Y) the kernel keeps a queue per CPU and puts a
request on its caller's CPU's queue. One C thread per queue (fuse/ring*.c), pinned to that CPU,
holds the queue's ring entries, hands each request to the trio thread through a FIFO and, while its
caller waits, polls for the answer on that CPU, so the CPU does not halt and the caller's
wake-up is local. Some requests are answered by the queue thread itself, from what this
side handed it (fuse/ring.c lists them; fuse/ring.h declares what passes between the two
sides, struct ck_fring_policy what a file they create is): a WRITE that landed whole on a
handle open for writing, FLUSH while the flusher has no error to report, IOCTL, GETATTR of a
directory whose attributes the trio thread left with it, LOOKUP of a name not in a directory whose
names the trio thread left with it or of a name whose answer it prepared, CREATE of a new name,
OPEN of a file it prepared a read window for, READ inside a handle's read window (bytes of
the read cache), and RELEASE, whose work the trio thread does later, as it makes the created files
and opened handles and accounts for the READs. Every other one is served here, by the fast
path's handlers (fuse/fastpath.py), as one read from /dev/fuse; only where its bytes are
read from and where its answer goes differ:

- a request sits in its ring entry: the 40-byte header and the op's fixed part in the entry's
  header buffer, the rest (names, a WRITE's payload) in its payload buffer. A WRITE's payload
  is copied from there into staging by the queue thread, on the caller's CPU, where the trio
  thread offered (the staging's tails, as the /dev/fuse loop reads a request into them); it
  records the landed writes in the order they landed, before it serves any request and
  before anything else changes staging (Staging.claim). A WRITE answered by its queue thread
  does not wake the trio thread: its record waits for the next request, a full segment (the
  zone's first part filled: a segment to seal and flush), a half-full landed list or the
  idle sealer's tick (FastPath.settle); pending() counts landed writes only then. What did
  not fit is copied here.
- the answer goes into the same entry: the out header into the header buffer, the body into
  the payload buffer, and the queue thread commits it (the kernel copies it to the caller).
- requests served by pyfuse3 are forwarded as the /dev/fuse ones are, their answers routed
  back to the entry by the request's unique.

What stays on /dev/fuse: INIT, the requests sent before every queue has its entries,
FORGET, INTERRUPT, and the daemon's notifications; the fast path keeps serving it.

The switch is root's and machine-wide: without it (or on an older kernel) the kernel does
not offer FUSE over io_uring in INIT, the mount serves /dev/fuse alone and logs why.

On /dev/fuse (`dev`: where FUSE over io_uring is not asked for or not offered) the same
queue threads, one per CPU (DEV_QUEUES at most), each pinned to its CPU, poll the descriptor:
a request wakes all of them, and the one on the caller's CPU, which the caller leaves as it
waits, reads it first, so its round trip stays on that CPU as on a ring ("What the FUSE
transport costs", dev-percpu). A request read there sits in an entry laid out as a ring
entry's and is served by the same code; an answer the trio thread gives is written on /dev/fuse
right away (answered() then frees the entry), and every request comes to the trio thread through
the queue threads (FORGET and INTERRUPT too: the trio thread does not read /dev/fuse then; gone()
says when the connection ended). A WRITE is read there straight into staging's tails when no
other queue thread holds them (the kernel's copy then the only one).
"""

from __future__ import annotations

import errno
import os
import struct
from typing import NamedTuple

from ckptfs.format.records import MAX_FILE_BYTES
from ckptfs.fuse import protocol
from ckptfs.io import uring
from ckptfs.io.uring import ffi, lib

ENABLE_URING = "/sys/module/fuse/parameters/enable_uring"
# Layout of an entry's header buffer (struct fuse_uring_req_header): the in/out header, the
# op's fixed part, then struct fuse_uring_ent_in_out.
_REQ_HEADER = protocol.layout("fuse_uring_req_header")
OP_IN = _REQ_HEADER.offset("op_in")
OP_IN_SIZE = _REQ_HEADER.offset("ring_ent_in_out") - OP_IN
PAYLOAD_SZ = _REQ_HEADER.offset("ring_ent_in_out.payload_sz")
# Memory: each entry has a payload buffer as large as the biggest request (1 MiB); a queue
# gets QUEUE_DEPTH entries (as many requests in service at once as the /dev/fuse loop's
# request tasks, fuse/loop.MAX_TASKS), fewer on machines with many CPUs (RING_MEMORY in all,
# at least one entry per queue; a buffer takes memory once a request used it).
QUEUE_DEPTH = 32
RING_MEMORY = 128 << 20
TAKE = 16
# The queue threads' figures (ck_fring_queue_counts, in its order), summed over the queues.
QUEUE_COUNTS = ("ring_requests", "ring_answered_in_c", "ring_attrs_answered_in_c",
                "ring_absent_answered_in_c", "ring_creates_answered_in_c", "ring_entries_lost",
                "ring_queues_pinned", "ring_writes_read_in_place", "ring_reads_answered_in_c",
                "ring_opens_answered_in_c", "ring_lookups_answered_in_c")
# Inode and handle numbers reserved for the queue threads' creates at a time (taken again once
# fewer than a quarter are left).
RESERVE = 256
# Buffers of a read window at most; directories whose names the queue threads hold at most
# (fuse/ring.h; the values stand where the module is not built, and no queue threads run).
WINDOW_PARTS = lib.CK_FRING_WINDOW_PARTS if lib is not None else 4
NAME_DIRS = lib.CK_FRING_NAME_DIRS if lib is not None else 32
_U32 = struct.Struct("<I")  # fuse_uring_ent_in_out.payload_sz
# Queue threads on /dev/fuse at most (on the first DEV_QUEUES CPUs this process may use):
# every request wakes each of them (a thread in poll(2)), so many would cost every request a
# wake-up per CPU.
DEV_QUEUES = 8


def enabled() -> str | None:
    """None when this kernel offers FUSE over io_uring to new mounts, else why not."""
    try:
        with open(ENABLE_URING) as f:
            on = f.read().strip()
    except OSError:
        return "this kernel has no FUSE over io_uring (Linux 6.14+)"
    if on != "Y":
        return f"{ENABLE_URING} is {on} (root can turn it on: docs/tuning.md)"
    return threads_unavailable()


def threads_unavailable() -> str | None:
    """None when the queue threads can run here (ckptfs's C module, built with liburing),
    else why not."""
    if lib is None:
        return uring.uring_unavailable_reason() or "ckptfs.io._uring_cffi is not built"
    if not lib.ck_have_uring():
        return ffi.string(lib.ck_build_info()).decode()
    return None


def queues() -> int:
    """The kernel's queues: one per possible CPU id."""
    try:
        with open("/sys/devices/system/cpu/possible") as f:
            last = f.read().strip().split(",")[-1]
        return int(last.split("-")[-1]) + 1
    except (OSError, ValueError):
        return os.cpu_count() or 1


class RingError(OSError):
    pass


class CreatePolicy(NamedTuple):
    """What a file the queue threads create is (struct ck_fring_policy), as the trio thread
    decided it (Landing.create_policy, from ops)."""

    entry_valid: tuple[int, int]  # its entry's timeout (s, ns)
    attr_valid: tuple[int, int]  # its attributes' timeout (s, ns)
    file_type: int  # the type bits of its mode (S_IFREG)
    mode_bits: int  # the bits of CREATE's mode it keeps, those the umask leaves
    blksize: int  # its attributes' blksize
    open_flags: tuple[int, int, int, int]  # FOPEN_* of its handle, by access mode (O_ACCMODE)
    writes_here: tuple[bool, bool, bool, bool]  # its handle takes writes, by access mode...
    no_writes_mode: int  # ... unless its mode has one of these bits


class Ring:
    """The queue threads of one mount and the entries they hand over."""

    def __init__(self, fuse_fd: int, payload: int, spin_s: float, dev: bool = False) -> None:
        self.dev = dev  # the requests are read from /dev/fuse (fuse/ring_dev.c)
        cpus = sorted(os.sched_getaffinity(0))[:DEV_QUEUES] if dev else None
        self.nqueues = len(cpus) if dev else queues()
        self.depth = max(1, min(QUEUE_DEPTH, RING_MEMORY // (self.nqueues * payload)))
        self.payload = payload
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        err = ffi.new("int *")
        self.handle = lib.ck_fring_start(fuse_fd, self.nqueues, self.depth, payload,
                                         self.wake_fd, spin_s,
                                         ffi.new("int[]", cpus) if dev else ffi.NULL, err)
        if self.handle == ffi.NULL:
            os.close(self.wake_fd)
            raise RingError(err[0], ("cannot start the queue threads: " if dev else
                                     "FUSE over io_uring: cannot register the queues: ")
                            + os.strerror(err[0]))
        lib.ck_fring_file_bytes_max(self.handle, MAX_FILE_BYTES)
        n = self.nqueues * self.depth
        self.headers = [memoryview(ffi.buffer(lib.ck_fring_header(self.handle, i), 4096))
                        for i in range(n)]
        self.payloads = [memoryview(ffi.buffer(lib.ck_fring_payload(self.handle, i), payload))
                         for i in range(n)]
        self._ids = ffi.new("int[]", TAKE)
        self._landed = ffi.new("struct ck_fring_landed[]", TAKE)
        self._numbers = ffi.new("uint64_t[]", TAKE)
        self._created = ffi.new("struct ck_fring_created[]", TAKE)
        self._reads = ffi.new("struct ck_fring_read[]", TAKE)
        self._opened = ffi.new("struct ck_fring_opened[]", TAKE)
        self._parts = ffi.new("char *[]", WINDOW_PARTS)
        self._lens = ffi.new("uint32_t[]", WINDOW_PARTS)
        self.windows: dict[int, list] = {}  # (keeps each window's buffers' cdata alive)
        self.zone = None  # (keeps the offered buffers' cdata alive)
        self.taken: list[int] = []

    def pending(self) -> int:
        return lib.ck_fring_pending(self.handle) or len(self.taken)

    def take(self) -> int:
        """The next entry handed over (its request in headers[i], payloads[i]), or -1."""
        if not self.taken:
            k = lib.ck_fring_take(self.handle, self._ids, TAKE)
            if not k:
                return -1
            self.taken = list(self._ids[0:k])
            self.taken.reverse()
        return self.taken.pop()

    def landed(self) -> int:
        """Writes landed and not yet taken (take_landed), due or not (pending())."""
        return lib.ck_fring_landed(self.handle)

    def sleep(self, sleeping: bool) -> bool:
        """Tell the queue threads the trio thread sleeps on wake_fd (True) or is awake again;
        returns whether a request waits, or what they left to take (releases, creates, READs
        answered from windows and landed writes that are due): then do not sleep."""
        waiting = lib.ck_fring_sleep(self.handle, 1 if sleeping else 0)
        if not sleeping:
            try:
                os.eventfd_read(self.wake_fd)
            except BlockingIOError:
                pass
        return bool(waiting or self.taken)

    def offer(self, t1, t2) -> None:
        """The next WRITE payloads go into t1, then (once it is full) t2 (writable buffers)."""
        p1 = ffi.from_buffer(t1, require_writable=True)
        p2 = ffi.from_buffer(t2, require_writable=True) if t2 is not None else ffi.NULL
        self.zone = (p1, p2)
        lib.ck_fring_offer(self.handle, p1, len(t1), p2, len(t2) if t2 is not None else 0)

    def revoke(self) -> None:
        """No more landing until the next offer."""
        lib.ck_fring_revoke(self.handle)
        self.zone = None

    def take_landed(self) -> list[tuple]:
        """The writes landed since the last call, in order: (entry, answered already, bytes in
        the first part of the zone, bytes in the second, fh, offset, size, write_flags, pid,
        the CRC32C of the bytes in the first part and in the second or None where their
        queue thread had not taken it yet). An entry answered already is back with the
        kernel."""
        rec = self._landed
        out: list[tuple] = []
        while True:
            n = lib.ck_fring_take_landed(self.handle, rec, TAKE)
            for j in range(n):
                r = rec[j]
                summed = r.summed
                out.append((r.id, r.answered, r.k1, r.k2, r.fh, r.off, r.size, r.flags, r.pid,
                            r.crc1 if summed else None, r.crc2 if summed else None))
            if n < TAKE:
                return out

    def sum_landed(self) -> int:
        """The CRC32C of the landed writes not taken yet into their records, in C (GIL
        released) while the queue threads go on landing; how many (fuse/ring_landing.c)."""
        return lib.ck_fring_sum_landed(self.handle)

    def released(self) -> int:
        """RELEASEs the queue threads answered whose handles were not taken yet."""
        return lib.ck_fring_released(self.handle)

    def take_released(self) -> list[int]:
        """The handles of those RELEASEs, in the order they came (their work is the trio thread's:
        Handles.release_now)."""
        return self._take_numbers(lib.ck_fring_take_released)

    def _take_numbers(self, take) -> list[int]:
        """All the numbers (handles, inodes) a list of the queue threads holds, in order."""
        out: list[int] = []
        buf = self._numbers
        while True:
            n = take(self.handle, buf, TAKE)
            out.extend(buf[0:n])
            if n < TAKE:
                return out

    def stop_deferring(self) -> None:
        """The queue threads answer no more RELEASEs and CREATEs (the mount stops):
        take_released and take_created then return the last of them."""
        lib.ck_fring_defer_here(self.handle, 0)

    def create_setup(self, policy: CreatePolicy) -> None:
        """The queue threads answer CREATE where they can (fuse/ring_dirs.c), the new file
        being what `policy` says. Numbers come from reserve()."""
        p = ffi.new("struct ck_fring_policy *")
        p.entry_valid, p.entry_valid_nsec = policy.entry_valid
        p.attr_valid, p.attr_valid_nsec = policy.attr_valid
        p.file_type = policy.file_type
        p.mode_bits = policy.mode_bits
        p.blksize = policy.blksize
        p.open_flags = list(policy.open_flags)
        p.writes_here = [1 if w else 0 for w in policy.writes_here]
        p.no_writes_mode = policy.no_writes_mode
        lib.ck_fring_create_setup(self.handle, p)

    def reserve_left(self) -> int:
        """Creates the numbers reserved for the queue threads are left for."""
        return lib.ck_fring_reserve_left(self.handle)

    def reserve(self, ino: int, fh: int, n: int) -> None:
        """The queue threads' creates take inode numbers ino.. and handles fh.. (n of each)."""
        lib.ck_fring_reserve(self.handle, ino, fh, n)

    def created(self) -> int:
        """Files the queue threads created that were not taken yet."""
        return lib.ck_fring_created(self.handle)

    def take_created(self) -> list[tuple]:
        """Those files, in the order they were created: (parent, name, ino, fh, mode, uid,
        gid, open flags, pid, time in ns); each is for the trio thread to make (ops.create_open)."""
        out: list[tuple] = []
        buf = self._created
        while True:
            n = lib.ck_fring_take_created(self.handle, buf, TAKE)
            for j in range(n):
                c = buf[j]
                out.append((c.parent, ffi.unpack(c.name, c.namelen), c.ino, c.fh, c.mode,
                            c.uid, c.gid, c.flags, c.pid, c.now_ns))
            if n < TAKE:
                return out

    def window(self, fh: int, start: int, eof: bool, parts: list, nodeid: int = 0,
               open_flags: int = 0) -> bool:
        """Handle fh's READs of bytes [start, start + the parts' lengths) are answered by the
        queue threads from `parts` (buffers, in file order, end to end, unchanged until
        window_drop or the next window of fh; at most WINDOW_PARTS); eof: the file ends
        there. False if no window was free (fh then has none). With `nodeid`, a prepared
        window: fh is not open yet; the queue threads answer the next read-only OPEN of
        nodeid with fh and `open_flags` (FOPEN_*), and fh has the window from then on
        (take_opened)."""
        held = [ffi.from_buffer(p) for p in parts]
        for i, (c, p) in enumerate(zip(held, parts)):
            self._parts[i] = c
            self._lens[i] = len(p)
        ok = bool(lib.ck_fring_window(self.handle, fh, nodeid, open_flags, start,
                                      1 if eof else 0, len(parts), self._parts, self._lens))
        if ok:
            self.windows[fh] = held
        else:
            self.windows.pop(fh, None)
        return ok

    def window_drop(self, fh: int) -> None:
        """Handle fh's window is gone (its buffers are free to change once this returns)."""
        lib.ck_fring_window_drop(self.handle, fh)
        self.windows.pop(fh, None)

    def reads(self) -> int:
        """READs the queue threads answered from windows, not yet taken (take_reads)."""
        return lib.ck_fring_reads(self.handle)

    def take_reads(self) -> list[tuple[int, int, int, int]]:
        """The READs answered from windows since the last call, in order: (fh, offset, size
        asked for, bytes answered)."""
        rec, out = self._reads, []
        while True:
            n = lib.ck_fring_take_reads(self.handle, rec, TAKE)
            out.extend((rec[j].fh, rec[j].off, rec[j].size, rec[j].n) for j in range(n))
            if n < TAKE:
                return out

    def lookup_put(self, parent: int, name: bytes, nodeid: int, entry_out: bytes) -> bool:
        """The queue threads answer the next LOOKUP of `name` in directory `parent` with
        `entry_out` (inode nodeid's fuse_entry_out), once, and note it (take_looked). False
        if every slot is taken."""
        return bool(lib.ck_fring_lookup_put(self.handle, parent, name, len(name), nodeid,
                                            entry_out))

    def lookup_drop(self, parent: int, name: bytes) -> None:
        """The prepared answer of `name` in directory `parent` goes, if one stands."""
        lib.ck_fring_lookup_drop(self.handle, parent, name, len(name))

    def lookups_clear(self) -> None:
        """Every prepared LOOKUP answer goes."""
        lib.ck_fring_lookups_clear(self.handle)

    def looked(self) -> int:
        """LOOKUPs the queue threads answered from prepared answers, not yet taken."""
        return lib.ck_fring_looked(self.handle)

    def take_looked(self) -> list[int]:
        """The inodes of those LOOKUPs, in order (each is one more lookup the kernel holds)."""
        return self._take_numbers(lib.ck_fring_take_looked)

    def opened(self) -> int:
        """OPENs the queue threads answered from prepared windows, not yet taken."""
        return lib.ck_fring_opened(self.handle)

    def take_opened(self) -> list[tuple[int, int, int, int, int, int]]:
        """Those OPENs, in order: (fh, nodeid, open flags, uid, gid, pid); each handle is for
        the trio thread to make (Handles.open_prepared)."""
        rec, out = self._opened, []
        while True:
            n = lib.ck_fring_take_opened(self.handle, rec, TAKE)
            out.extend((rec[j].fh, rec[j].nodeid, rec[j].flags, rec[j].uid, rec[j].gid,
                        rec[j].pid) for j in range(n))
            if n < TAKE:
                return out

    def writable(self, fh: int, on: bool) -> None:
        """Handle fh takes writes (its WRITEs that land whole are answered by the queue
        threads) or, at its release, no longer."""
        lib.ck_fring_writable(self.handle, fh, 1 if on else 0)

    def request(self, i: int) -> tuple[memoryview, int]:
        """Entry i's header buffer and its payload's length."""
        h = self.headers[i]
        return h, _U32.unpack_from(h, PAYLOAD_SZ)[0]

    def answer(self, i: int, header: bytes, data) -> bool:
        """Entry i's answer: `header` (out header and maybe the start of the body), then the
        buffers `data`; the queue thread commits it. False if it does not fit."""
        h, pay = self.headers[i], self.payloads[i]
        body = len(header) - 16 + sum(map(len, data))
        if body > self.payload:
            return False
        h[0:16] = header[0:16]
        pos = len(header) - 16
        if pos:
            pay[0:pos] = header[16:]
        for d in data:
            k = len(d)
            pay[pos:pos + k] = d
            pos += k
        _U32.pack_into(h, PAYLOAD_SZ, body)
        lib.ck_fring_answer(self.handle, i)
        return True

    def go(self) -> None:
        """/dev/fuse: the queue threads start reading it (set up: flush_fails and the rest)."""
        lib.ck_fring_go(self.handle)

    def answered(self, i: int) -> None:
        """/dev/fuse: entry i's answer was written there (or its request needs none): the
        entry is free again."""
        lib.ck_fring_answer(self.handle, i)

    def gone(self) -> bool:
        """/dev/fuse: the queue threads found the connection ended (unmounted, aborted)."""
        return self.handle is not None and bool(lib.ck_fring_gone(self.handle))

    def counts(self) -> dict:
        err = self.error()
        sums = [0] * len(QUEUE_COUNTS)
        if self.handle is not None:
            out = ffi.new("long[]", len(QUEUE_COUNTS))
            for q in range(self.nqueues):
                k = lib.ck_fring_queue_counts(self.handle, q, out, len(QUEUE_COUNTS))
                for j in range(k):
                    sums[j] += out[j]
        return {"ring_queues": self.nqueues, "ring_depth": self.depth,
                **dict(zip(QUEUE_COUNTS, sums)), "ring_error": os.strerror(err) if err else "",
                "ring_writable_handles": lib.ck_fring_writable_count(self.handle)
                if self.handle is not None else 0}

    def attr_put(self, nodeid: int, attr_out: bytes, new_gid: int | None) -> None:
        """GETATTR of directory `nodeid` is answered by the queue threads with `attr_out` (a
        struct fuse_attr_out) until a directory changes (dirs_changed); a file they create in
        it takes group `new_gid` (None: its creator's)."""
        if self.handle is not None:
            lib.ck_fring_attr_put(self.handle, nodeid, attr_out, len(attr_out),
                                  -1 if new_gid is None else new_gid)

    def names_put(self, nodeid: int, names) -> bool:
        """LOOKUP of a name in directory `nodeid` that is none of `names` (bytes) is answered
        absent by the queue threads while absent_until allows, until view_changed; the names
        it gains come by name_added. False if the directory is too large to hold."""
        if self.handle is None:
            return False
        names = list(names)
        blob = b"\0".join(names)
        return lib.ck_fring_names_put(self.handle, nodeid, blob, len(blob), len(names)) == 0

    def has_names(self, nodeid: int) -> bool:
        """Whether the queue threads hold directory nodeid's names (names_put)."""
        return self.handle is not None and bool(lib.ck_fring_names_has(self.handle, nodeid))

    def absent_until(self, t: float) -> None:
        """The queue threads answer a LOOKUP absent only before `t` (time.monotonic()): a
        look at other writers is due then (OtherWriters.fresh_until), which the trio thread makes
        first."""
        if self.handle is not None:
            lib.ck_fring_absent_until(self.handle, t)

    # what the queue threads answer from goes when the tree changes (FastPath, Landing and the
    # answer cache call these)
    def dirs_changed(self) -> None:
        """Every GETATTR of a directory goes to the trio thread again until attr_put."""
        if self.handle is not None:
            lib.ck_fring_attr_clear(self.handle)

    def name_added(self, parent: int, name: bytes) -> None:
        """A LOOKUP of `name` in directory `parent` is never answered absent from now on."""
        if self.handle is not None:
            lib.ck_fring_name_add(self.handle, parent, name, len(name))

    def view_changed(self, keeps) -> None:
        """Other writers' changes come in: no LOOKUP is answered absent (and no CREATE) until
        absent_until says so again; the attributes the queue threads hold go, and so do the
        names of every directory `keeps(nodeid)` does not keep (the trio thread gives them again as
        it answers)."""
        if self.handle is None:
            return
        lib.ck_fring_absent_until(self.handle, 0.0)
        lib.ck_fring_attr_clear(self.handle)
        held = ffi.new("uint64_t[]", NAME_DIRS)
        for i in range(lib.ck_fring_names_held(self.handle, held, NAME_DIRS)):
            if not keeps(held[i]):
                lib.ck_fring_names_drop(self.handle, held[i])

    def flush_fails(self, failing: bool) -> None:
        """The flusher has an error to report at close (FLUSH then goes to the trio thread) or
        not."""
        lib.ck_fring_flush_fails(self.handle, 1 if failing else 0)

    def error(self) -> int:
        return lib.ck_fring_error(self.handle) if self.handle is not None else 0

    def stop(self) -> None:
        """Stop the queue threads and free the entries (after the last request is served)."""
        if self.handle is None:
            return
        self.headers = self.payloads = []
        self.zone = None
        stuck = lib.ck_fring_stop(self.handle)
        self.handle = None
        if stuck:  # (the eventfd stays open: a thread that still runs may write it)
            raise RingError(errno.EBUSY, f"{stuck} FUSE queue threads did not stop")
        os.close(self.wake_fd)
