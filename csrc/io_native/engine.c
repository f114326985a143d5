/*
 * The engine of engine.h: the request queue, the completion list, the thread pool (the threads
 * backend) and the engine's life from engine_start() to engine_free().
 */
#define _GNU_SOURCE
#include "engine.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "posix_io.h"

void engine_init(engine_t *e) {
    e->efd = -1;
#ifdef OFFLOADD_HAVE_URING
    e->ring.fd = -1; /* before anything can fail: engine_stop() tears the ring down */
    e->ring.kick_fd = -1;
#endif
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->work_cv, NULL);
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

int take_chunk(engine_t *e, chunk_t *c) {
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

void finish_chunk(engine_t *e, request_t *r, uint64_t moved, int err) {
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
        r->dnext = NULL; /* engine_release() frees it */
        if (e->done_tail) e->done_tail->dnext = r; else e->done_head = r;
        e->done_tail = r;
        e->ndone++;
        if (r->op == OP_READ) e->bytes_read += r->done; else e->bytes_written += r->done;
        e->pending_requests--;
        signal_eventfd(e);
    }
}

/* ------------------------------------------------------------------------ the thread pool -- */

void *thread_main(void *arg) {
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

void pool_grow(engine_t *e) {
    while (e->nthreads < e->pool_size && !e->stopping) {
        if (pthread_create(&e->threads[e->nthreads], NULL, thread_main, e)) break;
        e->nthreads++;
    }
}

/* -------------------------------------------------------------------------------- a life -- */

int engine_start(engine_t *e, int threads, uint64_t chunk_bytes, int uring, unsigned depth) {
    e->chunk_bytes = chunk_bytes;
    e->depth = depth;
    e->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (e->efd < 0) return errno;
    if (uring) {
#ifdef OFFLOADD_HAVE_URING
        e->ring.kick_fd = eventfd(0, EFD_CLOEXEC);
        if (e->ring.kick_fd < 0) return errno;
        int err = ring_setup(&e->ring, depth + 1); /* + the kick read */
        if (err) return err;
        /* Here, not in the ring thread: a failure is the caller's to report. */
        if (uring_alloc_slots(e)) return ENGINE_NOMEM;
        e->use_uring = 1;
#else
        return ENGINE_NO_URING;
#endif
    }
    e->pool_size = threads;
    e->threads = calloc((size_t)threads, sizeof(pthread_t));
    if (!e->threads) return ENGINE_NOMEM;
    if (e->use_uring) threads = 1;
    for (int i = 0; i < threads; i++) {
        void *(*fn)(void *) = thread_main;
#ifdef OFFLOADD_HAVE_URING
        if (e->use_uring) fn = ring_main;
#endif
        int rc = pthread_create(&e->threads[i], NULL, fn, e);
        if (rc) return rc; /* engine_stop() stops the threads already started */
        pthread_mutex_lock(&e->mu);
        e->nthreads = i + 1;
        pthread_mutex_unlock(&e->mu);
    }
    return 0;
}

void engine_stop(engine_t *e) {
    pthread_mutex_lock(&e->mu);
    if (e->closed) { /* another engine_stop() got here first */
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
    ring_teardown(&e->ring);
#endif
}

void engine_free(engine_t *e) {
    free(e->threads);
    e->threads = NULL;
#ifdef OFFLOADD_HAVE_URING
    uring_free_slots(e);
#endif
    engine_release(e->done_head); /* never reaped */
    e->done_head = e->done_tail = NULL;
    if (e->efd >= 0) close(e->efd);
    e->efd = -1;
    pthread_cond_destroy(&e->work_cv);
    pthread_mutex_destroy(&e->mu);
}

/* ---------------------------------------------------------------------- the caller's side -- */

int engine_submit(engine_t *e, uint64_t token, int op, int fd, uint64_t offset, char *addr,
                  uint64_t nbytes, char *head, char *tail) {
    if (op != OP_READ && op != OP_WRITE) return ENGINE_BAD_OP;
    if ((head || tail) && (op != OP_WRITE || nbytes < ALIGN || (tail && nbytes < 2 * ALIGN)))
        return ENGINE_BAD_PAGES;
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0) return errno;
    int direct = (flags & O_DIRECT) != 0;
    if (direct && offset % ALIGN) return ENGINE_UNALIGNED;
    request_t *r = calloc(1, sizeof *r);
    if (!r) return ENGINE_NOMEM;
    r->token = token;
    r->op = op;
    r->fd = fd;
    r->direct = direct;
    r->offset = offset;
    r->addr = addr;
    r->head = head;
    r->tail = tail;
    r->nbytes = nbytes;
    pthread_mutex_lock(&e->mu);
    if (e->stopping) { /* checked under the lock: a request can never be stranded by close() */
        pthread_mutex_unlock(&e->mu);
        free(r);
        return ENGINE_CLOSED;
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
            if (write(e->ring.kick_fd, &one, sizeof one) < 0) { /* the ring thread wakes later */ }
        }
#endif
        if (!e->use_uring && e->nthreads > 1 && nbytes > e->chunk_bytes)
            pthread_cond_broadcast(&e->work_cv);
    }
    pthread_mutex_unlock(&e->mu);
    return 0;
}

int engine_cancel(engine_t *e, uint64_t token) {
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
    return found;
}

int engine_wait(engine_t *e, double timeout, request_t **got, size_t *n) {
    *got = NULL;
    *n = 0;
    for (;;) {
        /* Clear the eventfd before draining: a completion added after the drain signals it
         * again, so poll() below can never sleep on a completion already queued. */
        uint64_t v;
        if (read(e->efd, &v, sizeof v) < 0 && errno != EAGAIN) return errno;
        pthread_mutex_lock(&e->mu);
        if (e->done_head) {
            *got = e->done_head;
            *n = e->ndone;
            e->done_head = e->done_tail = NULL;
            e->ndone = 0;
        }
        pthread_mutex_unlock(&e->mu);
        if (*n || timeout == 0.0) return 0;
        struct pollfd pfd = {.fd = e->efd, .events = POLLIN};
        int ms = timeout < 0 ? -1 : (int)(timeout * 1000.0 + 0.999);
        int rc = poll(&pfd, 1, ms);
        if (rc < 0 && errno != EINTR) return errno;
        if (rc == 0) timeout = 0.0; /* one last look, then return empty */
    }
}

void engine_give_back(engine_t *e, request_t *got, size_t n) {
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

void engine_release(request_t *got) {
    for (request_t *r = got, *next; r; r = next) {
        next = r->dnext;
        free(r);
    }
}

void engine_counters(engine_t *e, uint64_t *bytes_read, uint64_t *bytes_written,
                     uint64_t *pending) {
    pthread_mutex_lock(&e->mu);
    *bytes_read = e->bytes_read;
    *bytes_written = e->bytes_written;
    *pending = e->pending_requests;
    pthread_mutex_unlock(&e->mu);
}

int engine_uses_uring(engine_t *e) { return __atomic_load_n(&e->use_uring, __ATOMIC_ACQUIRE); }

int engine_fallback_errno(engine_t *e) {
    return __atomic_load_n(&e->fallback_err, __ATOMIC_ACQUIRE);
}
