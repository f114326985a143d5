/*
 * The native I/O engine without Python: a queue of requests, the backends that move their
 * chunks, and a completion list signalled through an eventfd.
 *
 * Two backends move the chunks:
 *
 *   threads  a pool of pthreads doing pread/pwrite (the baseline, always available: engine.c);
 *   uring    one thread driving an io_uring ring with up to `depth` chunks in flight
 *            (uring_backend.c, on the ring of ring.h).
 *
 * Nothing here ends the process.  If io_uring_enter fails for good (any error but EINTR, or
 * EAGAIN/EBUSY for about a second), the engine moves to the threads backend for the rest of its
 * life: queued requests go to a pool of `threads` pthreads, chunks already in the ring finish
 * (with pread/pwrite where the kernel never took them), and fallback_err says why.  A failed
 * allocation fails only the request that needed it, with ENOMEM.
 *
 * No backend thread ever takes the GIL (none knows Python).  When a request's last chunk
 * finishes, the request itself is appended to the completion list (no allocation: completing can
 * never fail) and the eventfd `efd` is signalled; the caller collects finished requests with
 * engine_wait().  Reads are handed out before writes.
 */
#ifndef OFFLOADD_IO_ENGINE_H
#define OFFLOADD_IO_ENGINE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "request.h"
#include "ring.h"

typedef struct engine {
    pthread_mutex_t mu;
    pthread_cond_t work_cv;
    request_t *qhead[2], *qtail[2];  /* pending chunks: [OP_READ], [OP_WRITE] */
    request_t *done_head, *done_tail; /* finished requests, oldest first, until engine_wait() */
    size_t ndone;
    int efd;
    int stopping;
    int closed;
    int use_uring;    /* written under mu, atomically: engine_uses_uring() reads it without */
    int fallback_err; /* io_uring_enter's errno once the ring failed, else 0 (atomic) */
    int nthreads;     /* threads started (guarded by mu) */
    int pool_size;    /* threads asked for: the pool that takes over if the ring fails */
    pthread_t *threads; /* pool_size of them */
    uint64_t chunk_bytes;
    unsigned depth;
    uint64_t pending_requests; /* submitted and not completed */
    uint64_t bytes_read, bytes_written;
#ifdef OFFLOADD_HAVE_URING
    ring_t ring;       /* ring.kick_fd: read through the ring, wakes the ring thread for new work */
    int ring_sleeping; /* the ring thread waits in io_uring_enter (guarded by mu) */
    int use_kick;
    struct uslot *slots; /* depth of them, owned by the ring thread (allocated by engine_start) */
    char **bounce;       /* each slot's bounce buffer, allocated at its first use */
#endif
} engine_t;

/* Return codes besides 0 and errno values (which are positive). */
enum {
    ENGINE_NOMEM = -1,     /* an allocation failed (Python: MemoryError) */
    ENGINE_NO_URING = -2,  /* the uring backend was asked for, built without <linux/io_uring.h> */
    ENGINE_BAD_OP = -3,    /* op is neither OP_READ nor OP_WRITE */
    ENGINE_BAD_PAGES = -4, /* head/tail pages on a read or on a write shorter than they are */
    ENGINE_UNALIGNED = -5, /* an unaligned file offset on an O_DIRECT file (that is EINVAL) */
    ENGINE_CLOSED = -6,    /* engine_stop() has begun */
};

/* The limits engine_start() expects its arguments to be within (checked by the caller). */
#define ENGINE_MAX_THREADS 256
#define ENGINE_MAX_CHUNK (1ull << 30)
#define ENGINE_MAX_DEPTH 4096u

/* Put e (zeroed memory) in the state engine_free() can take: no descriptor, no thread. */
void engine_init(engine_t *e);

/* Open the eventfd, set up the ring (uring != 0) and start the backend's threads: `threads`
 * pthreads, or one ring thread (with io_uring, the pool is started only if the ring fails).
 * Returns 0, an errno, ENGINE_NOMEM or ENGINE_NO_URING; on failure the caller still calls
 * engine_stop() and engine_free(), which undo what was done. */
int engine_start(engine_t *e, int threads, uint64_t chunk_bytes, int uring, unsigned depth);

/* Finish every submitted request, then stop the threads and tear the ring down.  Idempotent. */
void engine_stop(engine_t *e);

/* After engine_stop(): free what e holds (not e itself), unreaped completions included. */
void engine_free(engine_t *e);

/* Queue one transfer; a write's first (last) 4096 bytes come from head (tail) when not NULL.
 * Returns 0, ENGINE_BAD_OP, ENGINE_BAD_PAGES, fcntl's errno, ENGINE_UNALIGNED, ENGINE_NOMEM or
 * ENGINE_CLOSED.  An empty request completes at once. */
int engine_submit(engine_t *e, uint64_t token, int op, int fd, uint64_t offset, char *addr,
                  uint64_t nbytes, char *head, char *tail);

/* Drop a request none of whose chunks has started: 1 if it will never complete, else 0. */
int engine_cancel(engine_t *e, uint64_t token);

/* Take every finished request (a list linked by dnext, oldest first, *n of them), waiting up to
 * `timeout` seconds (< 0: for ever, 0: not at all) for one.  Returns 0 (*got NULL if none came)
 * or an errno of read/poll on the eventfd.  Call it without holding any lock of the caller's:
 * it sleeps. */
int engine_wait(engine_t *e, double timeout, request_t **got, size_t *n);

/* Put requests engine_wait() took but the caller could not deliver back at the head of the
 * completion list, in order, for the next engine_wait(). */
void engine_give_back(engine_t *e, request_t *got, size_t n);

/* Free a list engine_wait() returned. */
void engine_release(request_t *got);

void engine_counters(engine_t *e, uint64_t *bytes_read, uint64_t *bytes_written,
                     uint64_t *pending);

/* Whether the io_uring backend serves now (0 for good once the ring has failed). */
int engine_uses_uring(engine_t *e);

/* 0, or io_uring_enter's errno when the io_uring backend moved to threads. */
int engine_fallback_errno(engine_t *e);

/* -- shared by the backends (engine.c, uring_backend.c) ------------------------------------ */

/* Hand out the next chunk, reads first.  Returns 0 if there is none.  Holds mu. */
int take_chunk(engine_t *e, chunk_t *c);

/* Record the end of a chunk; completes the request when it was the last one.  Holds mu. */
void finish_chunk(engine_t *e, request_t *r, uint64_t moved, int err);

/* A thread of the pool: pread/pwrite chunks until engine_stop(). */
void *thread_main(void *arg);

/* Start the rest of the pool the engine was asked for (the ring thread is one of them); where
 * pthread_create fails, fewer threads serve.  Holds mu. */
void pool_grow(engine_t *e);

#ifdef OFFLOADD_HAVE_URING
/* The uring backend (uring_backend.c): its slot table, and the thread that drives the ring. */
int uring_alloc_slots(engine_t *e);
void uring_free_slots(engine_t *e);
void *ring_main(void *arg);
#endif

#endif
