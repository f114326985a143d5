/*
 * The engine's io_uring backend: one thread keeps up to `depth` chunks in the ring of ring.h,
 * and moves the engine to its thread pool if the ring fails (engine.h).
 */
#define _GNU_SOURCE
#include "engine.h"

#ifdef OFFLOADD_HAVE_URING

#include <errno.h>
#include <stdlib.h>
#include <time.h>

#include "faults.h"
#include "posix_io.h"

/* A slot and its bounce buffer belong to the ring thread alone: it reads and writes them without
 * the engine's mutex, which it takes only to hand out chunks and to report them finished. */
enum {
    SLOT_FREE,
    SLOT_TAKEN, /* holds a chunk not started yet (its bounce copy is made outside the mutex) */
    SLOT_RING,  /* its chunk is in the ring (an SQE written, or the kernel moving it) */
    SLOT_DONE   /* finished with `err`, to be reported under the mutex */
};

typedef struct uslot {
    chunk_t c;
    char *buf;        /* where the kernel transfers (the source or a bounce buffer) */
    uint64_t io_len;  /* bytes the kernel must move */
    uint64_t got;     /* bytes moved so far */
    int state;
    int err;          /* SLOT_DONE: 0 or an errno */
} uslot_t;

#define KICK_TOKEN UINT64_MAX

int uring_alloc_slots(engine_t *e) {
    if (fault(FAULT_ALLOC)) return -1;
    e->slots = calloc(e->depth, sizeof *e->slots);
    e->bounce = calloc(e->depth, sizeof *e->bounce);
    return e->slots && e->bounce ? 0 : -1;
}

void uring_free_slots(engine_t *e) {
    for (unsigned i = 0; e->bounce && i < e->depth; i++) free(e->bounce[i]);
    free(e->bounce);
    free(e->slots);
    e->bounce = NULL;
    e->slots = NULL;
}

/* Put slot s's chunk (the part the kernel has not moved yet) in the ring. */
static void slot_prep(engine_t *e, uslot_t *s, unsigned idx) {
    /* Issued from io_uring's workers, never inline: submitting a large O_DIRECT request blocks
     * until the device queue has room, and the ring thread must stay free to take reads. */
    const request_t *r = s->c.req;
    ring_prep(&e->ring, r->op, r->fd, s->buf + s->got, (unsigned)(s->io_len - s->got),
              r->offset + s->c.pos + s->got, idx, IOSQE_ASYNC);
}

/* Set up a slot for a new chunk; 0, or an errno for a chunk that fails before any I/O.  Called
 * without the mutex: a write's bounce copy can be as large as a chunk (up to 1 GiB). */
static int slot_start(engine_t *e, uslot_t *s, char **bounce) {
    s->got = 0;
    return chunk_buffer(s->c.req, &s->c, bounce, e->chunk_bytes + ALIGN, &s->buf, &s->io_len);
}

/* Keep one read of kick_fd in flight: engine_submit() writes kick_fd when the ring thread is
 * waiting for completions, so new work (reads above all) is taken at once, not after the next
 * I/O.  Eventfds have no position: the read is at the current one ((uint64_t)-1). */
static void ring_arm_kick(engine_t *e) {
    ring_prep(&e->ring, OP_READ, e->ring.kick_fd, &e->ring.kick_buf, sizeof e->ring.kick_buf,
              (uint64_t)-1, KICK_TOKEN, 0);
}

/* The chunk of slot s is over (err 0 or an errno): check its length, copy a bounced read to its
 * destination (no mutex held), and leave it SLOT_DONE: ring_main (or ring_fall_back) reports it
 * with the mutex held. */
static void slot_done(uslot_t *s, int err) {
    if (!err && s->got < s->c.len) err = EIO;
    if (!err) chunk_copy_back(s->c.req, &s->c, s->buf);
    s->err = err;
    s->state = SLOT_DONE;
}

/* The kernel moved `res` bytes (or failed with -res) for slot s.  Returns 1 if the chunk needs
 * more I/O (a short transfer: the caller resubmits the rest), else 0 with the slot SLOT_DONE. */
static int slot_result(uslot_t *s, int res) {
    int err = 0;
    if (res == -EAGAIN || res == -EINTR) return 1;
    if (res < 0) err = -res;
    else if (res > 0) {
        uint64_t before = s->got;
        s->got += (uint64_t)res;
        if (s->got < s->io_len) {
            if (!s->c.req->direct || s->got % ALIGN == 0) return 1;
            if (s->c.req->op == OP_WRITE) { /* short O_DIRECT write: resume aligned */
                s->got -= s->got % ALIGN;   /* (see rw_loop) */
                if (s->got > before) return 1;
                err = EIO;
            } /* a short O_DIRECT read is the end of the file: slot_done checks the length */
        }
    } /* res == 0: end of file, or no progress: slot_done checks the length */
    slot_done(s, err);
    return 0;
}

/* Finish the chunk of slot s here with pread/pwrite, from where the kernel left it. */
static void slot_sync(uslot_t *s) {
    request_t *r = s->c.req;
    slot_done(s, rw_loop(r, s->buf, r->offset + s->c.pos, s->io_len, &s->got));
}

/* io_uring_enter failed with `err`, for good: the engine moves to the threads backend for the
 * rest of its life.  Queued requests go to the pool at once.  Then this thread finishes the
 * chunks it holds: one whose SQE the kernel never consumed is transferred here with
 * pread/pwrite; one the kernel took completes with its CQE, which the kernel posts to the
 * shared CQ without io_uring_enter.  Those are waited for, never failed early: until its CQE,
 * the kernel may still write into the chunk's buffer. */
static void ring_fall_back(engine_t *e, int err) {
    ring_t *q = &e->ring;
    uslot_t *slots = e->slots;
    if (err <= 0) err = EIO; /* fallback_err 0 would read as "no fallback" */
    pthread_mutex_lock(&e->mu);
    e->use_kick = 0; /* engine_submit() no longer wakes the ring */
    e->ring_sleeping = 0;
    __atomic_store_n(&e->fallback_err, err, __ATOMIC_RELEASE);
    __atomic_store_n(&e->use_uring, 0, __ATOMIC_RELEASE);
    pool_grow(e);
    pthread_cond_broadcast(&e->work_cv);
    pthread_mutex_unlock(&e->mu);

    unsigned head = __atomic_load_n(q->sq_head, __ATOMIC_ACQUIRE);
    for (unsigned tail = *q->sq_tail; head != tail; head++) { /* SQEs the kernel never took */
        uint64_t idx = q->sqes[q->sq_array[head & *q->sq_mask]].user_data;
        if (idx != KICK_TOKEN) slot_sync(&slots[idx]);
    }
    long nap_ns = 50000;
    for (;;) {
        unsigned waiting = 0;
        pthread_mutex_lock(&e->mu);
        for (unsigned i = 0; i < e->depth; i++) {
            uslot_t *s = &slots[i];
            if (s->state == SLOT_DONE) {
                finish_chunk(e, s->c.req, s->err ? 0 : s->c.len, s->err);
                s->state = SLOT_FREE;
            } else if (s->state == SLOT_RING) {
                waiting++;
            }
        }
        pthread_mutex_unlock(&e->mu);
        if (!waiting) break;
        unsigned h = *q->cq_head;
        unsigned t = __atomic_load_n(q->cq_tail, __ATOMIC_ACQUIRE);
        if (h == t) { /* nothing yet: poll, backing off to 10 ms */
            struct timespec ts = {0, nap_ns};
            nanosleep(&ts, NULL);
            if (nap_ns < 10000000) nap_ns *= 2;
            continue;
        }
        nap_ns = 50000;
        for (; h != t; h++) {
            struct io_uring_cqe *cqe = &q->cqes[h & *q->cq_mask];
            if (cqe->user_data == KICK_TOKEN) continue;
            uslot_t *s = &slots[cqe->user_data];
            if (slot_result(s, cqe->res)) slot_sync(s); /* a short transfer: the rest here */
        }
        __atomic_store_n(q->cq_head, h, __ATOMIC_RELEASE);
    }
    for (unsigned i = 0; i < e->depth; i++) { /* no slot is used again */
        free(e->bounce[i]);
        e->bounce[i] = NULL;
    }
}

void *ring_main(void *arg) {
    engine_t *e = arg;
    ring_t *q = &e->ring;
    unsigned depth = e->depth;
    uslot_t *slots = e->slots;
    unsigned held = 0; /* slots not SLOT_FREE */
    int kick_failed = 0;
    pthread_mutex_lock(&e->mu);
    e->use_kick = 1;
    pthread_mutex_unlock(&e->mu);
    ring_arm_kick(e);
    pthread_mutex_lock(&e->mu);
    for (;;) {
        /* With the mutex: report the chunks that finished, take new ones into free slots. */
        e->ring_sleeping = 0;
        if (kick_failed) e->use_kick = 0; /* the kick read fails here: wake on completions only */
        kick_failed = 0;
        for (unsigned i = 0; i < depth; i++) {
            uslot_t *s = &slots[i];
            if (s->state == SLOT_DONE) {
                finish_chunk(e, s->c.req, s->err ? 0 : s->c.len, s->err);
                s->state = SLOT_FREE;
                held--;
            }
            if (s->state == SLOT_FREE && take_chunk(e, &s->c)) {
                s->state = SLOT_TAKEN;
                held++;
            }
        }
        if (held == 0) {
            if (e->stopping && !e->qhead[0] && !e->qhead[1]) break;
            if (!e->qhead[0] && !e->qhead[1]) pthread_cond_wait(&e->work_cv, &e->mu);
            continue;
        }
        e->ring_sleeping = 1;
        pthread_mutex_unlock(&e->mu);

        /* Without it: bounce copies, SQEs, waiting, CQEs, copies back. */
        int done = 0;
        for (unsigned i = 0; i < depth; i++) {
            uslot_t *s = &slots[i];
            if (s->state != SLOT_TAKEN) continue;
            int err = slot_start(e, s, &e->bounce[i]);
            if (err) {
                s->err = err;
                s->state = SLOT_DONE;
                done++;
                continue;
            }
            s->state = SLOT_RING;
            slot_prep(e, s, i);
        }
        if (ring_enter(q, done ? 0 : 1) < 0) {
            ring_fall_back(e, errno);
            return thread_main(e); /* serve in the pool until engine_stop() */
        }
        unsigned head = *q->cq_head;
        unsigned tail = __atomic_load_n(q->cq_tail, __ATOMIC_ACQUIRE);
        for (; head != tail; head++) {
            struct io_uring_cqe *cqe = &q->cqes[head & *q->cq_mask];
            if (cqe->user_data == KICK_TOKEN) { /* woken for new work: re-arm */
                if (cqe->res > 0) ring_arm_kick(e);
                else kick_failed = 1;
                continue;
            }
            uslot_t *s = &slots[cqe->user_data];
            if (slot_result(s, cqe->res)) slot_prep(e, s, (unsigned)cqe->user_data);
        }
        __atomic_store_n(q->cq_head, head, __ATOMIC_RELEASE);
        pthread_mutex_lock(&e->mu);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

#endif /* OFFLOADD_HAVE_URING */
