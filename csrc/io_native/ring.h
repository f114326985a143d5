/*
 * A hand-rolled io_uring ring: the three mappings, writing SQEs, io_uring_enter, reading CQEs.
 *
 * Compiled when <linux/io_uring.h> exists (OFFLOADD_HAVE_URING); a ring is used only if
 * io_uring_setup succeeds at run time, since container seccomp profiles often refuse it.
 * A ring_t belongs to one thread at a time: nothing here locks.
 */
#ifndef OFFLOADD_IO_RING_H
#define OFFLOADD_IO_RING_H

#include <stddef.h>
#include <stdint.h>

#if defined(__has_include)
#if __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#define OFFLOADD_HAVE_URING 1
#endif
#endif

#ifdef OFFLOADD_HAVE_URING

typedef struct ring {
    int fd;            /* -1: no ring */
    int kick_fd;       /* eventfd the engine's ring thread reads through the ring (-1: none) */
    uint64_t kick_buf;
    void *sq_ptr, *cq_ptr, *sqes_ptr;
    size_t sq_size, cq_size, sqes_size;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;
    struct io_uring_sqe *sqes;
} ring_t;

#define RING_RETRIES 1000 /* EAGAIN/EBUSY from io_uring_enter, retried 1 ms apart: ~1 s */

/* Set up a ring of `entries` SQEs in q (whose fd and kick_fd must be set, -1 if none).  Returns
 * 0 or an errno; on failure q->fd is -1 and nothing is left mapped. */
int ring_setup(ring_t *q, unsigned entries);

/* Unmap and close the ring and close kick_fd; safe to call again. */
void ring_teardown(ring_t *q);

/* Write one read or write SQE (op OP_READ or OP_WRITE) of len bytes at buf from file offset
 * off, tagged user_data, and publish it.  The caller makes sure the SQ has room. */
void ring_prep(ring_t *q, int op, int fd, void *buf, unsigned len, uint64_t off,
               uint64_t user_data, unsigned sqe_flags);

/* SQEs written to the ring and not yet consumed by the kernel. */
unsigned ring_unsubmitted(const ring_t *q);

/* Submit what the SQ holds and wait for min_complete CQEs.  Transient errors are retried: EINTR
 * always, EAGAIN/EBUSY (the kernel short of memory for requests) for about a second.  Returns
 * -1 with errno set when the ring has failed. */
int ring_enter(ring_t *q, unsigned min_complete);

/* Set up a ring and read 8 bytes of /dev/zero through it (IORING_OP_READ needs Linux 5.6).
 * Returns 1 if that worked, else 0 with why (a message, at most n bytes) filled in. */
int ring_selftest(char *why, size_t n);

#endif /* OFFLOADD_HAVE_URING */
#endif
