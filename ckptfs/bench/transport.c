/* `ckptfs bench transport`'s two programs (bench/transport.py builds and runs them).
 *
 * serve MNT dev|uring SPIN_US THREADS PIN [HANDOFF]
 *     A FUSE file system that keeps nothing: every LOOKUP misses, CREATE makes a new inode,
 *     WRITE accepts its bytes and drops them. What a request costs here is the transport:
 *     the kernel's side, the wake-ups, the copies; nothing of a daemon's own work. Mounted
 *     with mount(2) (root), served either by read/write on /dev/fuse (dev: SPIN_US > 0 polls
 *     that long before a blocking read, as ckptfs's request loop does) or by FUSE over
 *     io_uring (uring, Linux 6.14+, /sys/module/fuse/parameters/enable_uring = Y): one ring
 *     with entries for every CPU's queue, or (THREADS = 1) one thread and ring per queue,
 *     each thread on its queue's CPU when PIN = 1. The kernel puts a request on the queue
 *     of the CPU its caller runs on, so a pinned queue thread serves it on that CPU.
 *     With HANDOFF = 1 the queue threads hand LOOKUP and CREATE (a daemon's
 *     namespace requests) to one other thread, which polls for them for SPIN_US before it
 *     sleeps, and wait for its answer: what a per-CPU loop in C pays to keep the namespace
 *     on one thread. Prints "ready" once the INIT reply is sent; on exit the requests served
 *     each way.
 *
 * client DIR N SIZE M
 *     N files created, written once (SIZE bytes) and closed, then M writes of 1 MiB into one
 *     file (opened with direct I/O by the server, so each is one WRITE request); then N files
 *     of SIZE bytes opened, read and closed, and M reads of 1 MiB from one file (the server
 *     has every name "r<size>_<anything>": a file of that size, read with direct I/O, its
 *     bytes whatever the reply buffer holds). Prints the microseconds per file written, per
 *     1 MiB written, per file read and per 1 MiB read.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* linux/fuse.h (protocol 7.45); Debian's headers predate the io_uring part */
enum { LOOKUP = 1, FORGET = 2, GETATTR = 3, OPEN = 14, READ = 15, WRITE = 16, STATFS = 17, RELEASE = 18,
       FLUSH = 25, INIT = 26, OPENDIR = 27, RELEASEDIR = 29, CREATE = 35, INTERRUPT = 36,
       DESTROY = 38, IOCTL = 39, BATCH_FORGET = 42 };
#define BIG_WRITES (1u << 5)
#define MAX_PAGES (1u << 22)
#define INIT_EXT (1u << 30)
#define OVER_IO_URING_FLAGS2 (1u << 9) /* FUSE_OVER_IO_URING, bit 41 */
#define FOPEN_DIRECT_IO 1u
#define URING_REGISTER 1
#define URING_COMMIT_AND_FETCH 2
#define NO_REPLY (-100000)

struct in_header { uint32_t len, opcode; uint64_t unique, nodeid; uint32_t uid, gid, pid;
                   uint16_t total_extlen, padding; };
struct out_header { uint32_t len; int32_t error; uint64_t unique; };
struct attr { uint64_t ino, size, blocks, atime, mtime, ctime;
              uint32_t atimensec, mtimensec, ctimensec, mode, nlink, uid, gid, rdev, blksize,
                       flags; };
struct entry_out { uint64_t nodeid, generation, entry_valid, attr_valid;
                   uint32_t entry_valid_nsec, attr_valid_nsec; struct attr attr; };
struct attr_out { uint64_t attr_valid; uint32_t attr_valid_nsec, dummy; struct attr attr; };
struct open_out { uint64_t fh; uint32_t open_flags; int32_t backing_id; };
struct write_in { uint64_t fh, offset; uint32_t size, write_flags; uint64_t lock_owner;
                  uint32_t flags, padding; };
struct write_out { uint32_t size, padding; };
struct read_in { uint64_t fh, offset; uint32_t size, read_flags; uint64_t lock_owner;
                 uint32_t flags, padding; };
struct init_in { uint32_t major, minor, max_readahead, flags, flags2; };
struct init_out { uint32_t major, minor, max_readahead, flags;
                  uint16_t max_background, congestion_threshold;
                  uint32_t max_write, time_gran; uint16_t max_pages, map_alignment;
                  uint32_t flags2, max_stack_depth; uint16_t request_timeout, unused[11]; };
struct ring_ent_in_out { uint64_t flags, commit_id; uint32_t payload_sz, padding;
                         uint64_t reserved; };
struct ring_header { char in_out[128]; char op_in[128]; struct ring_ent_in_out ent; };
struct ring_cmd { uint64_t flags, commit_id; uint16_t qid; uint8_t padding[6]; };

#define MAX_WRITE (1 << 20)
#define BUF_BYTES (MAX_WRITE + 8192)
#define QUEUE_DEPTH 4

static int fuse_fd;
static uint64_t next_ino = 2;  /* (one thread at a time creates: the caller waits) */
static double spin_s;
static double ring_spin_s;  /* (the namespace thread's when requests are handed off) */
static volatile long served_dev, served_ring;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void finish(int sig) {
    (void)sig;
    char b[128];
    int k = snprintf(b, sizeof b, "served %ld on /dev/fuse, %ld on io_uring\n",
                     served_dev, served_ring);
    if (write(2, b, k) < 0) {}
    _exit(0);
}

/* A file's size is in its inode number: the bits above SIZE_SHIFT (0 for created files). */
#define SIZE_SHIFT 24

static void fill_attr(struct attr *a, uint64_t ino) {
    memset(a, 0, sizeof *a);
    a->ino = ino;
    a->size = ino >> SIZE_SHIFT;
    a->nlink = 1;
    a->blksize = 4096;
    a->mode = ino == 1 ? (S_IFDIR | 0755) : (S_IFREG | 0644);
}

/* The bytes a READ answers with (they are not copied: the reply buffer's, whatever it holds). */
static int read_length(const struct in_header *h, const void *op) {
    const struct read_in *r = op;
    uint64_t size = h->nodeid >> SIZE_SHIFT;
    return r->offset >= size ? 0 : (int)(size - r->offset < r->size ? size - r->offset : r->size);
}

/* The reply body of request h (its per-op struct `op`, then `name`: what follows it) into
 * out: its length, a negative errno, or NO_REPLY. */
static int handle(const struct in_header *h, const void *op, const char *name, char *out) {
    switch (h->opcode) {
    case LOOKUP: {
        if (name[0] != 'r')
            return -ENOENT;
        struct entry_out *e = (void *)out;
        memset(e, 0, sizeof *e);
        uint64_t size = strtoull(name + 1, NULL, 10);
        e->nodeid = size << SIZE_SHIFT | (__sync_fetch_and_add(&next_ino, 1) &
                                          ((1u << SIZE_SHIFT) - 1));
        e->entry_valid = 1;
        e->attr_valid = 300;
        fill_attr(&e->attr, e->nodeid);
        return sizeof *e;
    }
    case GETATTR: {
        struct attr_out *o = (void *)out;
        memset(o, 0, sizeof *o);
        o->attr_valid = 300;
        fill_attr(&o->attr, h->nodeid);
        return sizeof *o;
    }
    case CREATE: {
        struct entry_out *e = (void *)out;
        struct open_out *o = (void *)(out + sizeof *e);
        memset(e, 0, sizeof *e);
        memset(o, 0, sizeof *o);
        e->nodeid = __sync_fetch_and_add(&next_ino, 1);
        e->entry_valid = 1;
        e->attr_valid = 300;
        fill_attr(&e->attr, e->nodeid);
        o->fh = e->nodeid;
        o->open_flags = FOPEN_DIRECT_IO;
        return sizeof *e + sizeof *o;
    }
    case OPEN: case OPENDIR: {
        struct open_out *o = (void *)out;
        memset(o, 0, sizeof *o);
        o->open_flags = h->opcode == OPEN ? FOPEN_DIRECT_IO : 0;
        return sizeof *o;
    }
    case WRITE: {
        struct write_out *o = (void *)out;
        o->size = ((const struct write_in *)op)->size;
        o->padding = 0;
        return sizeof *o;
    }
    case FLUSH: case RELEASE: case RELEASEDIR: case DESTROY:
        return 0;
    case STATFS:
        memset(out, 0, 80);
        return 80;
    case FORGET: case BATCH_FORGET: case INTERRUPT:
        return NO_REPLY;
    case IOCTL:
        return -ENOTTY;
    default:
        return -ENOSYS;
    }
}

/* ------------------------------------------------------------------ /dev/fuse */
/* Where a request's name (or payload) starts after its per-op struct, on /dev/fuse. */
static size_t op_size(uint32_t opcode) {
    switch (opcode) {
    case CREATE: return 16;  /* fuse_create_in */
    case WRITE: return sizeof(struct write_in);
    default: return 0;  /* (LOOKUP: the name right after the header) */
    }
}

static int dev_pollers;  /* /dev/fuse served by a thread per CPU: each polls, then reads */

static void *serve_dev(void *spin) {
    char *buf = aligned_alloc(4096, BUF_BYTES), out[4096];
    struct pollfd p = { fuse_fd, POLLIN, 0 };
    for (;;) {
        if (spin && spin_s > 0) {
            double end = now() + spin_s;
            while (poll(&p, 1, 0) == 0 && now() < end) {}
        }
        /* (every thread in poll is woken by a request, not one: the one on the caller's CPU
         * reads it, the descriptor being non-blocking) */
        if (dev_pollers)
            poll(&p, 1, -1);
        ssize_t n = read(fuse_fd, buf, BUF_BYTES);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ENOENT)
                continue;
            finish(0);  /* ENODEV: unmounted */
        }
        const struct in_header *h = (void *)buf;
        const char *op = buf + sizeof *h;
        __sync_fetch_and_add(&served_dev, 1);
        struct out_header *oh = (void *)out;
        oh->unique = h->unique;
        if (h->opcode == READ) {  /* the reply's bytes: the receive buffer's */
            int k = read_length(h, op);
            struct iovec iov[2] = { { out, sizeof *oh }, { buf, k } };
            oh->error = 0;
            oh->len = sizeof *oh + k;
            if (writev(fuse_fd, iov, 2) < 0 && errno != ENOENT)
                finish(0);
            continue;
        }
        int r = handle(h, op, op + op_size(h->opcode), out + sizeof(struct out_header));
        if (r == NO_REPLY)
            continue;
        oh->error = r < 0 ? r : 0;
        oh->len = sizeof *oh + (r > 0 ? r : 0);
        if (write(fuse_fd, out, oh->len) < 0 && errno != ENOENT)
            finish(0);
        if (h->opcode == DESTROY)
            finish(0);
    }
    return NULL;
}

/* ------------------------------------------------------------------ handoff */
struct handoff { const struct in_header *h; const void *op; const char *name; char *out;
                 int reply_fd; };
static int handoff_fds[2] = { -1, -1 };

static void *namespace_thread(void *arg) {
    (void)arg;
    struct pollfd p = { handoff_fds[0], POLLIN, 0 };
    for (;;) {
        if (spin_s > 0) {
            double end = now() + spin_s;
            while (poll(&p, 1, 0) == 0 && now() < end) {}
        }
        struct handoff m;
        if (read(handoff_fds[0], &m, sizeof m) != sizeof m)
            continue;
        int r = handle(m.h, m.op, m.name, m.out);
        if (write(m.reply_fd, &r, sizeof r) < 0) {}
    }
    return NULL;
}

/* handle(), on the namespace thread for LOOKUP and CREATE when requests are handed off */
static int handle_here_or_there(const struct in_header *h, const void *op, const char *name,
                                char *out, int reply[2]) {
    if (handoff_fds[1] < 0 || (h->opcode != LOOKUP && h->opcode != CREATE))
        return handle(h, op, name, out);
    struct handoff m = { h, op, name, out, reply[1] };
    int r;
    if (write(handoff_fds[1], &m, sizeof m) != sizeof m)
        return -EIO;
    /* (polled: this thread's CPU is the caller's, which waits anyway; a sleep here would
     * halt it and make the answer pay a wake-up) */
    struct pollfd p = { reply[0], POLLIN, 0 };
    double end = now() + 0.001;
    while (poll(&p, 1, 0) == 0 && now() < end) {}
    if (read(reply[0], &r, sizeof r) != sizeof r)
        return -EIO;
    return r;
}

/* ------------------------------------------------------------------ io_uring */
struct entry { struct ring_header *hdr; char *payload; struct iovec iov[2]; int qid; };

static void queue_cmd(struct io_uring *ring, struct entry *e, int idx, uint32_t cmd,
                      uint64_t commit_id) {
    struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
    if (!sqe) {  /* (full: what is queued goes first) */
        io_uring_submit(ring);
        sqe = io_uring_get_sqe(ring);
    }
    if (!sqe) {
        fprintf(stderr, "io_uring: no free submission entry\n");
        exit(1);
    }
    /* SQE128: the entry is two struct io_uring_sqe, the command area the second half */
    memset(sqe, 0, 2 * sizeof *sqe);
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->fd = fuse_fd;
    sqe->cmd_op = cmd;
    sqe->addr = (uint64_t)(uintptr_t)e->iov;
    sqe->len = 2;
    sqe->user_data = idx;
    struct ring_cmd *c = (void *)sqe->cmd;
    c->qid = e->qid;
    c->commit_id = commit_id;
}

/* Serve queues first .. first + count - 1 from one ring. */
static void serve_ring(int first, int count) {
    struct io_uring ring;
    struct io_uring_params par = { .flags = IORING_SETUP_SQE128 };
    int err = io_uring_queue_init_params(2 * QUEUE_DEPTH * count + 8, &ring, &par);
    if (err) {
        fprintf(stderr, "io_uring: %s\n", strerror(-err));
        exit(1);
    }
    int n = count * QUEUE_DEPTH;
    struct entry *ents = calloc(n, sizeof *ents);
    for (int i = 0; i < n; i++) {
        struct entry *e = &ents[i];
        e->hdr = aligned_alloc(4096, 4096);
        memset(e->hdr, 0, 4096);
        e->payload = aligned_alloc(4096, BUF_BYTES);
        e->iov[0] = (struct iovec){ e->hdr, sizeof(struct ring_header) };
        e->iov[1] = (struct iovec){ e->payload, BUF_BYTES };
        e->qid = first + i / QUEUE_DEPTH;
        queue_cmd(&ring, e, i, URING_REGISTER, 0);
    }
    io_uring_submit(&ring);
    char out[4096];
    int reply[2];
    if (pipe(reply)) {
        perror("pipe");
        exit(1);
    }
    for (;;) {
        struct io_uring_cqe *cqe = NULL;
        if (ring_spin_s > 0) {  /* (the last commit goes first; else submit_and_wait takes it) */
            io_uring_submit(&ring);
            double end = now() + ring_spin_s;
            while (io_uring_peek_cqe(&ring, &cqe) != 0 && now() < end)
                io_uring_get_events(&ring);
        }
        if (!cqe) {
            err = io_uring_submit_and_wait(&ring, 1);
            if (err < 0 && err != -EINTR)
                finish(0);
            if (io_uring_peek_cqe(&ring, &cqe) != 0)
                continue;
        }
        int idx = (int)cqe->user_data, res = cqe->res;
        io_uring_cqe_seen(&ring, cqe);
        if (res < 0) {
            if (res != -ENOTCONN && res != -ECANCELED && res != -ENODEV)
                fprintf(stderr, "io_uring entry %d: %s\n", idx, strerror(-res));
            finish(0);
        }
        struct entry *e = &ents[idx];
        const struct in_header *h = (void *)e->hdr->in_out;
        __sync_fetch_and_add(&served_ring, 1);
        uint64_t unique = h->unique;
        int destroy = h->opcode == DESTROY;
        int r;
        if (h->opcode == READ) {
            r = read_length(h, e->hdr->op_in);  /* (the payload buffer's bytes) */
        } else {
            r = handle_here_or_there(h, e->hdr->op_in, e->payload, out, reply);
            if (r > 0)
                memcpy(e->payload, out, r);  /* reply bodies go in the payload buffer */
        }
        struct out_header *oh = (void *)e->hdr->in_out;
        oh->unique = unique;
        oh->error = r < 0 ? r : 0;
        oh->len = sizeof *oh + (r > 0 ? r : 0);
        e->hdr->ent.payload_sz = r > 0 ? r : 0;
        queue_cmd(&ring, e, idx, URING_COMMIT_AND_FETCH, e->hdr->ent.commit_id);
        if (destroy) {
            io_uring_submit(&ring);
            finish(0);
        }
    }
}

static int pin;

/* The calling thread on CPU `cpu` when the threads are pinned. */
static void pin_to(int cpu) {
    if (!pin)
        return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *serve_queue(void *arg) {
    int q = (int)(intptr_t)arg;
    pin_to(q);
    serve_ring(q, 1);
    return NULL;
}

/* fn(cpu) in a thread for every CPU (256 at most); returns when they all ended. */
static void per_cpu(void *(*fn)(void *)) {
    int ncpu = (int)sysconf(_SC_NPROCESSORS_CONF);
    pthread_t q[256];
    for (int i = 0; i < ncpu && i < 256; i++)
        pthread_create(&q[i], NULL, fn, (void *)(intptr_t)i);
    for (int i = 0; i < ncpu && i < 256; i++)
        pthread_join(q[i], NULL);
}

static void *serve_dev_on(void *arg) {
    pin_to((int)(intptr_t)arg);
    return serve_dev(NULL);
}

static int serve(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: transport serve MNT dev|uring SPIN_US THREADS PIN\n");
        return 2;
    }
    int uring = strcmp(argv[3], "uring") == 0, threads = atoi(argv[5]);
    spin_s = atof(argv[4]) * 1e-6;
    pin = atoi(argv[6]);
    signal(SIGTERM, finish);
    fuse_fd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
    if (fuse_fd < 0) {
        perror("/dev/fuse");
        return 1;
    }
    char opts[160];
    snprintf(opts, sizeof opts,
             "fd=%d,rootmode=40000,user_id=0,group_id=0,default_permissions", fuse_fd);
    if (mount("ckptfs-transport", argv[2], "fuse.ckptfs-transport", MS_NOSUID | MS_NODEV,
              opts)) {
        perror("mount");
        return 1;
    }
    char *buf = aligned_alloc(4096, BUF_BYTES);
    ssize_t n = read(fuse_fd, buf, BUF_BYTES);
    const struct in_header *h = (void *)buf;
    const struct init_in *in = (void *)(buf + sizeof *h);
    if (n < (ssize_t)(sizeof *h + sizeof *in) || h->opcode != INIT) {
        fprintf(stderr, "no INIT from the kernel\n");
        return 1;
    }
    struct { struct out_header oh; struct init_out io; } rep;
    memset(&rep, 0, sizeof rep);
    rep.oh.len = sizeof rep;
    rep.oh.unique = h->unique;
    rep.io.major = 7;
    rep.io.minor = in->minor < 45 ? in->minor : 45;
    rep.io.max_readahead = in->max_readahead;
    rep.io.flags = (BIG_WRITES | MAX_PAGES | INIT_EXT) & in->flags;
    rep.io.flags2 = uring ? OVER_IO_URING_FLAGS2 & in->flags2 : 0;
    rep.io.max_background = 16;
    rep.io.congestion_threshold = 12;
    rep.io.max_write = MAX_WRITE;
    rep.io.time_gran = 1;
    rep.io.max_pages = MAX_WRITE / 4096;
    if (uring && !rep.io.flags2) {
        fprintf(stderr, "the kernel does not offer FUSE over io_uring (enable_uring)\n");
        return 1;
    }
    if (write(fuse_fd, &rep, sizeof rep) < 0) {
        perror("INIT reply");
        return 1;
    }
    printf("ready\n");
    fflush(stdout);
    if (!uring && threads) {  /* a thread per CPU, pinned if asked, polling /dev/fuse */
        dev_pollers = 1;
        fcntl(fuse_fd, F_SETFL, fcntl(fuse_fd, F_GETFL) | O_NONBLOCK);
        per_cpu(serve_dev_on);
        return 0;
    }
    if (!uring) {
        serve_dev((void *)1);
        return 0;
    }
    /* Some requests still come on /dev/fuse: those sent before every queue has an entry,
     * FORGETs, INTERRUPTs. */
    pthread_t t;
    pthread_create(&t, NULL, serve_dev, NULL);
    int ncpu = (int)sysconf(_SC_NPROCESSORS_CONF);
    ring_spin_s = spin_s;
    if (argc > 7 && atoi(argv[7])) {
        ring_spin_s = 0;
        if (pipe(handoff_fds)) {
            perror("pipe");
            return 1;
        }
        pthread_t ns;
        pthread_create(&ns, NULL, namespace_thread, NULL);
    }
    if (!threads) {
        serve_ring(0, ncpu);
        return 0;
    }
    per_cpu(serve_queue);
    return 0;
}

/* ------------------------------------------------------------------ client */
/* m writes (or reads) of 1 MiB through one descriptor of path; 1 on an error (printed). */
static int big_io(const char *path, int writing, char *buf, int m) {
    int fd = writing ? open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644) : open(path, O_RDONLY);
    for (int i = 0; i < m; i++) {
        ssize_t k = fd < 0 ? -1 : writing ? write(fd, buf, MAX_WRITE) : read(fd, buf, MAX_WRITE);
        if (k != MAX_WRITE) {
            perror(path);
            return 1;
        }
    }
    close(fd);
    return 0;
}

static int client(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: transport client DIR N SIZE M\n");
        return 2;
    }
    const char *dir = argv[2];
    int n = atoi(argv[3]), size = atoi(argv[4]), m = atoi(argv[5]);
    char *buf = malloc(MAX_WRITE), path[4096];
    memset(buf, 7, MAX_WRITE);
    if (size > MAX_WRITE)
        size = MAX_WRITE;
    double t0 = now();
    for (int i = 0; i < n; i++) {
        snprintf(path, sizeof path, "%s/f%d", dir, i);
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0 || (size && write(fd, buf, size) != size) || close(fd)) {
            perror(path);
            return 1;
        }
    }
    double t1 = now();
    snprintf(path, sizeof path, "%s/big", dir);
    if (big_io(path, 1, buf, m))
        return 1;
    double t2 = now();
    for (int i = 0; i < n; i++) {
        snprintf(path, sizeof path, "%s/r%d_%d", dir, size, i);
        int fd = open(path, O_RDONLY);
        if (fd < 0 || read(fd, buf, MAX_WRITE) != size || close(fd)) {
            perror(path);
            return 1;
        }
    }
    double t3 = now();
    snprintf(path, sizeof path, "%s/r%ld_big", dir, (long)m * MAX_WRITE);
    if (big_io(path, 0, buf, m))
        return 1;
    double t4 = now();
    printf("%.2f %.2f %.2f %.2f\n", n ? (t1 - t0) / n * 1e6 : 0.0, m ? (t2 - t1) / m * 1e6 : 0.0,
           n ? (t3 - t2) / n * 1e6 : 0.0, m ? (t4 - t3) / m * 1e6 : 0.0);
    return 0;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "serve") == 0)
        return serve(argc, argv);
    if (argc > 1 && strcmp(argv[1], "client") == 0)
        return client(argc, argv);
    fprintf(stderr, "usage: transport serve|client ...\n");
    return 2;
}
