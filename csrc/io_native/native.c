/*
 * offloadd.io._native: the native I/O engine.
 *
 * Requests are (token, op, fd, offset, address, nbytes).  Each request is cut into chunks of at
 * most `chunk_bytes`; chunks of the same request run concurrently.  Two backends move the chunks:
 *
 *   threads  a pool of pthreads doing pread/pwrite (the baseline, always available);
 *   uring    one thread driving an io_uring ring with up to `depth` chunks in flight (compiled
 *            when <linux/io_uring.h> exists; used only if io_uring_setup succeeds at run time,
 *            since container seccomp profiles often refuse it).
 *
 * Nothing here ends the process.  If io_uring_enter fails for good (any error but EINTR, or
 * EAGAIN/EBUSY for about a second), the engine moves to the threads backend for the rest of its
 * life: queued requests go to a pool of `threads` pthreads, chunks already in the ring finish
 * (with pread/pwrite where the kernel never took them), and `fallback` says why.  A failed
 * allocation fails only the request that needed it, with ENOMEM.
 *
 * No backend thread ever takes the GIL.  When a request's last chunk finishes, the request
 * itself is appended to a completion list (no allocation: completing can never fail) and an
 * eventfd is signalled; Python collects (token, errno, bytes done) with reap(), which waits on
 * the eventfd with the GIL released, or watches fileno() from an event loop.  If reap() cannot
 * build its result (MemoryError), the completions stay queued for the next call.  Reads are
 * handed out before writes.
 *
 * O_DIRECT: when the file was opened with O_DIRECT and a chunk's address or length is not a
 * multiple of 4096, the chunk goes through an aligned bounce buffer (a write's tail is padded
 * with zeros up to 4096 bytes; a read of a tail reads the padded length and copies what was
 * asked for).  An unaligned file offset on an O_DIRECT file fails with EINVAL.
 *
 * Head and tail pages: a write may name other addresses for its first and last 4096 bytes
 * (the zero-copy write path writes a tensor's aligned interior in place and its unaligned ends
 * from bounce pages).  Each such page is a chunk of its own, written from its own address.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__has_include)
#if __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#define OFFLOADD_HAVE_URING 1
#endif
#endif

#define ALIGN 4096u
#define OP_READ 0
#define OP_WRITE 1

typedef struct request {
    uint64_t token;
    int op;
    int fd;
    int direct;
    int started;
    int err;          /* first errno seen, 0 if none */
    int inflight;     /* chunks being transferred */
    uint64_t offset;  /* file offset of byte 0 */
    char *addr;
    char *head;       /* writes: the first 4096 bytes come from here instead (NULL: from addr) */
    char *tail;       /* writes: the last 4096 bytes come from here instead (NULL: from addr) */
    uint64_t nbytes;
    uint64_t next;    /* first byte not yet handed out */
    uint64_t done;    /* bytes transferred */
    struct request *qnext;  /* in a queue of pending requests */
    struct request *dnext;  /* in the completion list, once finished */
} request_t;

typedef struct {
    request_t *req;
    uint64_t pos;  /* offset of the chunk inside the request */
    uint64_t len;
} chunk_t;

typedef struct engine {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t work_cv;
    request_t *qhead[2], *qtail[2];  /* pending chunks: [OP_READ], [OP_WRITE] */
    request_t *done_head, *done_tail; /* finished requests, oldest first, until reap() */
    size_t ndone;
    int efd;
    int stopping;
    int closed;
    int use_uring;    /* written under mu, atomically: the `backend` getter reads it without */
    int fallback_err; /* io_uring_enter's errno once the ring failed, else 0 (atomic) */
    int nthreads;     /* threads started (guarded by mu) */
    int pool_size;    /* threads asked for: the pool that takes over if the ring fails */
    pthread_t *threads; /* pool_size of them */
    uint64_t chunk_bytes;
    unsigned depth;
    uint64_t pending_requests; /* submitted and not completed */
    uint64_t bytes_read, bytes_written;
#ifdef OFFLOADD_HAVE_URING
    int ring_fd;
    int kick_fd;       /* eventfd read through the ring: wakes the ring thread for new work */
    uint64_t kick_buf;
    int ring_sleeping; /* the ring thread waits in io_uring_enter (guarded by mu) */
    int use_kick;
    void *sq_ptr, *cq_ptr, *sqes_ptr;
    size_t sq_size, cq_size, sqes_size;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;
    struct io_uring_sqe *sqes;
    struct uslot *slots; /* depth of them, owned by the ring thread (allocated by Engine()) */
    char **bounce;       /* each slot's bounce buffer, allocated at its first use */
#endif
} engine_t;

/* ----------------------------------------------------------------- test hooks (faults) -- */

/* Fault injection for the tests (offloadd.io._native._inject_fault): the next `count` passes
 * through a fault point (every pass if count < 0) fail with `err` instead of doing the real
 * call.  Checked only where an
 * allocation or io_uring_enter is about to happen, never per byte: one relaxed load when
 * disarmed. */
enum {
    FAULT_URING_ENTER, /* io_uring_enter */
    FAULT_ALLOC,       /* allocations made for I/O: the ring's slot table, bounce buffers */
    FAULT_COMPLETION,  /* handing finished requests to Python (the list reap() builds) */
    NFAULTS
};
static const char *const fault_names[NFAULTS] = {"uring_enter", "alloc", "completion"};
static int fault_count[NFAULTS];
static int fault_errno[NFAULTS];

/* 0, or the errno the caller must fail with instead of doing the call. */
static int fault(int which) {
    int n = __atomic_load_n(&fault_count[which], __ATOMIC_ACQUIRE);
    if (n < 0) return fault_errno[which];
    while (n > 0) {
        if (__atomic_compare_exchange_n(&fault_count[which], &n, n - 1, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return fault_errno[which];
    }
    return 0;
}

/* offloadd.io._native._hold_copies: while on, every bounce-buffer copy waits before it starts (at
 * most 5 s), so a test can look at the engine while a copy is "running". */
static int hold_copies;
static int held_copies; /* copies waiting now */

static void copy_gate(void) {
    if (!__atomic_load_n(&hold_copies, __ATOMIC_RELAXED)) return;
    __atomic_add_fetch(&held_copies, 1, __ATOMIC_ACQ_REL);
    for (int ms = 0; ms < 5000 && __atomic_load_n(&hold_copies, __ATOMIC_ACQUIRE); ms++) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    __atomic_sub_fetch(&held_copies, 1, __ATOMIC_ACQ_REL);
}

/* ---------------------------------------------------------------- queue (caller holds mu) -- */

static void queue_push(engine_t *e, request_t *r) {
    int q = r->op;
    r->qnext = NULL;
    if (e->qtail[q]) e->qtail[q]->qnext = r; else e->qhead[q] = r;
    e->qtail[q] = r;
}

static void queue_remove(engine_t *e, request_t *r) {
    int q = r->op;
    request_t *prev = NULL, *cur = e->qhead[q];
    while (cur && cur != r) { prev = cur; cur = cur->qnext; }
    if (!cur) return;
    if (prev) prev->qnext = cur->qnext; else e->qhead[q] = cur->qnext;
    if (e->qtail[q] == cur) e->qtail[q] = prev;
    cur->qnext = NULL;
}

/* Hand out the next chunk, reads first. Returns 0 if there is none. */
static int take_chunk(engine_t *e, chunk_t *c) {
    for (int q = OP_READ; q <= OP_WRITE; q++) {
        request_t *r = e->qhead[q];
        if (!r) continue;
        uint64_t len = r->nbytes - r->next;
        if (len > e->chunk_bytes) len = e->chunk_bytes;
        /* A head or tail page is a chunk of its own: its bytes come from another buffer. */
        if (r->head && r->next == 0) len = ALIGN;
        else if (r->tail) {
            uint64_t tail_at = r->nbytes - ALIGN;
            if (r->next < tail_at && r->next + len > tail_at) len = tail_at - r->next;
        }
        c->req = r;
        c->pos = r->next;
        c->len = len;
        r->next += len;
        r->inflight++;
        r->started = 1;
        if (r->next >= r->nbytes) queue_remove(e, r);
        return 1;
    }
    return 0;
}

static void signal_eventfd(engine_t *e) {
    uint64_t one = 1;
    ssize_t rc;
    do { rc = write(e->efd, &one, sizeof one); } while (rc < 0 && errno == EINTR);
}

/* Record the end of a chunk; completes the request when it was the last one. Holds mu. */
static void finish_chunk(engine_t *e, request_t *r, uint64_t moved, int err) {
    r->inflight--;
    r->done += moved;
    if (err && !r->err) {
        r->err = err;
        if (r->next < r->nbytes) {  /* stop handing out the rest */
            r->next = r->nbytes;
            queue_remove(e, r);
        }
    }
    if (r->inflight == 0 && r->next >= r->nbytes) {
        r->dnext = NULL; /* reap() frees it */
        if (e->done_tail) e->done_tail->dnext = r; else e->done_head = r;
        e->done_tail = r;
        e->ndone++;
        if (r->op == OP_READ) e->bytes_read += r->done; else e->bytes_written += r->done;
        e->pending_requests--;
        signal_eventfd(e);
    }
}

/* ------------------------------------------------------------------ the blocking transfer -- */

/* Where a chunk's bytes are in memory: the request's buffer, or its head or tail page. */
static char *chunk_addr(const request_t *r, const chunk_t *c) {
    if (r->head && c->pos == 0) return r->head;
    if (r->tail && c->pos == r->nbytes - ALIGN) return r->tail;
    return r->addr + c->pos;
}

static int needs_bounce(const request_t *r, const chunk_t *c) {
    if (!r->direct) return 0;
    return ((uintptr_t)chunk_addr(r, c) % ALIGN) != 0 || (c->len % ALIGN) != 0;
}

/* pread/pwrite buf[*got, io_len) at file offset off + *got, looping over short transfers and
 * advancing *got; stops early at the end of the file.  Returns 0 or an errno. */
static int rw_loop(const request_t *r, char *buf, uint64_t off, uint64_t io_len, uint64_t *got) {
    while (*got < io_len) {
        ssize_t n;
        if (r->op == OP_WRITE) n = pwrite(r->fd, buf + *got, io_len - *got, (off_t)(off + *got));
        else n = pread(r->fd, buf + *got, io_len - *got, (off_t)(off + *got));
        if (n < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (n == 0) break; /* end of file (read) or no progress (write) */
        uint64_t before = *got;
        *got += (uint64_t)n;
        if (r->direct && *got % ALIGN) {
            if (r->op == OP_READ) break; /* O_DIRECT short read: end of file */
            /* Short O_DIRECT write (the disk filled up): go on from the last aligned byte, so
             * the next call keeps the alignment and reports the real errno (ENOSPC). */
            *got -= *got % ALIGN;
            if (*got <= before) return EIO;
        }
    }
    return 0;
}

/* Move one chunk with pread/pwrite, looping over short transfers. Returns 0 or an errno. */
static int transfer_chunk(const request_t *r, const chunk_t *c, char **bounce, uint64_t cap,
                          uint64_t *moved) {
    char *src = chunk_addr(r, c);
    uint64_t off = r->offset + c->pos;
    uint64_t len = c->len, io_len = c->len;
    char *buf = src;
    *moved = 0;
    if (needs_bounce(r, c)) {
        if (!*bounce) {
            void *p = NULL;
            if (fault(FAULT_ALLOC) || posix_memalign(&p, ALIGN, cap)) return ENOMEM;
            *bounce = p;
        }
        buf = *bounce;
        io_len = (len + ALIGN - 1) / ALIGN * ALIGN;
        if (r->op == OP_WRITE) {
            copy_gate();
            memcpy(buf, src, len);
            memset(buf + len, 0, io_len - len);
        }
    }
    uint64_t got = 0;
    int err = rw_loop(r, buf, off, io_len, &got);
    if (err) return err;
    if (got < len) return EIO;
    if (buf != src && r->op == OP_READ) {
        copy_gate();
        memcpy(src, buf, len);
    }
    *moved = len;
    return 0;
}

static void *thread_main(void *arg) {
    engine_t *e = arg;
    char *bounce = NULL;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        chunk_t c;
        if (!take_chunk(e, &c)) {
            if (e->stopping) break;
            pthread_cond_wait(&e->work_cv, &e->mu);
            continue;
        }
        pthread_mutex_unlock(&e->mu);
        uint64_t moved = 0;
        int err = transfer_chunk(c.req, &c, &bounce, e->chunk_bytes + ALIGN, &moved);
        pthread_mutex_lock(&e->mu);
        finish_chunk(e, c.req, moved, err);
    }
    pthread_mutex_unlock(&e->mu);
    free(bounce);
    return NULL;
}

/* ---------------------------------------------------------------------------- io_uring -- */

#ifdef OFFLOADD_HAVE_URING
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

static int ring_setup(engine_t *e, unsigned entries) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    int fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (fd < 0) return errno;
    e->ring_fd = fd;
    e->sq_size = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    e->cq_size = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    e->sqes_size = p.sq_entries * sizeof(struct io_uring_sqe);
    e->sq_ptr = mmap(NULL, e->sq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                     IORING_OFF_SQ_RING);
    e->cq_ptr = mmap(NULL, e->cq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                     IORING_OFF_CQ_RING);
    e->sqes_ptr = mmap(NULL, e->sqes_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                       IORING_OFF_SQES);
    if (e->sq_ptr == MAP_FAILED || e->cq_ptr == MAP_FAILED || e->sqes_ptr == MAP_FAILED) {
        int err = errno;
        if (e->sq_ptr != MAP_FAILED) munmap(e->sq_ptr, e->sq_size);
        if (e->cq_ptr != MAP_FAILED) munmap(e->cq_ptr, e->cq_size);
        if (e->sqes_ptr != MAP_FAILED) munmap(e->sqes_ptr, e->sqes_size);
        close(fd);
        e->ring_fd = -1;
        return err;
    }
    char *sq = e->sq_ptr, *cq = e->cq_ptr;
    e->sq_head = (unsigned *)(sq + p.sq_off.head);
    e->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    e->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    e->sq_array = (unsigned *)(sq + p.sq_off.array);
    e->cq_head = (unsigned *)(cq + p.cq_off.head);
    e->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    e->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    e->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    e->sqes = e->sqes_ptr;
    return 0;
}

static void ring_teardown(engine_t *e) {
    if (e->kick_fd >= 0) {
        close(e->kick_fd);
        e->kick_fd = -1;
    }
    if (e->ring_fd < 0) return;
    munmap(e->sq_ptr, e->sq_size);
    munmap(e->cq_ptr, e->cq_size);
    munmap(e->sqes_ptr, e->sqes_size);
    close(e->ring_fd);
    e->ring_fd = -1;
}

static void ring_prep(engine_t *e, uslot_t *s, unsigned idx) {
    unsigned tail = *e->sq_tail;
    unsigned i = tail & *e->sq_mask;
    struct io_uring_sqe *sqe = &e->sqes[i];
    memset(sqe, 0, sizeof *sqe);
    sqe->opcode = s->c.req->op == OP_WRITE ? IORING_OP_WRITE : IORING_OP_READ;
    /* Issued from io_uring's workers, never inline: submitting a large O_DIRECT request blocks
     * until the device queue has room, and the ring thread must stay free to take reads. */
    sqe->flags = IOSQE_ASYNC;
    sqe->fd = s->c.req->fd;
    sqe->addr = (uint64_t)(uintptr_t)(s->buf + s->got);
    sqe->len = (unsigned)(s->io_len - s->got);
    sqe->off = s->c.req->offset + s->c.pos + s->got;
    sqe->user_data = idx;
    e->sq_array[i] = i;
    __atomic_store_n(e->sq_tail, tail + 1, __ATOMIC_RELEASE);
}

/* Set up a slot for a new chunk; 0, or an errno for a chunk that fails before any I/O.  Called
 * without the mutex: a write's bounce copy can be as large as a chunk (up to 1 GiB). */
static int slot_start(engine_t *e, uslot_t *s, char **bounce) {
    request_t *r = s->c.req;
    s->got = 0;
    s->buf = chunk_addr(r, &s->c);
    s->io_len = s->c.len;
    if (needs_bounce(r, &s->c)) {
        if (!*bounce) {
            void *p = NULL;
            if (fault(FAULT_ALLOC) || posix_memalign(&p, ALIGN, e->chunk_bytes + ALIGN))
                return ENOMEM;
            *bounce = p;
        }
        s->buf = *bounce;
        s->io_len = (s->c.len + ALIGN - 1) / ALIGN * ALIGN;
        if (r->op == OP_WRITE) {
            copy_gate();
            memcpy(s->buf, chunk_addr(r, &s->c), s->c.len);
            memset(s->buf + s->c.len, 0, s->io_len - s->c.len);
        }
    }
    return 0;
}

/* SQEs written to the ring and not yet consumed by the kernel. */
static unsigned ring_unsubmitted(engine_t *e) {
    return *e->sq_tail - __atomic_load_n(e->sq_head, __ATOMIC_ACQUIRE);
}

#define RING_RETRIES 1000 /* EAGAIN/EBUSY from io_uring_enter, retried 1 ms apart: ~1 s */

/* Submit what the SQ holds and wait for min_complete CQEs.  Transient errors are retried: EINTR
 * always, EAGAIN/EBUSY (the kernel short of memory for requests) for about a second.  Returns
 * -1 with errno set when the ring has failed. */
static int ring_enter(engine_t *e, unsigned min_complete) {
    for (int tries = 0;;) {
        int rc, injected = fault(FAULT_URING_ENTER);
        if (injected) {
            errno = injected;
            rc = -1;
        } else {
            rc = (int)syscall(__NR_io_uring_enter, e->ring_fd, ring_unsubmitted(e), min_complete,
                              min_complete ? IORING_ENTER_GETEVENTS : 0, NULL, 0);
        }
        if (rc >= 0) return rc;
        if (errno == EINTR) continue;
        if ((errno != EAGAIN && errno != EBUSY) || ++tries >= RING_RETRIES) return -1;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
}

#define KICK_TOKEN UINT64_MAX

/* Keep one read of kick_fd in flight: submit() writes kick_fd when the ring thread is waiting
 * for completions, so new work (reads above all) is taken at once, not after the next I/O. */
static void ring_arm_kick(engine_t *e) {
    unsigned tail = *e->sq_tail;
    unsigned i = tail & *e->sq_mask;
    struct io_uring_sqe *sqe = &e->sqes[i];
    memset(sqe, 0, sizeof *sqe);
    sqe->opcode = IORING_OP_READ;
    sqe->fd = e->kick_fd;
    sqe->addr = (uint64_t)(uintptr_t)&e->kick_buf;
    sqe->len = sizeof e->kick_buf;
    sqe->off = (uint64_t)-1; /* current position: eventfds have none */
    sqe->user_data = KICK_TOKEN;
    e->sq_array[i] = i;
    __atomic_store_n(e->sq_tail, tail + 1, __ATOMIC_RELEASE);
}

/* The chunk of slot s is over (err 0 or an errno): check its length, copy a bounced read to its
 * destination (no mutex held), and leave it SLOT_DONE: ring_main (or ring_teardown) reports it
 * with the mutex held. */
static void slot_done(uslot_t *s, int err) {
    request_t *r = s->c.req;
    if (!err && s->got < s->c.len) err = EIO;
    if (!err && r->op == OP_READ && s->buf != chunk_addr(r, &s->c)) {
        copy_gate();
        memcpy(r->addr + s->c.pos, s->buf, s->c.len);
    }
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
                s->got -= s->got % ALIGN;   /* (see transfer_chunk) */
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

/* Start the rest of the pool the engine was asked for (the ring thread is one of them); where
 * pthread_create fails, fewer threads serve.  Holds mu. */
static void pool_grow(engine_t *e) {
    while (e->nthreads < e->pool_size && !e->stopping) {
        if (pthread_create(&e->threads[e->nthreads], NULL, thread_main, e)) break;
        e->nthreads++;
    }
}

/* io_uring_enter failed with `err`, for good: the engine moves to the threads backend for the
 * rest of its life.  Queued requests go to the pool at once.  Then this thread finishes the
 * chunks it holds: one whose SQE the kernel never consumed is transferred here with
 * pread/pwrite; one the kernel took completes with its CQE, which the kernel posts to the
 * shared CQ without io_uring_enter.  Those are waited for, never failed early: until its CQE,
 * the kernel may still write into the chunk's buffer. */
static void ring_fall_back(engine_t *e, int err) {
    uslot_t *slots = e->slots;
    if (err <= 0) err = EIO; /* fallback_err 0 would read as "no fallback" */
    pthread_mutex_lock(&e->mu);
    e->use_kick = 0; /* submit() no longer wakes the ring */
    e->ring_sleeping = 0;
    __atomic_store_n(&e->fallback_err, err, __ATOMIC_RELEASE);
    __atomic_store_n(&e->use_uring, 0, __ATOMIC_RELEASE);
    pool_grow(e);
    pthread_cond_broadcast(&e->work_cv);
    pthread_mutex_unlock(&e->mu);

    unsigned head = __atomic_load_n(e->sq_head, __ATOMIC_ACQUIRE);
    for (unsigned tail = *e->sq_tail; head != tail; head++) { /* SQEs the kernel never took */
        uint64_t idx = e->sqes[e->sq_array[head & *e->sq_mask]].user_data;
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
        unsigned h = *e->cq_head;
        unsigned t = __atomic_load_n(e->cq_tail, __ATOMIC_ACQUIRE);
        if (h == t) { /* nothing yet: poll, backing off to 10 ms */
            struct timespec ts = {0, nap_ns};
            nanosleep(&ts, NULL);
            if (nap_ns < 10000000) nap_ns *= 2;
            continue;
        }
        nap_ns = 50000;
        for (; h != t; h++) {
            struct io_uring_cqe *cqe = &e->cqes[h & *e->cq_mask];
            if (cqe->user_data == KICK_TOKEN) continue;
            uslot_t *s = &slots[cqe->user_data];
            if (slot_result(s, cqe->res)) slot_sync(s); /* a short transfer: the rest here */
        }
        __atomic_store_n(e->cq_head, h, __ATOMIC_RELEASE);
    }
    for (unsigned i = 0; i < e->depth; i++) { /* no slot is used again */
        free(e->bounce[i]);
        e->bounce[i] = NULL;
    }
}

static void *ring_main(void *arg) {
    engine_t *e = arg;
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
            ring_prep(e, s, i);
        }
        if (ring_enter(e, done ? 0 : 1) < 0) {
            ring_fall_back(e, errno);
            return thread_main(e); /* serve in the pool until close() */
        }
        unsigned head = *e->cq_head;
        unsigned tail = __atomic_load_n(e->cq_tail, __ATOMIC_ACQUIRE);
        for (; head != tail; head++) {
            struct io_uring_cqe *cqe = &e->cqes[head & *e->cq_mask];
            if (cqe->user_data == KICK_TOKEN) { /* woken for new work: re-arm */
                if (cqe->res > 0) ring_arm_kick(e);
                else kick_failed = 1;
                continue;
            }
            uslot_t *s = &slots[cqe->user_data];
            if (slot_result(s, cqe->res)) ring_prep(e, s, (unsigned)cqe->user_data);
        }
        __atomic_store_n(e->cq_head, head, __ATOMIC_RELEASE);
        pthread_mutex_lock(&e->mu);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}
#endif

/* ------------------------------------------------------------------------ Python object -- */

static PyObject *Engine_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"threads", "chunk_bytes", "backend", "depth", NULL};
    int threads = 4;
    unsigned long long chunk = 1u << 20;
    const char *backend = "threads";
    unsigned depth = 32;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$iKsI", kwlist, &threads, &chunk, &backend,
                                     &depth))
        return NULL;
    if (threads < 1 || threads > 256) {
        PyErr_Format(PyExc_ValueError, "threads must be in 1..256, got %d", threads);
        return NULL;
    }
    if (chunk < ALIGN || chunk % ALIGN || chunk > (1ull << 30)) {
        PyErr_Format(PyExc_ValueError,
                     "chunk_bytes must be a multiple of 4096 between 4096 and 1 GiB, got %llu",
                     chunk);
        return NULL;
    }
    if (depth < 1 || depth > 4096) {
        PyErr_Format(PyExc_ValueError, "depth must be in 1..4096, got %u", depth);
        return NULL;
    }
    int want_uring;
    if (strcmp(backend, "threads") == 0) want_uring = 0;
    else if (strcmp(backend, "uring") == 0) want_uring = 1;
    else {
        PyErr_Format(PyExc_ValueError, "backend must be 'threads' or 'uring', got '%s'", backend);
        return NULL;
    }
    engine_t *e = (engine_t *)type->tp_alloc(type, 0);
    if (!e) return NULL;
    e->efd = -1;
#ifdef OFFLOADD_HAVE_URING
    e->ring_fd = -1; /* before anything can fail: dealloc tears the ring down */
    e->kick_fd = -1;
#endif
    e->chunk_bytes = chunk;
    e->depth = depth;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->work_cv, NULL);
    e->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (e->efd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(e);
        return NULL;
    }
#ifdef OFFLOADD_HAVE_URING
    if (want_uring) {
        e->kick_fd = eventfd(0, EFD_CLOEXEC);
        if (e->kick_fd < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            Py_DECREF(e);
            return NULL;
        }
        int err = ring_setup(e, depth + 1); /* + the kick read */
        if (err) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
            Py_DECREF(e);
            return NULL;
        }
        /* Here, not in the ring thread: a failure is a MemoryError for the caller. */
        if (!fault(FAULT_ALLOC)) {
            e->slots = calloc(depth, sizeof *e->slots);
            e->bounce = calloc(depth, sizeof *e->bounce);
        }
        if (!e->slots || !e->bounce) {
            PyErr_NoMemory();
            Py_DECREF(e);
            return NULL;
        }
        e->use_uring = 1;
    }
#else
    if (want_uring) {
        PyErr_SetString(PyExc_OSError, "offloadd.io._native was built without io_uring support");
        Py_DECREF(e);
        return NULL;
    }
#endif
    /* With io_uring, one thread drives the ring; the pool is started only if the ring fails. */
    e->pool_size = threads;
    e->threads = calloc((size_t)threads, sizeof(pthread_t));
    if (!e->threads) {
        Py_DECREF(e);
        return PyErr_NoMemory();
    }
    if (e->use_uring) threads = 1;
    for (int i = 0; i < threads; i++) {
        void *(*fn)(void *) = thread_main;
#ifdef OFFLOADD_HAVE_URING
        if (e->use_uring) fn = ring_main;
#endif
        int rc = pthread_create(&e->threads[i], NULL, fn, e);
        if (rc) { /* dealloc stops the threads already started and tears the ring down */
            errno = rc;
            PyErr_SetFromErrno(PyExc_OSError);
            Py_DECREF(e);
            return NULL;
        }
        pthread_mutex_lock(&e->mu);
        e->nthreads = i + 1;
        pthread_mutex_unlock(&e->mu);
    }
    return (PyObject *)e;
}

static void engine_stop(engine_t *e) {
    pthread_mutex_lock(&e->mu);
    if (e->closed) { /* another close() got here first */
        pthread_mutex_unlock(&e->mu);
        return;
    }
    e->closed = 1;
    e->stopping = 1; /* from here on no thread is started (pool_grow) */
    pthread_cond_broadcast(&e->work_cv);
    int n = e->nthreads;
    pthread_mutex_unlock(&e->mu);
    for (int i = 0; i < n; i++) pthread_join(e->threads[i], NULL);
    e->nthreads = 0;
#ifdef OFFLOADD_HAVE_URING
    ring_teardown(e);
#endif
}

static void Engine_dealloc(engine_t *e) {
    Py_BEGIN_ALLOW_THREADS
    engine_stop(e);
    Py_END_ALLOW_THREADS
    free(e->threads);
#ifdef OFFLOADD_HAVE_URING
    for (unsigned i = 0; e->bounce && i < e->depth; i++) free(e->bounce[i]);
    free(e->bounce);
    free(e->slots);
#endif
    for (request_t *r = e->done_head, *next; r; r = next) { /* never reaped */
        next = r->dnext;
        free(r);
    }
    if (e->efd >= 0) close(e->efd);
    pthread_cond_destroy(&e->work_cv);
    pthread_mutex_destroy(&e->mu);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

static PyObject *Engine_submit(engine_t *e, PyObject *args) {
    unsigned long long token, offset, address, nbytes, head = 0, tail = 0;
    int op, fd;
    if (!PyArg_ParseTuple(args, "KiiKKK|KK", &token, &op, &fd, &offset, &address, &nbytes, &head,
                          &tail))
        return NULL;
    if (op != OP_READ && op != OP_WRITE) {
        PyErr_Format(PyExc_ValueError, "op must be 0 (read) or 1 (write), got %d", op);
        return NULL;
    }
    if ((head || tail) && (op != OP_WRITE || nbytes < ALIGN || (tail && nbytes < 2 * ALIGN))) {
        PyErr_SetString(PyExc_ValueError,
                        "head/tail pages are for writes of at least one page (two with a tail)");
        return NULL;
    }
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0) return PyErr_SetFromErrno(PyExc_OSError);
    int direct = (flags & O_DIRECT) != 0;
    if (direct && offset % ALIGN) {
        PyObject *exc = PyObject_CallFunction(
            PyExc_OSError, "is", EINVAL, "file offset is not a multiple of 4096 on an O_DIRECT file");
        if (exc) {
            PyErr_SetObject(PyExc_OSError, exc);
            Py_DECREF(exc);
        }
        return NULL;
    }
    request_t *r = calloc(1, sizeof *r);
    if (!r) return PyErr_NoMemory();
    r->token = token;
    r->op = op;
    r->fd = fd;
    r->direct = direct;
    r->offset = offset;
    r->addr = (char *)(uintptr_t)address;
    r->head = (char *)(uintptr_t)head;
    r->tail = (char *)(uintptr_t)tail;
    r->nbytes = nbytes;
    pthread_mutex_lock(&e->mu);
    if (e->stopping) { /* checked under the lock: a request can never be stranded by close() */
        pthread_mutex_unlock(&e->mu);
        free(r);
        PyErr_SetString(PyExc_RuntimeError, "offloadd: native engine is closed");
        return NULL;
    }
    e->pending_requests++;
    if (nbytes == 0) {
        r->inflight = 1; /* complete at once through the normal path */
        finish_chunk(e, r, 0, 0);
    } else {
        queue_push(e, r);
        pthread_cond_signal(&e->work_cv);
#ifdef OFFLOADD_HAVE_URING
        if (e->use_uring && e->use_kick && e->ring_sleeping) {
            uint64_t one = 1;
            e->ring_sleeping = 0;
            if (write(e->kick_fd, &one, sizeof one) < 0) { /* the ring thread wakes later */ }
        }
#endif
        if (!e->use_uring && e->nthreads > 1 && nbytes > e->chunk_bytes)
            pthread_cond_broadcast(&e->work_cv);
    }
    pthread_mutex_unlock(&e->mu);
    Py_RETURN_NONE;
}

static PyObject *Engine_cancel(engine_t *e, PyObject *arg) {
    unsigned long long token = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    int found = 0;
    pthread_mutex_lock(&e->mu);
    for (int q = OP_READ; q <= OP_WRITE && !found; q++) {
        for (request_t *r = e->qhead[q]; r; r = r->qnext) {
            if (r->token == token && !r->started) {
                queue_remove(e, r);
                e->pending_requests--;
                free(r);
                found = 1;
                break;
            }
        }
    }
    pthread_mutex_unlock(&e->mu);
    return PyBool_FromLong(found);
}

/* Put finished requests that reap() took but could not hand to Python back at the head of the
 * completion list, in order, for the next reap(). */
static void give_back(engine_t *e, request_t *got, size_t n) {
    if (!got) return;
    request_t *last = got;
    while (last->dnext) last = last->dnext;
    pthread_mutex_lock(&e->mu);
    last->dnext = e->done_head;
    if (!e->done_tail) e->done_tail = last;
    e->done_head = got;
    e->ndone += n;
    signal_eventfd(e);
    pthread_mutex_unlock(&e->mu);
}

static PyObject *Engine_reap(engine_t *e, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"timeout", NULL};
    double timeout = -1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|d", kwlist, &timeout)) return NULL;
    request_t *got = NULL;
    size_t n = 0;
    int poll_err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        /* Clear the eventfd before draining: a completion added after the drain signals it
         * again, so poll() below can never sleep on a completion already queued. */
        uint64_t v;
        if (read(e->efd, &v, sizeof v) < 0 && errno != EAGAIN) { poll_err = errno; break; }
        pthread_mutex_lock(&e->mu);
        if (e->done_head) {
            got = e->done_head;
            n = e->ndone;
            e->done_head = e->done_tail = NULL;
            e->ndone = 0;
        }
        pthread_mutex_unlock(&e->mu);
        if (n || timeout == 0.0) break;
        struct pollfd pfd = {.fd = e->efd, .events = POLLIN};
        int ms = timeout < 0 ? -1 : (int)(timeout * 1000.0 + 0.999);
        int rc = poll(&pfd, 1, ms);
        if (rc < 0 && errno != EINTR) { poll_err = errno; break; }
        if (rc == 0) timeout = 0.0; /* one last look, then return empty */
    }
    Py_END_ALLOW_THREADS
    if (poll_err) { /* the loop only goes on while nothing was taken: nothing to give back */
        errno = poll_err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    /* Nothing is freed before the whole list is built: on MemoryError every completion taken
     * goes back to the engine, and a later reap() delivers it. */
    PyObject *list = fault(FAULT_COMPLETION) ? PyErr_NoMemory() : PyList_New((Py_ssize_t)n);
    if (!list) {
        give_back(e, got, n);
        return NULL;
    }
    Py_ssize_t i = 0;
    for (request_t *r = got; r; r = r->dnext, i++) {
        PyObject *t = Py_BuildValue("(KiK)", (unsigned long long)r->token, r->err,
                                    (unsigned long long)r->done);
        if (!t) {
            Py_DECREF(list);
            give_back(e, got, n);
            return NULL;
        }
        PyList_SET_ITEM(list, i, t);
    }
    for (request_t *r = got, *next; r; r = next) {
        next = r->dnext;
        free(r);
    }
    return list;
}

static PyObject *Engine_close(engine_t *e, PyObject *Py_UNUSED(ignored)) {
    Py_BEGIN_ALLOW_THREADS
    engine_stop(e);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Engine_fileno(engine_t *e, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLong(e->efd);
}

static PyObject *Engine_counters(engine_t *e, PyObject *Py_UNUSED(ignored)) {
    pthread_mutex_lock(&e->mu);
    unsigned long long rd = e->bytes_read, wr = e->bytes_written, pend = e->pending_requests;
    pthread_mutex_unlock(&e->mu);
    return Py_BuildValue("{sKsKsK}", "bytes_read", rd, "bytes_written", wr, "pending", pend);
}

static PyObject *Engine_get_backend(engine_t *e, void *Py_UNUSED(closure)) {
    return PyUnicode_FromString(__atomic_load_n(&e->use_uring, __ATOMIC_ACQUIRE) ? "uring"
                                                                                  : "threads");
}

static PyObject *Engine_get_fallback(engine_t *e, void *Py_UNUSED(closure)) {
    int err = __atomic_load_n(&e->fallback_err, __ATOMIC_ACQUIRE);
    if (!err) Py_RETURN_NONE;
    return PyUnicode_FromFormat("io_uring_enter: [Errno %d] %s", err, strerror(err));
}

static PyMethodDef Engine_methods[] = {
    {"submit", (PyCFunction)Engine_submit, METH_VARARGS,
     "submit(token, op, fd, offset, address, nbytes): queue one transfer"},
    {"cancel", (PyCFunction)Engine_cancel, METH_O,
     "cancel(token) -> bool: drop a request none of whose chunks has started"},
    {"reap", (PyCFunction)(void (*)(void))Engine_reap, METH_VARARGS | METH_KEYWORDS,
     "reap(timeout=-1) -> list[(token, errno, bytes)]: wait (GIL released) for completions; "
     "on MemoryError they stay queued for the next call"},
    {"close", (PyCFunction)Engine_close, METH_NOARGS,
     "close(): finish every submitted request, then stop the threads"},
    {"fileno", (PyCFunction)Engine_fileno, METH_NOARGS,
     "fileno() -> int: an eventfd that is readable when completions are waiting"},
    {"counters", (PyCFunction)Engine_counters, METH_NOARGS,
     "counters() -> dict: bytes read and written, requests pending"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Engine_getset[] = {
    {"backend", (getter)Engine_get_backend, NULL,
     "'threads' or 'uring' ('threads' for good once the ring has failed)", NULL},
    {"fallback", (getter)Engine_get_fallback, NULL,
     "None, or why the io_uring backend moved to threads (the error io_uring_enter returned)",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "offloadd.io._native.Engine",
    .tp_basicsize = sizeof(engine_t),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Native I/O engine: pthread pool or io_uring, completions through an eventfd.",
    .tp_new = Engine_new,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
    .tp_getset = Engine_getset,
};

#ifdef OFFLOADD_HAVE_URING
/* Set up a ring and read 8 bytes of /dev/zero through it (IORING_OP_READ needs Linux 5.6). */
static const char *uring_selftest(void) {
    static char why[160];
    engine_t e;
    memset(&e, 0, sizeof e);
    e.ring_fd = -1;
    e.kick_fd = -1;
    int err = ring_setup(&e, 4);
    if (err) {
        snprintf(why, sizeof why, "io_uring_setup: %s", strerror(err));
        return why;
    }
    const char *result = NULL;
    int zfd = open("/dev/zero", O_RDONLY | O_CLOEXEC);
    if (zfd < 0) {
        snprintf(why, sizeof why, "open /dev/zero: %s", strerror(errno));
        ring_teardown(&e);
        return why;
    }
    char buf[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    uslot_t slot;
    memset(&slot, 0, sizeof slot);
    request_t req;
    memset(&req, 0, sizeof req);
    req.op = OP_READ;
    req.fd = zfd;
    req.addr = buf;
    req.nbytes = sizeof buf;
    slot.c.req = &req;
    slot.c.len = sizeof buf;
    slot.buf = buf;
    slot.io_len = sizeof buf;
    ring_prep(&e, &slot, 0);
    if (ring_enter(&e, 1) < 0) {
        snprintf(why, sizeof why, "io_uring_enter: %s", strerror(errno));
        result = why;
    } else {
        unsigned head = *e.cq_head;
        if (head == __atomic_load_n(e.cq_tail, __ATOMIC_ACQUIRE)) {
            result = "io_uring: no completion";
        } else {
            int res = e.cqes[head & *e.cq_mask].res;
            __atomic_store_n(e.cq_head, head + 1, __ATOMIC_RELEASE);
            if (res != (int)sizeof buf || buf[0] != 0) {
                snprintf(why, sizeof why, "io_uring read test failed: %s",
                         res < 0 ? strerror(-res) : "short read");
                result = why;
            }
        }
    }
    close(zfd);
    ring_teardown(&e);
    return result;
}
#endif

static PyObject *probe_uring(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(ignored)) {
#ifdef OFFLOADD_HAVE_URING
    const char *why;
    Py_BEGIN_ALLOW_THREADS
    why = uring_selftest();
    Py_END_ALLOW_THREADS
    if (why) return Py_BuildValue("(Os)", Py_False, why);
    return Py_BuildValue("(Os)", Py_True, "io_uring read test succeeded");
#else
    return Py_BuildValue("(Os)", Py_False, "built without <linux/io_uring.h>");
#endif
}

static PyObject *inject_fault(PyObject *Py_UNUSED(self), PyObject *args) {
    const char *name;
    int count, err;
    if (!PyArg_ParseTuple(args, "sii", &name, &count, &err)) return NULL;
    for (int i = 0; i < NFAULTS; i++) {
        if (strcmp(name, fault_names[i]) != 0) continue;
        if (count != 0 && err <= 0) {
            PyErr_Format(PyExc_ValueError, "errno must be > 0, got %d", err);
            return NULL;
        }
        fault_errno[i] = err;
        __atomic_store_n(&fault_count[i], count, __ATOMIC_RELEASE);
        Py_RETURN_NONE;
    }
    PyErr_Format(PyExc_ValueError, "unknown fault point '%s'", name);
    return NULL;
}

static PyObject *hold_copies_py(PyObject *Py_UNUSED(self), PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    __atomic_store_n(&hold_copies, on, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *held_copies_py(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLong(__atomic_load_n(&held_copies, __ATOMIC_ACQUIRE));
}

static PyMethodDef module_methods[] = {
    {"_inject_fault", inject_fault, METH_VARARGS,
     "_inject_fault(name, count, errno): for tests, the next `count` passes through the fault "
     "point `name` ('uring_enter', 'alloc', 'completion') fail with `errno` (every pass if "
     "count < 0); count 0 disarms"},
    {"_hold_copies", hold_copies_py, METH_O,
     "_hold_copies(on): for tests, every bounce-buffer copy waits (at most 5 s) while on"},
    {"_held_copies", held_copies_py, METH_NOARGS,
     "_held_copies() -> int: bounce-buffer copies waiting in _hold_copies now"},
    {"probe_uring", probe_uring, METH_NOARGS,
     "probe_uring() -> (bool, str): whether io_uring works in this process, and why not"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "offloadd.io._native", "offloadd's native I/O engine.", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&EngineType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(&EngineType);
        Py_DECREF(m);
        return NULL;
    }
#ifdef OFFLOADD_HAVE_URING
    PyModule_AddIntConstant(m, "HAVE_URING", 1);
#else
    PyModule_AddIntConstant(m, "HAVE_URING", 0);
#endif
    PyModule_AddIntConstant(m, "ALIGN", ALIGN);
    return m;
}
