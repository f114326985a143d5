/*
 * The io_uring ring of csrc/io_native/ring.h on its own: SQEs in, CQEs out, on real files.
 * Every test skips, saying why, where io_uring does not work in this process (a seccomp filter,
 * an old kernel): that is checked at run time.
 */
#include "check.h"

#include <fcntl.h>
#include <stdint.h>
#include <sys/stat.h>

#include "faults.h"
#include "request.h"
#include "ring.h"

#ifdef OFFLOADD_HAVE_URING

static char why[160];
static int usable = -1;

static void need_uring(void) {
    if (usable < 0) usable = ring_selftest(why, sizeof why);
    if (!usable) SKIP("io_uring unavailable: %s", why);
}

static void setup(ring_t *q, unsigned entries) {
    memset(q, 0, sizeof *q);
    q->fd = -1;
    q->kick_fd = -1;
    CHECK_EQ(ring_setup(q, entries), 0);
    CHECK(q->fd >= 0);
}

typedef struct {
    uint64_t user_data;
    int res;
} cqe_t;

/* The next CQE, waiting for it with io_uring_enter if none is there. */
static cqe_t next_cqe(ring_t *q) {
    unsigned head = *q->cq_head;
    if (head == __atomic_load_n(q->cq_tail, __ATOMIC_ACQUIRE)) CHECK(ring_enter(q, 1) >= 0);
    CHECK(head != __atomic_load_n(q->cq_tail, __ATOMIC_ACQUIRE));
    const struct io_uring_cqe *cqe = &q->cqes[head & *q->cq_mask];
    cqe_t out = {cqe->user_data, cqe->res};
    __atomic_store_n(q->cq_head, head + 1, __ATOMIC_RELEASE);
    return out;
}

static int open_file(const char *name, int flags) {
    int fd = open(tmp_path(name), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | flags, 0600);
    if (fd < 0 && (flags & O_DIRECT) && errno == EINVAL)
        SKIP("O_DIRECT refused in %s (a tmpfs?): set OFFLOADD_TEST_DIR to a disk", tmp_path(""));
    CHECK(fd >= 0);
    return fd;
}

static void test_selftest(void) {
    need_uring();
    char again[160];
    CHECK_EQ(ring_selftest(again, sizeof again), 1);
}

static void test_setup_and_teardown(void) {
    need_uring();
    ring_t q;
    setup(&q, 8);
    CHECK(*q.sq_mask >= 7);
    CHECK_EQ(ring_unsubmitted(&q), 0);
    ring_teardown(&q);
    CHECK_EQ(q.fd, -1);
    ring_teardown(&q); /* a second teardown does nothing */
}

/* A write and a read through the ring, each answered by one CQE carrying its user_data. */
static void test_write_then_read(void) {
    need_uring();
    ring_t q;
    setup(&q, 4);
    int fd = open_file("rw", 0);
    char out[8192], in[8192];
    for (size_t i = 0; i < sizeof out; i++) out[i] = (char)(i * 7 + 1);
    ring_prep(&q, OP_WRITE, fd, out, sizeof out, 4096, 7, 0);
    CHECK_EQ(ring_unsubmitted(&q), 1);
    cqe_t cqe = next_cqe(&q);
    CHECK_EQ(ring_unsubmitted(&q), 0);
    CHECK_EQ(cqe.user_data, 7);
    CHECK_EQ(cqe.res, sizeof out);
    struct stat st;
    CHECK_EQ(fstat(fd, &st), 0);
    CHECK_EQ(st.st_size, 4096 + sizeof out);
    memset(in, 0, sizeof in);
    ring_prep(&q, OP_READ, fd, in, sizeof in, 4096, 8, IOSQE_ASYNC);
    cqe = next_cqe(&q);
    CHECK_EQ(cqe.user_data, 8);
    CHECK_EQ(cqe.res, sizeof in);
    CHECK(memcmp(out, in, sizeof in) == 0);
    /* past the end of the file: a read of 0 bytes, not an error */
    ring_prep(&q, OP_READ, fd, in, sizeof in, 1 << 20, 9, 0);
    cqe = next_cqe(&q);
    CHECK_EQ(cqe.res, 0);
    close(fd);
    unlink(tmp_path("rw"));
    ring_teardown(&q);
}

/* Several SQEs in one io_uring_enter; each completes once, in whatever order. */
static void test_batch(void) {
    need_uring();
    ring_t q;
    setup(&q, 8);
    int fd = open_file("batch", 0);
    static char page[8][4096];
    for (int i = 0; i < 8; i++) {
        memset(page[i], 'a' + i, sizeof page[i]);
        ring_prep(&q, OP_WRITE, fd, page[i], sizeof page[i], (uint64_t)i * 4096, (uint64_t)i,
                  IOSQE_ASYNC);
    }
    CHECK_EQ(ring_unsubmitted(&q), 8);
    int seen[8] = {0};
    for (int k = 0; k < 8; k++) {
        cqe_t cqe = next_cqe(&q);
        CHECK(cqe.user_data < 8);
        CHECK_EQ(cqe.res, 4096);
        seen[cqe.user_data]++;
    }
    for (int i = 0; i < 8; i++) CHECK_EQ(seen[i], 1);
    char back[4096];
    CHECK_EQ(pread(fd, back, sizeof back, 5 * 4096), sizeof back);
    CHECK(memcmp(back, page[5], sizeof back) == 0);
    close(fd);
    unlink(tmp_path("batch"));
    ring_teardown(&q);
}

/* A transfer the kernel refuses completes with -errno in its CQE (io_uring_enter succeeds). */
static void test_errors_come_back_in_the_cqe(void) {
    need_uring();
    ring_t q;
    setup(&q, 4);
    int fd = open_file("errors", 0);
    close(fd);
    fd = open(tmp_path("errors"), O_RDONLY | O_CLOEXEC);
    CHECK(fd >= 0);
    char buf[4096] = {0};
    ring_prep(&q, OP_WRITE, fd, buf, sizeof buf, 0, 1, 0); /* a read-only descriptor */
    CHECK_EQ(next_cqe(&q).res, -EBADF);
    close(fd);
    unlink(tmp_path("errors"));
    int dfd = open_file("direct", O_DIRECT);
    ring_prep(&q, OP_WRITE, dfd, buf + 1, 100, 0, 2, 0); /* O_DIRECT, unaligned */
    CHECK_EQ(next_cqe(&q).res, -EINVAL);
    close(dfd);
    unlink(tmp_path("direct"));
    ring_teardown(&q);
}

/* O_DIRECT through the ring with an aligned buffer. */
static void test_direct(void) {
    need_uring();
    ring_t q;
    setup(&q, 4);
    int fd = open_file("odirect", O_DIRECT);
    void *out = NULL, *in = NULL;
    CHECK_EQ(posix_memalign(&out, ALIGN, 64 * 1024), 0);
    CHECK_EQ(posix_memalign(&in, ALIGN, 64 * 1024), 0);
    memset(out, 0x5a, 64 * 1024);
    memset(in, 0, 64 * 1024);
    ring_prep(&q, OP_WRITE, fd, out, 64 * 1024, ALIGN, 1, IOSQE_ASYNC);
    CHECK_EQ(next_cqe(&q).res, 64 * 1024);
    ring_prep(&q, OP_READ, fd, in, 64 * 1024, ALIGN, 2, IOSQE_ASYNC);
    CHECK_EQ(next_cqe(&q).res, 64 * 1024);
    CHECK(memcmp(out, in, 64 * 1024) == 0);
    free(out);
    free(in);
    close(fd);
    unlink(tmp_path("odirect"));
    ring_teardown(&q);
}

/* io_uring_enter itself failing: transient errors are retried, the rest reported. */
static void test_enter_failures(void) {
    need_uring();
    ring_t q;
    setup(&q, 4);
    fault_arm(FAULT_URING_ENTER, 3, EAGAIN);
    CHECK(ring_enter(&q, 0) >= 0);
    fault_arm(FAULT_URING_ENTER, 1, EPERM);
    errno = 0;
    CHECK_EQ(ring_enter(&q, 0), -1);
    CHECK_EQ(errno, EPERM);
    fault_arm(FAULT_URING_ENTER, 0, 0);
    CHECK(ring_enter(&q, 0) >= 0);
    ring_teardown(&q);
}

#endif /* OFFLOADD_HAVE_URING */

int main(int argc, char **argv) {
#ifdef OFFLOADD_HAVE_URING
    static const test_t tests[] = {
        {"selftest", test_selftest},
        {"setup_and_teardown", test_setup_and_teardown},
        {"write_then_read", test_write_then_read},
        {"batch", test_batch},
        {"errors_come_back_in_the_cqe", test_errors_come_back_in_the_cqe},
        {"direct", test_direct},
        {"enter_failures", test_enter_failures},
    };
    return RUN_TESTS(tests, argc, argv);
#else
    (void)argc;
    (void)argv;
    printf("skip %s: built without <linux/io_uring.h>\n", __FILE__);
    return 0;
#endif
}
