/* The queue threads' shared state, for their C files only (fuse/ring*.c; the trio thread's
 * view is fuse/ring.h): the entries, the queues, the lists of what they noted for the trio
 * thread and the caches it left with them. Everything marked "(under lock)" is read and
 * written with ck_fring.lock held. */
#ifndef CKPTFS_FUSE_RING_INTERNAL_H
#define CKPTFS_FUSE_RING_INTERNAL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE  /* CPU_SET, pthread_setaffinity_np, pthread_timedjoin_np */
#endif
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <liburing.h>

#include "protocol.h"
#include "ring.h"

#define IN_HEADER_SIZE ((uint32_t)sizeof(struct fuse_in_header))
#define OP_PART_MAX ((uint32_t)sizeof(struct fuse_write_in))  /* the largest op part read */
#define CREATED_MAX 1024  /* files created here whose create the trio thread has not made */
#define FH_SLOTS 4096  /* the writable-handle set: open addressing, at most half full */
#define FH_EMPTY 0
#define FH_GONE UINT64_MAX
#define LANDED_MAX 4096  /* landed writes not yet recorded by the trio thread */
#define RELEASED_MAX 4096  /* handles released here whose release the trio thread has not run */
#define ATTR_SLOTS 256  /* the directory attribute cache: open addressing, short probes */
#define ATTR_PROBE 8
#define NAME_DIRS CK_FRING_NAME_DIRS  /* directories with a name filter: open addressing */
#define NAME_PROBE 4
#define NAME_MAX_LEN CK_FRING_NAME_MAX
#define NAME_HASHES 4  /* bits set per name */
#define WINDOWS CK_FRING_WINDOWS
#define WINDOW_PARTS CK_FRING_WINDOW_PARTS
#define READS_MAX 4096  /* READs answered here not yet accounted for by the trio thread */
#define OPENED_MAX WINDOWS  /* opens answered here not yet made by the trio thread */
#define LOOKUPS 64  /* LOOKUP answers the trio thread prepared (answers.LOOKUPS_MAX: 48) */
#define LOOKED_MAX 1024  /* LOOKUPs answered here not yet counted by the trio thread */
#define LOOKUPS_LEFT 2  /* a directory with at most this many prepared answers left wakes the
                         * trio thread (it prepares answers.LOOKUPS_AHEAD: 4) */
#define NAME_BITS_PER 16  /* per name at the most (one "maybe there" in ~400 absent names) */
#define NAME_BITS_MIN (1u << 12)
#define NAME_BITS_MAX (1u << 22)  /* 512 KiB: a directory of more than 128 Ki names has none
                                   * (a filter is made with room for twice its names) */

enum { AT_KERNEL = 0, AT_TRIO = 1, ANSWERED = 2 };
#define WAKE_TAG UINT64_MAX

struct fr_queue;

/* A directory's answer to GETATTR as the trio thread gave it (valid while gen is current),
 * and the group a file created in it takes (new_gid; -1: its creator's). */
struct fr_attr {
    uint64_t nodeid, gen;
    int64_t new_gid;
    struct fuse_attr_out out;
};

/* The names of a directory as the trio thread gave them, and those added since: a Bloom
 * filter (bits NULL: a free slot; dropped when it holds more than cap names). */
struct fr_names {
    uint64_t nodeid;
    uint64_t *bits;
    uint32_t mask;  /* bits - 1 */
    uint32_t count, cap;
};

/* A read window: bytes [start, end) of the file open as handle fh - 1 (0: a free window), in
 * the trio thread's buffers (parts, in file order, end to end), which it keeps unchanged while
 * the window stands; eof: the file ends at `end`. busy: READs answered from it right now
 * (raised under the lock; a window is not reused, nor its buffers given back, before 0).
 * A prepared window (nodeid not 0) waits for the file's next read-only OPEN, which is
 * answered here with handle fh - 1 and open_flags (fr_open); it is the handle's window then. */
struct fr_window {
    uint64_t fh, start, end;
    uint64_t nodeid;
    uint32_t open_flags;
    int eof, nparts;
    int woke;  /* a READ past its middle woke the trio thread (once per window) */
    _Atomic int busy;
    char *part[WINDOW_PARTS];
    uint32_t len[WINDOW_PARTS];
};

/* A LOOKUP answer the trio thread prepared (parent 0: a free slot): name in directory parent
 * is inode nodeid, `out` its answer; used once. */
struct fr_lookup {
    uint64_t parent, nodeid;
    uint32_t namelen;
    char name[NAME_MAX_LEN + 1];
    struct fuse_entry_out out;
};

/* An entry: a request and, once served, its answer. Its header buffer is laid out as FUSE
 * over io_uring's (struct fuse_uring_req_header) on both transports. */
struct fr_slot {
    struct fuse_uring_req_header *hdr;
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
    int wake;  /* wake the trio thread once the answer is sent */
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
    int efd;  /* the trio thread wakes a sleeping queue thread here */
    uint64_t efd_buf;
    _Atomic int sleeping;
    _Atomic int answered;  /* answers not committed yet */
    int with_trio, waited_with_trio;
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
    /* the FIFO of slots handed to the trio thread */
    pthread_mutex_t lock;
    int *fifo;
    unsigned head, tail;  /* below nqueues * depth + 1: full is not empty (under lock) */
    _Atomic int pending;
    int wake_fd;  /* the trio thread's eventfd */
    /* the landing zone and the landed list (under lock) */
    char *zone[2];
    uint32_t room[2];
    int zone_on;
    _Atomic int zone_ready;  /* zone_on, read without the lock (/dev/fuse: read in place) */
    struct ck_fring_landed *landed;
    unsigned lhead, ltail;
    _Atomic int landed_count;  /* records not taken yet */
    _Atomic int landed_due;  /* the trio thread is to take them now (fr_hand_over) */
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
    struct ck_fring_policy policy;  /* what a file created here is (under lock) */
    uint64_t file_bytes_max;  /* a WRITE ending past it is the trio thread's (short, EFBIG) */
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
    _Atomic int reads_due;  /* the trio thread is to take them now (ck_fring_pending) */
    struct ck_fring_opened *opened;  /* (under lock) */
    struct fr_lookup lookups[LOOKUPS];  /* (under lock) */
    _Atomic int nlookups;  /* prepared answers standing (read without the lock: none, no lock) */
    uint64_t *looked;  /* nodeids of LOOKUPs answered here (under lock) */
    unsigned lkhead, lktail;
    _Atomic int looked_count;  /* not taken yet */
    unsigned ohead, otail;
    _Atomic int opened_count;  /* not taken yet */
    double absent_until;  /* LOOKUP is answered absent only before then (under lock) */
    _Atomic int trio_sleeping;
    _Atomic int stop;
    _Atomic int error;  /* the first error a queue thread stopped on (errno) */
    _Atomic int gone;  /* /dev/fuse: the connection ended (unmounted or aborted) */
    _Atomic int go;  /* /dev/fuse: the threads may read it (ck_fring_go) */
    _Atomic int flush_fails;  /* the flusher has an error: FLUSH goes to the trio thread */
    _Atomic int registered;  /* queues whose entries are registered */
    _Atomic int failed;      /* queues that could not register */
};

static inline struct fuse_in_header *fr_in(const struct fr_slot *s)
{
    return (struct fuse_in_header *)s->hdr->in_out;
}

static inline struct fuse_out_header *fr_out(const struct fr_slot *s)
{
    return (struct fuse_out_header *)s->hdr->in_out;
}

static inline double fr_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Note an error (errno; the first one stays: ck_fring_error). */
static inline void fr_note_error(struct ck_fring *f, int err)
{
    int zero = 0;
    atomic_compare_exchange_strong(&f->error, &zero, err);
}

static inline void fr_wake_trio(struct ck_fring *f)
{
    if (atomic_exchange(&f->trio_sleeping, 0)) {
        uint64_t one = 1;
        if (write(f->wake_fd, &one, sizeof one) < 0) {}
    }
}

#pragma GCC visibility push(hidden)

/* fuse/ring.c: what both transports share */
int fr_hand_over(struct ck_fring *f, int idx, uint32_t write_size, int in_zone);
int fr_take_list(void *out, const void *list, size_t size, unsigned cap, unsigned *head,
                 unsigned tail, _Atomic int *count, int max);
void fr_answer(struct fr_slot *s, int32_t error, const void *body, uint32_t len);
int fr_dispatch(struct fr_queue *q, int idx, int in_zone);
int fr_commit_answers(struct fr_queue *q);
int fr_spin(struct fr_queue *q, int (*ready)(struct fr_queue *, void *), void *arg);
int fr_may_sleep(struct fr_queue *q);
void fr_pin(struct fr_queue *q);
void fr_wake(struct fr_queue *q);

/* fuse/ring_uring.c: FUSE over io_uring */
int fr_uring_setup(struct fr_queue *q);
int fr_queue_cmd(struct fr_queue *q, int idx, uint32_t cmd, uint64_t commit_id);
void *fr_serve_uring(void *arg);

/* fuse/ring_dev.c: /dev/fuse */
void *fr_serve_dev(void *arg);

/* fuse/ring_landing.c */
void fr_land_payload(struct ck_fring *f, struct fr_slot *s, uint32_t write_size);
int fr_note_landed(struct ck_fring *f, int idx, uint32_t write_size);
int fr_fh_set(struct ck_fring *f, uint64_t fh, int on);
int fr_fh_writable(struct ck_fring *f, uint64_t fh);

/* fuse/ring_dirs.c */
uint32_t fr_request_name(const struct fr_slot *s, uint32_t opsize);
int fr_attr_get(struct ck_fring *f, uint64_t nodeid, struct fuse_attr_out *out);
int fr_absent(struct ck_fring *f, uint64_t nodeid, const char *name, uint32_t len);
int fr_create(struct ck_fring *f, const struct fr_slot *s, const char *name, uint32_t len,
              void *out);

/* fuse/ring_reads.c */
int fr_lookup(struct ck_fring *f, const struct fr_slot *s, const char *name, uint32_t len,
              struct fuse_entry_out *out);
int fr_read(struct ck_fring *f, struct fr_slot *s);
int fr_open(struct ck_fring *f, const struct fr_slot *s, struct fuse_open_out *out);

#pragma GCC visibility pop

#endif
