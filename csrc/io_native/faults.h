/*
 * Fault points for the tests, compiled only into a test build (-DOFFLOADD_FAULTS, faults.c).
 *
 * In the production build every hook below is an empty inline function: fault() is the constant
 * 0 and the compiler drops the branch that tests it, so the module holds neither the hooks nor
 * their controls.  docs/native.md says how the tests get a test build.
 *
 * In a test build, the next `count` passes through a fault point (every pass if count < 0) fail
 * with `err` instead of doing the real call.  Fault points are checked only where an allocation
 * or io_uring_enter is about to happen, never per byte.
 */
#ifndef OFFLOADD_IO_FAULTS_H
#define OFFLOADD_IO_FAULTS_H

enum {
    FAULT_URING_ENTER, /* io_uring_enter */
    FAULT_ALLOC,       /* allocations made for I/O: the ring's slot table, bounce buffers */
    FAULT_COMPLETION,  /* handing finished requests to Python (the list reap() builds) */
    NFAULTS
};

#ifdef OFFLOADD_FAULTS
/* 0, or the errno the caller must fail with instead of doing the call. */
int fault(int which);
/* While copies are held (hold_copies), every bounce-buffer copy waits here before it starts (at
 * most 5 s), so a test can look at the engine while a copy is "running". */
void copy_gate(void);

/* The controls: the fault point called `name` (-1 if none is), arming one, holding copies. */
int fault_index(const char *name);
void fault_arm(int which, int count, int err);
void hold_copies(int on);
int held_copies(void); /* copies waiting in copy_gate now */
#else
static inline int fault(int which) {
    (void)which;
    return 0;
}
static inline void copy_gate(void) {}
#endif

#endif
