/*
 * The io_uring ring of ring.h, with the raw system calls (no liburing).
 */
#define _GNU_SOURCE
#include "ring.h"

#ifdef OFFLOADD_HAVE_URING

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "faults.h"
#include "request.h"

int ring_setup(ring_t *q, unsigned entries) {
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    int fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (fd < 0) return errno;
    q->fd = fd;
    q->sq_size = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    q->cq_size = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    q->sqes_size = p.sq_entries * sizeof(struct io_uring_sqe);
    q->sq_ptr = mmap(NULL, q->sq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                     IORING_OFF_SQ_RING);
    q->cq_ptr = mmap(NULL, q->cq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                     IORING_OFF_CQ_RING);
    q->sqes_ptr = mmap(NULL, q->sqes_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                       IORING_OFF_SQES);
    if (q->sq_ptr == MAP_FAILED || q->cq_ptr == MAP_FAILED || q->sqes_ptr == MAP_FAILED) {
        int err = errno;
        if (q->sq_ptr != MAP_FAILED) munmap(q->sq_ptr, q->sq_size);
        if (q->cq_ptr != MAP_FAILED) munmap(q->cq_ptr, q->cq_size);
        if (q->sqes_ptr != MAP_FAILED) munmap(q->sqes_ptr, q->sqes_size);
        close(fd);
        q->fd = -1;
        return err;
    }
    char *sq = q->sq_ptr, *cq = q->cq_ptr;
    q->sq_head = (unsigned *)(sq + p.sq_off.head);
    q->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    q->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    q->sq_array = (unsigned *)(sq + p.sq_off.array);
    q->cq_head = (unsigned *)(cq + p.cq_off.head);
    q->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    q->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    q->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    q->sqes = q->sqes_ptr;
    return 0;
}

void ring_teardown(ring_t *q) {
    if (q->kick_fd >= 0) {
        close(q->kick_fd);
        q->kick_fd = -1;
    }
    if (q->fd < 0) return;
    munmap(q->sq_ptr, q->sq_size);
    munmap(q->cq_ptr, q->cq_size);
    munmap(q->sqes_ptr, q->sqes_size);
    close(q->fd);
    q->fd = -1;
}

void ring_prep(ring_t *q, int op, int fd, void *buf, unsigned len, uint64_t off,
               uint64_t user_data, unsigned sqe_flags) {
    unsigned tail = *q->sq_tail;
    unsigned i = tail & *q->sq_mask;
    struct io_uring_sqe *sqe = &q->sqes[i];
    memset(sqe, 0, sizeof *sqe);
    sqe->opcode = op == OP_WRITE ? IORING_OP_WRITE : IORING_OP_READ;
    sqe->flags = (uint8_t)sqe_flags;
    sqe->fd = fd;
    sqe->addr = (uint64_t)(uintptr_t)buf;
    sqe->len = len;
    sqe->off = off;
    sqe->user_data = user_data;
    q->sq_array[i] = i;
    __atomic_store_n(q->sq_tail, tail + 1, __ATOMIC_RELEASE);
}

unsigned ring_unsubmitted(const ring_t *q) {
    return *q->sq_tail - __atomic_load_n(q->sq_head, __ATOMIC_ACQUIRE);
}

int ring_enter(ring_t *q, unsigned min_complete) {
    for (int tries = 0;;) {
        int rc, injected = fault(FAULT_URING_ENTER);
        if (injected) {
            errno = injected;
            rc = -1;
        } else {
            rc = (int)syscall(__NR_io_uring_enter, q->fd, ring_unsubmitted(q), min_complete,
                              min_complete ? IORING_ENTER_GETEVENTS : 0, NULL, 0);
        }
        if (rc >= 0) return rc;
        if (errno == EINTR) continue;
        if ((errno != EAGAIN && errno != EBUSY) || ++tries >= RING_RETRIES) return -1;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
}

int ring_selftest(char *why, size_t n) {
    ring_t q;
    memset(&q, 0, sizeof q);
    q.fd = -1;
    q.kick_fd = -1;
    int err = ring_setup(&q, 4);
    if (err) {
        snprintf(why, n, "io_uring_setup: %s", strerror(err));
        return 0;
    }
    int ok = 0;
    int zfd = open("/dev/zero", O_RDONLY | O_CLOEXEC);
    if (zfd < 0) {
        snprintf(why, n, "open /dev/zero: %s", strerror(errno));
        ring_teardown(&q);
        return 0;
    }
    char buf[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    ring_prep(&q, OP_READ, zfd, buf, sizeof buf, 0, 0, IOSQE_ASYNC);
    if (ring_enter(&q, 1) < 0) {
        snprintf(why, n, "io_uring_enter: %s", strerror(errno));
    } else {
        unsigned head = *q.cq_head;
        if (head == __atomic_load_n(q.cq_tail, __ATOMIC_ACQUIRE)) {
            snprintf(why, n, "io_uring: no completion");
        } else {
            int res = q.cqes[head & *q.cq_mask].res;
            __atomic_store_n(q.cq_head, head + 1, __ATOMIC_RELEASE);
            if (res != (int)sizeof buf || buf[0] != 0)
                snprintf(why, n, "io_uring read test failed: %s",
                         res < 0 ? strerror(-res) : "short read");
            else
                ok = 1;
        }
    }
    close(zfd);
    ring_teardown(&q);
    return ok;
}

#endif /* OFFLOADD_HAVE_URING */
