/* FUSE's wire protocol as ckptfs speaks it (linux/fuse.h, protocol 7.12 and later, and FUSE
 * over io_uring from 7.42): the one definition of the opcodes, flags and layouts that the
 * queue threads (fuse/ring*.c) and the fast path (fuse/fastpath.py, through
 * fuse/protocol.py, which reads this file) both use. Debian's linux/fuse.h predates FUSE
 * over io_uring, so the part ckptfs needs is written out here.
 *
 * Kept to what fuse/protocol.py parses: `#define NAME number` and structs of fixed-size
 * integer fields and arrays, laid out without implicit padding (as the kernel's are), so a
 * struct's little-endian Python format has the C compiler's offsets (tests/test_protocol.py
 * compares them with the compiled module's). Times are signed: ckptfs keeps times before
 * 1970. A struct the kernel grew over the versions holds the fields ckptfs reads (noted). */
#ifndef CKPTFS_FUSE_PROTOCOL_H
#define CKPTFS_FUSE_PROTOCOL_H

#include <stdint.h>

/* opcodes (fuse_in_header.opcode) */
#define FUSE_LOOKUP 1
#define FUSE_FORGET 2
#define FUSE_GETATTR 3
#define FUSE_SETATTR 4
#define FUSE_OPEN 14
#define FUSE_READ 15
#define FUSE_WRITE 16
#define FUSE_RELEASE 18
#define FUSE_FSYNC 20
#define FUSE_GETXATTR 22
#define FUSE_FLUSH 25
#define FUSE_INIT 26
#define FUSE_RELEASEDIR 29
#define FUSE_FSYNCDIR 30
#define FUSE_CREATE 35
#define FUSE_INTERRUPT 36
#define FUSE_IOCTL 39
#define FUSE_BATCH_FORGET 42

/* FUSE over io_uring's commands (the SQE's cmd_op) */
#define FUSE_IO_URING_CMD_REGISTER 1
#define FUSE_IO_URING_CMD_COMMIT_AND_FETCH 2

/* fuse_write_in.write_flags */
#define FUSE_WRITE_CACHE 1           /* the kernel's writeback of page-cache pages */
#define FUSE_WRITE_KILL_SUIDGID 4    /* the writer lacks CAP_FSETID (direct writes) */

/* fuse_open_out.open_flags */
#define FOPEN_DIRECT_IO 1
#define FOPEN_KEEP_CACHE 2
#define FOPEN_NONSEEKABLE 4
#define FOPEN_NOFLUSH 32

/* fuse_setattr_in.valid */
#define FATTR_MODE 1

/* INIT flags: bits 0-31 in fuse_init_in/out.flags, 32-63 in flags2 */
#define FUSE_INIT_EXT 0x40000000                 /* flags2 holds bits 32-63 */
#define FUSE_DIRECT_IO_ALLOW_MMAP 0x1000000000   /* Linux 6.6+: MAP_SHARED mmap, direct_io */
#define FUSE_OVER_IO_URING 0x20000000000         /* Linux 6.14+ */
#define FUSE_MAX_PAGES 0x400000                  /* max_pages is set */

struct fuse_in_header {
    uint32_t len;
    uint32_t opcode;
    uint64_t unique;
    uint64_t nodeid;
    uint32_t uid;
    uint32_t gid;
    uint32_t pid;
    uint16_t total_extlen;
    uint16_t padding;
};

struct fuse_out_header {
    uint32_t len;
    int32_t error;
    uint64_t unique;
};

struct fuse_attr {
    uint64_t ino;
    uint64_t size;
    uint64_t blocks;
    int64_t atime;
    int64_t mtime;
    int64_t ctime;
    uint32_t atimensec;
    uint32_t mtimensec;
    uint32_t ctimensec;
    uint32_t mode;
    uint32_t nlink;
    uint32_t uid;
    uint32_t gid;
    uint32_t rdev;
    uint32_t blksize;
    uint32_t flags;
};

struct fuse_attr_out {
    uint64_t attr_valid;
    uint32_t attr_valid_nsec;
    uint32_t dummy;
    struct fuse_attr attr;
};

struct fuse_entry_out {
    uint64_t nodeid;
    uint64_t generation;
    uint64_t entry_valid;
    uint64_t attr_valid;
    uint32_t entry_valid_nsec;
    uint32_t attr_valid_nsec;
    struct fuse_attr attr;
};

struct fuse_open_in {
    uint32_t flags;
    uint32_t open_flags;
};

struct fuse_open_out {
    uint64_t fh;
    uint32_t open_flags;
    int32_t backing_id;
};

/* CREATE's op part; the name follows it */
struct fuse_create_in {
    uint32_t flags;
    uint32_t mode;
    uint32_t umask;
    uint32_t open_flags;
};

struct fuse_read_in {
    uint64_t fh;
    uint64_t offset;
    uint32_t size;
    uint32_t read_flags;
    uint64_t lock_owner;
    uint32_t flags;
    uint32_t padding;
};

struct fuse_write_in {
    uint64_t fh;
    uint64_t offset;
    uint32_t size;
    uint32_t write_flags;
    uint64_t lock_owner;
    uint32_t flags;
    uint32_t padding;
};

struct fuse_write_out {
    uint32_t size;
    uint32_t padding;
};

struct fuse_flush_in {
    uint64_t fh;
    uint32_t unused;
    uint32_t padding;
    uint64_t lock_owner;
};

struct fuse_release_in {
    uint64_t fh;
    uint32_t flags;
    uint32_t release_flags;
    uint64_t lock_owner;
};

struct fuse_interrupt_in {
    uint64_t unique;
};

struct fuse_setattr_in {
    uint32_t valid;
    uint32_t padding;
    uint64_t fh;
    uint64_t size;
    uint64_t lock_owner;
    int64_t atime;
    int64_t mtime;
    int64_t ctime;
    uint32_t atimensec;
    uint32_t mtimensec;
    uint32_t ctimensec;
    uint32_t mode;
    uint32_t unused4;
    uint32_t uid;
    uint32_t gid;
    uint32_t unused5;
};

/* (the fields ckptfs reads: the kernel's is longer since 7.36, and sends no more before) */
struct fuse_init_in {
    uint32_t major;
    uint32_t minor;
    uint32_t max_readahead;
    uint32_t flags;
    uint32_t flags2;
};

struct fuse_init_out {
    uint32_t major;
    uint32_t minor;
    uint32_t max_readahead;
    uint32_t flags;
    uint16_t max_background;
    uint16_t congestion_threshold;
    uint32_t max_write;
    uint32_t time_gran;   /* 7.23+: the reply is 64 bytes from here on (24 before) */
    uint16_t max_pages;   /* 7.28+ */
    uint16_t map_alignment;
    uint32_t flags2;
    uint32_t max_stack_depth;
    uint16_t request_timeout;
    uint16_t unused[11];
};

/* FUSE over io_uring: an entry's header buffer (the request's in header, or the answer's out
 * header, then the op's fixed part, then the entry's own fields); the rest of a request
 * (names, a WRITE's payload) and an answer's body go in the entry's payload buffer */
struct fuse_uring_ent_in_out {
    uint64_t flags;
    uint64_t commit_id;
    uint32_t payload_sz;
    uint32_t padding;
    uint64_t reserved;
};

struct fuse_uring_req_header {
    char in_out[128];
    char op_in[128];
    struct fuse_uring_ent_in_out ring_ent_in_out;
};

/* the command area of a REGISTER or COMMIT_AND_FETCH SQE (SQE128) */
struct fuse_uring_cmd_req {
    uint64_t flags;
    uint64_t commit_id;
    uint16_t qid;
    uint8_t padding[6];
};

#endif
