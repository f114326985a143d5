/* offloadd.relay._write_guard: notices writes to relayed weights that autograd cannot see.
 *
 * A write through ``weight.data`` (``w.data.mul_(2)``) or through a tensor made from the same
 * memory bumps no version counter, so neither PyTorch's in-place check nor relay's sees it. While
 * a slab is swapped in, relay makes its pages read-only (protect). The first write into them
 * faults; the SIGSEGV handler (chain.c) asks guard_settles, which finds the slab, records the
 * faulting address, makes the slab writable again and returns, so the write goes ahead and every
 * later one runs at full speed. Relay then asks (fault) or releases (release) and knows the group
 * was written, and where. A fault the guard does not settle goes on to the handler that was there
 * before, and the guard's stays installed (Note [chaining] in chain.c).
 *
 * Note [a fault racing a release]
 * ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
 * A thread may write into a guarded slab while another releases it (or a slab is dropped while
 * guarded, its finalizer running anywhere). Its fault and the handler's lookup are apart: the
 * kernel delivers the signal, and the thread may be descheduled in between. Three rules keep
 * that sound:
 *
 * 1. A slot is claimed (FREE -> FILLING), filled, then published (GUARDED) before its pages are
 *    made read-only, so no fault on them finds it unpublished.
 * 2. A handler announces itself on a slot (users) and only then reads its state, start and
 *    end. release marks the slot RELEASING and waits until no handler is on it before it reads
 *    the fault, makes the pages writable and frees the slot. So a handler that reads GUARDED
 *    holds the slot as it was: it records its write and makes the pages writable before release
 *    goes on, and the slot cannot be refilled under it. A fault in a RELEASING range is retried,
 *    not recorded (were the slot refilled meanwhile, the retry faults and finds the new range).
 * 3. A fault whose range was released and freed before the handler looked finds nothing. Each
 *    release counts itself (releases) after its pages are writable and before its slot is free;
 *    each thread remembers the count it saw last. A fault that finds no range while the count
 *    moved since is retried once as a plain access: it runs if a release made its page
 *    writable, or faults again and goes on to the previous handler. So a fault is reported as a
 *    write only while its range is guarded, and passed on only once no release can explain it.
 *
 * The handler's part (guard_settles) uses only atomics and mprotect; it never waits.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#include "guard.h"

#define SLOTS 4096

enum { FREE, FILLING, GUARDED, RELEASING };

typedef struct {
    atomic_int state;
    atomic_int users; /* handlers reading this slot now */
    _Atomic uintptr_t start;
    _Atomic uintptr_t end;
    _Atomic uintptr_t fault; /* the first faulting address, 0 if none */
} Range;

static Range ranges[SLOTS];
static atomic_int in_use;     /* every slot ever claimed is below it */
static atomic_ulong releases; /* releases that made their pages writable */
/* the releases this thread's handler saw last: initial-exec, so reading it never allocates */
static __thread unsigned long releases_seen __attribute__((tls_model("initial-exec")));
static PyThread_type_lock install_lock;

/* What slot r says of a fault at ``at``: 1 settled (recorded, or to retry), 0 not its range. */
static int settles_in(Range *r, uintptr_t at) {
    atomic_fetch_add(&r->users, 1);
    int state = atomic_load(&r->state);
    uintptr_t start = atomic_load(&r->start), end = atomic_load(&r->end);
    int settled = state >= GUARDED && at >= start && at < end;
    if (settled && state == GUARDED) {
        uintptr_t none = 0;
        atomic_compare_exchange_strong(&r->fault, &none, at);
        /* should the pages stay read-only, the fault is not settled: better passed on than
         * taken again forever */
        settled = mprotect((void *)start, end - start, PROT_READ | PROT_WRITE) == 0;
    }
    atomic_fetch_sub(&r->users, 1);
    return settled;
}

int guard_settles(uintptr_t at) {
    int n = atomic_load(&in_use);
    for (int i = 0; i < n; i++) {
        if (atomic_load(&ranges[i].state) >= GUARDED && settles_in(&ranges[i], at))
            return 1;
    }
    unsigned long now = atomic_load(&releases);
    if (now == releases_seen)
        return 0;
    releases_seen = now; /* a release since this thread last looked: retry once */
    return 1;
}

/* Take slot r out of use: its pages writable, its fault returned (errno set if mprotect failed,
 * *failed nonzero). */
static uintptr_t retire(Range *r, int *failed) {
    atomic_store(&r->state, RELEASING);
    while (atomic_load(&r->users) != 0)
        sched_yield();
    uintptr_t start = atomic_load(&r->start), end = atomic_load(&r->end);
    *failed = mprotect((void *)start, end - start, PROT_READ | PROT_WRITE) != 0;
    int e = errno;
    uintptr_t fault = atomic_load(&r->fault);
    atomic_fetch_add(&releases, 1);
    atomic_store(&r->state, FREE);
    errno = e;
    return fault;
}

/* Put the handler back on top of SIGSEGV (a handler installed since goes under it); -1 with an
 * exception set when it cannot be. */
static int rechain(const char *who) {
    PyThread_acquire_lock(install_lock, WAIT_LOCK);
    int installed = chain_install();
    PyThread_release_lock(install_lock);
    if (installed == -1) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    if (installed == -2) {
        PyErr_Format(PyExc_RuntimeError,
                     "%s: other SIGSEGV handlers were put over the guard's too often", who);
        return -1;
    }
    return 0;
}

static PyObject *guard_rechain(PyObject *self, PyObject *unused) {
    return rechain("rechain") ? NULL : Py_NewRef(Py_None);
}

static PyObject *guard_protect(PyObject *self, PyObject *args) {
    unsigned long long address, nbytes;
    if (!PyArg_ParseTuple(args, "KK", &address, &nbytes))
        return NULL;
    long page = sysconf(_SC_PAGESIZE);
    if (address == 0 || nbytes == 0 || address % page || nbytes % page) {
        PyErr_Format(PyExc_ValueError, "protect: %llu bytes at 0x%llx are not whole pages",
                     nbytes, address);
        return NULL;
    }
    if (rechain("protect"))
        return NULL;
    for (int i = 0; i < SLOTS; i++) {
        Range *r = &ranges[i];
        int free_ = FREE;
        if (!atomic_compare_exchange_strong(&r->state, &free_, FILLING))
            continue;
        atomic_store(&r->fault, 0);
        atomic_store(&r->start, (uintptr_t)address);
        atomic_store(&r->end, (uintptr_t)(address + nbytes));
        int n = atomic_load(&in_use);
        while (n <= i && !atomic_compare_exchange_weak(&in_use, &n, i + 1))
            ;
        atomic_store(&r->state, GUARDED); /* published before any of its pages can fault */
        if (mprotect((void *)(uintptr_t)address, nbytes, PROT_READ) != 0) {
            int e = errno, failed;
            retire(r, &failed); /* a part may have been made read-only */
            errno = e;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        return PyLong_FromLong(i);
    }
    PyErr_SetString(PyExc_RuntimeError, "protect: every slot is in use");
    return NULL;
}

static Range *slot_of(PyObject *args) {
    int i;
    if (!PyArg_ParseTuple(args, "i", &i))
        return NULL;
    if (i < 0 || i >= SLOTS || atomic_load(&ranges[i].state) != GUARDED) {
        PyErr_Format(PyExc_ValueError, "no protected slot %d", i);
        return NULL;
    }
    return &ranges[i];
}

static PyObject *guard_fault(PyObject *self, PyObject *args) {
    Range *r = slot_of(args);
    return r ? PyLong_FromUnsignedLongLong(atomic_load(&r->fault)) : NULL;
}

static PyObject *guard_release(PyObject *self, PyObject *args) {
    Range *r = slot_of(args);
    if (r == NULL)
        return NULL;
    int failed;
    uintptr_t fault = retire(r, &failed);
    if (failed)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromUnsignedLongLong(fault);
}

static PyMethodDef methods[] = {
    {"protect", guard_protect, METH_VARARGS,
     "protect(address, nbytes) -> slot: make whole pages read-only, noting the first write."},
    {"rechain", guard_rechain, METH_NOARGS,
     "rechain(): put the guard's SIGSEGV handler back on top of any installed since."},
    {"fault", guard_fault, METH_VARARGS,
     "fault(slot) -> address: the first address written since protect, 0 if none."},
    {"release", guard_release, METH_VARARGS,
     "release(slot) -> address: make the pages writable, free the slot, return fault(slot)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_write_guard", "Notices writes autograd cannot see (csrc/write_guard).",
    -1, methods, NULL, NULL, NULL, NULL,
};

/* A child forked while a handler ran on another thread has no such thread: no handler is on
 * any slot, and a release there must not wait for one. */
static void forget_handlers(void) {
    for (int i = 0; i < SLOTS; i++)
        atomic_store(&ranges[i].users, 0);
}

PyMODINIT_FUNC PyInit__write_guard(void) {
    install_lock = PyThread_allocate_lock();
    if (install_lock == NULL)
        return PyErr_NoMemory();
    errno = pthread_atfork(NULL, NULL, forget_handlers);
    if (errno != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "SLOTS", SLOTS) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
