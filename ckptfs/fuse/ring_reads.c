/* A restore without the trio thread: what the queue threads answer of a checkpoint's files
 * from the answers and the read cache's bytes the trio thread left with them.
 * - READ of a handle that reads its file alone, from the read cache's buffers the trio thread
 *   left with it (the handle's read window: checked bytes of pinned chunks; fr_read), noted
 *   for the trio thread, which accounts for it (readahead, the cache's use) as for a READ it
 *   served; a restore's READs then need not wait for it.
 * - OPEN, read-only, of a file the trio thread prepared a window for when it answered the
 *   file's LOOKUP (its first bytes were in the read cache; fr_open): answered with the handle
 *   number and open flags it left with the window, which is that handle's from then on, and
 *   noted for the trio thread, which makes the handle before it serves any request.
 * - LOOKUP of a name whose answer the trio thread prepared (fr_lookup: after it answered a
 *   LOOKUP of a file, for the names that follow in the directory's creation order, the order
 *   a checkpoint's files are usually loaded in), used once and noted, so that the trio thread
 *   counts the kernel's lookup before it serves any request (a FORGET among them); every
 *   change of a directory or of a file's attributes takes them all back first.
 * So a restore's small file need not wait for the trio thread. Nor does it wake it for every
 * file: a LOOKUP's note wakes the trio thread once its directory has LOOKUPS_LEFT prepared
 * answers or fewer left (it prepares the next names then), and a READ past the middle of a
 * window that ends before the file does (the next window is opened then); the others (an
 * OPEN, the READs of a window to the file's end) wait for the next wake, request or idle
 * tick, unless their list is half full.
 */
#include "ring_internal.h"

/* The prepared answer of `name` in directory `parent` (under lock), or NULL. */
static struct fr_lookup *fr_lookup_find(struct ck_fring *f, uint64_t parent, const char *name,
                                        uint32_t len)
{
    if (!parent)  /* (a free slot's parent) */
        return NULL;
    for (int i = 0; i < LOOKUPS; i++) {
        struct fr_lookup *c = &f->lookups[i];
        if (c->parent == parent && c->namelen == len && !memcmp(c->name, name, len))
            return c;
    }
    return NULL;
}

/* LOOKUP of a name the trio thread prepared the answer of, while the queue threads answer
 * RELEASE and CREATE and no look at other writers is due: answered with it (`out`), the answer
 * used up, the lookup noted for the trio thread, which counts it (the kernel's lookup count
 * of the inode) before it serves any request, a FORGET among them. The trio thread is woken
 * once the directory has LOOKUPS_LEFT prepared answers or fewer left, to prepare the next
 * names' (every second file of a restore, not every one: a wake-up costs its trio thread
 * ~40-60 us). 1 if answered here. */
int fr_lookup(struct ck_fring *f, const struct fr_slot *s, const char *name, uint32_t len,
              struct fuse_entry_out *out)
{
    const struct fuse_in_header *h = fr_in(s);
    if (!atomic_load_explicit(&f->nlookups, memory_order_relaxed))
        return 0;
    double now = fr_now();
    struct fr_lookup *l = NULL;
    int wake = 0;
    pthread_mutex_lock(&f->lock);
    if (f->defer_here && now < f->absent_until && f->lktail - f->lkhead < LOOKED_MAX)
        l = fr_lookup_find(f, h->nodeid, name, len);
    if (l) {
        *out = l->out;
        f->looked[f->lktail++ % LOOKED_MAX] = l->nodeid;
        atomic_fetch_add(&f->looked_count, 1);
        l->parent = 0;
        atomic_fetch_sub(&f->nlookups, 1);
        int left = 0;
        for (int i = 0; i < LOOKUPS; i++)
            left += f->lookups[i].parent == h->nodeid;
        wake = left <= LOOKUPS_LEFT || f->lktail - f->lkhead >= LOOKED_MAX / 2;
    }
    pthread_mutex_unlock(&f->lock);
    if (wake)
        fr_wake_trio(f);
    return l != NULL;
}

/* The answer to LOOKUP of name (len bytes) in directory parent: inode nodeid, `out` its
 * fuse_entry_out; answered once (fr_lookup). 0 when every slot is
 * taken. */
int ck_fring_lookup_put(struct ck_fring *f, uint64_t parent, const char *name, uint32_t len,
                        uint64_t nodeid, const void *out)
{
    if (!parent || len == 0 || len > NAME_MAX_LEN)
        return 0;
    struct fr_lookup *l = NULL;
    pthread_mutex_lock(&f->lock);
    for (int i = 0; i < LOOKUPS && !l; i++)
        if (!f->lookups[i].parent)
            l = &f->lookups[i];
    if (l) {
        l->nodeid = nodeid;
        l->namelen = len;
        memcpy(l->name, name, len);
        memcpy(&l->out, out, sizeof l->out);
        l->parent = parent;
        atomic_fetch_add(&f->nlookups, 1);
    }
    pthread_mutex_unlock(&f->lock);
    return l != NULL;
}

/* The prepared answer of `name` in directory `parent` goes, if one stands (its LOOKUP came to
 * the trio thread: it and the file's OPEN are prepared afresh there). */
void ck_fring_lookup_drop(struct ck_fring *f, uint64_t parent, const char *name, uint32_t len)
{
    pthread_mutex_lock(&f->lock);
    struct fr_lookup *l = fr_lookup_find(f, parent, name, len);
    if (l) {
        l->parent = 0;
        atomic_fetch_sub(&f->nlookups, 1);
    }
    pthread_mutex_unlock(&f->lock);
}

/* Every prepared LOOKUP answer goes (the tree changed). */
void ck_fring_lookups_clear(struct ck_fring *f)
{
    pthread_mutex_lock(&f->lock);
    for (int i = 0; i < LOOKUPS; i++)
        f->lookups[i].parent = 0;
    atomic_store(&f->nlookups, 0);
    pthread_mutex_unlock(&f->lock);
}

/* LOOKUPs answered here the trio thread has not counted yet. */
int ck_fring_looked(struct ck_fring *f) { return atomic_load(&f->looked_count); }

/* Take up to max of their inodes, in the order they were answered. */
int ck_fring_take_looked(struct ck_fring *f, uint64_t *out, int max)
{
    pthread_mutex_lock(&f->lock);
    int n = fr_take_list(out, f->looked, sizeof *out, LOOKED_MAX, &f->lkhead, f->lktail,
                         &f->looked_count, max);
    pthread_mutex_unlock(&f->lock);
    return n;
}

/* (under lock) The window of handle fh, or NULL. */
static struct fr_window *fr_window_of(struct ck_fring *f, uint64_t fh)
{
    for (int i = 0; i < WINDOWS; i++)
        if (f->windows[i].fh == fh + 1)
            return &f->windows[i];
    return NULL;
}

/* READ from the handle's read window, when the window holds what it asks for (to the file's
 * end, where the window reaches it): the answer's body is the window's buffers, sent from
 * them on /dev/fuse (the window busy until fr_dev_reply), copied into the entry on a ring.
 * The READ is noted for the trio thread, which accounts for it as for one it served. 1 if
 * answered here. */
int fr_read(struct ck_fring *f, struct fr_slot *s)
{
    const struct fuse_read_in *r = (const void *)s->hdr->op_in;
    uint32_t size = r->size;
    uint64_t off = r->offset, hi = off + size;
    struct fr_window *w = NULL;
    int wake = 0;
    if (hi < off || !atomic_load_explicit(&f->nwindows, memory_order_relaxed))
        return 0;  /* (a range that wraps: the trio thread answers it) */
    pthread_mutex_lock(&f->lock);
    if (f->dtail - f->dhead < READS_MAX && (w = fr_window_of(f, r->fh)) && !w->nodeid) {
        if (hi > w->end && w->eof)
            hi = w->end > off ? w->end : off;
        if (off < w->start || hi > w->end || (!f->dev && hi - off > f->payload))
            w = NULL;
    } else {
        w = NULL;
    }
    if (w) {
        atomic_fetch_add(&w->busy, 1);
        struct ck_fring_read *d = &f->reads[f->dtail++ % READS_MAX];
        d->fh = r->fh;
        d->off = off;
        d->size = size;
        d->n = (uint32_t)(hi - off);
        atomic_fetch_add(&f->reads_count, 1);
        /* (the trio thread accounts for them when it serves a request: readahead, and the
         * window opened on; so they are due, and it is woken, once a READ passes the
         * window's middle, or the list fills) */
        uint64_t mid = w->start + (w->end - w->start) / 2;
        if ((hi > mid && !w->woke && !w->eof) || f->dtail - f->dhead >= READS_MAX / 2) {
            w->woke = 1;
            wake = 1;
            atomic_store(&f->reads_due, 1);
        }
    }
    pthread_mutex_unlock(&f->lock);
    if (!w)
        return 0;
    /* (the parts, end to end from w->start: the ones [off, hi) spans) */
    uint64_t at = w->start, pos = off;
    int k = 0;
    for (int i = 0; i < w->nparts && pos < hi; i++) {
        uint64_t end = at + w->len[i];
        if (pos < end) {
            uint64_t m = (hi < end ? hi : end) - pos;
            s->body[k].iov_base = w->part[i] + (pos - at);
            s->body[k++].iov_len = m;
            pos += m;
        }
        at = end;
    }
    uint32_t n = (uint32_t)(hi - off);
    fr_answer(s, 0, NULL, 0);
    fr_out(s)->len += n;
    if (f->dev) {  /* (sent from the window's buffers; the wake once it is: fr_dev_reply) */
        s->win = w;
        s->nbody = k;
        s->wake = wake;
    } else {
        char *p = s->payload;
        for (int i = 0; i < k; i++) {
            memcpy(p, s->body[i].iov_base, s->body[i].iov_len);
            p += s->body[i].iov_len;
        }
        s->hdr->ring_ent_in_out.payload_sz = n;
        atomic_fetch_sub(&w->busy, 1);
        if (wake)  /* (after: the trio thread may replace the window at once) */
            fr_wake_trio(f);
    }
    return 1;
}

/* OPEN of a file with a prepared window, read-only and without O_TRUNC, while the queue threads
 * answer RELEASE and CREATE and no look at other writers is due: answered with the window's
 * handle and open flags (`out`: fuse_open_out), the window now that handle's, the open noted
 * for the trio thread, which makes the handle (ops) before it serves any request, as it makes
 * a file created here. 1 if answered here. */
int fr_open(struct ck_fring *f, const struct fr_slot *s, struct fuse_open_out *out)
{
    const struct fuse_in_header *h = fr_in(s);
    uint32_t flags = ((const struct fuse_open_in *)s->hdr->op_in)->flags;
    if (!atomic_load_explicit(&f->nwindows, memory_order_relaxed)
            || (flags & O_ACCMODE) != O_RDONLY || (flags & O_TRUNC))
        return 0;
    double now = fr_now();
    struct fr_window *w = NULL;
    pthread_mutex_lock(&f->lock);
    if (f->defer_here && now < f->absent_until && f->otail - f->ohead < OPENED_MAX) {
        for (int i = 0; i < WINDOWS && !w; i++)
            if (f->windows[i].fh && f->windows[i].nodeid == h->nodeid)
                w = &f->windows[i];
    }
    int wake = 0;
    if (w) {
        w->nodeid = 0;  /* (the handle's window from now on) */
        struct ck_fring_opened *o = &f->opened[f->otail++ % OPENED_MAX];
        o->fh = w->fh - 1;
        o->nodeid = h->nodeid;
        o->flags = flags;
        o->uid = h->uid;
        o->gid = h->gid;
        o->pid = h->pid;
        atomic_fetch_add(&f->opened_count, 1);
        *out = (struct fuse_open_out){ .fh = w->fh - 1, .open_flags = w->open_flags };
        wake = f->otail - f->ohead >= OPENED_MAX / 2;
    }
    pthread_mutex_unlock(&f->lock);
    if (wake)
        fr_wake_trio(f);
    return w != NULL;
}

/* Handle fh's read window: bytes [start, start + the parts' lengths) of its file are in the
 * nparts buffers (end to end), unchanged until the window is dropped; eof: the file ends there.
 * Replaces the handle's window (once no READ uses the old one). Returns 1, or 0 when every
 * window is taken (the handle then has none). nodeid not 0: a prepared window, for a handle
 * not open yet: the file's next read-only OPEN is answered with fh and open_flags (fr_open). */
int ck_fring_window(struct ck_fring *f, uint64_t fh, uint64_t nodeid, uint32_t open_flags,
                    uint64_t start, int eof, int nparts, char **parts, const uint32_t *lens)
{
    if (nparts < 1 || nparts > WINDOW_PARTS) {
        ck_fring_window_drop(f, fh);  /* (the handle has none then, as with no free window) */
        return 0;
    }
    pthread_mutex_lock(&f->lock);
    struct fr_window *old = fr_window_of(f, fh), *w = NULL;
    if (old) {
        old->fh = 0;
        atomic_fetch_sub(&f->nwindows, 1);
    }
    for (int i = 0; i < WINDOWS && !w; i++)
        if (!f->windows[i].fh && !atomic_load(&f->windows[i].busy))
            w = &f->windows[i];
    if (w) {
        w->start = w->end = start;
        w->nodeid = nodeid;
        w->open_flags = open_flags;
        w->eof = eof;
        w->woke = 0;
        w->nparts = nparts;
        for (int i = 0; i < nparts; i++) {
            w->part[i] = parts[i];
            w->len[i] = lens[i];
            w->end += lens[i];
        }
        w->fh = fh + 1;
        atomic_fetch_add(&f->nwindows, 1);
    }
    pthread_mutex_unlock(&f->lock);
    while (old && old != w && atomic_load(&old->busy))
        sched_yield();  /* (a READ being sent from it: tens of microseconds) */
    return w != NULL;
}

/* Drop handle fh's window; its buffers are the trio thread's again on return. */
void ck_fring_window_drop(struct ck_fring *f, uint64_t fh)
{
    pthread_mutex_lock(&f->lock);
    struct fr_window *w = fr_window_of(f, fh);
    if (w) {
        w->fh = 0;
        atomic_fetch_sub(&f->nwindows, 1);
    }
    pthread_mutex_unlock(&f->lock);
    while (w && atomic_load(&w->busy))
        sched_yield();
}

int ck_fring_reads(struct ck_fring *f) { return atomic_load(&f->reads_count); }

/* Take up to max READs answered from windows, in the order they were answered. */
int ck_fring_take_reads(struct ck_fring *f, struct ck_fring_read *out, int max)
{
    pthread_mutex_lock(&f->lock);
    int n = fr_take_list(out, f->reads, sizeof *out, READS_MAX, &f->dhead, f->dtail,
                         &f->reads_count, max);
    if (f->dhead == f->dtail)
        atomic_store(&f->reads_due, 0);
    pthread_mutex_unlock(&f->lock);
    return n;
}

/* OPENs answered here whose handle the trio thread has not made yet. */
int ck_fring_opened(struct ck_fring *f) { return atomic_load(&f->opened_count); }

/* Take up to max of them, in the order they were answered. */
int ck_fring_take_opened(struct ck_fring *f, struct ck_fring_opened *out, int max)
{
    pthread_mutex_lock(&f->lock);
    int n = fr_take_list(out, f->opened, sizeof *out, OPENED_MAX, &f->ohead, f->otail,
                         &f->opened_count, max);
    pthread_mutex_unlock(&f->lock);
    return n;
}
