/*
 * Moving a chunk's bytes with pread/pwrite, and the O_DIRECT bounce buffer both backends use.
 *
 * O_DIRECT: when the file was opened with O_DIRECT and a chunk's address or length is not a
 * multiple of 4096, the chunk goes through an aligned bounce buffer (a write's tail is padded
 * with zeros up to 4096 bytes; a read of a tail reads the padded length and copies what was
 * asked for).  The engine refuses an unaligned file offset on an O_DIRECT file (EINVAL) before
 * any chunk is cut.
 */
#ifndef OFFLOADD_IO_POSIX_IO_H
#define OFFLOADD_IO_POSIX_IO_H

#include "request.h"

/* Where a chunk's bytes are in memory: the request's buffer, or its head or tail page. */
char *chunk_addr(const request_t *r, const chunk_t *c);

/* Whether chunk c must go through a bounce buffer (O_DIRECT, unaligned address or length). */
int needs_bounce(const request_t *r, const chunk_t *c);

/* Where the I/O of chunk c goes: *buf and *io_len, the bytes the kernel must move.  That is the
 * chunk's own memory, or its bounce buffer: *bounce, allocated (`cap` bytes, aligned) at its
 * first use, filled from the chunk for a write and padded with zeros to a multiple of 4096.
 * Returns 0, or ENOMEM when the bounce buffer cannot be allocated. */
int chunk_buffer(const request_t *r, const chunk_t *c, char **bounce, uint64_t cap, char **buf,
                 uint64_t *io_len);

/* After a read of chunk c into buf: copy the bytes to the chunk's memory if buf bounced them. */
void chunk_copy_back(const request_t *r, const chunk_t *c, const char *buf);

/* pread/pwrite buf[*got, io_len) at file offset off + *got, looping over short transfers and
 * advancing *got; stops early at the end of the file.  Returns 0 or an errno. */
int rw_loop(const request_t *r, char *buf, uint64_t off, uint64_t io_len, uint64_t *got);

/* Move one chunk with pread/pwrite, looping over short transfers; *moved is the chunk's length
 * on success, else 0.  Returns 0 or an errno (EIO for a chunk past the end of the file). */
int transfer_chunk(const request_t *r, const chunk_t *c, char **bounce, uint64_t cap,
                   uint64_t *moved);

#endif
