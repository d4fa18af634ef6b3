/* A small file's save without the trio thread: what the queue threads answer of a directory
 * from what the trio thread left with them.
 * - GETATTR of a directory whose answer the trio thread left here (the attribute cache: it
 *   leaves a directory's after a CREATE in it and after it answered a GETATTR of it, and
 *   clears them all whenever a directory changes): the kernel asks for the directory's
 *   attributes before every name created in it (its permission check, the attributes being
 *   invalid since the last CREATE), so a small file's save waits for the trio thread once
 *   less.
 * - LOOKUP of a name that is not there, in a directory whose names the trio thread left here
 *   (a Bloom filter of them: a name it does not hold is absent; one it holds goes to the
 *   trio thread), while the trio thread says no look at other writers is due (`--refresh`'s
 *   contract): a new file's open(O_CREAT) asks for its name first.
 * - CREATE of such a name in such a directory whose attributes it holds too: the new file's
 *   inode and handle numbers come from ranges the trio thread reserved, the file is what the
 *   trio thread's policy says (struct ck_fring_policy: its mode from the request's mode and
 *   umask, its handle's open flags, whether the handle takes writes here) and its group the
 *   one the trio thread left with the directory's attributes; the directory's cached
 *   attributes and names take the change at once, and the create is noted for the trio
 *   thread, which makes it in the tree (its INODE record, its handle) before it serves any
 *   request.
 * So a small file's save (GETATTR of the directory, LOOKUP, CREATE, WRITEs, FLUSH, RELEASE)
 * need not wait for the trio thread at all.
 */
#include "ring_internal.h"

/* The name a LOOKUP or CREATE asks for (in its payload, NUL-terminated, after an op part of
 * opsize bytes in the header), if it is one a filter can answer: not ".", "..", empty, longer
 * than NAME_MAX, or with a NUL inside; its length, else 0. */
uint32_t fr_request_name(const struct fr_slot *s, uint32_t opsize)
{
    const struct fuse_in_header *h = fr_in(s);
    uint32_t psz = s->hdr->ring_ent_in_out.payload_sz;
    if (h->total_extlen || psz < 2 || psz > NAME_MAX_LEN + 1
            || h->len != IN_HEADER_SIZE + opsize + psz
            || s->payload[psz - 1] != '\0' || memchr(s->payload, 0, psz - 1))
        return 0;
    if (s->payload[0] == '.' && (psz == 2 || (psz == 3 && s->payload[1] == '.')))
        return 0;
    return psz - 1;
}

static unsigned fr_attr_slot(uint64_t nodeid)
{
    return (unsigned)((nodeid * 0x9E3779B97F4A7C15ull) >> 56);  /* ATTR_SLOTS = 2^8 */
}

/* The cached GETATTR answer of directory nodeid, or NULL. (under lock) */
static struct fr_attr *fr_attr_of(struct ck_fring *f, uint64_t nodeid)
{
    for (unsigned i = fr_attr_slot(nodeid), n = 0; n < ATTR_PROBE;
         i = (i + 1) % ATTR_SLOTS, n++) {
        struct fr_attr *a = &f->attrs[i];
        if (a->gen == f->attr_gen && a->nodeid == nodeid)
            return a;
    }
    return NULL;
}

/* Copy the cached GETATTR answer of nodeid into out; 1 if there was one. */
int fr_attr_get(struct ck_fring *f, uint64_t nodeid, struct fuse_attr_out *out)
{
    pthread_mutex_lock(&f->lock);
    struct fr_attr *a = fr_attr_of(f, nodeid);
    if (a)
        *out = a->out;
    pthread_mutex_unlock(&f->lock);
    return a != NULL;
}

/* Whether a file created here in directory nodeid is not taken yet. (under lock) */
static int fr_creating_in(struct ck_fring *f, uint64_t nodeid)
{
    for (unsigned i = f->chead; i != f->ctail; i++)
        if (f->created[i % CREATED_MAX].parent == nodeid)
            return 1;
    return 0;
}

/* GETATTR of directory nodeid is answered here with `out` (a struct fuse_attr_out of len
 * bytes) until the next ck_fring_attr_clear; a file created in it here takes group new_gid
 * (-1: its creator's). Returns 0, or -EINVAL for a wrong length. */
int ck_fring_attr_put(struct ck_fring *f, uint64_t nodeid, const void *out, uint32_t len,
                      int64_t new_gid)
{
    if (len != sizeof(struct fuse_attr_out))
        return -EINVAL;
    pthread_mutex_lock(&f->lock);
    if (fr_creating_in(f, nodeid)) {  /* (the answer predates a create made here) */
        pthread_mutex_unlock(&f->lock);
        return -EAGAIN;
    }
    unsigned home = fr_attr_slot(nodeid), at = home;
    for (unsigned i = home, n = 0; n < ATTR_PROBE; i = (i + 1) % ATTR_SLOTS, n++) {
        struct fr_attr *a = &f->attrs[i];
        if (a->gen != f->attr_gen || a->nodeid == nodeid) {
            at = i;
            break;
        }
    }
    /* (no free slot within the probe: the home slot's directory is asked of the trio thread
     * again) */
    struct fr_attr *a = &f->attrs[at];
    a->nodeid = nodeid;
    a->gen = f->attr_gen;
    a->new_gid = new_gid;
    memcpy(&a->out, out, sizeof a->out);
    pthread_mutex_unlock(&f->lock);
    return 0;
}

/* Forget every cached directory attribute (a directory changed). */
void ck_fring_attr_clear(struct ck_fring *f)
{
    pthread_mutex_lock(&f->lock);
    f->attr_gen++;
    pthread_mutex_unlock(&f->lock);
}

static unsigned fr_names_slot(uint64_t nodeid)
{
    return (unsigned)((nodeid * 0x9E3779B97F4A7C15ull) >> 59);  /* NAME_DIRS = 2^5 */
}

/* A name's hash (64-bit FNV-1a, then a finaliser that spreads its bits over both halves). */
static uint64_t fr_name_hash(const char *name, uint32_t len)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (uint32_t i = 0; i < len; i++)
        h = (h ^ (unsigned char)name[i]) * 0x100000001b3ull;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

/* The filter of directory nodeid, or NULL. (under lock) */
static struct fr_names *fr_names_of(struct ck_fring *f, uint64_t nodeid)
{
    for (unsigned i = fr_names_slot(nodeid), n = 0; n < NAME_PROBE;
         i = (i + 1) % NAME_DIRS, n++) {
        struct fr_names *d = &f->names[i];
        if (d->bits && d->nodeid == nodeid)
            return d;
    }
    return NULL;
}

/* Set (add) or test the name's bits; returns whether all were set before. */
static int fr_names_bits(struct fr_names *d, const char *name, uint32_t len, int add)
{
    uint64_t h = fr_name_hash(name, len);
    uint32_t h1 = (uint32_t)h, h2 = (uint32_t)(h >> 32) | 1;
    int all = 1;
    for (uint32_t i = 0; i < NAME_HASHES; i++) {
        uint32_t b = (h1 + i * h2) & d->mask;
        uint64_t bit = 1ull << (b & 63);
        if (!(d->bits[b >> 6] & bit)) {
            all = 0;
            if (!add)
                break;
            d->bits[b >> 6] |= bit;
        }
    }
    return all;
}

/* Whether LOOKUP of name in directory nodeid is answered absent here: the directory has a
 * filter, the name is not in it, and no look at other writers is due. */
int fr_absent(struct ck_fring *f, uint64_t nodeid, const char *name, uint32_t len)
{
    double now = fr_now();
    int absent = 0;
    pthread_mutex_lock(&f->lock);
    struct fr_names *d = now < f->absent_until ? fr_names_of(f, nodeid) : NULL;
    if (d)
        absent = !fr_names_bits(d, name, len, 0);
    pthread_mutex_unlock(&f->lock);
    return absent;
}

/* LOOKUP of a name in directory nodeid that is none of `names` (count of them, each
 * NUL-terminated, len bytes in all) is answered absent here until the next
 * ck_fring_names_drop, while ck_fring_absent_until allows; names added later come with
 * ck_fring_name_add. Returns 0, -E2BIG for a directory too large to hold, -ENOMEM. */
int ck_fring_names_put(struct ck_fring *f, uint64_t nodeid, const char *names, uint32_t len,
                       uint32_t count)
{
    uint64_t want = (uint64_t)(count < 64 ? 64 : count) * NAME_BITS_PER * 2;
    uint32_t nbits = NAME_BITS_MIN;
    while (nbits < want && nbits < NAME_BITS_MAX)
        nbits <<= 1;
    if (nbits < want)
        return -E2BIG;
    struct fr_names d = { .nodeid = nodeid, .mask = nbits - 1, .cap = nbits / NAME_BITS_PER };
    d.bits = calloc(nbits / 64, sizeof *d.bits);  /* (outside the lock: the threads go on) */
    if (!d.bits)
        return -ENOMEM;
    for (uint32_t at = 0; at < len; ) {
        const char *end = memchr(names + at, 0, len - at);
        uint32_t n = end ? (uint32_t)(end - (names + at)) : len - at;
        fr_names_bits(&d, names + at, n, 1);
        d.count++;
        at += n + 1;
    }
    pthread_mutex_lock(&f->lock);
    /* (its own slot if it has one, else the first free one within the probe) */
    unsigned home = fr_names_slot(nodeid), at = home, free_at = NAME_DIRS;
    for (unsigned i = home, n = 0; n < NAME_PROBE; i = (i + 1) % NAME_DIRS, n++) {
        struct fr_names *o = &f->names[i];
        if (o->bits && o->nodeid == nodeid) {
            free_at = i;
            break;
        }
        if (free_at == NAME_DIRS && !o->bits)
            free_at = i;
    }
    if (free_at != NAME_DIRS)
        at = free_at;
    /* (no free slot within the probe: the home slot's directory is asked of the trio thread
     * again) */
    uint64_t *old = f->names[at].bits;
    f->names[at] = d;
    for (unsigned i = f->chead; i != f->ctail; i++) {  /* (made here, not in `names` yet) */
        struct ck_fring_created *c = &f->created[i % CREATED_MAX];
        if (c->parent == nodeid) {
            fr_names_bits(&f->names[at], c->name, c->namelen, 1);
            f->names[at].count++;
        }
    }
    pthread_mutex_unlock(&f->lock);
    free(old);
    return 0;
}

/* Name (len bytes) is now in directory nodeid: never answered absent there from now on. */
void ck_fring_name_add(struct ck_fring *f, uint64_t nodeid, const char *name, uint32_t len)
{
    uint64_t *old = NULL;
    pthread_mutex_lock(&f->lock);
    struct fr_names *d = fr_names_of(f, nodeid);
    if (d) {
        fr_names_bits(d, name, len, 1);
        if (++d->count > d->cap) {  /* (too full to answer well: built again, larger) */
            old = d->bits;
            d->bits = NULL;
        }
    }
    pthread_mutex_unlock(&f->lock);
    free(old);
}

/* Whether directory nodeid has a filter here. */
int ck_fring_names_has(struct ck_fring *f, uint64_t nodeid)
{
    pthread_mutex_lock(&f->lock);
    int has = fr_names_of(f, nodeid) != NULL;
    pthread_mutex_unlock(&f->lock);
    return has;
}

/* The directories that have a filter here (into out, at most max of them); their count. */
uint32_t ck_fring_names_held(struct ck_fring *f, uint64_t *out, uint32_t max)
{
    uint32_t n = 0;
    pthread_mutex_lock(&f->lock);
    for (int i = 0; i < NAME_DIRS && n < max; i++) {
        struct fr_names *d = &f->names[i];
        if (d->bits)
            out[n++] = d->nodeid;
    }
    pthread_mutex_unlock(&f->lock);
    return n;
}

/* Forget directory nodeid's filter (names may have come to it by other ways: other writers). */
void ck_fring_names_drop(struct ck_fring *f, uint64_t nodeid)
{
    uint64_t *old = NULL;
    pthread_mutex_lock(&f->lock);
    struct fr_names *d = fr_names_of(f, nodeid);
    if (d) {
        old = d->bits;
        d->bits = NULL;
    }
    pthread_mutex_unlock(&f->lock);
    free(old);
}

/* LOOKUP is answered absent here only before `until` (CLOCK_MONOTONIC seconds): then a look
 * at other writers is due, which the trio thread makes first. */
void ck_fring_absent_until(struct ck_fring *f, double until)
{
    pthread_mutex_lock(&f->lock);
    f->absent_until = until;
    pthread_mutex_unlock(&f->lock);
}

/* CREATE of name (len bytes) in directory nodeid, answered here when the directory's names
 * and attributes are here, the name is not among them, no look at other writers is due, and
 * numbers are left: `out` gets the answer (fuse_entry_out, fuse_open_out). Returns 1 then.
 * The new file is what the trio thread's policy says (ck_fring_create_setup), its group the
 * one the trio thread left with the directory's attributes (ck_fring_attr_put). */
int fr_create(struct ck_fring *f, const struct fr_slot *s, const char *name, uint32_t len,
              void *out)
{
    const struct fuse_in_header *h = fr_in(s);
    const struct fuse_create_in *cin = (const void *)s->hdr->op_in;
    struct { struct fuse_entry_out entry; struct fuse_open_out open; } *answer = out;
    double now = fr_now();
    struct timespec rt;
    clock_gettime(CLOCK_REALTIME, &rt);
    uint64_t *drop = NULL;
    int done = 0;
    pthread_mutex_lock(&f->lock);
    struct fr_names *d;
    struct fr_attr *a;
    if (f->create_here && f->defer_here && now < f->absent_until && f->ino_next < f->ino_end
            && f->fh_next < f->fh_end && f->ctail - f->chead < CREATED_MAX
            && (d = fr_names_of(f, h->nodeid)) && (a = fr_attr_of(f, h->nodeid))
            && !fr_names_bits(d, name, len, 0)) {
        const struct ck_fring_policy *p = &f->policy;
        uint32_t mode = p->file_type | (cin->mode & ~cin->umask & p->mode_bits);
        uint32_t gid = a->new_gid >= 0 ? (uint32_t)a->new_gid : h->gid;
        uint32_t acc = cin->flags & O_ACCMODE;
        uint64_t ino = f->ino_next++, fh = f->fh_next++;
        fr_names_bits(d, name, len, 1);
        if (++d->count > d->cap) {
            drop = d->bits;
            d->bits = NULL;
        }
        a->out.attr.mtime = a->out.attr.ctime = rt.tv_sec;  /* the directory's */
        a->out.attr.mtimensec = a->out.attr.ctimensec = (uint32_t)rt.tv_nsec;
        struct ck_fring_created *c = &f->created[f->ctail++ % CREATED_MAX];
        c->parent = h->nodeid;
        c->ino = ino;
        c->fh = fh;
        c->now_ns = (int64_t)rt.tv_sec * 1000000000 + rt.tv_nsec;
        c->mode = mode;
        c->uid = h->uid;
        c->gid = h->gid;
        c->flags = cin->flags;
        c->pid = h->pid;
        c->namelen = len;
        memcpy(c->name, name, len);
        c->name[len] = 0;
        atomic_fetch_add(&f->created_count, 1);
        /* (full: its WRITEs go to the trio thread too) */
        if (p->writes_here[acc] && !(mode & p->no_writes_mode))
            fr_fh_set(f, fh, 1);
        memset(answer, 0, sizeof *answer);
        struct fuse_entry_out *e = &answer->entry;
        e->nodeid = ino;  /* (generation 0) */
        e->entry_valid = p->entry_valid;
        e->entry_valid_nsec = p->entry_valid_nsec;
        e->attr_valid = p->attr_valid;
        e->attr_valid_nsec = p->attr_valid_nsec;
        e->attr.ino = ino;
        e->attr.atime = e->attr.mtime = e->attr.ctime = rt.tv_sec;
        e->attr.atimensec = e->attr.mtimensec = e->attr.ctimensec = (uint32_t)rt.tv_nsec;
        e->attr.mode = mode;
        e->attr.nlink = 1;
        e->attr.uid = h->uid;
        e->attr.gid = gid;
        e->attr.blksize = p->blksize;
        answer->open.fh = fh;
        answer->open.open_flags = p->open_flags[acc];
        done = 1;
    }
    pthread_mutex_unlock(&f->lock);
    free(drop);
    if (done)
        fr_wake_trio(f);
    return done;
}

/* CREATE is answered here (where the directory's names and attributes are), the new file
 * being what `policy` says. Numbers come from ck_fring_reserve. */
void ck_fring_create_setup(struct ck_fring *f, const struct ck_fring_policy *policy)
{
    pthread_mutex_lock(&f->lock);
    f->policy = *policy;
    f->create_here = 1;
    pthread_mutex_unlock(&f->lock);
}

/* Files created here take inode numbers ino .. ino + n - 1 and handles fh .. fh + n - 1 (the
 * trio thread reserved them; what is left of the ranges before is not used). */
void ck_fring_reserve(struct ck_fring *f, uint64_t ino, uint64_t fh, uint32_t n)
{
    pthread_mutex_lock(&f->lock);
    f->ino_next = ino;
    f->ino_end = ino + n;
    f->fh_next = fh;
    f->fh_end = fh + n;
    pthread_mutex_unlock(&f->lock);
}

/* Creates the reserved numbers are left for. */
int ck_fring_reserve_left(struct ck_fring *f)
{
    pthread_mutex_lock(&f->lock);
    uint64_t a = f->ino_end - f->ino_next, b = f->fh_end - f->fh_next;
    pthread_mutex_unlock(&f->lock);
    return (int)(a < b ? a : b);
}

/* Files created here that the trio thread has not taken yet. */
int ck_fring_created(struct ck_fring *f) { return atomic_load(&f->created_count); }

/* Take up to max of them, in the order they were created. */
int ck_fring_take_created(struct ck_fring *f, struct ck_fring_created *out, int max)
{
    pthread_mutex_lock(&f->lock);
    int n = fr_take_list(out, f->created, sizeof *out, CREATED_MAX, &f->chead, f->ctail,
                         &f->created_count, max);
    pthread_mutex_unlock(&f->lock);
    return n;
}
