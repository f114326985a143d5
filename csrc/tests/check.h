/*
 * A tiny test harness for the C tests of csrc/ (no framework is available offline).
 *
 * A test is a void function; CHECK and CHECK_EQ print where they failed and end the test (a
 * longjmp back to run_tests, which goes on with the next one), SKIP ends it as skipped.  Each
 * test runs under a 60 s alarm: a hang ends the program, naming the test.  run_tests returns
 * the program's exit status: 0 when no test failed.  Files go to a fresh directory under
 * $OFFLOADD_TEST_DIR, else /var/tmp (a disk: O_DIRECT is refused on tmpfs).
 */
#ifndef OFFLOADD_CHECK_H
#define OFFLOADD_CHECK_H

#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    const char *name;
    void (*fn)(void);
} test_t;

static jmp_buf check_jump;
static const char *check_current;
static char check_dir[4096];

#define CHECK_FAILED 1
#define CHECK_SKIPPED 2

static void check_fail(const char *file, int line, const char *what) {
    fprintf(stderr, "%s:%d: %s: CHECK failed: %s\n", file, line, check_current, what);
    longjmp(check_jump, CHECK_FAILED);
}

static void check_fail_eq(const char *file, int line, const char *a, const char *b, long long x,
                          long long y) {
    fprintf(stderr, "%s:%d: %s: CHECK_EQ failed: %s == %s (%lld != %lld)\n", file, line,
            check_current, a, b, x, y);
    longjmp(check_jump, CHECK_FAILED);
}

#define CHECK(cond) ((cond) ? (void)0 : check_fail(__FILE__, __LINE__, #cond))
#define CHECK_EQ(a, b)                                                                           \
    do {                                                                                         \
        long long check_a_ = (long long)(a), check_b_ = (long long)(b);                          \
        if (check_a_ != check_b_) check_fail_eq(__FILE__, __LINE__, #a, #b, check_a_, check_b_); \
    } while (0)
#define SKIP(...)                                                                                \
    do {                                                                                         \
        printf("skip %s: ", check_current);                                                     \
        printf(__VA_ARGS__);                                                                     \
        printf("\n");                                                                            \
        longjmp(check_jump, CHECK_SKIPPED);                                                      \
    } while (0)

/* The path of `name` in this run's directory (a static buffer: use it before the next call). */
static const char *tmp_path(const char *name) {
    static char path[sizeof check_dir + 512];
    snprintf(path, sizeof path, "%s/%s", check_dir, name);
    return path;
}

static void on_alarm(int sig) {
    (void)sig;
    static const char msg[] = "a test hung for 60 s; the last started is named above\n";
    if (write(2, msg, sizeof msg - 1) < 0) { /* nothing left to do */ }
    _exit(3);
}

static void remove_dir(void) {
    DIR *d = opendir(check_dir);
    if (!d) return;
    for (struct dirent *ent; (ent = readdir(d));)
        if (strcmp(ent->d_name, ".") && strcmp(ent->d_name, "..")) unlink(tmp_path(ent->d_name));
    closedir(d);
    rmdir(check_dir);
}

/* Run the tests (those named on the command line, else all); the exit status. */
static int run_tests(const char *program, const test_t *tests, size_t n, int argc, char **argv) {
    const char *root = getenv("OFFLOADD_TEST_DIR");
    snprintf(check_dir, sizeof check_dir, "%s/offloadd-ctest-XXXXXX", root ? root : "/var/tmp");
    if (!mkdtemp(check_dir)) {
        fprintf(stderr, "%s: mkdtemp %s: %s\n", program, check_dir, strerror(errno));
        return 2;
    }
    signal(SIGALRM, on_alarm);
    int failed = 0, ran = 0, skipped = 0;
    for (size_t i = 0; i < n; i++) {
        int wanted = argc < 2;
        for (int a = 1; a < argc; a++) wanted |= strcmp(argv[a], tests[i].name) == 0;
        if (!wanted) continue;
        check_current = tests[i].name;
        fflush(stdout);
        alarm(60);
        int how = setjmp(check_jump);
        if (how == 0) {
            tests[i].fn();
            printf("ok   %s\n", tests[i].name);
        } else if (how == CHECK_FAILED) {
            printf("FAIL %s\n", tests[i].name);
            failed++;
        } else {
            skipped++;
        }
        alarm(0);
        ran++;
    }
    remove_dir();
    printf("%s: %d tests, %d failed, %d skipped\n", program, ran, failed, skipped);
    return failed ? 1 : 0;
}

#define RUN_TESTS(tests, argc, argv) \
    run_tests(__FILE__, tests, sizeof tests / sizeof tests[0], argc, argv)

#endif
