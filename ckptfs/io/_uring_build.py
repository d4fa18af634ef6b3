"""cffi API-mode builder for ``ckptfs.io._uring_cffi`` (a thin C layer over the system liburing).

Used by setup.py (``cffi_modules=["ckptfs/io/_uring_build.py:ffibuilder"]``).  The C side does
the per-request work in batches: one call preps N SQEs from an array of request descriptors and
submits them; one call waits (in the kernel, GIL released by cffi) and copies a batch of CQEs
out.  The liburing functions that 2.3 defines ``static inline`` are used only inside this C code,
so the Python side never touches the ring layout.

If liburing is missing at install time (no header, no library: checked by compiling and linking
a tiny probe program), the install does not fail: the module is built from STUB_SOURCE instead,
whose functions all fail with ENOSYS, and ``ckptfs.io.open_engine("auto")`` falls back to the
posix engine and logs the build-time reason (``ck_build_info()``).  CKPTFS_BUILD_NO_URING=1 at
build time forces the stub (to test that path).  A C compiler is still required, as for any
cffi API-mode module (and for pyfuse3).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sysconfig
import tempfile

from cffi import FFI

CDEF = r"""
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
int ck_have_uring(void);
const char *ck_build_info(void);

/* CRC32C in C (fuse/crc32c.c): the checksums of the writes the queue threads land */
int ck_crc32c_hw(void);
uint32_t ck_crc32c(uint32_t crc, const void *p, size_t n);
uint32_t ck_crc32c_shift(uint32_t crc, uint64_t n);

/* FUSE over io_uring's queue threads (fuse/ring.c, fuse/ring.py) */
struct ck_fring;
struct ck_fring_landed {
    int id, answered;
    uint32_t k1, k2, size, flags, pid, pad;
    uint64_t fh, off;
    uint32_t crc1, crc2;
    int summed, pad2;
};
struct ck_fring *ck_fring_start(int fuse_fd, int nqueues, int depth, uint32_t payload,
                                int wake_fd, double spin_s, const int *cpus, int *err);
int ck_fring_take(struct ck_fring *f, int *ids, int max);
int ck_fring_pending(struct ck_fring *f);
int ck_fring_landed(struct ck_fring *f);
int ck_fring_released(struct ck_fring *f);
int ck_fring_take_released(struct ck_fring *f, uint64_t *out, int max);
void ck_fring_defer_here(struct ck_fring *f, int on);
struct ck_fring_created {
    uint64_t parent, ino, fh;
    int64_t now_ns;
    uint32_t mode, uid, gid, flags, pid, namelen;
    char name[256];
};
void ck_fring_create_setup(struct ck_fring *f, int direct_writes, uint64_t entry_valid,
                           uint32_t entry_valid_ns);
void ck_fring_reserve(struct ck_fring *f, uint64_t ino, uint64_t fh, uint32_t n);
void ck_fring_file_bytes_max(struct ck_fring *f, uint64_t n);
int ck_fring_reserve_left(struct ck_fring *f);
int ck_fring_created(struct ck_fring *f);
int ck_fring_take_created(struct ck_fring *f, struct ck_fring_created *out, int max);
int ck_fring_sleep(struct ck_fring *f, int sleeping);
void ck_fring_answer(struct ck_fring *f, int id);
void ck_fring_offer(struct ck_fring *f, void *p1, uint32_t n1, void *p2, uint32_t n2);
int ck_fring_revoke(struct ck_fring *f);
int ck_fring_take_landed(struct ck_fring *f, struct ck_fring_landed *out, int max);
int ck_fring_sum_landed(struct ck_fring *f);
int ck_fring_writable(struct ck_fring *f, uint64_t fh, int on);
int ck_fring_writable_count(struct ck_fring *f);
void *ck_fring_header(struct ck_fring *f, int id);
void *ck_fring_payload(struct ck_fring *f, int id);
int ck_fring_error(struct ck_fring *f);
int ck_fring_gone(struct ck_fring *f);
void ck_fring_go(struct ck_fring *f);
void ck_fring_flush_fails(struct ck_fring *f, int on);
int ck_fring_attr_put(struct ck_fring *f, uint64_t nodeid, const void *out, uint32_t len);
void ck_fring_attr_clear(struct ck_fring *f);
int ck_fring_names_put(struct ck_fring *f, uint64_t nodeid, const char *names, uint32_t len,
                       uint32_t count);
void ck_fring_name_add(struct ck_fring *f, uint64_t nodeid, const char *name, uint32_t len);
int ck_fring_names_has(struct ck_fring *f, uint64_t nodeid);
uint32_t ck_fring_names_held(struct ck_fring *f, uint64_t *out, uint32_t max);
void ck_fring_names_drop(struct ck_fring *f, uint64_t nodeid);
void ck_fring_absent_until(struct ck_fring *f, double until);
struct ck_fring_read { uint64_t fh, off; uint32_t size, n; };
int ck_fring_window(struct ck_fring *f, uint64_t fh, uint64_t nodeid, uint32_t open_flags,
                    uint64_t start, int eof, int nparts, char **parts, const uint32_t *lens);
void ck_fring_window_drop(struct ck_fring *f, uint64_t fh);
int ck_fring_reads(struct ck_fring *f);
struct ck_fring_opened { uint64_t fh, nodeid; uint32_t flags, uid, gid, pid; };
int ck_fring_opened(struct ck_fring *f);
int ck_fring_take_opened(struct ck_fring *f, struct ck_fring_opened *out, int max);
int ck_fring_lookup_put(struct ck_fring *f, uint64_t parent, const char *name, uint32_t len,
                        uint64_t nodeid, const void *out);
void ck_fring_lookup_drop(struct ck_fring *f, uint64_t parent, const char *name, uint32_t len);
void ck_fring_lookups_clear(struct ck_fring *f);
int ck_fring_looked(struct ck_fring *f);
int ck_fring_take_looked(struct ck_fring *f, uint64_t *out, int max);
int ck_fring_take_reads(struct ck_fring *f, struct ck_fring_read *out, int max);
int ck_fring_queue_counts(struct ck_fring *f, int qid, long *out, int n);
int ck_fring_stop(struct ck_fring *f);
"""

SOURCE = r"""
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <liburing.h>

#define CK_OP_WRITE 1
#define CK_OP_READ 2
#define CK_OP_FSYNC 3
#define CK_FSYNC_DATASYNC 1
#define CK_DRAIN 2

struct ck_req {
    int op;
    int fd;
    int buf_index;
    unsigned int flags;
    uint64_t addr;
    uint32_t len;
    uint64_t off;
    uint64_t user_data;
};

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
"""


# Same descriptor/ABI, no liburing: every entry point fails with ENOSYS and ck_have_uring()
# returns 0, so the package still installs and imports, and open_engine("auto") picks posix.
STUB_SOURCE = r"""
#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#define CK_OP_WRITE 1
#define CK_OP_READ 2
#define CK_OP_FSYNC 3
#define CK_FSYNC_DATASYNC 1
#define CK_DRAIN 2

struct ck_req {
    int op; int fd; int buf_index; unsigned int flags;
    uint64_t addr; uint32_t len; uint64_t off; uint64_t user_data;
};
struct ck_ring { int unused; };

int ck_have_uring(void) { return 0; }
const char *ck_build_info(void) { return CK_STUB_REASON; }
struct ck_ring *ck_ring_open(unsigned int entries, int *err, unsigned int *features)
{ (void)entries; *features = 0; *err = ENOSYS; return NULL; }
void ck_ring_close(struct ck_ring *r) { (void)r; }
int ck_ring_submit(struct ck_ring *r, const struct ck_req *q, unsigned int n)
{ (void)r; (void)q; (void)n; return -ENOSYS; }
int ck_ring_reap(struct ck_ring *r, unsigned int w, uint64_t *u, int32_t *s, unsigned int m)
{ (void)r; (void)w; (void)u; (void)s; (void)m; return -ENOSYS; }
int ck_ring_register_buffers(struct ck_ring *r, void **a, size_t *l, unsigned int n)
{ (void)r; (void)a; (void)l; (void)n; return -ENOSYS; }
int ck_ring_unregister_buffers(struct ck_ring *r) { (void)r; return -ENOSYS; }
unsigned int ck_ring_sq_space(struct ck_ring *r) { (void)r; return 0; }

struct ck_fring { int unused; };
struct ck_fring *ck_fring_start(int fd, int nq, int d, uint32_t p, int w, double s,
                                const int *cpus, int *err)
{ (void)fd; (void)nq; (void)d; (void)p; (void)w; (void)s; (void)cpus; *err = ENOSYS; return NULL; }
int ck_fring_take(struct ck_fring *f, int *i, int m) { (void)f; (void)i; (void)m; return 0; }
int ck_fring_pending(struct ck_fring *f) { (void)f; return 0; }
int ck_fring_landed(struct ck_fring *f) { (void)f; return 0; }
int ck_fring_released(struct ck_fring *f) { (void)f; return 0; }
int ck_fring_take_released(struct ck_fring *f, uint64_t *o, int m)
{ (void)f; (void)o; (void)m; return 0; }
void ck_fring_defer_here(struct ck_fring *f, int on) { (void)f; (void)on; }
struct ck_fring_created { uint64_t parent, ino, fh; int64_t now_ns;
                          uint32_t mode, uid, gid, flags, pid, namelen; char name[256]; };
void ck_fring_create_setup(struct ck_fring *f, int d, uint64_t e, uint32_t n)
{ (void)f; (void)d; (void)e; (void)n; }
void ck_fring_reserve(struct ck_fring *f, uint64_t i, uint64_t h, uint32_t n)
{ (void)f; (void)i; (void)h; (void)n; }
void ck_fring_file_bytes_max(struct ck_fring *f, uint64_t n) { (void)f; (void)n; }
int ck_fring_reserve_left(struct ck_fring *f) { (void)f; return 0; }
int ck_fring_created(struct ck_fring *f) { (void)f; return 0; }
int ck_fring_take_created(struct ck_fring *f, struct ck_fring_created *o, int m)
{ (void)f; (void)o; (void)m; return 0; }
int ck_fring_sleep(struct ck_fring *f, int s) { (void)f; (void)s; return 0; }
void ck_fring_answer(struct ck_fring *f, int id) { (void)f; (void)id; }
void ck_fring_offer(struct ck_fring *f, void *p1, uint32_t n1, void *p2, uint32_t n2)
{ (void)f; (void)p1; (void)n1; (void)p2; (void)n2; }
int ck_fring_revoke(struct ck_fring *f) { (void)f; return 0; }
struct ck_fring_landed { int id, answered; uint32_t k1, k2, size, flags, pid, pad;
                         uint64_t fh, off; uint32_t crc1, crc2; int summed, pad2; };
int ck_fring_take_landed(struct ck_fring *f, struct ck_fring_landed *o, int m)
{ (void)f; (void)o; (void)m; return 0; }
int ck_fring_sum_landed(struct ck_fring *f) { (void)f; return 0; }
int ck_fring_writable(struct ck_fring *f, uint64_t fh, int on)
{ (void)f; (void)fh; (void)on; return -ENOSYS; }
int ck_fring_writable_count(struct ck_fring *f) { (void)f; return 0; }
void *ck_fring_header(struct ck_fring *f, int id) { (void)f; (void)id; return NULL; }
void *ck_fring_payload(struct ck_fring *f, int id) { (void)f; (void)id; return NULL; }
int ck_fring_error(struct ck_fring *f) { (void)f; return ENOSYS; }
int ck_fring_gone(struct ck_fring *f) { (void)f; return 0; }
void ck_fring_go(struct ck_fring *f) { (void)f; }
void ck_fring_flush_fails(struct ck_fring *f, int on) { (void)f; (void)on; }
int ck_fring_attr_put(struct ck_fring *f, uint64_t n, const void *o, uint32_t l)
{ (void)f; (void)n; (void)o; (void)l; return -ENOSYS; }
void ck_fring_attr_clear(struct ck_fring *f) { (void)f; }
struct ck_fring_read { uint64_t fh, off; uint32_t size, n; };
int ck_fring_window(struct ck_fring *f, uint64_t fh, uint64_t nd, uint32_t of, uint64_t s,
                    int e, int n, char **p, const uint32_t *l)
{ (void)f; (void)fh; (void)nd; (void)of; (void)s; (void)e; (void)n; (void)p; (void)l;
  return 0; }
void ck_fring_window_drop(struct ck_fring *f, uint64_t fh) { (void)f; (void)fh; }
int ck_fring_reads(struct ck_fring *f) { (void)f; return 0; }
struct ck_fring_opened { uint64_t fh, nodeid; uint32_t flags, uid, gid, pid; };
int ck_fring_opened(struct ck_fring *f) { (void)f; return 0; }
int ck_fring_take_opened(struct ck_fring *f, struct ck_fring_opened *o, int m)
{ (void)f; (void)o; (void)m; return 0; }
int ck_fring_lookup_put(struct ck_fring *f, uint64_t p, const char *n, uint32_t l,
                        uint64_t nd, const void *o)
{ (void)f; (void)p; (void)n; (void)l; (void)nd; (void)o; return 0; }
void ck_fring_lookup_drop(struct ck_fring *f, uint64_t p, const char *n, uint32_t l)
{ (void)f; (void)p; (void)n; (void)l; }
void ck_fring_lookups_clear(struct ck_fring *f) { (void)f; }
int ck_fring_looked(struct ck_fring *f) { (void)f; return 0; }
int ck_fring_take_looked(struct ck_fring *f, uint64_t *o, int m)
{ (void)f; (void)o; (void)m; return 0; }
int ck_fring_take_reads(struct ck_fring *f, struct ck_fring_read *o, int m)
{ (void)f; (void)o; (void)m; return 0; }
int ck_fring_names_put(struct ck_fring *f, uint64_t n, const char *s, uint32_t l, uint32_t c)
{ (void)f; (void)n; (void)s; (void)l; (void)c; return -ENOSYS; }
void ck_fring_name_add(struct ck_fring *f, uint64_t n, const char *s, uint32_t l)
{ (void)f; (void)n; (void)s; (void)l; }
int ck_fring_names_has(struct ck_fring *f, uint64_t n) { (void)f; (void)n; return 0; }
uint32_t ck_fring_names_held(struct ck_fring *f, uint64_t *o, uint32_t m)
{ (void)f; (void)o; (void)m; return 0; }
void ck_fring_names_drop(struct ck_fring *f, uint64_t n) { (void)f; (void)n; }
void ck_fring_absent_until(struct ck_fring *f, double u) { (void)f; (void)u; }
int ck_fring_queue_counts(struct ck_fring *f, int q, long *o, int n)
{ (void)f; (void)q; (void)o; (void)n; return 0; }
int ck_fring_stop(struct ck_fring *f) { (void)f; return 0; }
"""

_PROBE = r"""
#include <liburing.h>
int main(void) { struct io_uring r; return io_uring_queue_init(1, &r, 0) < 0; }
"""


def _pkg_config() -> tuple[list[str], list[str], str]:
    """(cflags, libs, version) for liburing: pkg-config if it knows it, else -luring."""
    if shutil.which("pkg-config"):
        try:
            def run(*args: str) -> str:
                return subprocess.run(["pkg-config", *args, "liburing"], check=True,
                                      capture_output=True, text=True).stdout.strip()
            return shlex.split(run("--cflags")), shlex.split(run("--libs")), run("--modversion")
        except (OSError, subprocess.CalledProcessError):
            pass
    return [], ["-luring"], "unknown"


def _c_compiler() -> list[str]:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


def _probe_liburing(cflags: list[str], libs: list[str]) -> str | None:
    """None if a program using liburing compiles and links here, else the reason it does not."""
    if os.environ.get("CKPTFS_BUILD_NO_URING"):
        return "built without io_uring (CKPTFS_BUILD_NO_URING set at build time)"
    with tempfile.TemporaryDirectory(prefix="ckptfs-uring-probe-") as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as f:
            f.write(_PROBE)
        cmd = _c_compiler() + [src, "-o", os.path.join(tmp, "probe")] + cflags + libs
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            # No usable compiler for the probe: let the real build try (and fail loudly).
            return None
        if proc.returncode != 0:
            first = (proc.stderr.strip().splitlines() or ["?"])[0]
            return ("built without io_uring: liburing headers/library not usable at build "
                    "time (%s)" % first)
    return None


def _c_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


# FUSE over io_uring's queue threads: C of their own file, in this module because it is the
# one that links liburing; and their CRC32C (no liburing in it: the stub has it too).
_FUSE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fuse")
with open(os.path.join(_FUSE_DIR, "ring.c")) as _f:
    RING_SOURCE = _f.read()
with open(os.path.join(_FUSE_DIR, "crc32c.c")) as _f:
    CRC_SOURCE = _f.read()

_cflags, _libs, _version = _pkg_config()
_stub_reason = _probe_liburing(_cflags, _libs)

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
if _stub_reason is None:
    ffibuilder.set_source(
        "ckptfs.io._uring_cffi",
        SOURCE + CRC_SOURCE + RING_SOURCE,
        define_macros=[("CK_URING_VERSION", _c_string(_version)), ("_GNU_SOURCE", None)],
        extra_compile_args=["-O2"] + _cflags,
        extra_link_args=_libs + ["-pthread"],
    )
else:
    ffibuilder.set_source(
        "ckptfs.io._uring_cffi",
        STUB_SOURCE + CRC_SOURCE,
        define_macros=[("CK_STUB_REASON", _c_string(_stub_reason))],
        extra_compile_args=["-O2"],
        extra_link_args=["-pthread"],
    )


if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
