/* The io_uring engine's C layer (io/uring.c over the system liburing; io/uring.py drives it):
 * the one declaration of its request descriptor and calls, read by the cffi module's
 * declarations (io/_uring_build.py) and included by the C. One call preps and submits a
 * batch of SQEs from an array of descriptors; one call waits (in the kernel, the GIL
 * released by cffi) and copies a batch of CQEs out. The liburing functions that are
 * `static inline` are used only in the C, so Python code never touches the ring's
 * layout. */
#ifndef CKPTFS_IO_URING_H
#define CKPTFS_IO_URING_H

#include <stddef.h>
#include <stdint.h>

#define CK_OP_WRITE 1
#define CK_OP_READ 2
#define CK_OP_FSYNC 3
#define CK_FSYNC_DATASYNC 1
#define CK_DRAIN 2

struct ck_req {
    int op;              /* CK_OP_* */
    int fd;
    int buf_index;       /* >= 0: READ_FIXED/WRITE_FIXED with this registered buffer */
    unsigned int flags;  /* CK_FSYNC_DATASYNC for fsync; CK_DRAIN: IOSQE_IO_DRAIN */
    uint64_t addr;
    uint32_t len;
    uint64_t off;
    uint64_t user_data;
};

struct ck_ring;

struct ck_ring *ck_ring_open(unsigned int entries, int *err, unsigned int *features);
void ck_ring_close(struct ck_ring *r);
int ck_ring_submit(struct ck_ring *r, const struct ck_req *reqs, unsigned int n);
int ck_ring_reap(struct ck_ring *r, unsigned int wait_nr, uint64_t *user_data, int32_t *res,
                 unsigned int max);
int ck_ring_register_buffers(struct ck_ring *r, void **addrs, size_t *lens, unsigned int n);
int ck_ring_unregister_buffers(struct ck_ring *r);
unsigned int ck_ring_sq_space(struct ck_ring *r);
/* 1 where the module was built with liburing; else 0, and ck_build_info says why not */
int ck_have_uring(void);
const char *ck_build_info(void);

#endif
