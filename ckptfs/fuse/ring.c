/* The queue threads of the daemon's request transport (fuse/ring.py): what both transports
 * share. One thread per CPU, pinned to it, takes requests off /dev/fuse (fuse/ring_dev.c, the
 * default) or off that CPU's FUSE io_uring queue (fuse/ring_uring.c, --fuse-uring) into its
 * entries, answers the few it can (fr_dispatch) and hands every other one to the trio thread
 * (a FIFO it polls while requests flow, with an eventfd to wake it when it sleeps), which
 * serves it with the same handlers as a request it read itself and writes the answer into the
 * entry; the queue thread commits it (FUSE over io_uring) or the trio thread writes it on
 * /dev/fuse.
 *
 * These threads decide nothing about files: the trio thread hands them what they may
 * answer and with what (fuse/ring.h). They answer
 * - a WRITE that landed whole in the zone the trio thread offered, on a handle it said takes
 *   writes (fuse/ring_landing.c);
 * - GETATTR of a directory, LOOKUP of a name not in a directory, CREATE of such a name, from
 *   the attributes, names and policy the trio thread left (fuse/ring_dirs.c);
 * - LOOKUP of a name whose answer it prepared, OPEN of a file it prepared a read window for,
 *   READ inside a handle's read window (fuse/ring_reads.c);
 * - RELEASE, noted for the trio thread, which does its work later (its caller does not
 *   wait); IOCTL (ENOTTY: ckptfs files have none; Python's open() asks isatty() of every
 *   file); FLUSH while the flusher has no error to report (ckptfs's close() does not wait
 *   for durability; with an error, FLUSH goes to the trio thread, which reports it to
 *   handles that wrote).
 * What they answered they note in lists the trio thread takes in before it serves any
 * request (its settle), in order.
 *
 * Why: a FUSE round trip on a VM is dominated by wake-ups between vCPUs (docs/benchmarks.md,
 * "What the FUSE transport costs"). The caller's CPU halts while it waits, and the answer
 * from a daemon on the other CPU has to wake it through the hypervisor. Here the answer is
 * committed from the caller's own CPU, by a thread that polls for it while the caller waits
 * (so that CPU never halts), and the caller's wake-up is local.
 *
 * Bounds: a queue thread polls only while one of its requests is with the trio thread and
 * only for `spin_s` (then it sleeps until the trio thread wakes it); requests the caller does
 * not wait for (RELEASE, page-cache writeback) are not polled for; the poll yields the CPU
 * (sched_yield) so that a caller or the trio thread that wants this CPU gets it. Memory:
 * `depth` entries per queue, each a 4 KiB header and a payload buffer of `payload` bytes.
 */
#include <sys/eventfd.h>

#include "ring_internal.h"

/* Take up to max records, in order, of one of the lists the queue threads fill for the
 * trio thread (cap records of `size` bytes at `list`; head and tail count up, the count of
 * records not taken is lowered here, under the lock, as it is raised). (under lock) */
int fr_take_list(void *out, const void *list, size_t size, unsigned cap, unsigned *head, unsigned tail, _Atomic int *count, int max)
{
    int n = 0;
    for (; n < max && *head != tail; n++, (*head)++)
        memcpy((char *)out + (size_t)n * size, (const char *)list + (*head % cap) * size, size);
    atomic_fetch_sub(count, n);
    return n;
}

/* An answer written here: `error` (0 or -errno), then `len` bytes of body (from `body`). */
void fr_answer(struct fr_slot *s, int32_t error, const void *body, uint32_t len)
{
    struct fuse_out_header oh = { sizeof oh + len, error, fr_in(s)->unique };
    memcpy(s->hdr->in_out, &oh, sizeof oh);
    if (len)
        memcpy(s->payload, body, len);
    s->hdr->ring_ent_in_out.payload_sz = len;
}

/* Hand entry idx over; a WRITE (write_size > 0) lands in the zone first, unless it was read
 * there (in_zone: the lock held since, s->landed says how far, fr_dev_read). Returns 1
 * when the WRITE was answered here (the entry is not handed over). */
int fr_hand_over(struct ck_fring *f, int idx, uint32_t write_size, int in_zone)
{
    struct fr_slot *s = &f->slots[idx];
    unsigned cells = (unsigned)(f->nqueues * f->depth) + 1;
    int answered = 0;
    if (!in_zone) {
        s->landed[0] = s->landed[1] = 0;
        pthread_mutex_lock(&f->lock);
        if (write_size)
            fr_land_payload(f, s, write_size);
    }
    if (s->landed[0] || s->landed[1])
        answered = fr_note_landed(f, idx, write_size);
    if (!answered) {
        f->fifo[f->tail] = idx;
        f->tail = (f->tail + 1) % cells;
    }
    if (!in_zone)
        pthread_mutex_unlock(&f->lock);
    if (!answered)
        atomic_fetch_add(&f->pending, 1);
    if (!in_zone && (!answered || atomic_load(&f->landed_due)))
        fr_wake_trio(f);  /* (in_zone: the caller does, once it let go of the lock) */
    return answered;
}

/* A RELEASE answered here: its handle leaves the writable set and is noted for the trio
 * thread, which runs the release's work (the file's times into the journal) when it suits it.
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
        fr_wake_trio(f);
    return ok;
}

/* Commit the answers the trio thread left; returns how many. */
int fr_commit_answers(struct fr_queue *q)
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
        q->with_trio--;
        if (s->waited)
            q->waited_with_trio--;
        atomic_store(&s->state, AT_KERNEL);
        if (f->dev)  /* (written on /dev/fuse by the trio thread: the slot is free again) */
            n++;
        else if (fr_queue_cmd(q, i, FUSE_IO_URING_CMD_COMMIT_AND_FETCH,
                              s->hdr->ring_ent_in_out.commit_id) == 0)
            n++;
    }
    return n;
}

/* Serve the request in slot idx here (the answer written into the slot: 1) or hand it to the
 * trio thread (0). in_zone: a WRITE read into the zone, the lock held (fr_dev_read). */
int fr_dispatch(struct fr_queue *q, int idx, int in_zone)
{
    struct ck_fring *f = q->f;
    struct fr_slot *s = &f->slots[idx];
    const struct fuse_in_header *h = fr_in(s);
    const struct fuse_write_in *w = (const void *)s->hdr->op_in;
    uint32_t size = h->opcode == FUSE_WRITE && w->size == s->hdr->ring_ent_in_out.payload_sz
        ? w->size : 0;
    atomic_fetch_add(&q->served, 1);
    atomic_store_explicit(&s->state, AT_TRIO, memory_order_release);
    s->waited = !(h->opcode == FUSE_RELEASE || h->opcode == FUSE_RELEASEDIR
                  || h->opcode == FUSE_FORGET || h->opcode == FUSE_BATCH_FORGET
                  || h->opcode == FUSE_INTERRUPT
                  || (h->opcode == FUSE_WRITE && (w->write_flags & FUSE_WRITE_CACHE)));
    int here = 0;
    struct fuse_attr_out attr;
    struct { struct fuse_entry_out entry; struct fuse_open_out open; } created;
    uint32_t name_len;
    if (h->opcode == FUSE_GETATTR && fr_attr_get(f, h->nodeid, &attr)) {
        fr_answer(s, 0, &attr, sizeof attr);
        atomic_fetch_add(&q->attrs_here, 1);
        here = 1;
    } else if (h->opcode == FUSE_LOOKUP && (name_len = fr_request_name(s, 0))
               && fr_absent(f, h->nodeid, s->payload, name_len)) {
        fr_answer(s, -ENOENT, NULL, 0);
        atomic_fetch_add(&q->absent_here, 1);
        here = 1;
    } else if (h->opcode == FUSE_LOOKUP && (name_len = fr_request_name(s, 0))
               && fr_lookup(f, s, s->payload, name_len, &created.entry)) {
        fr_answer(s, 0, &created.entry, sizeof created.entry);
        atomic_fetch_add(&q->lookups_here, 1);
        here = 1;
    } else if (h->opcode == FUSE_CREATE
               && (name_len = fr_request_name(s, sizeof(struct fuse_create_in)))
               && fr_create(f, s, s->payload, name_len, &created)) {
        fr_answer(s, 0, &created, sizeof created);
        atomic_fetch_add(&q->creates_here, 1);
        here = 1;
    } else if (h->opcode == FUSE_RELEASE
               && fr_note_release(f, ((const struct fuse_release_in *)s->hdr->op_in)->fh)) {
        fr_answer(s, 0, NULL, 0);
        here = 1;
    } else if (h->opcode == FUSE_READ && fr_read(f, s)) {
        atomic_fetch_add(&q->reads_here, 1);
        here = 1;
    } else if (h->opcode == FUSE_OPEN && fr_open(f, s, &created.open)) {
        fr_answer(s, 0, &created.open, sizeof created.open);
        atomic_fetch_add(&q->opens_here, 1);
        here = 1;
    } else if (h->opcode == FUSE_IOCTL) {
        fr_answer(s, -ENOTTY, NULL, 0);
        here = 1;
    } else if (h->opcode == FUSE_FLUSH && !atomic_load(&f->flush_fails)) {
        fr_answer(s, 0, NULL, 0);
        here = 1;
    } else {
        q->with_trio++;
        if (s->waited)
            q->waited_with_trio++;
        if (fr_hand_over(f, idx, size, in_zone)) {
            q->with_trio--;
            if (s->waited)
                q->waited_with_trio--;
            struct fuse_write_out out = { size, 0 };
            fr_answer(s, 0, &out, sizeof out);
            here = 1;
        }
    }
    return here;
}

/* Poll for up to spin_s, yielding the CPU, until the trio thread answered something or
 * `ready` says a request came: 1 if one of them did. */
int fr_spin(struct fr_queue *q, int (*ready)(struct fr_queue *, void *), void *arg)
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
int fr_may_sleep(struct fr_queue *q)
{
    atomic_store(&q->sleeping, 1);
    if (atomic_load(&q->answered) || atomic_load(&q->f->stop)) {
        atomic_store(&q->sleeping, 0);
        return 0;
    }
    return 1;
}

void fr_pin(struct fr_queue *q)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(q->cpu, &set);
    /* (a CPU this process may not use: served from wherever the scheduler runs the thread) */
    q->pinned = pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0;
}

void fr_wake(struct fr_queue *q)
{
    uint64_t one = 1;
    if (write(q->efd, &one, sizeof one) < 0) {}
}

static void ck_fring_free(struct ck_fring *f);

/* Start nqueues queue threads with depth entries each; the trio thread's eventfd is wake_fd.
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
    if (!f->slots || !f->queues || !f->fifo || !f->landed || !f->land_at || !f->reads
        || !f->released || !f->created || !f->opened || !f->looked)
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
        s->iov[0] = (struct iovec){ s->hdr, sizeof(struct fuse_uring_req_header) };
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
        int r = dev ? 0 : fr_uring_setup(q);
        if (r < 0) {
            *err = -r;
            goto fail;
        }
    }
    for (int i = 0; i < nqueues; i++) {
        struct fr_queue *q = &f->queues[i];
        int r = pthread_create(&q->thread, NULL, dev ? fr_serve_dev : fr_serve_uring, q);
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

/* Take up to max slots handed to the trio thread (FIFO); returns how many. */
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

int ck_fring_pending(struct ck_fring *f)
{
    return atomic_load(&f->pending) + atomic_load(&f->landed_due)
        + atomic_load(&f->released_count) + atomic_load(&f->created_count)
        + atomic_load(&f->reads_due) + atomic_load(&f->opened_count)
        + atomic_load(&f->looked_count);
}

/* The trio thread is about to sleep on its eventfd (1) or is awake (0). Returns the requests
 * waiting (with what it is to take: releases, creates, READs answered here that are due):
 * with 1, if not 0, it must not sleep (one may have come before the flag was set). */
int ck_fring_sleep(struct ck_fring *f, int sleeping)
{
    atomic_store(&f->trio_sleeping, sleeping);
    int waiting = atomic_load(&f->pending) + atomic_load(&f->released_count)
        + atomic_load(&f->created_count) + atomic_load(&f->reads_due)
        + atomic_load(&f->landed_due) + atomic_load(&f->opened_count)
        + atomic_load(&f->looked_count);
    if (waiting)  /* (it does not sleep then) */
        atomic_store(&f->trio_sleeping, 0);
    return waiting;
}

/* The trio thread wrote slot id's answer (out header in the header's first 16 bytes, body in
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

void *ck_fring_header(struct ck_fring *f, int id) { return f->slots[id].hdr; }

void *ck_fring_payload(struct ck_fring *f, int id) { return f->slots[id].payload; }

int ck_fring_error(struct ck_fring *f) { return atomic_load(&f->error); }

int ck_fring_gone(struct ck_fring *f) { return atomic_load(&f->gone); }

/* /dev/fuse: the threads start reading it (the trio thread has set them up). */
void ck_fring_go(struct ck_fring *f)
{
    atomic_store(&f->go, 1);
    for (int i = 0; i < f->nqueues; i++)
        fr_wake(&f->queues[i]);
}

/* RELEASE and CREATE answered here (1, from the start) or handed over as any request (0: the
 * mount stops; the trio thread takes what was noted before). */
void ck_fring_defer_here(struct ck_fring *f, int on)
{
    pthread_mutex_lock(&f->lock);
    f->defer_here = on;
    pthread_mutex_unlock(&f->lock);
}

/* The flusher has an error to report (1: FLUSH goes to the trio thread) or not (0). */
void ck_fring_flush_fails(struct ck_fring *f, int on) { atomic_store(&f->flush_fails, on); }

/* Handles released here whose release the trio thread has not taken yet. */
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

static void ck_fring_free(struct ck_fring *f)
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
