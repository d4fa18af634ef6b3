/* The io_uring engine's C layer over the system liburing (io/uring.h says what it offers;
 * io/uring.py drives it). Built only where liburing is usable (io/uring_stub.c otherwise). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <liburing.h>

#include "uring.h"

struct ck_ring {
    struct io_uring ring;
    int registered;
};

int ck_have_uring(void) { return 1; }
const char *ck_build_info(void) { return "liburing " CK_URING_VERSION; }

struct ck_ring *ck_ring_open(unsigned int entries, int *err, unsigned int *features)
{
    struct ck_ring *r = calloc(1, sizeof(*r));
    struct io_uring_params p;
    int ret;

    *features = 0;
    if (!r) {
        *err = ENOMEM;
        return NULL;
    }
    memset(&p, 0, sizeof(p));
#ifdef IORING_SETUP_COOP_TASKRUN
    /* No IPI to interrupt the submitter for task work: completions are processed when we
       enter the kernel to wait, which is exactly our usage pattern. */
    p.flags = IORING_SETUP_COOP_TASKRUN;
#endif
    ret = io_uring_queue_init_params(entries, &r->ring, &p);
    if (ret == -EINVAL && p.flags) {
        memset(&p, 0, sizeof(p));
        ret = io_uring_queue_init_params(entries, &r->ring, &p);
    }
    if (ret < 0) {
        *err = -ret;
        free(r);
        return NULL;
    }
    *err = 0;
    *features = p.features;
    return r;
}

void ck_ring_close(struct ck_ring *r)
{
    if (!r)
        return;
    io_uring_queue_exit(&r->ring);
    free(r);
}

unsigned int ck_ring_sq_space(struct ck_ring *r)
{
    return io_uring_sq_space_left(&r->ring);
}

/* Prep up to n SQEs and submit them.  Returns the number of requests taken from reqs (they are
   in the SQ ring; the kernel consumes them on this or a later io_uring_enter), or -errno if
   nothing could be taken. */
int ck_ring_submit(struct ck_ring *r, const struct ck_req *reqs, unsigned int n)
{
    unsigned int i;

    for (i = 0; i < n; i++) {
        const struct ck_req *q = &reqs[i];
        struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
        void *addr = (void *)(uintptr_t)q->addr;

        if (!sqe)
            break;
        switch (q->op) {
        case CK_OP_WRITE:
            if (q->buf_index >= 0)
                io_uring_prep_write_fixed(sqe, q->fd, addr, q->len, q->off, q->buf_index);
            else
                io_uring_prep_write(sqe, q->fd, addr, q->len, q->off);
            break;
        case CK_OP_READ:
            if (q->buf_index >= 0)
                io_uring_prep_read_fixed(sqe, q->fd, addr, q->len, q->off, q->buf_index);
            else
                io_uring_prep_read(sqe, q->fd, addr, q->len, q->off);
            break;
        case CK_OP_FSYNC:
            io_uring_prep_fsync(sqe, q->fd,
                                (q->flags & CK_FSYNC_DATASYNC) ? IORING_FSYNC_DATASYNC : 0);
            break;
        default:
            io_uring_prep_nop(sqe);
            break;
        }
        if (q->flags & CK_DRAIN)
            io_uring_sqe_set_flags(sqe, IOSQE_IO_DRAIN);
        io_uring_sqe_set_data64(sqe, q->user_data);
    }
    if (i == 0)
        return n ? -EBUSY : 0;
    /* An error here (-EAGAIN, -EBUSY, -EINTR, ...) leaves the SQEs in the SQ ring: they go to
       the kernel with the next io_uring_enter (ck_ring_reap submits before it waits). */
    (void)io_uring_submit(&r->ring);
    return (int)i;
}

/* Copy out up to max completions.  While fewer than wait_nr were copied and none are ready,
   submit anything still in the SQ and wait in the kernel (cffi released the GIL).
   Returns the number copied, or -errno if none (e.g. -EINTR: Python runs signal handlers). */
int ck_ring_reap(struct ck_ring *r, unsigned int wait_nr, uint64_t *user_data, int32_t *res,
                 unsigned int max)
{
    struct io_uring_cqe *cqes[256];
    unsigned int got, want, i, total = 0;
    int ret;

    if (wait_nr > max)
        wait_nr = max;
    for (;;) {
        want = max - total;
        if (want > 256)
            want = 256;
        got = io_uring_peek_batch_cqe(&r->ring, cqes, want);
        for (i = 0; i < got; i++) {
            user_data[total + i] = io_uring_cqe_get_data64(cqes[i]);
            res[total + i] = cqes[i]->res;
        }
        io_uring_cq_advance(&r->ring, got);
        total += got;
        if (total >= max)
            return (int)total;
        if (got == want)
            continue;            /* there may be more ready */
        if (total >= wait_nr)
            return (int)total;
        ret = io_uring_submit_and_wait(&r->ring, wait_nr - total);
        if (ret < 0 && ret != -EAGAIN && ret != -EBUSY)
            return total ? (int)total : ret;
    }
}

int ck_ring_register_buffers(struct ck_ring *r, void **addrs, size_t *lens, unsigned int n)
{
    struct iovec *iov = calloc(n ? n : 1, sizeof(*iov));
    unsigned int i;
    int ret;

    if (!iov)
        return -ENOMEM;
    for (i = 0; i < n; i++) {
        iov[i].iov_base = addrs[i];
        iov[i].iov_len = lens[i];
    }
    if (r->registered) {
        io_uring_unregister_buffers(&r->ring);
        r->registered = 0;
    }
    ret = io_uring_register_buffers(&r->ring, iov, n);
    free(iov);
    if (ret == 0)
        r->registered = 1;
    return ret;
}

int ck_ring_unregister_buffers(struct ck_ring *r)
{
    int ret = 0;
    if (r->registered) {
        ret = io_uring_unregister_buffers(&r->ring);
        r->registered = 0;
    }
    return ret;
}
