/* FUSE over io_uring (--fuse-uring): the queue threads' transport where the kernel offers it.
 * With FUSE_OVER_IO_URING negotiated in INIT, the kernel keeps one request queue per CPU and
 * puts a request on the queue of the CPU its caller runs on. One queue thread per queue,
 * pinned to that CPU, holds the queue's entries in its own ring: REGISTER each, then
 * COMMIT_AND_FETCH (the answer of one request and the wait for the next in one command). A
 * request arrives in its entry's buffers (the header and the op's fixed part in the header
 * buffer, the rest in the payload buffer) and is served by fr_dispatch (fuse/ring.c); an
 * answer given here or by the trio thread goes back in the same entry.
 */
#include "ring_internal.h"

/* The queue's ring: SQE128, for the command area of FUSE's commands. */
int fr_uring_setup(struct fr_queue *q)
{
    struct io_uring_params par = { .flags = IORING_SETUP_SQE128 };
    int r = io_uring_queue_init_params(4 * q->f->depth + 8, &q->ring, &par);
    q->ring_ok = r == 0;
    return r;
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

int fr_queue_cmd(struct fr_queue *q, int idx, uint32_t cmd, uint64_t commit_id)
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
    struct fuse_uring_cmd_req *c = (void *)sqe->cmd;
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

/* Requests the kernel delivered: to the trio thread. Returns how many CQEs were seen, or
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
            if (fr_queue_cmd(q, (int)tag, FUSE_IO_URING_CMD_COMMIT_AND_FETCH, s->hdr->ring_ent_in_out.commit_id) < 0)
                return -EBUSY;
        }
    }
    return n;
}

static int fr_cqe_ready(struct fr_queue *q, void *arg)
{
    (void)arg;
    struct io_uring_cqe *cqe;
    return io_uring_peek_cqe(&q->ring, &cqe) == 0;
}

void *fr_serve_uring(void *arg)
{
    struct fr_queue *q = arg;
    struct ck_fring *f = q->f;
    int err = 0;
    fr_pin(q);
    for (int i = q->first_slot; i < q->first_slot + f->depth && !err; i++)
        err = fr_queue_cmd(q, i, FUSE_IO_URING_CMD_REGISTER, 0);
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
        if (q->waited_with_trio > 0 && f->spin_s > 0) {
            /* A caller on this CPU waits for the trio thread's answer: poll for it, so that
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
