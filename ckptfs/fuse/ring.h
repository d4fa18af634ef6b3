/* The queue threads' interface to the trio thread (fuse/ring.py): the one declaration of the
 * records they exchange and of the calls the trio thread makes. The cffi module's
 * declarations are this file's text (io/_uring_build.py drops the preprocessor lines cffi does
 * not read), and the C (fuse/ring*.c) includes it, so the two cannot differ.
 *
 * The trio thread decides; the queue threads carry out what it handed them: which requests
 * may be answered in C at all (ck_fring_defer_here, flush_fails, absent_until, the writable
 * handles), the answers it prepared (directory attributes, names, LOOKUP answers, read
 * windows) and, for the files they create, what such a file is (struct ck_fring_policy). */
#ifndef CKPTFS_FUSE_RING_H
#define CKPTFS_FUSE_RING_H

#include <stddef.h>
#include <stdint.h>

#define CK_FRING_WINDOWS 64      /* handles with a read window at most */
#define CK_FRING_WINDOW_PARTS 4  /* buffers per window */
#define CK_FRING_NAME_DIRS 32    /* directories whose names the queue threads hold at most */
#define CK_FRING_NAME_MAX 255    /* a name's bytes at most */

struct ck_fring;

/* What a file the queue threads create is, as the trio thread decided it (fuse/ops.py:
 * new_file_mode, inherited_gid; fuse/handles.py: file_info; fuse/landing.py hands it over):
 * the queue threads apply it to a CREATE and decide nothing of their own. */
struct ck_fring_policy {
    uint64_t entry_valid;  /* the new file's entry timeout (s, ns) */
    uint32_t entry_valid_nsec;
    uint32_t attr_valid_nsec;
    uint64_t attr_valid;  /* its attributes' timeout (s, ns) */
    uint32_t file_type;  /* S_IFREG: the type bits of its mode */
    uint32_t mode_bits;  /* the bits of CREATE's mode it keeps, those the umask leaves */
    uint32_t blksize;  /* its attributes' blksize */
    uint32_t open_flags[4];  /* FOPEN_* of its handle, by the open's access mode (O_ACCMODE) */
    uint32_t writes_here[4];  /* 1: its handle takes writes (ck_fring_writable), by mode */
    uint32_t no_writes_mode;  /* ... unless its mode has one of these bits (set-user/group-ID:
                               * a WRITE may have to clear them first, on the trio thread) */
};

/* A landed WRITE, as the trio thread records it (copied: an entry answered here goes back to
 * the kernel at once). */
struct ck_fring_landed {
    int id, answered;
    uint32_t k1, k2, size, flags, pid, pad;
    uint64_t fh, off;
    uint32_t crc1, crc2;  /* the CRC32C of the k1, k2 bytes where summed (ck_fring_sum_landed) */
    int summed, pad2;
};

/* A file created here, as the trio thread makes it in the tree (ops.create_open). */
struct ck_fring_created {
    uint64_t parent, ino, fh;
    int64_t now_ns;  /* CLOCK_REALTIME: the file's times and its directory's */
    uint32_t mode, uid, gid, flags, pid, namelen;  /* mode: umask applied; gid: the caller's */
    char name[256];
};

/* A READ answered here, as the trio thread accounts for it (readahead, the read cache's use). */
struct ck_fring_read {
    uint64_t fh, off;
    uint32_t size, n;  /* asked for, answered */
};

/* An OPEN answered here from a prepared window, as the trio thread makes the handle. */
struct ck_fring_opened {
    uint64_t fh, nodeid;
    uint32_t flags, uid, gid, pid;
};

/* the queue threads (fuse/ring.c) */
struct ck_fring *ck_fring_start(int fuse_fd, int nqueues, int depth, uint32_t payload,
                                int wake_fd, double spin_s, const int *cpus, int *err);
int ck_fring_stop(struct ck_fring *f);
void ck_fring_go(struct ck_fring *f);
int ck_fring_take(struct ck_fring *f, int *ids, int max);
int ck_fring_pending(struct ck_fring *f);
int ck_fring_sleep(struct ck_fring *f, int sleeping);
void ck_fring_answer(struct ck_fring *f, int id);
void *ck_fring_header(struct ck_fring *f, int id);
void *ck_fring_payload(struct ck_fring *f, int id);
int ck_fring_error(struct ck_fring *f);
int ck_fring_gone(struct ck_fring *f);
void ck_fring_defer_here(struct ck_fring *f, int on);
void ck_fring_flush_fails(struct ck_fring *f, int on);
int ck_fring_released(struct ck_fring *f);
int ck_fring_take_released(struct ck_fring *f, uint64_t *out, int max);
int ck_fring_queue_counts(struct ck_fring *f, int qid, long *out, int n);

/* landed writes and the handles that take writes (fuse/ring_landing.c) */
void ck_fring_file_bytes_max(struct ck_fring *f, uint64_t n);
void ck_fring_offer(struct ck_fring *f, void *p1, uint32_t n1, void *p2, uint32_t n2);
int ck_fring_revoke(struct ck_fring *f);
int ck_fring_landed(struct ck_fring *f);
int ck_fring_take_landed(struct ck_fring *f, struct ck_fring_landed *out, int max);
int ck_fring_sum_landed(struct ck_fring *f);
int ck_fring_writable(struct ck_fring *f, uint64_t fh, int on);
int ck_fring_writable_count(struct ck_fring *f);

/* directories: attributes, names, CREATE (fuse/ring_dirs.c) */
int ck_fring_attr_put(struct ck_fring *f, uint64_t nodeid, const void *out, uint32_t len,
                      int64_t new_gid);
void ck_fring_attr_clear(struct ck_fring *f);
int ck_fring_names_put(struct ck_fring *f, uint64_t nodeid, const char *names, uint32_t len,
                       uint32_t count);
void ck_fring_name_add(struct ck_fring *f, uint64_t nodeid, const char *name, uint32_t len);
int ck_fring_names_has(struct ck_fring *f, uint64_t nodeid);
uint32_t ck_fring_names_held(struct ck_fring *f, uint64_t *out, uint32_t max);
void ck_fring_names_drop(struct ck_fring *f, uint64_t nodeid);
void ck_fring_absent_until(struct ck_fring *f, double until);
void ck_fring_create_setup(struct ck_fring *f, const struct ck_fring_policy *policy);
void ck_fring_reserve(struct ck_fring *f, uint64_t ino, uint64_t fh, uint32_t n);
int ck_fring_reserve_left(struct ck_fring *f);
int ck_fring_created(struct ck_fring *f);
int ck_fring_take_created(struct ck_fring *f, struct ck_fring_created *out, int max);

/* a restore's answers: prepared LOOKUPs, read windows, OPEN and READ (fuse/ring_reads.c) */
int ck_fring_lookup_put(struct ck_fring *f, uint64_t parent, const char *name, uint32_t len,
                        uint64_t nodeid, const void *out);
void ck_fring_lookup_drop(struct ck_fring *f, uint64_t parent, const char *name, uint32_t len);
void ck_fring_lookups_clear(struct ck_fring *f);
int ck_fring_looked(struct ck_fring *f);
int ck_fring_take_looked(struct ck_fring *f, uint64_t *out, int max);
int ck_fring_window(struct ck_fring *f, uint64_t fh, uint64_t nodeid, uint32_t open_flags,
                    uint64_t start, int eof, int nparts, char **parts, const uint32_t *lens);
void ck_fring_window_drop(struct ck_fring *f, uint64_t fh);
int ck_fring_reads(struct ck_fring *f);
int ck_fring_take_reads(struct ck_fring *f, struct ck_fring_read *out, int max);
int ck_fring_opened(struct ck_fring *f);
int ck_fring_take_opened(struct ck_fring *f, struct ck_fring_opened *out, int max);

/* CRC32C of the landed bytes (fuse/crc32c.c; built with or without liburing) */
int ck_crc32c_hw(void);
uint32_t ck_crc32c(uint32_t crc, const void *p, size_t n);
uint32_t ck_crc32c_shift(uint32_t crc, uint64_t n);

#endif
