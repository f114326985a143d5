/*
 * The native I/O engine (csrc/io_native/engine.h) on real files, with each backend: round
 * trips, O_DIRECT through bounce buffers, head and tail pages, refused requests, errors of the
 * file (short file, bad descriptor), cancel, stop, and faults (a test build: -DOFFLOADD_FAULTS).
 */
#include "check.h"

#include <fcntl.h>
#include <stdint.h>
#include <sys/stat.h>

#include "engine.h"
#include "faults.h"
#include "ring.h"

#define KIB 1024ull

static int uring_ok = -1; /* whether io_uring works here: checked once, at run time */
static char uring_why[160];

static int have_uring(void) {
#ifdef OFFLOADD_HAVE_URING
    if (uring_ok < 0) uring_ok = ring_selftest(uring_why, sizeof uring_why);
    return uring_ok;
#else
    snprintf(uring_why, sizeof uring_why, "built without <linux/io_uring.h>");
    return 0;
#endif
}

static engine_t *start(int threads, uint64_t chunk, int uring, unsigned depth) {
    engine_t *e = calloc(1, sizeof *e);
    CHECK(e != NULL);
    engine_init(e);
    CHECK_EQ(engine_start(e, threads, chunk, uring, depth), 0);
    CHECK_EQ(engine_uses_uring(e), uring);
    return e;
}

static void finish(engine_t *e) {
    engine_stop(e);
    engine_stop(e); /* a second stop does nothing */
    engine_free(e);
    free(e);
}

typedef struct {
    uint64_t token;
    int err;
    uint64_t done;
} result_t;

/* Wait for n completions, in the order they came. */
static void collect(engine_t *e, result_t *out, size_t n) {
    size_t have = 0;
    while (have < n) {
        request_t *got;
        size_t k;
        CHECK_EQ(engine_wait(e, 30.0, &got, &k), 0);
        CHECK(k > 0); /* 30 s without a completion: hung */
        CHECK(have + k <= n);
        for (request_t *r = got; r; r = r->dnext, have++)
            out[have] = (result_t){r->token, r->err, r->done};
        engine_release(got);
    }
}

/* One request, waited for. */
static result_t transfer(engine_t *e, int op, int fd, uint64_t offset, void *addr, uint64_t n) {
    CHECK_EQ(engine_submit(e, 42, op, fd, offset, addr, n, NULL, NULL), 0);
    result_t r;
    collect(e, &r, 1);
    CHECK_EQ(r.token, 42);
    return r;
}

static char *aligned(size_t n) {
    void *p = NULL;
    CHECK_EQ(posix_memalign(&p, ALIGN, n + ALIGN), 0);
    return p;
}

static void fill(char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) p[i] = (char)((i * 131u + seed * 7u + (i >> 12)) & 0xff);
}

static int open_file(const char *name, int flags) {
    int fd = open(tmp_path(name), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | flags, 0600);
    CHECK(fd >= 0);
    return fd;
}

static void close_file(int fd, const char *name) {
    close(fd);
    unlink(tmp_path(name));
}

/* ------------------------------------------------------------------------------ round trips -- */

/* Odd sizes at odd offsets on a buffered file, several chunks each, all in flight at once. */
static void round_trip(int uring) {
    engine_t *e = start(4, 64 * KIB, uring, 8);
    int fd = open_file("round", 0);
    const uint64_t sizes[] = {1, 4097, 64 * KIB, (1 << 20) + 3, 200001};
    const size_t n = sizeof sizes / sizeof sizes[0];
    char *src[5], *dst[5];
    uint64_t off[5], at = 0;
    for (size_t i = 0; i < n; i++) {
        src[i] = malloc(sizes[i]);
        dst[i] = calloc(1, sizes[i]);
        fill(src[i], sizes[i], (unsigned)i);
        off[i] = at + 7;
        at += sizes[i] + 7;
        CHECK_EQ(engine_submit(e, i, OP_WRITE, fd, off[i], src[i], sizes[i], NULL, NULL), 0);
    }
    result_t res[5];
    collect(e, res, n);
    for (size_t i = 0; i < n; i++) {
        CHECK_EQ(res[i].err, 0);
        CHECK_EQ(res[i].done, sizes[res[i].token]);
    }
    for (size_t i = 0; i < n; i++)
        CHECK_EQ(engine_submit(e, i, OP_READ, fd, off[i], dst[i], sizes[i], NULL, NULL), 0);
    collect(e, res, n);
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        CHECK_EQ(res[i].err, 0);
        CHECK(memcmp(src[i], dst[i], sizes[i]) == 0);
        total += sizes[i];
        free(src[i]);
        free(dst[i]);
    }
    uint64_t rd, wr, pending;
    engine_counters(e, &rd, &wr, &pending);
    CHECK_EQ(rd, total);
    CHECK_EQ(wr, total);
    CHECK_EQ(pending, 0);
    close_file(fd, "round");
    finish(e);
}

static void test_round_trip_threads(void) { round_trip(0); }

static void test_round_trip_uring(void) {
    if (!have_uring()) SKIP("io_uring unavailable: %s", uring_why);
    round_trip(1);
}

/* O_DIRECT: an aligned buffer goes straight to the file; an unaligned one, or a length that is
 * not a multiple of 4096, goes through a bounce buffer, and a write's tail is padded with zeros
 * to the next 4096 bytes. */
static void direct(int uring) {
    engine_t *e = start(2, 64 * KIB, uring, 4);
    int fd = open(tmp_path("direct"), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EINVAL) {
        finish(e);
        SKIP("O_DIRECT refused in %s (a tmpfs?): set OFFLOADD_TEST_DIR to a disk", tmp_path(""));
    }
    CHECK(fd >= 0);
    const size_t big = 256 * KIB, odd = 70000;
    char *a = aligned(big), *b = aligned(odd + 100), *c = aligned(big);
    fill(a, big, 1);
    fill(b + 100, odd, 2);
    CHECK_EQ(transfer(e, OP_WRITE, fd, 0, a, big).err, 0);
    result_t r = transfer(e, OP_WRITE, fd, big, b + 100, odd); /* unaligned address and length */
    CHECK_EQ(r.err, 0);
    CHECK_EQ(r.done, odd);
    struct stat st;
    CHECK_EQ(fstat(fd, &st), 0);
    CHECK_EQ(st.st_size, big + (odd + ALIGN - 1) / ALIGN * ALIGN); /* the padded tail */
    memset(c, 0, big);
    CHECK_EQ(transfer(e, OP_READ, fd, 0, c, big).err, 0);
    CHECK(memcmp(a, c, big) == 0);
    memset(c, 0, big);
    r = transfer(e, OP_READ, fd, big, c + 3, odd); /* unaligned destination, a tail to copy */
    CHECK_EQ(r.err, 0);
    CHECK_EQ(r.done, odd);
    CHECK(memcmp(b + 100, c + 3, odd) == 0);
    CHECK_EQ(c[3 + odd], 0); /* nothing copied past what was asked for */
    /* an unaligned file offset cannot be done on an O_DIRECT file: refused at submit */
    CHECK_EQ(engine_submit(e, 1, OP_READ, fd, 100, c, ALIGN, NULL, NULL), ENGINE_UNALIGNED);
    free(a);
    free(b);
    free(c);
    close_file(fd, "direct");
    finish(e);
}

static void test_direct_threads(void) { direct(0); }

static void test_direct_uring(void) {
    if (!have_uring()) SKIP("io_uring unavailable: %s", uring_why);
    direct(1);
}

/* A write's first and last pages come from other buffers; each is a chunk of its own. */
static void test_head_and_tail_pages(void) {
    engine_t *e = start(3, 8 * KIB, 0, 4);
    int fd = open_file("pages", 0);
    const size_t n = 5 * ALIGN;
    char *body = aligned(n), *head = aligned(ALIGN), *tail = aligned(ALIGN), *back = aligned(n);
    fill(body, n, 3);
    memset(head, 'h', ALIGN);
    memset(tail, 't', ALIGN);
    CHECK_EQ(engine_submit(e, 9, OP_WRITE, fd, 0, body, n, head, tail), 0);
    result_t r;
    collect(e, &r, 1);
    CHECK_EQ(r.err, 0);
    CHECK_EQ(r.done, n);
    CHECK_EQ(transfer(e, OP_READ, fd, 0, back, n).err, 0);
    CHECK(memcmp(back, head, ALIGN) == 0);
    CHECK(memcmp(back + ALIGN, body + ALIGN, n - 2 * ALIGN) == 0);
    CHECK(memcmp(back + n - ALIGN, tail, ALIGN) == 0);
    free(body);
    free(head);
    free(tail);
    free(back);
    close_file(fd, "pages");
    finish(e);
}

/* ------------------------------------------------------------------------- refusals, errors -- */

static void test_refused_requests(void) {
    engine_t *e = start(1, 4 * KIB, 0, 1);
    int fd = open_file("refused", 0);
    char buf[2 * ALIGN];
    CHECK_EQ(engine_submit(e, 1, 2, fd, 0, buf, 1, NULL, NULL), ENGINE_BAD_OP);
    CHECK_EQ(engine_submit(e, 1, OP_READ, fd, 0, buf, ALIGN, buf, NULL), ENGINE_BAD_PAGES);
    CHECK_EQ(engine_submit(e, 1, OP_WRITE, fd, 0, buf, ALIGN - 1, buf, NULL), ENGINE_BAD_PAGES);
    CHECK_EQ(engine_submit(e, 1, OP_WRITE, fd, 0, buf, ALIGN, NULL, buf), ENGINE_BAD_PAGES);
    CHECK_EQ(engine_submit(e, 1, OP_READ, -1, 0, buf, 1, NULL, NULL), EBADF);
    uint64_t rd, wr, pending;
    engine_counters(e, &rd, &wr, &pending);
    CHECK_EQ(pending, 0);
    /* an empty request completes at once */
    CHECK_EQ(engine_submit(e, 5, OP_READ, fd, 0, buf, 0, NULL, NULL), 0);
    result_t r;
    collect(e, &r, 1);
    CHECK_EQ(r.token, 5);
    CHECK_EQ(r.err, 0);
    CHECK_EQ(r.done, 0);
    engine_stop(e);
    CHECK_EQ(engine_submit(e, 6, OP_READ, fd, 0, buf, 1, NULL, NULL), ENGINE_CLOSED);
    close_file(fd, "refused");
    finish(e);
}

/* Reading past the end of a file fails the request with EIO; the bytes before it were moved. */
static void short_file(int uring, int direct) {
    engine_t *e = start(2, 4 * KIB, uring, 4);
    int fd = open(tmp_path("short"), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | direct, 0600);
    if (fd < 0 && direct && errno == EINVAL) {
        finish(e);
        SKIP("O_DIRECT refused in %s (a tmpfs?): set OFFLOADD_TEST_DIR to a disk", tmp_path(""));
    }
    CHECK(fd >= 0);
    char *buf = aligned(16 * KIB);
    fill(buf, 16 * KIB, 4);
    const uint64_t have = direct ? 8 * KIB : 5000;
    CHECK_EQ(transfer(e, OP_WRITE, fd, 0, buf, have).err, 0);
    result_t r = transfer(e, OP_READ, fd, 0, buf, 16 * KIB);
    CHECK_EQ(r.err, EIO);
    CHECK(r.done < 16 * KIB);
    CHECK(r.done <= have);
    free(buf);
    close_file(fd, "short");
    finish(e);
}

static void test_short_file_threads(void) {
    short_file(0, 0);
    short_file(0, O_DIRECT);
}

static void test_short_file_uring(void) {
    if (!have_uring()) SKIP("io_uring unavailable: %s", uring_why);
    short_file(1, 0);
    short_file(1, O_DIRECT);
}

/* A descriptor that cannot do the transfer: the request fails with the kernel's errno. */
static void bad_descriptor(int uring) {
    engine_t *e = start(2, 4 * KIB, uring, 4);
    int fd = open_file("readonly", 0);
    close(fd);
    fd = open(tmp_path("readonly"), O_RDONLY | O_CLOEXEC);
    CHECK(fd >= 0);
    char buf[ALIGN] = {0};
    CHECK_EQ(transfer(e, OP_WRITE, fd, 0, buf, sizeof buf).err, EBADF);
    close_file(fd, "readonly");
    finish(e);
}

static void test_bad_descriptor_threads(void) { bad_descriptor(0); }

static void test_bad_descriptor_uring(void) {
    if (!have_uring()) SKIP("io_uring unavailable: %s", uring_why);
    bad_descriptor(1);
}

/* ------------------------------------------------------------------ cancel, faults, fallback -- */

/* A request none of whose chunks has started can be cancelled; the one running cannot. */
static void test_cancel(void) {
    engine_t *e = start(1, 64 * KIB, 0, 1);
    int fd = open(tmp_path("cancel"), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EINVAL) {
        finish(e);
        SKIP("O_DIRECT refused in %s (a tmpfs?): set OFFLOADD_TEST_DIR to a disk", tmp_path(""));
    }
    CHECK(fd >= 0);
    char *buf = aligned(2 * ALIGN);
    hold_copies(1); /* the one thread waits in its bounce copy: request 1 has started */
    CHECK_EQ(engine_submit(e, 1, OP_WRITE, fd, 0, buf + 1, 100, NULL, NULL), 0);
    for (int ms = 0; held_copies() == 0; ms++) {
        CHECK(ms < 5000);
        usleep(1000);
    }
    CHECK_EQ(engine_submit(e, 2, OP_WRITE, fd, ALIGN, buf, ALIGN, NULL, NULL), 0);
    CHECK_EQ(engine_cancel(e, 1), 0);
    CHECK_EQ(engine_cancel(e, 2), 1);
    CHECK_EQ(engine_cancel(e, 2), 0);
    hold_copies(0);
    result_t r;
    collect(e, &r, 1);
    CHECK_EQ(r.token, 1);
    CHECK_EQ(r.err, 0);
    uint64_t rd, wr, pending;
    engine_counters(e, &rd, &wr, &pending);
    CHECK_EQ(pending, 0);
    free(buf);
    close_file(fd, "cancel");
    finish(e);
}

/* No memory for a bounce buffer fails that request with ENOMEM, and only that one. */
static void bounce_alloc_fails(int uring) {
    engine_t *e = start(2, 64 * KIB, uring, 4);
    int fd = open(tmp_path("nomem"), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EINVAL) {
        finish(e);
        SKIP("O_DIRECT refused in %s (a tmpfs?): set OFFLOADD_TEST_DIR to a disk", tmp_path(""));
    }
    CHECK(fd >= 0);
    char *buf = aligned(3 * ALIGN), *back = aligned(3 * ALIGN);
    fill(buf, 3 * ALIGN, 5);
    fault_arm(FAULT_ALLOC, 1, ENOMEM);
    result_t r = transfer(e, OP_WRITE, fd, 0, buf + 1, 5000);
    fault_arm(FAULT_ALLOC, 0, 0);
    CHECK_EQ(r.err, ENOMEM);
    CHECK_EQ(r.done, 0);
    CHECK_EQ(transfer(e, OP_WRITE, fd, 0, buf + 1, 5000).err, 0);
    CHECK_EQ(transfer(e, OP_READ, fd, 0, back + 2, 5000).err, 0);
    CHECK(memcmp(buf + 1, back + 2, 5000) == 0);
    free(buf);
    free(back);
    close_file(fd, "nomem");
    finish(e);
}

static void test_bounce_alloc_fails_threads(void) { bounce_alloc_fails(0); }

static void test_bounce_alloc_fails_uring(void) {
    if (!have_uring()) SKIP("io_uring unavailable: %s", uring_why);
    bounce_alloc_fails(1);
}

/* No memory for the ring's slot table: engine_start fails; engine_stop and engine_free clean up. */
static void test_slot_table_alloc_fails(void) {
    if (!have_uring()) SKIP("io_uring unavailable: %s", uring_why);
    engine_t *e = calloc(1, sizeof *e);
    CHECK(e != NULL);
    engine_init(e);
    fault_arm(FAULT_ALLOC, 1, ENOMEM);
    int rc = engine_start(e, 2, 64 * KIB, 1, 8);
    fault_arm(FAULT_ALLOC, 0, 0);
    CHECK_EQ(rc, ENGINE_NOMEM);
    finish(e);
}

/* io_uring_enter failing for good moves the engine to its threads; no request is lost. */
static void test_ring_failure_falls_back_to_threads(void) {
    if (!have_uring()) SKIP("io_uring unavailable: %s", uring_why);
    engine_t *e = start(3, 64 * KIB, 1, 8);
    int fd = open_file("fallback", 0);
    const size_t n = 1 << 20;
    char *src = malloc(n), *dst = calloc(1, n);
    fill(src, n, 6);
    fault_arm(FAULT_URING_ENTER, 1, EPERM);
    for (uint64_t i = 0; i < 16; i++)
        CHECK_EQ(engine_submit(e, i, OP_WRITE, fd, i * (n / 16), src + i * (n / 16), n / 16, NULL,
                               NULL),
                 0);
    result_t res[16];
    collect(e, res, 16);
    fault_arm(FAULT_URING_ENTER, 0, 0);
    for (int i = 0; i < 16; i++) CHECK_EQ(res[i].err, 0);
    CHECK_EQ(engine_uses_uring(e), 0);
    CHECK_EQ(engine_fallback_errno(e), EPERM);
    CHECK_EQ(transfer(e, OP_READ, fd, 0, dst, n).err, 0);
    CHECK(memcmp(src, dst, n) == 0);
    free(src);
    free(dst);
    close_file(fd, "fallback");
    finish(e);
}

/* A few EAGAIN from io_uring_enter are retried: the ring goes on. */
static void test_ring_transient_errors_are_retried(void) {
    if (!have_uring()) SKIP("io_uring unavailable: %s", uring_why);
    engine_t *e = start(2, 64 * KIB, 1, 8);
    int fd = open_file("transient", 0);
    char buf[8192];
    fill(buf, sizeof buf, 7);
    fault_arm(FAULT_URING_ENTER, 5, EAGAIN);
    CHECK_EQ(transfer(e, OP_WRITE, fd, 0, buf, sizeof buf).err, 0);
    fault_arm(FAULT_URING_ENTER, 0, 0);
    CHECK_EQ(engine_uses_uring(e), 1);
    CHECK_EQ(engine_fallback_errno(e), 0);
    close_file(fd, "transient");
    finish(e);
}

/* Stopping finishes what was submitted; what was never reaped is freed with the engine. */
static void test_stop_finishes_everything(void) {
    engine_t *e = start(2, 4 * KIB, 0, 1);
    int fd = open_file("stop", 0);
    char *buf = malloc(1 << 20);
    fill(buf, 1 << 20, 8);
    for (uint64_t i = 0; i < 8; i++)
        CHECK_EQ(engine_submit(e, i, OP_WRITE, fd, i << 17, buf + (i << 17), 1 << 17, NULL, NULL),
                 0);
    engine_stop(e);
    uint64_t rd, wr, pending;
    engine_counters(e, &rd, &wr, &pending);
    CHECK_EQ(pending, 0);
    CHECK_EQ(wr, 1 << 20);
    free(buf);
    close_file(fd, "stop");
    finish(e);
}

int main(int argc, char **argv) {
    static const test_t tests[] = {
        {"round_trip_threads", test_round_trip_threads},
        {"round_trip_uring", test_round_trip_uring},
        {"direct_threads", test_direct_threads},
        {"direct_uring", test_direct_uring},
        {"head_and_tail_pages", test_head_and_tail_pages},
        {"refused_requests", test_refused_requests},
        {"short_file_threads", test_short_file_threads},
        {"short_file_uring", test_short_file_uring},
        {"bad_descriptor_threads", test_bad_descriptor_threads},
        {"bad_descriptor_uring", test_bad_descriptor_uring},
        {"cancel", test_cancel},
        {"bounce_alloc_fails_threads", test_bounce_alloc_fails_threads},
        {"bounce_alloc_fails_uring", test_bounce_alloc_fails_uring},
        {"slot_table_alloc_fails", test_slot_table_alloc_fails},
        {"ring_failure_falls_back_to_threads", test_ring_failure_falls_back_to_threads},
        {"ring_transient_errors_are_retried", test_ring_transient_errors_are_retried},
        {"stop_finishes_everything", test_stop_finishes_everything},
    };
    return RUN_TESTS(tests, argc, argv);
}
