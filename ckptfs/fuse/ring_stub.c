/* The queue threads where the module is built without liburing: ck_fring_start fails with
 * ENOSYS (fuse/ring.py then says why: ck_build_info), and the rest does nothing. */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#include "ring.h"

struct ck_fring { int unused; };
struct ck_fring *ck_fring_start(int fd, int nq, int d, uint32_t p, int w, double s,
                                const int *cpus, int *err)
{
    (void)fd; (void)nq; (void)d; (void)p; (void)w; (void)s; (void)cpus;
    *err = ENOSYS;
    return NULL;
}
int ck_fring_take(struct ck_fring *f, int *i, int m) { (void)f; (void)i; (void)m; return 0; }
int ck_fring_pending(struct ck_fring *f) { (void)f; return 0; }
int ck_fring_landed(struct ck_fring *f) { (void)f; return 0; }
int ck_fring_released(struct ck_fring *f) { (void)f; return 0; }
int ck_fring_take_released(struct ck_fring *f, uint64_t *o, int m)
{ (void)f; (void)o; (void)m; return 0; }
void ck_fring_defer_here(struct ck_fring *f, int on) { (void)f; (void)on; }
void ck_fring_create_setup(struct ck_fring *f, const struct ck_fring_policy *p)
{ (void)f; (void)p; }
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
int ck_fring_attr_put(struct ck_fring *f, uint64_t n, const void *o, uint32_t l, int64_t g)
{ (void)f; (void)n; (void)o; (void)l; (void)g; return -ENOSYS; }
void ck_fring_attr_clear(struct ck_fring *f) { (void)f; }
int ck_fring_window(struct ck_fring *f, uint64_t fh, uint64_t nd, uint32_t of, uint64_t s,
                    int e, int n, char **p, const uint32_t *l)
{ (void)f; (void)fh; (void)nd; (void)of; (void)s; (void)e; (void)n; (void)p; (void)l;
  return 0; }
void ck_fring_window_drop(struct ck_fring *f, uint64_t fh) { (void)f; (void)fh; }
int ck_fring_reads(struct ck_fring *f) { (void)f; return 0; }
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
