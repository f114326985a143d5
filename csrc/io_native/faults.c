/*
 * The fault points of faults.h: the test build's only (-DOFFLOADD_FAULTS).  Disarmed, a fault
 * point costs one relaxed load.
 */
#ifndef OFFLOADD_FAULTS
#error "faults.c belongs to the test build: compile it with -DOFFLOADD_FAULTS"
#endif
#define _GNU_SOURCE
#include "faults.h"

#include <string.h>
#include <time.h>

static const char *const fault_names[NFAULTS] = {"uring_enter", "alloc", "completion"};
static int fault_count[NFAULTS];
static int fault_errno[NFAULTS];

int fault(int which) {
    int n = __atomic_load_n(&fault_count[which], __ATOMIC_ACQUIRE);
    if (n < 0) return fault_errno[which];
    while (n > 0) {
        if (__atomic_compare_exchange_n(&fault_count[which], &n, n - 1, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return fault_errno[which];
    }
    return 0;
}

int fault_index(const char *name) {
    for (int i = 0; i < NFAULTS; i++)
        if (strcmp(name, fault_names[i]) == 0) return i;
    return -1;
}

void fault_arm(int which, int count, int err) {
    fault_errno[which] = err;
    __atomic_store_n(&fault_count[which], count, __ATOMIC_RELEASE);
}

static int holding;
static int waiting; /* copies waiting now */

void hold_copies(int on) { __atomic_store_n(&holding, on, __ATOMIC_RELEASE); }

int held_copies(void) { return __atomic_load_n(&waiting, __ATOMIC_ACQUIRE); }

void copy_gate(void) {
    if (!__atomic_load_n(&holding, __ATOMIC_RELAXED)) return;
    __atomic_add_fetch(&waiting, 1, __ATOMIC_ACQ_REL);
    for (int ms = 0; ms < 5000 && __atomic_load_n(&holding, __ATOMIC_ACQUIRE); ms++) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    __atomic_sub_fetch(&waiting, 1, __ATOMIC_ACQ_REL);
}
