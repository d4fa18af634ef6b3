/* The io_uring engine without liburing (not usable where the module was built): every call
 * fails with ENOSYS and ck_have_uring() is 0, so the package still installs and imports and
 * open_engine("auto") picks the POSIX engine, logging ck_build_info()'s reason. */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#include "uring.h"

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

