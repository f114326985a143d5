/*
 * The blocking transfer: pread/pwrite of a chunk, through a bounce buffer where O_DIRECT needs
 * one (posix_io.h).
 */
#define _GNU_SOURCE
#include "posix_io.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "faults.h"

char *chunk_addr(const request_t *r, const chunk_t *c) {
    if (r->head && c->pos == 0) return r->head;
    if (r->tail && c->pos == r->nbytes - ALIGN) return r->tail;
    return r->addr + c->pos;
}

int needs_bounce(const request_t *r, const chunk_t *c) {
    if (!r->direct) return 0;
    return ((uintptr_t)chunk_addr(r, c) % ALIGN) != 0 || (c->len % ALIGN) != 0;
}

int chunk_buffer(const request_t *r, const chunk_t *c, char **bounce, uint64_t cap, char **buf,
                 uint64_t *io_len) {
    char *src = chunk_addr(r, c);
    *buf = src;
    *io_len = c->len;
    if (!needs_bounce(r, c)) return 0;
    if (!*bounce) {
        void *p = NULL;
        if (fault(FAULT_ALLOC) || posix_memalign(&p, ALIGN, cap)) return ENOMEM;
        *bounce = p;
    }
    *buf = *bounce;
    *io_len = (c->len + ALIGN - 1) / ALIGN * ALIGN;
    if (r->op == OP_WRITE) {
        copy_gate();
        memcpy(*buf, src, c->len);
        memset(*buf + c->len, 0, *io_len - c->len);
    }
    return 0;
}

void chunk_copy_back(const request_t *r, const chunk_t *c, const char *buf) {
    char *dst = chunk_addr(r, c);
    if (r->op != OP_READ || buf == dst) return;
    copy_gate();
    memcpy(dst, buf, c->len);
}

int rw_loop(const request_t *r, char *buf, uint64_t off, uint64_t io_len, uint64_t *got) {
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

int transfer_chunk(const request_t *r, const chunk_t *c, char **bounce, uint64_t cap,
                   uint64_t *moved) {
    char *buf;
    uint64_t io_len, got = 0;
    *moved = 0;
    int err = chunk_buffer(r, c, bounce, cap, &buf, &io_len);
    if (err) return err;
    err = rw_loop(r, buf, r->offset + c->pos, io_len, &got);
    if (err) return err;
    if (got < c->len) return EIO;
    chunk_copy_back(r, c, buf);
    *moved = c->len;
    return 0;
}
