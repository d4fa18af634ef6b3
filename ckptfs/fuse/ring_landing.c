/* Landed writes: a WRITE's payload copied into staging by the queue thread that took it, on
 * the caller's CPU while its bytes are still in that CPU's cache, where the trio thread said
 * the next bytes go (the landing zone: the staging's tails, as the trio thread's own loop
 * reads a /dev/fuse request into them in place). The copy and the note of where it went
 * (the landed list) are made under one lock, so the trio thread records landed writes in
 * the order they took the zone. It takes the zone back (revoke) before it changes staging
 * itself, and records what landed first.
 *
 * A WRITE that landed whole, on a handle the trio thread said takes writes (the writable
 * set), is answered here at once: its record carries what the trio thread needs of it (the
 * entry goes back to the kernel), and the trio thread records it before it serves any
 * request or changes staging, as it records a WRITE read into staging from /dev/fuse before
 * its answer. Such a WRITE does not wake the trio thread: its record waits for the next
 * request served there (or the trio thread's idle tick), unless the zone's first part (the
 * open segment's rest, or a whole free buffer) is full, a segment to seal and flush, or the
 * landed list is half full (landed_due); so a large file's WRITEs cost the trio thread about
 * one turn per segment, not one each. The landed bytes' CRC32C is taken in C before the
 * trio thread takes their records (ck_fring_sum_landed, fuse/crc32c.c), on its thread, not
 * on the writer's CPU where the queue thread that landed them runs.
 */
#include "ring_internal.h"

static uint32_t fr_land(struct ck_fring *f, int part, const char *src, uint32_t n)
{
    uint32_t k = n < f->room[part] ? n : f->room[part];
    if (!k)
        return 0;
    memcpy(f->zone[part], src, k);
    f->zone[part] += k;
    f->room[part] -= k;
    return k;
}

/* Copy a WRITE's payload (write_size bytes) into the zone, as far as it has room; the
 * second part only once the first is full (staging opens it then). (under lock) */
void fr_land_payload(struct ck_fring *f, struct fr_slot *s, uint32_t write_size)
{
    if (!f->zone_on || f->ltail - f->lhead >= LANDED_MAX)
        return;
    s->land_at[0] = f->zone[0];
    s->land_at[1] = f->zone[1];
    s->landed[0] = fr_land(f, 0, s->payload, write_size);
    if (s->landed[0] < write_size && !f->room[0])
        s->landed[1] = fr_land(f, 1, s->payload + s->landed[0], write_size - s->landed[0]);
}

/* The landed record of entry idx's WRITE (s->landed says how much of it landed where);
 * returns whether it is answered here: it landed whole, within the largest file, on a handle
 * that takes writes. (under lock) */
int fr_note_landed(struct ck_fring *f, int idx, uint32_t write_size)
{
    struct fr_slot *s = &f->slots[idx];
    const struct fuse_write_in *w = (const void *)s->hdr->op_in;
    struct fr_land_at *a = &f->land_at[f->ltail % LANDED_MAX];
    a->at[0] = s->land_at[0];
    a->at[1] = s->land_at[1];
    struct ck_fring_landed *r = &f->landed[f->ltail++ % LANDED_MAX];
    r->id = idx;
    r->summed = 0;
    r->k1 = s->landed[0];
    r->k2 = s->landed[1];
    r->fh = w->fh;
    r->off = w->offset;
    r->size = w->size;
    r->flags = w->write_flags;
    r->pid = fr_in(s)->pid;
    int answered = r->k1 + r->k2 == write_size && r->off <= f->file_bytes_max
        && write_size <= f->file_bytes_max - r->off && fr_fh_writable(f, r->fh);
    r->answered = answered;
    atomic_fetch_add(&f->landed_count, 1);
    /* (a segment to seal and flush, or a list to empty before it fills: else the records
     * wait for the next request the trio thread serves, which takes them first) */
    if (!f->room[0] || f->ltail - f->lhead >= LANDED_MAX / 2)
        atomic_store(&f->landed_due, 1);
    return answered;
}

static unsigned fr_fh_slot(uint64_t fh)
{
    return (unsigned)((fh * 0x9E3779B97F4A7C15ull) >> 52);  /* FH_SLOTS = 2^12 */
}

/* Handle fh in the writable set (on) or out of it; -ENOSPC when the set is full. (under
 * lock) */
int fr_fh_set(struct ck_fring *f, uint64_t fh, int on)
{
    unsigned i = fr_fh_slot(fh), gone = FH_SLOTS;
    for (unsigned n = 0; n < FH_SLOTS; i = (i + 1) % FH_SLOTS, n++) {
        if (f->fhs[i] == fh + 1) {
            if (!on) {
                /* (a tombstone only where a probe may have to pass it) */
                f->fhs[i] = f->fhs[(i + 1) % FH_SLOTS] == FH_EMPTY ? FH_EMPTY : FH_GONE;
                f->nfhs--;
            }
            return 0;
        }
        if (f->fhs[i] == FH_GONE && gone == FH_SLOTS)
            gone = i;
        if (f->fhs[i] == FH_EMPTY)
            break;
    }
    if (on) {
        if (f->nfhs >= FH_SLOTS / 2)
            return -ENOSPC;
        f->fhs[gone != FH_SLOTS ? gone : i] = fh + 1;
        f->nfhs++;
    }
    return 0;
}

/* (under lock) */
int fr_fh_writable(struct ck_fring *f, uint64_t fh)
{
    for (unsigned i = fr_fh_slot(fh), n = 0; n < FH_SLOTS; i = (i + 1) % FH_SLOTS, n++) {
        if (f->fhs[i] == fh + 1)
            return 1;
        if (f->fhs[i] == FH_EMPTY)
            return 0;
    }
    return 0;
}

/* A WRITE whose end lies past n bytes is not answered here (the largest file the index
 * records: format/records.py MAX_FILE_BYTES): the trio thread records the bytes below it and
 * answers with their count, or EFBIG (Handles.write_target); 0 until the trio thread says. */
void ck_fring_file_bytes_max(struct ck_fring *f, uint64_t n)
{
    pthread_mutex_lock(&f->lock);
    f->file_bytes_max = n;
    pthread_mutex_unlock(&f->lock);
}

/* Where the next WRITE payloads go: n1 bytes at p1, then (once those are full) n2 at p2. */
void ck_fring_offer(struct ck_fring *f, void *p1, uint32_t n1, void *p2, uint32_t n2)
{
    pthread_mutex_lock(&f->lock);
    f->zone[0] = p1;
    f->room[0] = p1 ? n1 : 0;
    f->zone[1] = p2;
    f->room[1] = p2 ? n2 : 0;
    f->zone_on = f->room[0] > 0;
    atomic_store(&f->zone_ready, f->zone_on);
    pthread_mutex_unlock(&f->lock);
}

/* No more landing (the trio thread changes staging); returns the landed writes to record. */
int ck_fring_revoke(struct ck_fring *f)
{
    pthread_mutex_lock(&f->lock);
    f->zone_on = 0;
    atomic_store(&f->zone_ready, 0);
    int n = (int)(f->ltail - f->lhead);
    pthread_mutex_unlock(&f->lock);
    return n;
}

/* Landed writes the trio thread has not taken yet. */
int ck_fring_landed(struct ck_fring *f) { return atomic_load(&f->landed_count); }

/* Take up to max landed writes, in the order they landed. */
int ck_fring_take_landed(struct ck_fring *f, struct ck_fring_landed *out, int max)
{
    pthread_mutex_lock(&f->lock);
    int n = fr_take_list(out, f->landed, sizeof *out, LANDED_MAX, &f->lhead, f->ltail,
                         &f->landed_count, max);
    if (f->lhead == f->ltail)
        atomic_store(&f->landed_due, 0);
    pthread_mutex_unlock(&f->lock);
    return n;
}

/* The trio thread, before it takes the landed writes (its claim): the CRC32C of the bytes of
 * each record not summed yet goes into it (crc1, crc2, summed), in C and with the GIL
 * released (cffi), while the queue threads go on landing: the bytes of a record not taken
 * cannot change (the trio thread takes every record before it changes staging, and only
 * the trio thread takes them). A record taken before is not summed: the trio thread sums its
 * bytes itself. Returns how many were summed. */
int ck_fring_sum_landed(struct ck_fring *f)
{
    enum { BATCH = 64 };
    struct { unsigned seq; struct fr_land_at a; uint32_t n[2], crc[2]; } jobs[BATCH];
    int total = 0;
    if (!f->sum_landed)
        return 0;
    for (;;) {
        int n = 0;
        pthread_mutex_lock(&f->lock);
        if (f->ltail - f->lsum > f->ltail - f->lhead)  /* (behind the records taken) */
            f->lsum = f->lhead;
        for (; n < BATCH && f->lsum != f->ltail; n++, f->lsum++) {
            const struct ck_fring_landed *r = &f->landed[f->lsum % LANDED_MAX];
            jobs[n].seq = f->lsum;
            jobs[n].a = f->land_at[f->lsum % LANDED_MAX];
            jobs[n].n[0] = r->k1;
            jobs[n].n[1] = r->k2;
        }
        pthread_mutex_unlock(&f->lock);
        if (!n)
            return total;
        for (int i = 0; i < n; i++)
            for (int k = 0; k < 2; k++)
                jobs[i].crc[k] = jobs[i].n[k] ? ck_crc32c(0, jobs[i].a.at[k], jobs[i].n[k]) : 0;
        pthread_mutex_lock(&f->lock);
        for (int i = 0; i < n; i++) {
            struct ck_fring_landed *r = &f->landed[jobs[i].seq % LANDED_MAX];
            r->crc1 = jobs[i].crc[0];
            r->crc2 = jobs[i].crc[1];
            r->summed = 1;
        }
        pthread_mutex_unlock(&f->lock);
        total += n;
    }
}

/* Handle fh takes writes (on = 1: a WRITE on it that lands whole is answered here) or no
 * longer (0, at its release). Returns 0, or -ENOSPC when the set is full (then its WRITEs go
 * to the trio thread, as any). */
int ck_fring_writable(struct ck_fring *f, uint64_t fh, int on)
{
    pthread_mutex_lock(&f->lock);
    int r = fr_fh_set(f, fh, on);
    pthread_mutex_unlock(&f->lock);
    return r;
}

/* Handles in the writable set. */
int ck_fring_writable_count(struct ck_fring *f)
{
    pthread_mutex_lock(&f->lock);
    int n = f->nfhs;
    pthread_mutex_unlock(&f->lock);
    return n;
}
