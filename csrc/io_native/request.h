/*
 * A transfer the engine was asked for, and the chunks it is cut into.
 *
 * Requests are (token, op, fd, offset, address, nbytes).  Each request is cut into chunks of at
 * most the engine's `chunk_bytes`; chunks of the same request run concurrently.
 *
 * Head and tail pages: a write may name other addresses for its first and last 4096 bytes
 * (the zero-copy write path writes a tensor's aligned interior in place and its unaligned ends
 * from bounce pages).  Each such page is a chunk of its own, written from its own address.
 */
#ifndef OFFLOADD_IO_REQUEST_H
#define OFFLOADD_IO_REQUEST_H

#include <stdint.h>

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

#endif
