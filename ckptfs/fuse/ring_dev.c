/* /dev/fuse: the queue threads' transport where FUSE over io_uring is not used (the default).
 * A thread per CPU, pinned to it, each polling the (non-blocking) descriptor. A request
 * wakes every poller; the one on the caller's CPU, which the caller leaves as it waits, is
 * the first to read it, so the round trip stays on that CPU as on a ring ("What the FUSE
 * transport costs", dev-percpu). Not always: a thread on a CPU that was awake (the trio
 * thread's) may take it, and its answer must then wake the caller's CPU; so a thread woken for
 * a request another one took polls for up to spin_s, and that CPU does not halt meanwhile.
 * A request is read into a free entry laid out as a ring entry's (the op's fixed part in
 * op_in, the rest in the payload buffer), served by the same code (fr_dispatch), and its
 * answer written on /dev/fuse: by the queue thread for what it answers, by the trio thread
 * (ck_fring_answer after it wrote) for what it was handed. A WRITE is read straight into the
 * landing zone when no other thread holds it, so that the kernel's copy is the only one.
 */
#include <poll.h>

#include "ring_internal.h"

#define DEV_HEAD (IN_HEADER_SIZE + OP_PART_MAX)  /* read into the entry's header buffer */

/* (arg: the pollfd of /dev/fuse, fd -1 while no slot is free) */
static int fr_dev_ready(struct fr_queue *q, void *arg)
{
    (void)q;
    struct pollfd *p = arg;
    return p->fd >= 0 && poll(p, 1, 0) > 0;
}

/* A free slot of q, or -1. */
static int fr_dev_free_slot(struct fr_queue *q)
{
    struct ck_fring *f = q->f;
    for (int i = q->first_slot; i < q->first_slot + f->depth; i++)
        if (atomic_load_explicit(&f->slots[i].state, memory_order_acquire) == AT_KERNEL)
            return i;
    return -1;
}

/* Read a request into slot idx: 1, 2 for a WRITE read into the zone (the lock then held:
 * fr_dispatch with in_zone, then unlock), 0 when there was none (another thread took it),
 * -errno when the connection is gone (-ENODEV) or reading fails. */
static int fr_dev_read(struct ck_fring *f, int idx)
{
    struct fr_slot *s = &f->slots[idx];
    /* A WRITE's payload is read straight into the zone when no one else holds it: [header |
     * op | the zone's two parts | the slot's payload buffer (what does not fit)], as the
     * trio thread's own loop reads into staging's tails; so the kernel's copy is the only
     * one. (Another thread holding it reads into its slot and lands the payload after: the
     * lock orders the landings; the read does not block, the descriptor being non-blocking.) */
    int zone = atomic_load_explicit(&f->zone_ready, memory_order_relaxed)
        && pthread_mutex_trylock(&f->lock) == 0;
    if (zone && !(f->zone_on && f->ltail - f->lhead < LANDED_MAX)) {
        pthread_mutex_unlock(&f->lock);
        zone = 0;
    }
    uint32_t r0 = zone ? f->room[0] : 0, r1 = zone ? f->room[1] : 0;
    struct iovec iov[5] = { { s->hdr->in_out, IN_HEADER_SIZE }, { s->hdr->op_in, OP_PART_MAX },
                            { f->zone[0], r0 }, { f->zone[1], r1 },
                            { s->payload, f->payload } };
    ssize_t n = zone ? readv(f->fuse_fd, iov, 5)
        : readv(f->fuse_fd, (struct iovec[3]){ iov[0], iov[1], iov[4] }, 3);
    int err = n < 0 ? errno : 0;
    s->landed[0] = s->landed[1] = 0;
    if (n < DEV_HEAD || !zone) {
        if (zone)
            pthread_mutex_unlock(&f->lock);
        if (n < 0)
            return err == EAGAIN || err == EINTR || err == ENOENT ? 0 : -err;
        if (n < IN_HEADER_SIZE)
            return 0;
    }
    const struct fuse_in_header *h = fr_in(s);
    uint32_t rest = n >= DEV_HEAD ? (uint32_t)n - DEV_HEAD : 0;  /* (past the op part) */
    if (zone && n >= DEV_HEAD) {
        uint32_t k0 = rest < r0 ? rest : r0, k1 = rest - k0 < r1 ? rest - k0 : r1;
        uint32_t over = rest - k0 - k1;  /* (at the payload buffer's start) */
        const struct fuse_write_in *w = (const void *)s->hdr->op_in;
        if (rest > f->payload) {
            pthread_mutex_unlock(&f->lock);
            return -EPROTO;
        }
        if (over)  /* (where the rest of the request goes in the payload buffer) */
            memmove(s->payload + k0 + k1, s->payload, over);
        /* (the second part only once the first is full, as fr_land) */
        if (h->opcode == FUSE_WRITE && w->size == rest && (k0 || (!r0 && k1))) {
            s->land_at[0] = f->zone[0];
            s->land_at[1] = f->zone[1];
            f->zone[0] += k0;
            f->room[0] -= k0;
            f->zone[1] += k1;
            f->room[1] -= k1;
            s->landed[0] = k0;
            s->landed[1] = k1;
            s->hdr->ring_ent_in_out.payload_sz = rest;
            return 2;
        }
        /* (not a WRITE: its bytes are the request's, not file data) */
        memcpy(s->payload, f->zone[0], k0);
        memcpy(s->payload + k0, f->zone[1], k1);
        pthread_mutex_unlock(&f->lock);
    }
    /* The op's fixed part as a ring entry has it: LOOKUP has none (the name is the payload),
     * CREATE's is struct fuse_create_in; for the others OP_PART_MAX bytes at most (WRITE and
     * READ: struct fuse_write_in / fuse_read_in), the split of a request the trio thread
     * hands to libfuse being of no matter (it is sent whole). */
    uint32_t all = (uint32_t)n - IN_HEADER_SIZE, k = all < OP_PART_MAX ? all : OP_PART_MAX;
    uint32_t psz = all - k, opsize = k;
    if (h->opcode == FUSE_LOOKUP)
        opsize = 0;
    else if (h->opcode == FUSE_CREATE && k >= sizeof(struct fuse_create_in))
        opsize = sizeof(struct fuse_create_in);
    if (opsize < k) {
        uint32_t moved = k - opsize;
        if (psz + moved > f->payload)
            return -EPROTO;
        memmove(s->payload + moved, s->payload, psz);
        memcpy(s->payload, s->hdr->op_in + opsize, moved);
        psz += moved;
    }
    s->hdr->ring_ent_in_out.payload_sz = psz;
    return 1;
}

/* Write slot s's answer (fr_answer's) on /dev/fuse; -errno if the kernel refused it. */
static int fr_dev_reply(struct ck_fring *f, struct fr_slot *s)
{
    uint32_t psz = s->hdr->ring_ent_in_out.payload_sz;
    struct iovec iov[1 + WINDOW_PARTS] = { { s->hdr->in_out, sizeof(struct fuse_out_header) },
                                           { s->payload, psz } };
    int n = psz ? 2 : 1;
    if (s->win) {  /* (a READ's body from a read window's buffers) */
        memcpy(iov + 1, s->body, s->nbody * sizeof *iov);
        n = 1 + s->nbody;
    }
    int err = writev(f->fuse_fd, iov, n) < 0 && errno != ENOENT ? errno : 0;
    if (s->win) {  /* (ENOENT: the request was interrupted and is gone) */
        atomic_fetch_sub(&s->win->busy, 1);
        s->win = NULL;
        s->nbody = 0;
        if (s->wake)
            fr_wake_trio(f);
        s->wake = 0;
    }
    return -err;
}

/* A request this thread cannot serve (a defect: nothing the kernel sends) is answered EIO. */
static void fr_dev_refuse(struct ck_fring *f, int idx)
{
    struct fr_slot *s = &f->slots[idx];
    fr_answer(s, -EIO, NULL, 0);
    fr_dev_reply(f, s);
}

void *fr_serve_dev(void *arg)
{
    struct fr_queue *q = arg;
    struct ck_fring *f = q->f;
    fr_pin(q);
    atomic_fetch_add(&f->registered, 1);
    struct pollfd p[2] = { { f->fuse_fd, POLLIN, 0 }, { q->efd, POLLIN, 0 } };
    /* (nothing is read before the trio thread said go: until then a failed start loses
     * nothing, and it sets what answers depend on, e.g. flush_fails, first) */
    while (!atomic_load(&f->go) && !atomic_load(&f->stop)) {
        struct pollfd e = { q->efd, POLLIN, 0 };
        if (poll(&e, 1, -1) > 0) {
            uint64_t v;
            if (read(q->efd, &v, sizeof v) < 0) {}
        }
    }
    int gone = 0, woken = 0, lost = 0;
    /* Only the end of the connection or ck_fring_stop ends the loop: were the threads to stop
     * on an error, nobody would read /dev/fuse any more (the trio thread does not). */
    while (!atomic_load(&f->stop)) {
        fr_commit_answers(q);  /* (the slots the trio thread answered are free again) */
        int idx = fr_dev_free_slot(q);
        if (idx >= 0) {
            int r = fr_dev_read(f, idx);
            /* (woken for a request another thread took: most likely this CPU's caller's,
             * served from a CPU that was awake, the trio thread's; its answer then wakes the
             * caller here, cheaply if this CPU did not halt meanwhile) */
            lost = woken && r == 0;
            woken = 0;
            if (r == -ENODEV) {
                gone = 1;
                break;
            }
            if (r == -EPROTO) {
                fr_note_error(f, EPROTO);
                fr_dev_refuse(f, idx);
                continue;
            }
            if (r < 0) {
                fr_note_error(f, -r);
                usleep(1000);  /* (not in a loop as fast as the error comes) */
                continue;
            }
            if (r > 0) {
                int here = fr_dispatch(q, idx, r == 2);
                if (r == 2) {
                    pthread_mutex_unlock(&f->lock);
                    if (!here || atomic_load(&f->landed_due))
                        fr_wake_trio(f);
                    atomic_fetch_add(&q->read_in_place, 1);
                }
                if (here) {
                    struct fr_slot *s = &f->slots[idx];
                    atomic_fetch_add(&q->answered_here, 1);
                    r = fr_dev_reply(f, s);
                    atomic_store(&s->state, AT_KERNEL);
                    if (r == -ENODEV) {
                        gone = 1;
                        break;
                    }
                    if (r < 0)
                        fr_note_error(f, -r);
                }
                continue;
            }
        }
        p[0].fd = idx >= 0 ? f->fuse_fd : -1;  /* (no free slot: wait for an answer only) */
        if ((q->waited_with_trio > 0 || lost) && f->spin_s > 0) {
            lost = 0;
            /* A caller on this CPU waits for the trio thread's answer (or, likely, another
             * queue thread's): poll, so that this CPU does not halt (the answer's wake-up is
             * then cheap), and take the next request at once. */
            if (fr_spin(q, fr_dev_ready, p))
                continue;
        }
        if (!fr_may_sleep(q))
            continue;
        int k = poll(p, 2, -1);
        atomic_store(&q->sleeping, 0);
        if (k < 0) {
            if (errno != EINTR) {
                fr_note_error(f, errno);
                usleep(1000);
            }
            continue;
        }
        if (p[1].revents & POLLIN) {
            uint64_t v;
            if (read(q->efd, &v, sizeof v) < 0) {}
        }
        if (p[0].revents & (POLLERR | POLLHUP | POLLNVAL)) {
            gone = 1;
            break;
        }
        woken = (p[0].revents & POLLIN) != 0;
    }
    if (gone) {  /* (the trio thread learns it even while it sleeps) */
        atomic_store(&f->gone, 1);
        uint64_t one = 1;
        if (write(f->wake_fd, &one, sizeof one) < 0) {}
    }
    return NULL;
}
