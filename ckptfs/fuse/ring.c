/* FUSE over io_uring: the queue threads of the daemon's request transport (fuse/ring.py).
 * (Where FUSE over io_uring is not used, the same threads read /dev/fuse: "/dev/fuse" below;
 * everything but how a request arrives and how its answer leaves is shared.)
 *
 * Compiled into ckptfs.io._uring_cffi (io/_uring_build.py): the one C module that links
 * liburing. With FUSE_OVER_IO_URING negotiated in INIT, the kernel keeps one request queue
 * per CPU and puts a request on the queue of the CPU its caller runs on. Here one thread per
 * queue, pinned to that CPU, holds the queue's ring entries (REGISTER, then
 * COMMIT_AND_FETCH: the answer of one request and the wait for the next in one command).
 * These threads decide nothing: each request that arrives is handed to the Python side (a
 * FIFO it polls while requests flow, with an eventfd to wake it when it sleeps), which serves
 * it with the same handlers as a request read from /dev/fuse and writes the answer into the
 * entry's buffers; the queue thread commits it.
 *
 * One thing is done here: a WRITE's payload is copied into staging, on the caller's CPU while
 * its bytes are still in that CPU's cache, where the Python side said the next bytes go (the
 * landing zone: the staging's tails, as a /dev/fuse request is read into them in place). The
 * copy and the note of where it went (the landed list) are made under one lock, so the
 * Python side records landed writes in the order they took the zone. It takes the zone back
 * (revoke) before it changes staging itself, and records what landed first. A WRITE that
 * landed whole, on a handle the Python side said takes writes, is answered here at once:
 * its record carries what the Python side needs of it (the entry goes back to the kernel),
 * and the Python side records it before it serves any request or changes staging, as it
 * records a WRITE read into staging from /dev/fuse before its answer. Such a WRITE does not
 * wake the Python side: its record waits for the next request served there (or the Python
 * side's idle tick), unless the zone's first part (the open segment's rest, or a whole free
 * buffer) is full, a segment to seal and flush, or the landed list is half full (landed_due);
 * so a large file's WRITEs cost the Python side about one turn per segment, not one each. The
 * landed bytes' CRC32C is taken in C before the Python side takes their records
 * (ck_fring_sum_landed, fuse/crc32c.c), on its thread, not on the writer's CPU where the
 * queue thread that landed them runs. (On /dev/fuse a queue
 * thread reads a WRITE straight into the zone when no other thread holds it, so that the
 * kernel's copy is the only one: fr_dev_read.) Two more requests are
 * answered here, as the fast path would: IOCTL (ENOTTY: ckptfs files have none; Python's
 * open() asks isatty() of every file) and FLUSH while the flusher has no error to report
 * (ckptfs's close() does not wait for durability; with an error, FLUSH goes to the Python side,
 * which reports it to handles that wrote). And GETATTR of a directory whose answer the Python
 * side left here (the attribute cache: it leaves a directory's after a CREATE in it and after
 * it answered a GETATTR of it, and clears them all whenever a directory changes): the kernel
 * asks for the directory's attributes before every name created in it (its permission check,
 * the attributes being invalid since the last CREATE), so a small file's save waits for the
 * Python side once less. And LOOKUP of a name that is not there, in a directory whose names
 * the Python side left here (a Bloom filter of them: a name it does not hold is absent; one
 * it holds goes to the Python side), while the Python side says no look at other writers is
 * due (`--refresh`'s contract): a new file's open(O_CREAT) asks for its name first.
 * And, in such a directory whose attributes it holds too, CREATE of such a name: the new
 * file's inode and handle numbers come from ranges the Python side reserved, its attributes
 * from the request and the directory's; the directory's cached attributes and names take the
 * change at once, the handle takes writes, and the create is noted for the Python side, which
 * makes it in the tree (its INODE record, its handle) before it serves any request, as it
 * does a RELEASE's work. So a small file's save (GETATTR of the directory, LOOKUP, CREATE,
 * WRITEs, FLUSH, RELEASE) need not wait for the Python side at all. And READ of a handle that
 * reads its file alone, from the read cache's buffers the Python side left with it (the
 * handle's read window: checked bytes of pinned chunks; fr_read), noted for the Python side,
 * which accounts for it (readahead, the cache's use) as for a READ it served; a restore's
 * READs then need not wait for it either. And OPEN, read-only, of a file the Python side
 * prepared a window for when it answered the file's LOOKUP (its first bytes were in the read
 * cache; fr_open): answered with the handle number and open flags it left with the window,
 * which is that handle's from then on, and noted for the Python side, which makes the handle
 * before it serves any request. And LOOKUP of a name whose answer the Python side prepared
 * (fr_lookup: after it answered a LOOKUP of a file, for the names that follow in the
 * directory's creation order, the order a checkpoint's files are usually loaded in), used
 * once and noted, so that the Python side counts the kernel's lookup before it serves any
 * request (a FORGET among them); every change of a directory or of a file's attributes
 * takes them all back first. So a restore's small file need not wait for the Python side.
 * Nor does it wake it for every file: of these notes, a LOOKUP's wakes the Python side once
 * its directory has LOOKUPS_LEFT prepared answers or fewer left (it prepares the next names
 * then), and a RELEASE of a handle that can write, and a READ past
 * the middle of a window that ends before the file does (the next window is opened then);
 * the others (an OPEN, a read-only RELEASE, the READs of a window to the file's end) wait
 * for the next wake, request or idle tick, unless their list is half full: every request
 * served there takes them all first.
 *
 * Why: a FUSE round trip on a VM is dominated by wake-ups between vCPUs (docs/benchmarks.md,
 * "What the FUSE transport costs"). The caller's CPU halts while it waits, and the answer
 * from a daemon on the other CPU has to wake it through the hypervisor. Here the answer is
 * committed from the caller's own CPU, by a thread that polls for it while the caller waits
 * (so that CPU never halts), and the caller's wake-up is local.
 *
 * Bounds: a queue thread polls only while one of its requests is with the Python side and
 * only for `spin_s` (then it sleeps until the Python side wakes it); requests the caller does
 * not wait for (RELEASE, page-cache writeback) are not polled for; the poll yields the CPU
 * (sched_yield) so that a caller or the Python side that wants this CPU gets it. Memory:
 * `depth` entries per queue, each a 4 KiB header and a payload buffer of `payload` bytes.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE  /* CPU_SET, pthread_setaffinity_np, pthread_timedjoin_np */
#endif
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <liburing.h>

/* linux/fuse.h (7.42+); Debian's headers predate it */
#define FR_REGISTER 1
#define FR_COMMIT_AND_FETCH 2
#define FR_OP_LOOKUP 1
#define FR_OP_FORGET 2
#define FR_OP_GETATTR 3
#define FR_OP_OPEN 14
#define FR_OP_READ 15
#define FR_OP_RELEASE 18
#define FR_OP_FLUSH 25
#define FR_OP_IOCTL 39
#define FR_OP_WRITE 16
#define FR_OP_RELEASEDIR 29
#define FR_OP_CREATE 35
#define FR_OP_INTERRUPT 36
#define FR_OP_BATCH_FORGET 42
#define FR_O_ACCMODE 3
#define FR_O_RDONLY 0
#define FR_O_TRUNC 01000
#define FR_O_WRONLY 1
#define FR_S_IFREG 0100000
#define FR_S_ISGID 02000
#define FR_S_ISUID 04000
#define FR_FOPEN_DIRECT_IO 1u
#define FR_FOPEN_KEEP_CACHE 2u
#define FR_FOPEN_NOFLUSH 32u
#define CREATE_IN_SIZE 16  /* struct fuse_create_in */
#define ENTRY_OUT_SIZE 128  /* struct fuse_entry_out */
#define OPEN_OUT_SIZE 16  /* struct fuse_open_out */
#define CREATED_MAX 1024  /* files created here whose create the Python side has not made */
#define FR_WRITE_CACHE 1u
#define FH_SLOTS 4096  /* the writable-handle set: open addressing, at most half full */
#define FH_EMPTY 0
#define FH_GONE UINT64_MAX
#define LANDED_MAX 4096  /* landed writes not yet recorded by the Python side */
#define RELEASED_MAX 4096  /* handles released here whose release the Python side has not run */
#define ATTR_SLOTS 256  /* the directory attribute cache: open addressing, short probes */
#define ATTR_PROBE 8
#define ATTR_OUT_SIZE 104  /* struct fuse_attr_out */
#define NAME_DIRS 32  /* directories with a name filter: open addressing, short probes */
#define NAME_PROBE 4
#define NAME_MAX_LEN 255
#define NAME_HASHES 4  /* bits set per name */
#define WINDOWS 64  /* handles with a read window */
#define WINDOW_PARTS 4  /* buffers per window */
#define READS_MAX 4096  /* READs answered here not yet accounted for by the Python side */
#define OPENED_MAX WINDOWS  /* opens answered here not yet made by the Python side */
#define LOOKUPS 64  /* LOOKUP answers the Python side prepared (fastpath.LOOKUPS_MAX: 48) */
#define LOOKED_MAX 1024  /* LOOKUPs answered here not yet counted by the Python side */
#define LOOKUPS_LEFT 2  /* a directory with at most this many prepared answers left wakes the
                         * Python side (it prepares fastpath.LOOKUPS_AHEAD: 4) */
#define NAME_BITS_PER 16  /* per name at the most (one "maybe there" in ~400 absent names) */
#define NAME_BITS_MIN (1u << 12)
#define NAME_BITS_MAX (1u << 22)  /* 512 KiB: a directory of more than 128 Ki names has none
                                   * (a filter is made with room for twice its names) */

struct fr_in_header { uint32_t len, opcode; uint64_t unique, nodeid; uint32_t uid, gid, pid;
                      uint16_t total_extlen, padding; };
struct fr_ent_in_out { uint64_t flags, commit_id; uint32_t payload_sz, padding;
                       uint64_t reserved; };
struct fr_header { char in_out[128]; char op_in[128]; struct fr_ent_in_out ent; };
struct fr_cmd { uint64_t flags, commit_id; uint16_t qid; uint8_t padding[6]; };

enum { AT_KERNEL = 0, AT_PYTHON = 1, ANSWERED = 2 };
#define WAKE_TAG UINT64_MAX

struct fr_queue;

/* A directory's answer to GETATTR as the Python side gave it (valid while gen is current). */
struct fr_attr {
    uint64_t nodeid, gen;
    char out[ATTR_OUT_SIZE];
};

/* The names of a directory as the Python side gave them, and those added since: a Bloom
 * filter (bits NULL: a free slot; dropped when it holds more than cap names). */
struct fr_names {
    uint64_t nodeid;
    uint64_t *bits;
    uint32_t mask;  /* bits - 1 */
    uint32_t count, cap;
};

/* A file created here, as the Python side makes it in the tree (ops.create_open). */
struct ck_fring_created {
    uint64_t parent, ino, fh;
    int64_t now_ns;  /* CLOCK_REALTIME: the file's times and its directory's */
    uint32_t mode, uid, gid, flags, pid, namelen;  /* mode: umask applied; gid: the caller's */
    char name[256];
};

/* A landed WRITE, as the Python side records it (copied: an entry answered here goes back to
 * the kernel at once). */
struct ck_fring_landed {
    int id, answered;
    uint32_t k1, k2, size, flags, pid, pad;
    uint64_t fh, off;
    uint32_t crc1, crc2;  /* the CRC32C of the k1, k2 bytes where summed (ck_fring_sum_landed) */
    int summed, pad2;
};

/* A read window: bytes [start, end) of the file open as handle fh - 1 (0: a free window), in
 * the Python side's buffers (parts, in file order, end to end), which it keeps unchanged while
 * the window stands; eof: the file ends at `end`. busy: READs answered from it right now
 * (raised under the lock; a window is not reused, nor its buffers given back, before 0).
 * A prepared window (nodeid not 0) waits for the file's next read-only OPEN, which is
 * answered here with handle fh - 1 and open_flags (fr_open); it is the handle's window then. */
struct fr_window {
    uint64_t fh, start, end;
    uint64_t nodeid;
    uint32_t open_flags;
    int eof, nparts;
    int woke;  /* a READ past its middle woke the Python side (once per window) */
    _Atomic int busy;
    char *part[WINDOW_PARTS];
    uint32_t len[WINDOW_PARTS];
};

/* A LOOKUP answer the Python side prepared (parent 0: a free slot): name in directory parent
 * is inode nodeid, `out` its fuse_entry_out; used once. */
struct fr_lookup {
    uint64_t parent, nodeid;
    uint32_t namelen;
    char name[NAME_MAX_LEN + 1];
    char out[ENTRY_OUT_SIZE];
};

/* An OPEN answered here from a prepared window, as the Python side makes the handle. */
struct ck_fring_opened {
    uint64_t fh, nodeid;
    uint32_t flags, uid, gid, pid;
};

/* A READ answered here, as the Python side accounts for it (readahead, the read cache's use). */
struct ck_fring_read {
    uint64_t fh, off;
    uint32_t size, n;  /* asked for, answered */
};

struct fr_slot {
    struct fr_header *hdr;
    char *payload;
    struct iovec iov[2];
    struct fr_queue *q;
    _Atomic int state;
    int waited;  /* its caller waits for the answer */
    uint32_t landed[2];  /* a WRITE's bytes copied into the zone's two parts */
    const char *land_at[2];  /* where they went */
    /* /dev/fuse: a READ's answer straight from a window's buffers (held busy until sent) */
    struct fr_window *win;
    struct iovec body[WINDOW_PARTS];
    int nbody;
    int wake;  /* wake the Python side once the answer is sent */
};

/* Where a landed WRITE's bytes went in the zone's two parts (beside its landed record). */
struct fr_land_at {
    const char *at[2];
};

struct fr_queue {
    struct ck_fring *f;
    int qid;
    int cpu;  /* the CPU it is pinned to (its queue's, with FUSE over io_uring) */
    pthread_t thread;
    int started, pinned;
    struct io_uring ring;
    int ring_ok;
    int efd;  /* the Python side wakes a sleeping queue thread here */
    uint64_t efd_buf;
    _Atomic int sleeping;
    _Atomic int answered;  /* answers not committed yet */
    int with_python, waited_with_python;
    int first_slot;
    _Atomic long served;
    _Atomic long answered_here;
    _Atomic long attrs_here;  /* (of those: GETATTR of a directory from the cache) */
    _Atomic long absent_here;  /* (and LOOKUP of an absent name) */
    _Atomic long creates_here;  /* (and CREATE) */
    _Atomic long read_in_place;  /* /dev/fuse: WRITEs read straight into the zone */
    _Atomic long reads_here;  /* READs answered from a read window */
    _Atomic long opens_here;  /* OPENs answered from a prepared window */
    _Atomic long lookups_here;  /* LOOKUPs answered from a prepared answer */
    _Atomic int lost;  /* entries whose command the kernel refused */
};

struct ck_fring {
    int fuse_fd, nqueues, depth;
    int dev;  /* the requests are read from /dev/fuse (not FUSE over io_uring) */
    uint32_t payload;
    double spin_s;
    struct fr_slot *slots;
    struct fr_queue *queues;
    /* the FIFO of slots handed to the Python side */
    pthread_mutex_t lock;
    int *fifo;
    unsigned head, tail;  /* below nqueues * depth + 1: full is not empty (under lock) */
    _Atomic int pending;
    int wake_fd;  /* the Python side's eventfd */
    /* the landing zone and the landed list (under lock) */
    char *zone[2];
    uint32_t room[2];
    int zone_on;
    _Atomic int zone_ready;  /* zone_on, read without the lock (/dev/fuse: read in place) */
    struct ck_fring_landed *landed;
    unsigned lhead, ltail;
    _Atomic int landed_count;  /* records not taken yet */
    _Atomic int landed_due;  /* the Python side is to take them now (fr_hand_over) */
    struct fr_land_at *land_at;  /* (as landed, under lock) */
    int sum_landed;  /* landed bytes are checksummed in C (ck_fring_sum_landed): ck_crc32c_hw() */
    unsigned lsum;  /* the landed records before it are summed, or taken (under lock) */
    uint64_t *released;  /* handles of RELEASEs answered here (under lock) */
    unsigned rhead, rtail;
    _Atomic int released_count;  /* not taken yet */
    int defer_here;  /* RELEASE and CREATE are answered here (under lock; off once the mount
                      * stops) */
    struct ck_fring_created *created;  /* (under lock) */
    unsigned chead, ctail;
    _Atomic int created_count;  /* not taken yet */
    uint64_t ino_next, ino_end, fh_next, fh_end;  /* numbers reserved for creates (under lock) */
    int create_here;  /* CREATE is answered here at all (ck_fring_create_setup) */
    int direct_writes;  /* a write-only handle gets FOPEN_DIRECT_IO (ops._file_info) */
    uint64_t file_bytes_max;  /* a WRITE ending past it is the Python side's to refuse (EFBIG) */
    uint64_t entry_valid;  /* the entry timeout a new file gets (s, ns) */
    uint32_t entry_valid_ns;
    uint64_t fhs[FH_SLOTS];  /* handles that take writes (fh + 1; under lock) */
    int nfhs;
    struct fr_attr attrs[ATTR_SLOTS];  /* (under lock) */
    uint64_t attr_gen;  /* 0: never valid; a clear moves it on (under lock) */
    struct fr_names names[NAME_DIRS];  /* (under lock) */
    struct fr_window windows[WINDOWS];  /* (under lock, but busy) */
    _Atomic int nwindows;  /* windows standing (read without the lock: none, no lock) */
    struct ck_fring_read *reads;  /* (under lock) */
    unsigned dhead, dtail;
    _Atomic int reads_count;  /* not taken yet */
    _Atomic int reads_due;  /* the Python side is to take them now (ck_fring_pending) */
    struct ck_fring_opened *opened;  /* (under lock) */
    struct fr_lookup lookups[LOOKUPS];  /* (under lock) */
    _Atomic int nlookups;  /* prepared answers standing (read without the lock: none, no lock) */
    uint64_t *looked;  /* nodeids of LOOKUPs answered here (under lock) */
    unsigned lkhead, lktail;
    _Atomic int looked_count;  /* not taken yet */
    unsigned ohead, otail;
    _Atomic int opened_count;  /* not taken yet */
    double absent_until;  /* LOOKUP is answered absent only before then (under lock) */
    _Atomic int py_sleeping;
    _Atomic int stop;
    _Atomic int error;  /* the first error a queue thread stopped on (errno) */
    _Atomic int gone;  /* /dev/fuse: the connection ended (unmounted or aborted) */
    _Atomic int go;  /* /dev/fuse: the threads may read it (ck_fring_go) */
    _Atomic int flush_fails;  /* the flusher has an error: FLUSH goes to the Python side */
    _Atomic int registered;  /* queues whose entries are registered */
    _Atomic int failed;      /* queues that could not register */
};

static int fr_fh_set(struct ck_fring *f, uint64_t fh, int on);
static int fr_fh_writable(struct ck_fring *f, uint64_t fh);
static void fr_wake_python(struct ck_fring *f);

/* Note an error (errno; the first one stays: ck_fring_error). */
static void fr_note_error(struct ck_fring *f, int err)
{
    int zero = 0;
    atomic_compare_exchange_strong(&f->error, &zero, err);
}

/* Take up to max records, in order, of one of the lists the queue threads fill for the
 * Python side (cap records of `size` bytes at `list`; head and tail count up, the count of
 * records not taken is lowered here, under the lock, as it is raised). (under lock) */
static int fr_take_list(void *out, const void *list, size_t size, unsigned cap,
                        unsigned *head, unsigned tail, _Atomic int *count, int max)
{
    int n = 0;
    for (; n < max && *head != tail; n++, (*head)++)
        memcpy((char *)out + (size_t)n * size, (const char *)list + (*head % cap) * size, size);
    atomic_fetch_sub(count, n);
    return n;
}

static double fr_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static struct io_uring_sqe *fr_sqe(struct io_uring *ring)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
    if (!sqe) {  /* (full: what is queued goes first) */
        io_uring_submit(ring);
        sqe = io_uring_get_sqe(ring);
    }
    return sqe;
}

static int fr_queue_cmd(struct fr_queue *q, int idx, uint32_t cmd, uint64_t commit_id)
{
    struct fr_slot *s = &q->f->slots[idx];
    struct io_uring_sqe *sqe = fr_sqe(&q->ring);
    if (!sqe)
        return -EBUSY;
    /* SQE128: the entry is two struct io_uring_sqe, the command area the second half */
    memset(sqe, 0, 2 * sizeof *sqe);
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->fd = q->f->fuse_fd;
    sqe->cmd_op = cmd;
    sqe->addr = (uint64_t)(uintptr_t)s->iov;
    sqe->len = 2;
    sqe->user_data = (uint64_t)idx;
    struct fr_cmd *c = (void *)sqe->cmd;
    c->qid = (uint16_t)q->qid;
    c->commit_id = commit_id;
    return 0;
}

static int fr_arm_wake(struct fr_queue *q)
{
    struct io_uring_sqe *sqe = fr_sqe(&q->ring);
    if (!sqe)
        return -EBUSY;
    io_uring_prep_read(sqe, q->efd, &q->efd_buf, sizeof q->efd_buf, 0);
    sqe->user_data = WAKE_TAG;
    return 0;
}

static uint32_t fr_land(struct ck_fring *f, int part, const char *src, uint32_t n)
{
    uint32_t k = n < f->room[part] ? n : f->room[part];
    if (!k)
        return 0;
    memcpy(f->zone[part], src, k);
    f->zone[part] += k;
    f->room[part] -= k;
    return k;
}

static unsigned fr_fh_slot(uint64_t fh) { return (unsigned)((fh * 0x9E3779B97F4A7C15ull) >> 52); }

static unsigned fr_attr_slot(uint64_t nodeid)
{
    return (unsigned)((nodeid * 0x9E3779B97F4A7C15ull) >> 56);  /* ATTR_SLOTS = 2^8 */
}

static struct fr_attr *fr_attr_of(struct ck_fring *f, uint64_t nodeid);

/* Copy the cached GETATTR answer of nodeid into out; 1 if there was one. */
static int fr_attr_get(struct ck_fring *f, uint64_t nodeid, char *out)
{
    pthread_mutex_lock(&f->lock);
    struct fr_attr *a = fr_attr_of(f, nodeid);
    if (a)
        memcpy(out, a->out, ATTR_OUT_SIZE);
    pthread_mutex_unlock(&f->lock);
    return a != NULL;
}

static unsigned fr_names_slot(uint64_t nodeid)
{
    return (unsigned)((nodeid * 0x9E3779B97F4A7C15ull) >> 59);  /* NAME_DIRS = 2^5 */
}

/* A name's hash (64-bit FNV-1a, then a finaliser that spreads its bits over both halves). */
static uint64_t fr_name_hash(const char *name, uint32_t len)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (uint32_t i = 0; i < len; i++)
        h = (h ^ (unsigned char)name[i]) * 0x100000001b3ull;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

/* The filter of directory nodeid, or NULL. (under lock) */
static struct fr_names *fr_names_of(struct ck_fring *f, uint64_t nodeid)
{
    for (unsigned i = fr_names_slot(nodeid), n = 0; n < NAME_PROBE;
         i = (i + 1) % NAME_DIRS, n++) {
        struct fr_names *d = &f->names[i];
        if (d->bits && d->nodeid == nodeid)
            return d;
    }
    return NULL;
}

/* Set (add) or test the name's bits; returns whether all were set before. */
static int fr_names_bits(struct fr_names *d, const char *name, uint32_t len, int add)
{
    uint64_t h = fr_name_hash(name, len);
    uint32_t h1 = (uint32_t)h, h2 = (uint32_t)(h >> 32) | 1;
    int all = 1;
    for (uint32_t i = 0; i < NAME_HASHES; i++) {
        uint32_t b = (h1 + i * h2) & d->mask;
        uint64_t bit = 1ull << (b & 63);
        if (!(d->bits[b >> 6] & bit)) {
            all = 0;
            if (!add)
                break;
            d->bits[b >> 6] |= bit;
        }
    }
    return all;
}

/* Whether LOOKUP of name in directory nodeid is answered absent here: the directory has a
 * filter, the name is not in it, and no look at other writers is due. */
static int fr_absent(struct ck_fring *f, uint64_t nodeid, const char *name, uint32_t len)
{
    double now = fr_now();
    int absent = 0;
    pthread_mutex_lock(&f->lock);
    struct fr_names *d = now < f->absent_until ? fr_names_of(f, nodeid) : NULL;
    if (d)
        absent = !fr_names_bits(d, name, len, 0);
    pthread_mutex_unlock(&f->lock);
    return absent;
}

/* The cached GETATTR answer of directory nodeid, or NULL. (under lock) */
static struct fr_attr *fr_attr_of(struct ck_fring *f, uint64_t nodeid)
{
    for (unsigned i = fr_attr_slot(nodeid), n = 0; n < ATTR_PROBE;
         i = (i + 1) % ATTR_SLOTS, n++) {
        struct fr_attr *a = &f->attrs[i];
        if (a->gen == f->attr_gen && a->nodeid == nodeid)
            return a;
    }
    return NULL;
}

static void fr_put32(char *p, size_t at, uint32_t v) { memcpy(p + at, &v, 4); }
static void fr_put64(char *p, size_t at, uint64_t v) { memcpy(p + at, &v, 8); }
static uint32_t fr_get32(const char *p, size_t at) { uint32_t v; memcpy(&v, p + at, 4); return v; }

/* CREATE of name (len bytes) in directory nodeid, answered here when the directory's names
 * and attributes are here, the name is not among them, no look at other writers is due, and
 * numbers are left: `out` gets the answer (fuse_entry_out, fuse_open_out). Returns 1 then. */
static int fr_create(struct ck_fring *f, const struct fr_slot *s, const char *name,
                     uint32_t len, char *out)
{
    const struct fr_in_header *h = (const void *)s->hdr->in_out;
    uint32_t cin[4];  /* flags mode umask open_flags */
    memcpy(cin, s->hdr->op_in, sizeof cin);
    double now = fr_now();
    struct timespec rt;
    clock_gettime(CLOCK_REALTIME, &rt);
    uint64_t *drop = NULL;
    int done = 0;
    pthread_mutex_lock(&f->lock);
    struct fr_names *d;
    struct fr_attr *a;
    if (f->create_here && f->defer_here && now < f->absent_until && f->ino_next < f->ino_end
            && f->fh_next < f->fh_end && f->ctail - f->chead < CREATED_MAX
            && (d = fr_names_of(f, h->nodeid)) && (a = fr_attr_of(f, h->nodeid))
            && !fr_names_bits(d, name, len, 0)) {
        /* fuse_attr_out: valid (s, ns) at 0 and 8, then fuse_attr at 16 (ino size blocks,
         * atime mtime ctime s, their ns, mode nlink uid gid rdev blksize flags) */
        uint32_t dmode = fr_get32(a->out, 76), dgid = fr_get32(a->out, 88);
        uint32_t mode = FR_S_IFREG | (cin[1] & ~cin[2] & 07777);
        uint32_t gid = dmode & FR_S_ISGID ? dgid : h->gid;  /* (as ops._new) */
        uint32_t acc = cin[0] & FR_O_ACCMODE;
        uint64_t ino = f->ino_next++, fh = f->fh_next++;
        fr_names_bits(d, name, len, 1);
        if (++d->count > d->cap) {
            drop = d->bits;
            d->bits = NULL;
        }
        fr_put64(a->out, 48, (uint64_t)rt.tv_sec);  /* the directory's mtime and ctime */
        fr_put64(a->out, 56, (uint64_t)rt.tv_sec);
        fr_put32(a->out, 68, (uint32_t)rt.tv_nsec);
        fr_put32(a->out, 72, (uint32_t)rt.tv_nsec);
        struct ck_fring_created *c = &f->created[f->ctail++ % CREATED_MAX];
        c->parent = h->nodeid;
        c->ino = ino;
        c->fh = fh;
        c->now_ns = (int64_t)rt.tv_sec * 1000000000 + rt.tv_nsec;
        c->mode = mode;
        c->uid = h->uid;
        c->gid = h->gid;
        c->flags = cin[0];
        c->pid = h->pid;
        c->namelen = len;
        memcpy(c->name, name, len);
        c->name[len] = 0;
        atomic_fetch_add(&f->created_count, 1);
        /* (not a set-user/group-ID file: a WRITE there may have to clear them first, on
         * the Python side; full: its WRITEs go there too) */
        if (acc != FR_O_RDONLY && !(mode & (FR_S_ISGID | FR_S_ISUID)))
            fr_fh_set(f, fh, 1);
        memset(out, 0, ENTRY_OUT_SIZE + OPEN_OUT_SIZE);
        fr_put64(out, 0, ino);  /* nodeid, generation 0 */
        fr_put64(out, 16, f->entry_valid);
        memcpy(out + 24, a->out, 8);  /* attr_valid, as the directory's */
        fr_put32(out, 32, f->entry_valid_ns);
        memcpy(out + 36, a->out + 8, 4);
        char *at = out + 40;  /* fuse_attr */
        fr_put64(at, 0, ino);
        for (int i = 0; i < 3; i++) {
            fr_put64(at, 24 + 8 * i, (uint64_t)rt.tv_sec);
            fr_put32(at, 48 + 4 * i, (uint32_t)rt.tv_nsec);
        }
        fr_put32(at, 60, mode);
        fr_put32(at, 64, 1);  /* nlink */
        fr_put32(at, 68, h->uid);
        fr_put32(at, 72, gid);
        memcpy(at + 80, a->out + 16 + 80, 4);  /* blksize, as the directory's */
        uint32_t oflags = f->direct_writes && acc == FR_O_WRONLY ? FR_FOPEN_DIRECT_IO
                                                                : FR_FOPEN_KEEP_CACHE;
        if (acc == FR_O_RDONLY)
            oflags |= FR_FOPEN_NOFLUSH;
        fr_put64(out, ENTRY_OUT_SIZE, fh);
        fr_put32(out, ENTRY_OUT_SIZE + 8, oflags);
        done = 1;
    }
    pthread_mutex_unlock(&f->lock);
    free(drop);
    if (done)
        fr_wake_python(f);
    return done;
}

/* The name a LOOKUP or CREATE asks for (in its payload, NUL-terminated, after an op part of
 * opsize bytes in the header), if it is one a filter can answer: not ".", "..", empty, longer
 * than NAME_MAX, or with a NUL inside; its length, else 0. */
static uint32_t fr_request_name(const struct fr_slot *s, uint32_t opsize)
{
    const struct fr_in_header *h = (const void *)s->hdr->in_out;
    uint32_t psz = s->hdr->ent.payload_sz;
    if (h->total_extlen || psz < 2 || psz > NAME_MAX_LEN + 1 || h->len != 40 + opsize + psz
            || s->payload[psz - 1] != '\0' || memchr(s->payload, 0, psz - 1))
        return 0;
    if (s->payload[0] == '.' && (psz == 2 || (psz == 3 && s->payload[1] == '.')))
        return 0;
    return psz - 1;
}

/* Handle fh in the writable set (on) or out of it; -ENOSPC when the set is full. (under
 * lock) */
static int fr_fh_set(struct ck_fring *f, uint64_t fh, int on)
{
    unsigned i = fr_fh_slot(fh), gone = FH_SLOTS;
    for (unsigned n = 0; n < FH_SLOTS; i = (i + 1) % FH_SLOTS, n++) {
        if (f->fhs[i] == fh + 1) {
            if (!on) {
                /* (a tombstone only where a probe may have to pass it) */
                f->fhs[i] = f->fhs[(i + 1) % FH_SLOTS] == FH_EMPTY ? FH_EMPTY : FH_GONE;
                f->nfhs--;
            }
            return 0;
        }
        if (f->fhs[i] == FH_GONE && gone == FH_SLOTS)
            gone = i;
        if (f->fhs[i] == FH_EMPTY)
            break;
    }
    if (on) {
        if (f->nfhs >= FH_SLOTS / 2)
            return -ENOSPC;
        f->fhs[gone != FH_SLOTS ? gone : i] = fh + 1;
        f->nfhs++;
    }
    return 0;
}

static void fr_wake_python(struct ck_fring *f)
{
    if (atomic_exchange(&f->py_sleeping, 0)) {
        uint64_t one = 1;
        if (write(f->wake_fd, &one, sizeof one) < 0) {}
    }
}

/* A RELEASE answered here: its handle leaves the writable set and is noted for the Python
 * side, which runs the release's work (the file's times into the journal) when it suits it.
 * 0 when the list is full (the request is then handed over). */
static int fr_note_release(struct ck_fring *f, uint64_t fh)
{
    int ok = 0, wake = 0;
    pthread_mutex_lock(&f->lock);
    if (f->defer_here && f->rtail - f->rhead < RELEASED_MAX) {
        f->released[f->rtail++ % RELEASED_MAX] = fh;
        wake = fr_fh_writable(f, fh) || f->rtail - f->rhead >= RELEASED_MAX / 2;
        fr_fh_set(f, fh, 0);
        atomic_fetch_add(&f->released_count, 1);  /* (under the lock: never below the list) */
        ok = 1;
    }
    pthread_mutex_unlock(&f->lock);
    if (wake)
        fr_wake_python(f);
    return ok;
}

/* (under lock) */
static int fr_fh_writable(struct ck_fring *f, uint64_t fh)
{
    for (unsigned i = fr_fh_slot(fh), n = 0; n < FH_SLOTS; i = (i + 1) % FH_SLOTS, n++) {
        if (f->fhs[i] == fh + 1)
            return 1;
        if (f->fhs[i] == FH_EMPTY)
            return 0;
    }
    return 0;
}

/* Hand entry idx over; a WRITE (write_size > 0) lands in the zone first, unless it was read
 * there (in_zone: the lock held since, s->landed says how far, fr_dev_read). Returns 1
 * when the WRITE was answered here (the entry is not handed over). */
static int fr_hand_over(struct ck_fring *f, int idx, uint32_t write_size, int in_zone)
{
    struct fr_slot *s = &f->slots[idx];
    unsigned cells = (unsigned)(f->nqueues * f->depth) + 1;
    int answered = 0;
    if (!in_zone) {
        s->landed[0] = s->landed[1] = 0;
        pthread_mutex_lock(&f->lock);
        if (write_size && f->zone_on && f->ltail - f->lhead < LANDED_MAX) {
            /* (the second part only once the first is full: staging opens it then) */
            s->land_at[0] = f->zone[0];
            s->land_at[1] = f->zone[1];
            s->landed[0] = fr_land(f, 0, s->payload, write_size);
            if (s->landed[0] < write_size && !f->room[0])
                s->landed[1] = fr_land(f, 1, s->payload + s->landed[0],
                                       write_size - s->landed[0]);
        }
    }
    if (s->landed[0] || s->landed[1]) {
        const struct fr_in_header *h = (const void *)s->hdr->in_out;
        const uint64_t *w = (const void *)s->hdr->op_in;  /* fh, offset */
        const uint32_t *w32 = (const void *)(s->hdr->op_in + 16);  /* size, write_flags */
        struct fr_land_at *a = &f->land_at[f->ltail % LANDED_MAX];
        a->at[0] = s->land_at[0];
        a->at[1] = s->land_at[1];
        struct ck_fring_landed *r = &f->landed[f->ltail++ % LANDED_MAX];
        r->id = idx;
        r->summed = 0;
        r->k1 = s->landed[0];
        r->k2 = s->landed[1];
        r->fh = w[0];
        r->off = w[1];
        r->size = w32[0];
        r->flags = w32[1];
        r->pid = h->pid;
        answered = r->k1 + r->k2 == write_size && r->off <= f->file_bytes_max
            && write_size <= f->file_bytes_max - r->off && fr_fh_writable(f, r->fh);
        r->answered = answered;
        atomic_fetch_add(&f->landed_count, 1);
        /* (a segment to seal and flush, or a list to empty before it fills: else the records
         * wait for the next request the Python side serves, which takes them first) */
        if (!f->room[0] || f->ltail - f->lhead >= LANDED_MAX / 2)
            atomic_store(&f->landed_due, 1);
    }
    if (!answered) {
        f->fifo[f->tail] = idx;
        f->tail = (f->tail + 1) % cells;
    }
    if (!in_zone)
        pthread_mutex_unlock(&f->lock);
    if (!answered)
        atomic_fetch_add(&f->pending, 1);
    if (!in_zone && (!answered || atomic_load(&f->landed_due)))
        fr_wake_python(f);  /* (in_zone: the caller does, once it let go of the lock) */
    return answered;
}

/* An answer written here: `error` (0 or -errno), then `len` bytes of body (from `body`). */
static void fr_answer(struct fr_slot *s, int32_t error, const void *body, uint32_t len)
{
    struct { uint32_t len; int32_t error; uint64_t unique; } oh;
    const struct fr_in_header *h = (const void *)s->hdr->in_out;
    oh.len = sizeof oh + len;
    oh.error = error;
    oh.unique = h->unique;
    memcpy(s->hdr->in_out, &oh, sizeof oh);
    if (len)
        memcpy(s->payload, body, len);
    s->hdr->ent.payload_sz = len;
}

/* Commit the answers the Python side left; returns how many. */
static int fr_commit_answers(struct fr_queue *q)
{
    struct ck_fring *f = q->f;
    if (!atomic_load(&q->answered))
        return 0;
    int n = 0;
    for (int i = q->first_slot; i < q->first_slot + f->depth; i++) {
        struct fr_slot *s = &f->slots[i];
        if (atomic_load_explicit(&s->state, memory_order_acquire) != ANSWERED)
            continue;
        atomic_fetch_sub(&q->answered, 1);
        q->with_python--;
        if (s->waited)
            q->waited_with_python--;
        atomic_store(&s->state, AT_KERNEL);
        if (f->dev)  /* (written on /dev/fuse by the Python side: the slot is free again) */
            n++;
        else if (fr_queue_cmd(q, i, FR_COMMIT_AND_FETCH, s->hdr->ent.commit_id) == 0)
            n++;
    }
    return n;
}

/* (under lock) The window of handle fh, or NULL. */
static struct fr_window *fr_window_of(struct ck_fring *f, uint64_t fh)
{
    for (int i = 0; i < WINDOWS; i++)
        if (f->windows[i].fh == fh + 1)
            return &f->windows[i];
    return NULL;
}

/* READ from the handle's read window, when the window holds what it asks for (to the file's
 * end, where the window reaches it): the answer's body is the window's buffers, sent from
 * them on /dev/fuse (the window busy until fr_dev_reply), copied into the entry on a ring.
 * The READ is noted for the Python side, which accounts for it as for one it served. 1 if
 * answered here. */
static int fr_read(struct ck_fring *f, struct fr_slot *s)
{
    const uint64_t *r = (const void *)s->hdr->op_in;  /* fh, offset */
    uint32_t size = fr_get32(s->hdr->op_in, 16);
    uint64_t off = r[1], hi = off + size;
    struct fr_window *w = NULL;
    int wake = 0;
    if (hi < off || !atomic_load_explicit(&f->nwindows, memory_order_relaxed))
        return 0;  /* (a range that wraps: the Python side answers it) */
    pthread_mutex_lock(&f->lock);
    if (f->dtail - f->dhead < READS_MAX && (w = fr_window_of(f, r[0])) && !w->nodeid) {
        if (hi > w->end && w->eof)
            hi = w->end > off ? w->end : off;
        if (off < w->start || hi > w->end || (!f->dev && hi - off > f->payload))
            w = NULL;
    } else {
        w = NULL;
    }
    if (w) {
        atomic_fetch_add(&w->busy, 1);
        struct ck_fring_read *d = &f->reads[f->dtail++ % READS_MAX];
        d->fh = r[0];
        d->off = off;
        d->size = size;
        d->n = (uint32_t)(hi - off);
        atomic_fetch_add(&f->reads_count, 1);
        /* (the Python side accounts for them when it serves a request: readahead, and the
         * window opened on; so they are due, and it is woken, once a READ passes the
         * window's middle, or the list fills) */
        uint64_t mid = w->start + (w->end - w->start) / 2;
        if ((hi > mid && !w->woke && !w->eof) || f->dtail - f->dhead >= READS_MAX / 2) {
            w->woke = 1;
            wake = 1;
            atomic_store(&f->reads_due, 1);
        }
    }
    pthread_mutex_unlock(&f->lock);
    if (!w)
        return 0;
    /* (the parts, end to end from w->start: the ones [off, hi) spans) */
    uint64_t at = w->start, pos = off;
    int k = 0;
    for (int i = 0; i < w->nparts && pos < hi; i++) {
        uint64_t end = at + w->len[i];
        if (pos < end) {
            uint64_t m = (hi < end ? hi : end) - pos;
            s->body[k].iov_base = w->part[i] + (pos - at);
            s->body[k++].iov_len = m;
            pos += m;
        }
        at = end;
    }
    uint32_t n = (uint32_t)(hi - off);
    fr_answer(s, 0, NULL, 0);
    if (f->dev) {  /* (sent from the window's buffers; the wake once it is: fr_dev_reply) */
        fr_put32(s->hdr->in_out, 0, 16 + n);
        s->win = w;
        s->nbody = k;
        s->wake = wake;
    } else {
        char *p = s->payload;
        for (int i = 0; i < k; i++) {
            memcpy(p, s->body[i].iov_base, s->body[i].iov_len);
            p += s->body[i].iov_len;
        }
        fr_put32(s->hdr->in_out, 0, 16 + n);
        s->hdr->ent.payload_sz = n;
        atomic_fetch_sub(&w->busy, 1);
        if (wake)  /* (after: the Python side may replace the window at once) */
            fr_wake_python(f);
    }
    return 1;
}

/* The prepared answer of `name` in directory `parent` (under lock), or NULL. */
static struct fr_lookup *fr_lookup_find(struct ck_fring *f, uint64_t parent, const char *name,
                                        uint32_t len)
{
    if (!parent)  /* (a free slot's parent) */
        return NULL;
    for (int i = 0; i < LOOKUPS; i++) {
        struct fr_lookup *c = &f->lookups[i];
        if (c->parent == parent && c->namelen == len && !memcmp(c->name, name, len))
            return c;
    }
    return NULL;
}

/* LOOKUP of a name the Python side prepared the answer of, while the queue threads answer
 * RELEASE and CREATE and no look at other writers is due: answered with it (`out`), the answer
 * used up, the lookup noted for the Python side, which counts it (the kernel's lookup count
 * of the inode) before it serves any request, a FORGET among them. The Python side is woken
 * once the directory has LOOKUPS_LEFT prepared answers or fewer left, to prepare the next
 * names' (every second file of a restore, not every one: a wake-up costs its trio thread
 * ~40-60 us). 1 if answered here. */
static int fr_lookup(struct ck_fring *f, const struct fr_slot *s, const char *name,
                     uint32_t len, char *out)
{
    const struct fr_in_header *h = (const void *)s->hdr->in_out;
    if (!atomic_load_explicit(&f->nlookups, memory_order_relaxed))
        return 0;
    double now = fr_now();
    struct fr_lookup *l = NULL;
    int wake = 0;
    pthread_mutex_lock(&f->lock);
    if (f->defer_here && now < f->absent_until && f->lktail - f->lkhead < LOOKED_MAX)
        l = fr_lookup_find(f, h->nodeid, name, len);
    if (l) {
        memcpy(out, l->out, ENTRY_OUT_SIZE);
        f->looked[f->lktail++ % LOOKED_MAX] = l->nodeid;
        atomic_fetch_add(&f->looked_count, 1);
        l->parent = 0;
        atomic_fetch_sub(&f->nlookups, 1);
        int left = 0;
        for (int i = 0; i < LOOKUPS; i++)
            left += f->lookups[i].parent == h->nodeid;
        wake = left <= LOOKUPS_LEFT || f->lktail - f->lkhead >= LOOKED_MAX / 2;
    }
    pthread_mutex_unlock(&f->lock);
    if (wake)
        fr_wake_python(f);
    return l != NULL;
}

/* OPEN of a file with a prepared window, read-only and without O_TRUNC, while the queue threads
 * answer RELEASE and CREATE and no look at other writers is due: answered with the window's
 * handle and open flags (`out`: fuse_open_out), the window now that handle's, the open noted
 * for the Python side, which makes the handle (ops) before it serves any request, as it makes
 * a file created here. 1 if answered here. */
static int fr_open(struct ck_fring *f, const struct fr_slot *s, char *out)
{
    const struct fr_in_header *h = (const void *)s->hdr->in_out;
    uint32_t flags = fr_get32(s->hdr->op_in, 0);  /* fuse_open_in: flags, open_flags */
    if (!atomic_load_explicit(&f->nwindows, memory_order_relaxed)
            || (flags & FR_O_ACCMODE) != FR_O_RDONLY || (flags & FR_O_TRUNC))
        return 0;
    double now = fr_now();
    struct fr_window *w = NULL;
    pthread_mutex_lock(&f->lock);
    if (f->defer_here && now < f->absent_until && f->otail - f->ohead < OPENED_MAX) {
        for (int i = 0; i < WINDOWS && !w; i++)
            if (f->windows[i].fh && f->windows[i].nodeid == h->nodeid)
                w = &f->windows[i];
    }
    int wake = 0;
    if (w) {
        w->nodeid = 0;  /* (the handle's window from now on) */
        struct ck_fring_opened *o = &f->opened[f->otail++ % OPENED_MAX];
        o->fh = w->fh - 1;
        o->nodeid = h->nodeid;
        o->flags = flags;
        o->uid = h->uid;
        o->gid = h->gid;
        o->pid = h->pid;
        atomic_fetch_add(&f->opened_count, 1);
        memset(out, 0, OPEN_OUT_SIZE);
        fr_put64(out, 0, w->fh - 1);
        fr_put32(out, 8, w->open_flags);
        wake = f->otail - f->ohead >= OPENED_MAX / 2;
    }
    pthread_mutex_unlock(&f->lock);
    if (wake)
        fr_wake_python(f);
    return w != NULL;
}

/* Serve the request in slot idx here (the answer written into the slot: 1) or hand it to the
 * Python side (0). in_zone: a WRITE read into the zone, the lock held (fr_dev_read). */
static int fr_dispatch(struct fr_queue *q, int idx, int in_zone)
{
    struct ck_fring *f = q->f;
    struct fr_slot *s = &f->slots[idx];
    const struct fr_in_header *h = (const void *)s->hdr->in_out;
    const uint32_t *write_size = (const void *)(s->hdr->op_in + 16);
    const uint32_t *write_flags = (const void *)(s->hdr->op_in + 20);
    uint32_t size = h->opcode == FR_OP_WRITE && *write_size == s->hdr->ent.payload_sz
        ? *write_size : 0;
    atomic_fetch_add(&q->served, 1);
    atomic_store_explicit(&s->state, AT_PYTHON, memory_order_release);
    s->waited = !(h->opcode == FR_OP_RELEASE || h->opcode == FR_OP_RELEASEDIR
                  || h->opcode == FR_OP_FORGET || h->opcode == FR_OP_BATCH_FORGET
                  || h->opcode == FR_OP_INTERRUPT
                  || (h->opcode == FR_OP_WRITE && (*write_flags & FR_WRITE_CACHE)));
    int here = 0;
    char attr[ATTR_OUT_SIZE];
    char created[ENTRY_OUT_SIZE + OPEN_OUT_SIZE];
    uint32_t name_len;
    if (h->opcode == FR_OP_GETATTR && fr_attr_get(f, h->nodeid, attr)) {
        fr_answer(s, 0, attr, ATTR_OUT_SIZE);
        atomic_fetch_add(&q->attrs_here, 1);
        here = 1;
    } else if (h->opcode == FR_OP_LOOKUP && (name_len = fr_request_name(s, 0))
               && fr_absent(f, h->nodeid, s->payload, name_len)) {
        fr_answer(s, -ENOENT, NULL, 0);
        atomic_fetch_add(&q->absent_here, 1);
        here = 1;
    } else if (h->opcode == FR_OP_LOOKUP && (name_len = fr_request_name(s, 0))
               && fr_lookup(f, s, s->payload, name_len, created)) {
        fr_answer(s, 0, created, ENTRY_OUT_SIZE);
        atomic_fetch_add(&q->lookups_here, 1);
        here = 1;
    } else if (h->opcode == FR_OP_CREATE
               && (name_len = fr_request_name(s, CREATE_IN_SIZE))
               && fr_create(f, s, s->payload, name_len, created)) {
        fr_answer(s, 0, created, ENTRY_OUT_SIZE + OPEN_OUT_SIZE);
        atomic_fetch_add(&q->creates_here, 1);
        here = 1;
    } else if (h->opcode == FR_OP_RELEASE
               && fr_note_release(f, *(const uint64_t *)s->hdr->op_in)) {
        fr_answer(s, 0, NULL, 0);
        here = 1;
    } else if (h->opcode == FR_OP_READ && fr_read(f, s)) {
        atomic_fetch_add(&q->reads_here, 1);
        here = 1;
    } else if (h->opcode == FR_OP_OPEN && fr_open(f, s, created)) {
        fr_answer(s, 0, created, OPEN_OUT_SIZE);
        atomic_fetch_add(&q->opens_here, 1);
        here = 1;
    } else if (h->opcode == FR_OP_IOCTL) {
        fr_answer(s, -ENOTTY, NULL, 0);
        here = 1;
    } else if (h->opcode == FR_OP_FLUSH && !atomic_load(&f->flush_fails)) {
        fr_answer(s, 0, NULL, 0);
        here = 1;
    } else {
        q->with_python++;
        if (s->waited)
            q->waited_with_python++;
        if (fr_hand_over(f, idx, size, in_zone)) {
            q->with_python--;
            if (s->waited)
                q->waited_with_python--;
            uint32_t out[2] = { size, 0 };  /* fuse_write_out */
            fr_answer(s, 0, out, sizeof out);
            here = 1;
        }
    }
    return here;
}

/* Requests the kernel delivered: to the Python side. Returns how many CQEs were seen, or
 * -errno when the connection is gone. */
static int fr_reap(struct fr_queue *q)
{
    struct ck_fring *f = q->f;
    struct io_uring_cqe *cqe;
    int n = 0;
    while (io_uring_peek_cqe(&q->ring, &cqe) == 0) {
        uint64_t tag = cqe->user_data;
        int res = cqe->res;
        io_uring_cqe_seen(&q->ring, cqe);
        n++;
        if (tag == WAKE_TAG) {
            if (fr_arm_wake(q) < 0)
                return -EBUSY;
            continue;
        }
        if (res == -ENOTCONN || res == -ECANCELED || res == -ENODEV)
            return res;  /* unmounted, or the connection aborted */
        if (res < 0) {
            /* (the kernel refused this entry's command, e.g. an answer it could not take: the
             * caller got an error; the entry is lost to the queue, the others go on) */
            fr_note_error(f, -res);
            atomic_fetch_add(&q->lost, 1);
            continue;
        }
        if (fr_dispatch(q, (int)tag, 0)) {
            struct fr_slot *s = &f->slots[tag];
            atomic_fetch_add(&q->answered_here, 1);
            atomic_store(&s->state, AT_KERNEL);
            if (fr_queue_cmd(q, (int)tag, FR_COMMIT_AND_FETCH, s->hdr->ent.commit_id) < 0)
                return -EBUSY;
        }
    }
    return n;
}

/* Poll for up to spin_s, yielding the CPU, until the Python side answered something or
 * `ready` says a request came: 1 if one of them did. */
static int fr_spin(struct fr_queue *q, int (*ready)(struct fr_queue *, void *), void *arg)
{
    struct ck_fring *f = q->f;
    double end = fr_now() + f->spin_s;
    while (!atomic_load(&f->stop) && fr_now() < end) {
        if (atomic_load(&q->answered) || ready(q, arg))
            return 1;
        sched_yield();
    }
    return 0;
}

/* About to sleep: 0 when an answer or the stop came meanwhile (then it must not). */
static int fr_may_sleep(struct fr_queue *q)
{
    atomic_store(&q->sleeping, 1);
    if (atomic_load(&q->answered) || atomic_load(&q->f->stop)) {
        atomic_store(&q->sleeping, 0);
        return 0;
    }
    return 1;
}

static int fr_cqe_ready(struct fr_queue *q, void *arg)
{
    (void)arg;
    struct io_uring_cqe *cqe;
    return io_uring_peek_cqe(&q->ring, &cqe) == 0;
}

/* (arg: the pollfd of /dev/fuse, fd -1 while no slot is free) */
static int fr_dev_ready(struct fr_queue *q, void *arg)
{
    (void)q;
    struct pollfd *p = arg;
    return p->fd >= 0 && poll(p, 1, 0) > 0;
}

static void fr_pin(struct fr_queue *q)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(q->cpu, &set);
    /* (a CPU this process may not use: served from wherever the scheduler runs the thread) */
    q->pinned = pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0;
}

static void *fr_serve(void *arg)
{
    struct fr_queue *q = arg;
    struct ck_fring *f = q->f;
    int err = 0;
    fr_pin(q);
    for (int i = q->first_slot; i < q->first_slot + f->depth && !err; i++)
        err = fr_queue_cmd(q, i, FR_REGISTER, 0);
    if (!err)
        err = fr_arm_wake(q);
    if (!err) {
        int k = io_uring_submit(&q->ring);
        err = k < 0 ? k : 0;
    }
    if (!err) {
        /* A registration the kernel refuses fails at once; one it takes stays pending. */
        struct __kernel_timespec ts = { 0, 20 * 1000 * 1000 };
        struct io_uring_cqe *cqe;
        if (io_uring_wait_cqe_timeout(&q->ring, &cqe, &ts) == 0 && cqe->user_data != WAKE_TAG
                && cqe->res < 0)
            err = cqe->res;
    }
    if (err) {
        fr_note_error(f, -err);
        atomic_fetch_add(&f->failed, 1);
        return NULL;
    }
    atomic_fetch_add(&f->registered, 1);
    while (!atomic_load(&f->stop)) {
        int work = fr_commit_answers(q);
        int r = fr_reap(q);
        if (r < 0) {
            if (r != -ENOTCONN && r != -ECANCELED && r != -ENODEV) {
                fr_note_error(f, -r);
            }
            break;
        }
        if (work || r)
            continue;
        if (q->waited_with_python > 0 && f->spin_s > 0) {
            /* A caller on this CPU waits for the Python side's answer: poll for it, so that
             * this CPU does not halt and the answer does not pay a wake-up. */
            io_uring_submit(&q->ring);
            if (fr_spin(q, fr_cqe_ready, NULL))
                continue;
        }
        if (!fr_may_sleep(q))
            continue;
        int k = io_uring_submit_and_wait(&q->ring, 1);
        atomic_store(&q->sleeping, 0);
        if (k < 0 && k != -EINTR && k != -EAGAIN && k != -EBUSY) {
            fr_note_error(f, -k);
            break;
        }
    }
    return NULL;
}

/* ------------------------------------------------------------------ /dev/fuse
 * The same queue threads over /dev/fuse, where the kernel does not offer FUSE over io_uring:
 * a thread per CPU, pinned to it, each polling the (non-blocking) descriptor. A request
 * wakes every poller; the one on the caller's CPU, which the caller leaves as it waits, is
 * the first to read it, so the round trip stays on that CPU as on a ring ("What the FUSE
 * transport costs", dev-percpu). Not always: a thread on a CPU that was awake (the Python
 * side's) may take it, and its answer must then wake the caller's CPU; so a thread woken for
 * a request another one took polls for up to spin_s, and that CPU does not halt meanwhile.
 * A request is read into a free slot laid out as a ring
 * entry's (the op's fixed part in op_in, the rest in the payload buffer), served by the same
 * code, and its answer written on /dev/fuse: by the queue thread for what it answers, by the
 * Python side (ck_fring_answer after it wrote) for what it was handed. */

/* A free slot of q, or -1. */
static int fr_dev_free_slot(struct fr_queue *q)
{
    struct ck_fring *f = q->f;
    for (int i = q->first_slot; i < q->first_slot + f->depth; i++)
        if (atomic_load_explicit(&f->slots[i].state, memory_order_acquire) == AT_KERNEL)
            return i;
    return -1;
}

/* Read a request into slot idx: 1, 2 for a WRITE read into the zone (the lock then held:
 * fr_dispatch with in_zone, then unlock), 0 when there was none (another thread took it),
 * -errno when the connection is gone (-ENODEV) or reading fails. */
static int fr_dev_read(struct ck_fring *f, int idx)
{
    struct fr_slot *s = &f->slots[idx];
    /* A WRITE's payload is read straight into the zone when no one else holds it: [header |
     * op | the zone's two parts | the slot's payload buffer (what does not fit)], as the
     * Python side's own loop reads into staging's tails; so the kernel's copy is the only
     * one. (Another thread holding it reads into its slot and lands the payload after: the
     * lock orders the landings; the read does not block, the descriptor being non-blocking.) */
    int zone = atomic_load_explicit(&f->zone_ready, memory_order_relaxed)
        && pthread_mutex_trylock(&f->lock) == 0;
    if (zone && !(f->zone_on && f->ltail - f->lhead < LANDED_MAX)) {
        pthread_mutex_unlock(&f->lock);
        zone = 0;
    }
    uint32_t r0 = zone ? f->room[0] : 0, r1 = zone ? f->room[1] : 0;
    struct iovec iov[5] = { { s->hdr->in_out, 40 }, { s->hdr->op_in, 40 },
                            { f->zone[0], r0 }, { f->zone[1], r1 },
                            { s->payload, f->payload } };
    ssize_t n = zone ? readv(f->fuse_fd, iov, 5)
        : readv(f->fuse_fd, (struct iovec[3]){ iov[0], iov[1], iov[4] }, 3);
    int err = n < 0 ? errno : 0;
    s->landed[0] = s->landed[1] = 0;
    if (n < 80 || !zone) {
        if (zone)
            pthread_mutex_unlock(&f->lock);
        if (n < 0)
            return err == EAGAIN || err == EINTR || err == ENOENT ? 0 : -err;
        if (n < 40)
            return 0;
    }
    const struct fr_in_header *h = (const void *)s->hdr->in_out;
    uint32_t rest = n >= 80 ? (uint32_t)n - 80 : 0;  /* (past the op's 40 bytes) */
    if (zone && n >= 80) {
        uint32_t k0 = rest < r0 ? rest : r0, k1 = rest - k0 < r1 ? rest - k0 : r1;
        uint32_t over = rest - k0 - k1;  /* (at the payload buffer's start) */
        const uint32_t *size = (const void *)(s->hdr->op_in + 16);
        if (rest > f->payload) {
            pthread_mutex_unlock(&f->lock);
            return -EPROTO;
        }
        if (over)  /* (where the rest of the request goes in the payload buffer) */
            memmove(s->payload + k0 + k1, s->payload, over);
        /* (the second part only once the first is full, as fr_land) */
        if (h->opcode == FR_OP_WRITE && *size == rest && (k0 || (!r0 && k1))) {
            s->land_at[0] = f->zone[0];
            s->land_at[1] = f->zone[1];
            f->zone[0] += k0;
            f->room[0] -= k0;
            f->zone[1] += k1;
            f->room[1] -= k1;
            s->landed[0] = k0;
            s->landed[1] = k1;
            s->hdr->ent.payload_sz = rest;
            return 2;
        }
        /* (not a WRITE: its bytes are the request's, not file data) */
        memcpy(s->payload, f->zone[0], k0);
        memcpy(s->payload + k0, f->zone[1], k1);
        pthread_mutex_unlock(&f->lock);
    }
    /* The op's fixed part as a ring entry has it: LOOKUP has none (the name is the payload),
     * CREATE's is struct fuse_create_in; for the others 40 bytes at most (WRITE and READ:
     * struct fuse_write_in / fuse_read_in), the split of a request the Python side hands to
     * libfuse being of no matter (it is sent whole). */
    uint32_t all = (uint32_t)n - 40, k = all < 40 ? all : 40, psz = all - k, opsize = k;
    if (h->opcode == FR_OP_LOOKUP)
        opsize = 0;
    else if (h->opcode == FR_OP_CREATE && k >= CREATE_IN_SIZE)
        opsize = CREATE_IN_SIZE;
    if (opsize < k) {
        uint32_t moved = k - opsize;
        if (psz + moved > f->payload)
            return -EPROTO;
        memmove(s->payload + moved, s->payload, psz);
        memcpy(s->payload, s->hdr->op_in + opsize, moved);
        psz += moved;
    }
    s->hdr->ent.payload_sz = psz;
    return 1;
}

/* Write slot s's answer (fr_answer's) on /dev/fuse; -errno if the kernel refused it. */
static int fr_dev_reply(struct ck_fring *f, struct fr_slot *s)
{
    uint32_t psz = s->hdr->ent.payload_sz;
    struct iovec iov[1 + WINDOW_PARTS] = { { s->hdr->in_out, 16 }, { s->payload, psz } };
    int n = psz ? 2 : 1;
    if (s->win) {  /* (a READ's body from a read window's buffers) */
        memcpy(iov + 1, s->body, s->nbody * sizeof *iov);
        n = 1 + s->nbody;
    }
    int err = writev(f->fuse_fd, iov, n) < 0 && errno != ENOENT ? errno : 0;
    if (s->win) {  /* (ENOENT: the request was interrupted and is gone) */
        atomic_fetch_sub(&s->win->busy, 1);
        s->win = NULL;
        s->nbody = 0;
        if (s->wake)
            fr_wake_python(f);
        s->wake = 0;
    }
    return -err;
}

/* A request this thread cannot serve (a defect: nothing the kernel sends) is answered EIO. */
static void fr_dev_refuse(struct ck_fring *f, int idx)
{
    struct fr_slot *s = &f->slots[idx];
    fr_answer(s, -EIO, NULL, 0);
    fr_dev_reply(f, s);
}

static void *fr_serve_dev(void *arg)
{
    struct fr_queue *q = arg;
    struct ck_fring *f = q->f;
    fr_pin(q);
    atomic_fetch_add(&f->registered, 1);
    struct pollfd p[2] = { { f->fuse_fd, POLLIN, 0 }, { q->efd, POLLIN, 0 } };
    /* (nothing is read before the Python side said go: until then a failed start loses
     * nothing, and it sets what answers depend on, e.g. flush_fails, first) */
    while (!atomic_load(&f->go) && !atomic_load(&f->stop)) {
        struct pollfd e = { q->efd, POLLIN, 0 };
        if (poll(&e, 1, -1) > 0) {
            uint64_t v;
            if (read(q->efd, &v, sizeof v) < 0) {}
        }
    }
    int gone = 0, woken = 0, lost = 0;
    /* Only the end of the connection or ck_fring_stop ends the loop: were the threads to stop
     * on an error, nobody would read /dev/fuse any more (the Python side does not). */
    while (!atomic_load(&f->stop)) {
        fr_commit_answers(q);  /* (the slots the Python side answered are free again) */
        int idx = fr_dev_free_slot(q);
        if (idx >= 0) {
            int r = fr_dev_read(f, idx);
            /* (woken for a request another thread took: most likely this CPU's caller's,
             * served from a CPU that was awake, the Python side's; its answer then wakes the
             * caller here, cheaply if this CPU did not halt meanwhile) */
            lost = woken && r == 0;
            woken = 0;
            if (r == -ENODEV) {
                gone = 1;
                break;
            }
            if (r == -EPROTO) {
                fr_note_error(f, EPROTO);
                fr_dev_refuse(f, idx);
                continue;
            }
            if (r < 0) {
                fr_note_error(f, -r);
                usleep(1000);  /* (not in a loop as fast as the error comes) */
                continue;
            }
            if (r > 0) {
                int here = fr_dispatch(q, idx, r == 2);
                if (r == 2) {
                    pthread_mutex_unlock(&f->lock);
                    if (!here || atomic_load(&f->landed_due))
                        fr_wake_python(f);
                    atomic_fetch_add(&q->read_in_place, 1);
                }
                if (here) {
                    struct fr_slot *s = &f->slots[idx];
                    atomic_fetch_add(&q->answered_here, 1);
                    r = fr_dev_reply(f, s);
                    atomic_store(&s->state, AT_KERNEL);
                    if (r == -ENODEV) {
                        gone = 1;
                        break;
                    }
                    if (r < 0)
                        fr_note_error(f, -r);
                }
                continue;
            }
        }
        p[0].fd = idx >= 0 ? f->fuse_fd : -1;  /* (no free slot: wait for an answer only) */
        if ((q->waited_with_python > 0 || lost) && f->spin_s > 0) {
            lost = 0;
            /* A caller on this CPU waits for the Python side's answer (or, likely, another
             * queue thread's): poll, so that this CPU does not halt (the answer's wake-up is
             * then cheap), and take the next request at once. */
            if (fr_spin(q, fr_dev_ready, p))
                continue;
        }
        if (!fr_may_sleep(q))
            continue;
        int k = poll(p, 2, -1);
        atomic_store(&q->sleeping, 0);
        if (k < 0) {
            if (errno != EINTR) {
                fr_note_error(f, errno);
                usleep(1000);
            }
            continue;
        }
        if (p[1].revents & POLLIN) {
            uint64_t v;
            if (read(q->efd, &v, sizeof v) < 0) {}
        }
        if (p[0].revents & (POLLERR | POLLHUP | POLLNVAL)) {
            gone = 1;
            break;
        }
        woken = (p[0].revents & POLLIN) != 0;
    }
    if (gone) {  /* (the Python side learns it even while it sleeps) */
        atomic_store(&f->gone, 1);
        uint64_t one = 1;
        if (write(f->wake_fd, &one, sizeof one) < 0) {}
    }
    return NULL;
}

static void fr_wake(struct fr_queue *q)
{
    uint64_t one = 1;
    if (write(q->efd, &one, sizeof one) < 0) {}
}

void ck_fring_free(struct ck_fring *f);

/* Start nqueues queue threads with depth entries each; the Python side's eventfd is wake_fd.
 * cpus NULL: on FUSE over io_uring, queue i on CPU i; waits until every queue has registered
 * its entries (or one failed: NULL, *err set). Else on /dev/fuse, thread i pinned to cpus[i];
 * they read nothing before ck_fring_go. */
struct ck_fring *ck_fring_start(int fuse_fd, int nqueues, int depth, uint32_t payload,
                                int wake_fd, double spin_s, const int *cpus, int *err)
{
    int dev = cpus != NULL;
    struct ck_fring *f = calloc(1, sizeof *f);
    *err = ENOMEM;
    if (!f)
        return NULL;
    f->fuse_fd = fuse_fd;
    f->dev = dev;
    f->nqueues = nqueues;
    f->depth = depth;
    f->payload = payload;
    f->wake_fd = wake_fd;
    f->spin_s = spin_s;
    f->attr_gen = 1;
    f->defer_here = 1;
    f->sum_landed = ck_crc32c_hw();
    pthread_mutex_init(&f->lock, NULL);
    int n = nqueues * depth;
    f->slots = calloc(n, sizeof *f->slots);
    f->queues = calloc(nqueues, sizeof *f->queues);
    f->fifo = calloc(n + 1, sizeof *f->fifo);
    f->landed = calloc(LANDED_MAX, sizeof *f->landed);
    f->land_at = calloc(LANDED_MAX, sizeof *f->land_at);
    f->reads = calloc(READS_MAX, sizeof *f->reads);
    f->released = calloc(RELEASED_MAX, sizeof *f->released);
    f->created = calloc(CREATED_MAX, sizeof *f->created);
    f->opened = calloc(OPENED_MAX, sizeof *f->opened);
    f->looked = calloc(LOOKED_MAX, sizeof *f->looked);
    if (!f->slots || !f->queues || !f->fifo || !f->landed || !f->land_at || !f->reads || !f->released
        || !f->created || !f->opened || !f->looked)
        goto fail;
    for (int i = 0; i < nqueues; i++)
        f->queues[i].efd = -1;
    for (int i = 0; i < n; i++) {
        struct fr_slot *s = &f->slots[i];
        s->hdr = aligned_alloc(4096, 4096);
        s->payload = aligned_alloc(4096, (payload + 4095) & ~4095u);
        if (!s->hdr || !s->payload)
            goto fail;
        memset(s->hdr, 0, 4096);
        s->iov[0] = (struct iovec){ s->hdr, sizeof(struct fr_header) };
        s->iov[1] = (struct iovec){ s->payload, payload };
        s->q = &f->queues[i / depth];
    }
    for (int i = 0; i < nqueues; i++) {
        struct fr_queue *q = &f->queues[i];
        q->f = f;
        q->qid = i;
        q->cpu = dev ? cpus[i] : i;
        q->first_slot = i * depth;
        q->efd = eventfd(0, EFD_CLOEXEC);
        if (q->efd < 0) {
            *err = errno;
            goto fail;
        }
        if (dev)
            continue;
        struct io_uring_params par = { .flags = IORING_SETUP_SQE128 };
        int r = io_uring_queue_init_params(4 * depth + 8, &q->ring, &par);
        if (r < 0) {
            *err = -r;
            goto fail;
        }
        q->ring_ok = 1;
    }
    for (int i = 0; i < nqueues; i++) {
        struct fr_queue *q = &f->queues[i];
        int r = pthread_create(&q->thread, NULL, dev ? fr_serve_dev : fr_serve, q);
        if (r) {
            *err = r;
            atomic_store(&f->stop, 1);
            goto fail;
        }
        q->started = 1;
    }
    double end = fr_now() + 5.0;
    while (atomic_load(&f->registered) + atomic_load(&f->failed) < nqueues && fr_now() < end)
        usleep(200);
    if (atomic_load(&f->failed) || atomic_load(&f->registered) < nqueues) {
        *err = atomic_load(&f->error) ? atomic_load(&f->error) : ETIMEDOUT;
        atomic_store(&f->stop, 1);
        goto fail;
    }
    *err = 0;
    return f;
fail:
    ck_fring_free(f);
    return NULL;
}

/* Take up to max slots handed to the Python side (FIFO); returns how many. */
int ck_fring_take(struct ck_fring *f, int *ids, int max)
{
    if (!atomic_load(&f->pending))
        return 0;
    int n = 0;
    pthread_mutex_lock(&f->lock);
    unsigned cells = (unsigned)(f->nqueues * f->depth) + 1;
    while (n < max && f->head != f->tail) {
        ids[n++] = f->fifo[f->head];
        f->head = (f->head + 1) % cells;
    }
    pthread_mutex_unlock(&f->lock);
    atomic_fetch_sub(&f->pending, n);
    return n;
}

/* Landed writes the Python side has not taken yet. */
int ck_fring_landed(struct ck_fring *f) { return atomic_load(&f->landed_count); }

int ck_fring_pending(struct ck_fring *f)
{
    return atomic_load(&f->pending) + atomic_load(&f->landed_due)
        + atomic_load(&f->released_count) + atomic_load(&f->created_count)
        + atomic_load(&f->reads_due) + atomic_load(&f->opened_count)
        + atomic_load(&f->looked_count);
}

/* Handles released here whose release the Python side has not taken yet. */
int ck_fring_released(struct ck_fring *f) { return atomic_load(&f->released_count); }

/* Take up to max of them, in the order their RELEASEs came. */
int ck_fring_take_released(struct ck_fring *f, uint64_t *out, int max)
{
    pthread_mutex_lock(&f->lock);
    int n = fr_take_list(out, f->released, sizeof *out, RELEASED_MAX, &f->rhead, f->rtail,
                         &f->released_count, max);
    pthread_mutex_unlock(&f->lock);
    return n;
}

/* RELEASE and CREATE answered here (1, from the start) or handed over as any request (0: the
 * mount stops; the Python side takes what was noted before). */
void ck_fring_defer_here(struct ck_fring *f, int on)
{
    pthread_mutex_lock(&f->lock);
    f->defer_here = on;
    pthread_mutex_unlock(&f->lock);
}

/* CREATE is answered here (where the directory's names and attributes are): a write-only
 * handle gets FOPEN_DIRECT_IO when direct_writes, a new file's entry is valid for
 * entry_valid s + entry_valid_ns ns. Numbers come from ck_fring_reserve. */
void ck_fring_create_setup(struct ck_fring *f, int direct_writes, uint64_t entry_valid,
                           uint32_t entry_valid_ns)
{
    pthread_mutex_lock(&f->lock);
    f->direct_writes = direct_writes;
    f->entry_valid = entry_valid;
    f->entry_valid_ns = entry_valid_ns;
    f->create_here = 1;
    pthread_mutex_unlock(&f->lock);
}

/* A WRITE whose end lies past n bytes is not answered here (the largest file the index
 * records: format/records.py MAX_FILE_BYTES); 0 until the Python side says. */
void ck_fring_file_bytes_max(struct ck_fring *f, uint64_t n)
{
    pthread_mutex_lock(&f->lock);
    f->file_bytes_max = n;
    pthread_mutex_unlock(&f->lock);
}

/* Files created here take inode numbers ino .. ino + n - 1 and handles fh .. fh + n - 1 (the
 * Python side reserved them; what is left of the ranges before is not used). */
void ck_fring_reserve(struct ck_fring *f, uint64_t ino, uint64_t fh, uint32_t n)
{
    pthread_mutex_lock(&f->lock);
    f->ino_next = ino;
    f->ino_end = ino + n;
    f->fh_next = fh;
    f->fh_end = fh + n;
    pthread_mutex_unlock(&f->lock);
}

/* Creates the reserved numbers are left for. */
int ck_fring_reserve_left(struct ck_fring *f)
{
    pthread_mutex_lock(&f->lock);
    uint64_t a = f->ino_end - f->ino_next, b = f->fh_end - f->fh_next;
    pthread_mutex_unlock(&f->lock);
    return (int)(a < b ? a : b);
}

/* Files created here that the Python side has not taken yet. */
int ck_fring_created(struct ck_fring *f) { return atomic_load(&f->created_count); }

/* Take up to max of them, in the order they were created. */
int ck_fring_take_created(struct ck_fring *f, struct ck_fring_created *out, int max)
{
    pthread_mutex_lock(&f->lock);
    int n = fr_take_list(out, f->created, sizeof *out, CREATED_MAX, &f->chead, f->ctail,
                         &f->created_count, max);
    pthread_mutex_unlock(&f->lock);
    return n;
}

/* Whether a file created here in directory nodeid is not taken yet. (under lock) */
static int fr_creating_in(struct ck_fring *f, uint64_t nodeid)
{
    for (unsigned i = f->chead; i != f->ctail; i++)
        if (f->created[i % CREATED_MAX].parent == nodeid)
            return 1;
    return 0;
}

/* Handles in the writable set. */
int ck_fring_writable_count(struct ck_fring *f)
{
    pthread_mutex_lock(&f->lock);
    int n = f->nfhs;
    pthread_mutex_unlock(&f->lock);
    return n;
}

/* Handle fh takes writes (on = 1: a WRITE on it that lands whole is answered here) or no
 * longer (0, at its release). Returns 0, or -ENOSPC when the set is full (then its WRITEs go
 * to the Python side, as any). */
int ck_fring_writable(struct ck_fring *f, uint64_t fh, int on)
{
    pthread_mutex_lock(&f->lock);
    int r = fr_fh_set(f, fh, on);
    pthread_mutex_unlock(&f->lock);
    return r;
}

/* The Python side is about to sleep on its eventfd (1) or is awake (0). Returns the requests
 * waiting (with what it is to take: releases, creates, READs answered here that are due):
 * with 1, if not 0, it must not sleep (one may have come before the flag was set). */
int ck_fring_sleep(struct ck_fring *f, int sleeping)
{
    atomic_store(&f->py_sleeping, sleeping);
    int waiting = atomic_load(&f->pending) + atomic_load(&f->released_count)
        + atomic_load(&f->created_count) + atomic_load(&f->reads_due)
        + atomic_load(&f->landed_due) + atomic_load(&f->opened_count)
        + atomic_load(&f->looked_count);
    if (waiting)  /* (it does not sleep then) */
        atomic_store(&f->py_sleeping, 0);
    return waiting;
}

/* The Python side wrote slot id's answer (out header in the header's first 16 bytes, body in
 * the payload buffer, its length in payload_sz): the queue thread commits it. (/dev/fuse:
 * it wrote the answer there itself, or the request needs none: the slot is free again.) */
void ck_fring_answer(struct ck_fring *f, int id)
{
    struct fr_slot *s = &f->slots[id];
    struct fr_queue *q = s->q;
    atomic_store_explicit(&s->state, ANSWERED, memory_order_release);
    atomic_fetch_add(&q->answered, 1);
    if (atomic_exchange(&q->sleeping, 0))
        fr_wake(q);
}

/* Where the next WRITE payloads go: n1 bytes at p1, then (once those are full) n2 at p2. */
void ck_fring_offer(struct ck_fring *f, void *p1, uint32_t n1, void *p2, uint32_t n2)
{
    pthread_mutex_lock(&f->lock);
    f->zone[0] = p1;
    f->room[0] = p1 ? n1 : 0;
    f->zone[1] = p2;
    f->room[1] = p2 ? n2 : 0;
    f->zone_on = f->room[0] > 0;
    atomic_store(&f->zone_ready, f->zone_on);
    pthread_mutex_unlock(&f->lock);
}

/* No more landing (the Python side changes staging); returns the landed writes to record. */
int ck_fring_revoke(struct ck_fring *f)
{
    pthread_mutex_lock(&f->lock);
    f->zone_on = 0;
    atomic_store(&f->zone_ready, 0);
    int n = (int)(f->ltail - f->lhead);
    pthread_mutex_unlock(&f->lock);
    return n;
}

/* Take up to max landed writes, in the order they landed. */
int ck_fring_take_landed(struct ck_fring *f, struct ck_fring_landed *out, int max)
{
    pthread_mutex_lock(&f->lock);
    int n = fr_take_list(out, f->landed, sizeof *out, LANDED_MAX, &f->lhead, f->ltail,
                         &f->landed_count, max);
    if (f->lhead == f->ltail)
        atomic_store(&f->landed_due, 0);
    pthread_mutex_unlock(&f->lock);
    return n;
}

/* The Python side, before it takes the landed writes (its claim): the CRC32C of the bytes of
 * each record not summed yet goes into it (crc1, crc2, summed), in C and with the GIL
 * released (cffi), while the queue threads go on landing: the bytes of a record not taken
 * cannot change (the Python side takes every record before it changes staging, and only
 * this side takes them). A record taken before is not summed: the Python side sums its
 * bytes itself. Returns how many were summed. */
int ck_fring_sum_landed(struct ck_fring *f)
{
    enum { BATCH = 64 };
    struct { unsigned seq; struct fr_land_at a; uint32_t n[2], crc[2]; } jobs[BATCH];
    int total = 0;
    if (!f->sum_landed)
        return 0;
    for (;;) {
        int n = 0;
        pthread_mutex_lock(&f->lock);
        if (f->ltail - f->lsum > f->ltail - f->lhead)  /* (behind the records taken) */
            f->lsum = f->lhead;
        for (; n < BATCH && f->lsum != f->ltail; n++, f->lsum++) {
            const struct ck_fring_landed *r = &f->landed[f->lsum % LANDED_MAX];
            jobs[n].seq = f->lsum;
            jobs[n].a = f->land_at[f->lsum % LANDED_MAX];
            jobs[n].n[0] = r->k1;
            jobs[n].n[1] = r->k2;
        }
        pthread_mutex_unlock(&f->lock);
        if (!n)
            return total;
        for (int i = 0; i < n; i++)
            for (int k = 0; k < 2; k++)
                jobs[i].crc[k] = jobs[i].n[k] ? ck_crc32c(0, jobs[i].a.at[k], jobs[i].n[k]) : 0;
        pthread_mutex_lock(&f->lock);
        for (int i = 0; i < n; i++) {
            struct ck_fring_landed *r = &f->landed[jobs[i].seq % LANDED_MAX];
            r->crc1 = jobs[i].crc[0];
            r->crc2 = jobs[i].crc[1];
            r->summed = 1;
        }
        pthread_mutex_unlock(&f->lock);
        total += n;
    }
}

void *ck_fring_header(struct ck_fring *f, int id) { return f->slots[id].hdr; }
void *ck_fring_payload(struct ck_fring *f, int id) { return f->slots[id].payload; }
int ck_fring_error(struct ck_fring *f) { return atomic_load(&f->error); }
int ck_fring_gone(struct ck_fring *f) { return atomic_load(&f->gone); }

/* /dev/fuse: the threads start reading it (the Python side has set them up). */
void ck_fring_go(struct ck_fring *f)
{
    atomic_store(&f->go, 1);
    for (int i = 0; i < f->nqueues; i++)
        fr_wake(&f->queues[i]);
}

/* GETATTR of directory nodeid is answered here with `out` (a struct fuse_attr_out of len
 * bytes) until the next ck_fring_attr_clear. Returns 0, or -EINVAL for a wrong length. */
int ck_fring_attr_put(struct ck_fring *f, uint64_t nodeid, const void *out, uint32_t len)
{
    if (len != ATTR_OUT_SIZE)
        return -EINVAL;
    pthread_mutex_lock(&f->lock);
    if (fr_creating_in(f, nodeid)) {  /* (the answer predates a create made here) */
        pthread_mutex_unlock(&f->lock);
        return -EAGAIN;
    }
    unsigned home = fr_attr_slot(nodeid), at = home;
    for (unsigned i = home, n = 0; n < ATTR_PROBE; i = (i + 1) % ATTR_SLOTS, n++) {
        struct fr_attr *a = &f->attrs[i];
        if (a->gen != f->attr_gen || a->nodeid == nodeid) {
            at = i;
            break;
        }
    }
    /* (no free slot within the probe: the home slot's directory is asked of Python again) */
    struct fr_attr *a = &f->attrs[at];
    a->nodeid = nodeid;
    a->gen = f->attr_gen;
    memcpy(a->out, out, ATTR_OUT_SIZE);
    pthread_mutex_unlock(&f->lock);
    return 0;
}

/* Forget every cached directory attribute (a directory changed). */
void ck_fring_attr_clear(struct ck_fring *f)
{
    pthread_mutex_lock(&f->lock);
    f->attr_gen++;
    pthread_mutex_unlock(&f->lock);
}

/* LOOKUP of a name in directory nodeid that is none of `names` (count of them, each
 * NUL-terminated, len bytes in all) is answered absent here until the next
 * ck_fring_names_drop, while ck_fring_absent_until allows; names added later come with
 * ck_fring_name_add. Returns 0, -E2BIG for a directory too large to hold, -ENOMEM. */
int ck_fring_names_put(struct ck_fring *f, uint64_t nodeid, const char *names, uint32_t len,
                       uint32_t count)
{
    uint64_t want = (uint64_t)(count < 64 ? 64 : count) * NAME_BITS_PER * 2;
    uint32_t nbits = NAME_BITS_MIN;
    while (nbits < want && nbits < NAME_BITS_MAX)
        nbits <<= 1;
    if (nbits < want)
        return -E2BIG;
    struct fr_names d = { .nodeid = nodeid, .mask = nbits - 1, .cap = nbits / NAME_BITS_PER };
    d.bits = calloc(nbits / 64, sizeof *d.bits);  /* (outside the lock: the threads go on) */
    if (!d.bits)
        return -ENOMEM;
    for (uint32_t at = 0; at < len; ) {
        const char *end = memchr(names + at, 0, len - at);
        uint32_t n = end ? (uint32_t)(end - (names + at)) : len - at;
        fr_names_bits(&d, names + at, n, 1);
        d.count++;
        at += n + 1;
    }
    pthread_mutex_lock(&f->lock);
    /* (its own slot if it has one, else the first free one within the probe) */
    unsigned home = fr_names_slot(nodeid), at = home, free_at = NAME_DIRS;
    for (unsigned i = home, n = 0; n < NAME_PROBE; i = (i + 1) % NAME_DIRS, n++) {
        struct fr_names *o = &f->names[i];
        if (o->bits && o->nodeid == nodeid) {
            free_at = i;
            break;
        }
        if (free_at == NAME_DIRS && !o->bits)
            free_at = i;
    }
    if (free_at != NAME_DIRS)
        at = free_at;
    /* (no free slot within the probe: the home slot's directory is asked of Python again) */
    uint64_t *old = f->names[at].bits;
    f->names[at] = d;
    for (unsigned i = f->chead; i != f->ctail; i++) {  /* (made here, not in `names` yet) */
        struct ck_fring_created *c = &f->created[i % CREATED_MAX];
        if (c->parent == nodeid) {
            fr_names_bits(&f->names[at], c->name, c->namelen, 1);
            f->names[at].count++;
        }
    }
    pthread_mutex_unlock(&f->lock);
    free(old);
    return 0;
}

/* Name (len bytes) is now in directory nodeid: never answered absent there from now on. */
void ck_fring_name_add(struct ck_fring *f, uint64_t nodeid, const char *name, uint32_t len)
{
    uint64_t *old = NULL;
    pthread_mutex_lock(&f->lock);
    struct fr_names *d = fr_names_of(f, nodeid);
    if (d) {
        fr_names_bits(d, name, len, 1);
        if (++d->count > d->cap) {  /* (too full to answer well: built again, larger) */
            old = d->bits;
            d->bits = NULL;
        }
    }
    pthread_mutex_unlock(&f->lock);
    free(old);
}

/* Whether directory nodeid has a filter here. */
int ck_fring_names_has(struct ck_fring *f, uint64_t nodeid)
{
    pthread_mutex_lock(&f->lock);
    int has = fr_names_of(f, nodeid) != NULL;
    pthread_mutex_unlock(&f->lock);
    return has;
}

/* The directories that have a filter here (into out, at most max of them); their count. */
uint32_t ck_fring_names_held(struct ck_fring *f, uint64_t *out, uint32_t max)
{
    uint32_t n = 0;
    pthread_mutex_lock(&f->lock);
    for (int i = 0; i < NAME_DIRS && n < max; i++) {
        struct fr_names *d = &f->names[i];
        if (d->bits)
            out[n++] = d->nodeid;
    }
    pthread_mutex_unlock(&f->lock);
    return n;
}

/* Forget directory nodeid's filter (names may have come to it by other ways: other writers). */
void ck_fring_names_drop(struct ck_fring *f, uint64_t nodeid)
{
    uint64_t *old = NULL;
    pthread_mutex_lock(&f->lock);
    struct fr_names *d = fr_names_of(f, nodeid);
    if (d) {
        old = d->bits;
        d->bits = NULL;
    }
    pthread_mutex_unlock(&f->lock);
    free(old);
}

/* LOOKUP is answered absent here only before `until` (CLOCK_MONOTONIC seconds): then a look
 * at other writers is due, which the Python side makes first. */
void ck_fring_absent_until(struct ck_fring *f, double until)
{
    pthread_mutex_lock(&f->lock);
    f->absent_until = until;
    pthread_mutex_unlock(&f->lock);
}

/* The flusher has an error to report (1: FLUSH goes to the Python side) or not (0). */
void ck_fring_flush_fails(struct ck_fring *f, int on) { atomic_store(&f->flush_fails, on); }

/* Handle fh's read window: bytes [start, start + the parts' lengths) of its file are in the
 * nparts buffers (end to end), unchanged until the window is dropped; eof: the file ends there.
 * Replaces the handle's window (once no READ uses the old one). Returns 1, or 0 when every
 * window is taken (the handle then has none). nodeid not 0: a prepared window, for a handle
 * not open yet: the file's next read-only OPEN is answered with fh and open_flags (fr_open). */
void ck_fring_window_drop(struct ck_fring *f, uint64_t fh);

int ck_fring_window(struct ck_fring *f, uint64_t fh, uint64_t nodeid, uint32_t open_flags,
                    uint64_t start, int eof, int nparts, char **parts, const uint32_t *lens)
{
    if (nparts < 1 || nparts > WINDOW_PARTS) {
        ck_fring_window_drop(f, fh);  /* (the handle has none then, as with no free window) */
        return 0;
    }
    pthread_mutex_lock(&f->lock);
    struct fr_window *old = fr_window_of(f, fh), *w = NULL;
    if (old) {
        old->fh = 0;
        atomic_fetch_sub(&f->nwindows, 1);
    }
    for (int i = 0; i < WINDOWS && !w; i++)
        if (!f->windows[i].fh && !atomic_load(&f->windows[i].busy))
            w = &f->windows[i];
    if (w) {
        w->start = w->end = start;
        w->nodeid = nodeid;
        w->open_flags = open_flags;
        w->eof = eof;
        w->woke = 0;
        w->nparts = nparts;
        for (int i = 0; i < nparts; i++) {
            w->part[i] = parts[i];
            w->len[i] = lens[i];
            w->end += lens[i];
        }
        w->fh = fh + 1;
        atomic_fetch_add(&f->nwindows, 1);
    }
    pthread_mutex_unlock(&f->lock);
    while (old && old != w && atomic_load(&old->busy))
        sched_yield();  /* (a READ being sent from it: tens of microseconds) */
    return w != NULL;
}

/* Drop handle fh's window; its buffers are the Python side's again on return. */
void ck_fring_window_drop(struct ck_fring *f, uint64_t fh)
{
    pthread_mutex_lock(&f->lock);
    struct fr_window *w = fr_window_of(f, fh);
    if (w) {
        w->fh = 0;
        atomic_fetch_sub(&f->nwindows, 1);
    }
    pthread_mutex_unlock(&f->lock);
    while (w && atomic_load(&w->busy))
        sched_yield();
}

int ck_fring_reads(struct ck_fring *f) { return atomic_load(&f->reads_count); }

/* The answer to LOOKUP of name (len bytes) in directory parent: inode nodeid, `out` its
 * fuse_entry_out (ENTRY_OUT_SIZE bytes); answered once (fr_lookup). 0 when every slot is
 * taken. */
int ck_fring_lookup_put(struct ck_fring *f, uint64_t parent, const char *name, uint32_t len,
                        uint64_t nodeid, const void *out)
{
    if (!parent || len == 0 || len > NAME_MAX_LEN)
        return 0;
    struct fr_lookup *l = NULL;
    pthread_mutex_lock(&f->lock);
    for (int i = 0; i < LOOKUPS && !l; i++)
        if (!f->lookups[i].parent)
            l = &f->lookups[i];
    if (l) {
        l->nodeid = nodeid;
        l->namelen = len;
        memcpy(l->name, name, len);
        memcpy(l->out, out, ENTRY_OUT_SIZE);
        l->parent = parent;
        atomic_fetch_add(&f->nlookups, 1);
    }
    pthread_mutex_unlock(&f->lock);
    return l != NULL;
}

/* The prepared answer of `name` in directory `parent` goes, if one stands (its LOOKUP came to
 * the Python side: it and the file's OPEN are prepared afresh there). */
void ck_fring_lookup_drop(struct ck_fring *f, uint64_t parent, const char *name, uint32_t len)
{
    pthread_mutex_lock(&f->lock);
    struct fr_lookup *l = fr_lookup_find(f, parent, name, len);
    if (l) {
        l->parent = 0;
        atomic_fetch_sub(&f->nlookups, 1);
    }
    pthread_mutex_unlock(&f->lock);
}

/* Every prepared LOOKUP answer goes (the tree changed). */
void ck_fring_lookups_clear(struct ck_fring *f)
{
    pthread_mutex_lock(&f->lock);
    for (int i = 0; i < LOOKUPS; i++)
        f->lookups[i].parent = 0;
    atomic_store(&f->nlookups, 0);
    pthread_mutex_unlock(&f->lock);
}

/* LOOKUPs answered here the Python side has not counted yet. */
int ck_fring_looked(struct ck_fring *f) { return atomic_load(&f->looked_count); }

/* Take up to max of their inodes, in the order they were answered. */
int ck_fring_take_looked(struct ck_fring *f, uint64_t *out, int max)
{
    pthread_mutex_lock(&f->lock);
    int n = fr_take_list(out, f->looked, sizeof *out, LOOKED_MAX, &f->lkhead, f->lktail,
                         &f->looked_count, max);
    pthread_mutex_unlock(&f->lock);
    return n;
}

/* OPENs answered here whose handle the Python side has not made yet. */
int ck_fring_opened(struct ck_fring *f) { return atomic_load(&f->opened_count); }

/* Take up to max of them, in the order they were answered. */
int ck_fring_take_opened(struct ck_fring *f, struct ck_fring_opened *out, int max)
{
    pthread_mutex_lock(&f->lock);
    int n = fr_take_list(out, f->opened, sizeof *out, OPENED_MAX, &f->ohead, f->otail,
                         &f->opened_count, max);
    pthread_mutex_unlock(&f->lock);
    return n;
}

/* Take up to max READs answered from windows, in the order they were answered. */
int ck_fring_take_reads(struct ck_fring *f, struct ck_fring_read *out, int max)
{
    pthread_mutex_lock(&f->lock);
    int n = fr_take_list(out, f->reads, sizeof *out, READS_MAX, &f->dhead, f->dtail,
                         &f->reads_count, max);
    if (f->dhead == f->dtail)
        atomic_store(&f->reads_due, 0);
    pthread_mutex_unlock(&f->lock);
    return n;
}

/* Queue qid's figures into out[0..n): requests served, answered here, of those GETATTRs of
 * a directory, LOOKUPs of an absent name and CREATEs, entries lost, pinned to its CPU (1 or
 * 0), WRITEs read into the zone, READs answered from a read window, OPENs answered from a
 * prepared one, LOOKUPs answered from a prepared answer. Returns how many were written. */
int ck_fring_queue_counts(struct ck_fring *f, int qid, long *out, int n)
{
    if (qid < 0 || qid >= f->nqueues)
        return 0;
    struct fr_queue *q = &f->queues[qid];
    long all[] = { atomic_load(&q->served), atomic_load(&q->answered_here),
                   atomic_load(&q->attrs_here), atomic_load(&q->absent_here),
                   atomic_load(&q->creates_here), atomic_load(&q->lost), q->pinned,
                   atomic_load(&q->read_in_place), atomic_load(&q->reads_here),
                   atomic_load(&q->opens_here), atomic_load(&q->lookups_here) };
    int k = n < (int)(sizeof all / sizeof *all) ? n : (int)(sizeof all / sizeof *all);
    memcpy(out, all, k * sizeof *out);
    return k;
}

/* Stop the queue threads (their rings closed: the kernel cancels their entries), wait for
 * them (at most 5 s each), free everything. Returns the threads that did not end. */
int ck_fring_stop(struct ck_fring *f)
{
    atomic_store(&f->stop, 1);
    int stuck = 0;
    for (int i = 0; i < f->nqueues; i++) {
        struct fr_queue *q = &f->queues[i];
        if (!q->started)
            continue;
        fr_wake(q);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += 5;
        if (pthread_timedjoin_np(q->thread, NULL, &ts) != 0) {
            stuck++;
            continue;
        }
        q->started = 0;
    }
    if (stuck)
        return stuck;  /* (kept: a thread still runs on it) */
    ck_fring_free(f);
    return 0;
}

void ck_fring_free(struct ck_fring *f)
{
    if (!f)
        return;
    for (int i = 0; f->queues && i < f->nqueues; i++) {
        struct fr_queue *q = &f->queues[i];
        if (q->started) {
            fr_wake(q);
            pthread_join(q->thread, NULL);
        }
        if (q->ring_ok)
            io_uring_queue_exit(&q->ring);
        if (q->efd >= 0)
            close(q->efd);
    }
    for (int i = 0; f->slots && i < f->nqueues * f->depth; i++) {
        free(f->slots[i].hdr);
        free(f->slots[i].payload);
    }
    free(f->slots);
    free(f->queues);
    free(f->fifo);
    free(f->landed);
    free(f->land_at);
    free(f->reads);
    free(f->released);
    free(f->created);
    free(f->opened);
    free(f->looked);
    for (int i = 0; i < NAME_DIRS; i++)
        free(f->names[i].bits);
    pthread_mutex_destroy(&f->lock);
    free(f);
}
