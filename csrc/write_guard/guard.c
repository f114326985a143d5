/* offloadd.relay._write_guard: notices writes to relayed weights that autograd cannot see.
 *
 * A write through ``weight.data`` (``w.data.mul_(2)``) or through a tensor made from the same
 * memory bumps no version counter, so neither PyTorch's in-place check nor relay's sees it. While
 * a slab is swapped in, relay makes its pages read-only (protect). The first write into them
 * faults; the SIGSEGV handler below finds the slab, records the faulting address, makes the slab
 * writable again and returns, so the write goes ahead and every later one runs at full speed.
 * Relay then asks (fault) or releases (release) and knows the group was written, and where.
 *
 * A fault outside every protected slab is not ours: the handler puts the previous handler back
 * (Python's faulthandler, or the default action) and returns; the instruction faults again and
 * meets that handler as if this one had never been installed. A SIGSEGV not raised by a fault
 * (kill, raise) goes to that handler too, then ends the process with the default action (a
 * faulthandler enabled after relay raises it again, back here). protect() installs the handler
 * again if something replaced it (faulthandler.enable() after relay), chaining to that one.
 *
 * The handler makes only async-signal-safe calls (mprotect, sigaction, raise); slots are claimed
 * and freed with atomics, so a slot is never seen half written: its start is published last and
 * cleared first.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define SLOTS 4096

typedef struct {
    _Atomic uintptr_t start; /* 0: free (or being filled) */
    _Atomic uintptr_t end;
    _Atomic uintptr_t fault; /* the first faulting address, 0 if none */
    _Atomic int claimed;
} Range;

static Range ranges[SLOTS];
static struct sigaction previous;
static volatile sig_atomic_t passed_on; /* a sent SIGSEGV went to the previous handler */
static PyThread_type_lock install_lock;

static void on_segv(int sig, siginfo_t *info, void *context) {
    (void)context;
    uintptr_t at = (uintptr_t)info->si_addr;
    if (info->si_code == SEGV_ACCERR) {
        for (int i = 0; i < SLOTS; i++) {
            uintptr_t start = atomic_load(&ranges[i].start);
            if (start == 0 || at < start || at >= atomic_load(&ranges[i].end))
                continue;
            uintptr_t none = 0;
            atomic_compare_exchange_strong(&ranges[i].fault, &none, at);
            int saved = errno;
            mprotect((void *)start, atomic_load(&ranges[i].end) - start, PROT_READ | PROT_WRITE);
            errno = saved;
            return;
        }
    }
    if (info->si_code <= 0) { /* sent, not a fault: nothing to return to */
        /* Raised again on return, once under the previous handler (faulthandler's traceback),
         * then under the default action: a faulthandler enabled after relay raises it back here. */
        if (!passed_on) {
            passed_on = 1;
            sigaction(sig, &previous, NULL);
        } else {
            signal(sig, SIG_DFL);
        }
        raise(sig);
        return;
    }
    sigaction(sig, &previous, NULL); /* the fault happens again, under the previous handler */
}

static int ensure_handler(void) {
    struct sigaction now;
    if (sigaction(SIGSEGV, NULL, &now) != 0)
        return -1;
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_segv)
        return 0;
    struct sigaction mine;
    memset(&mine, 0, sizeof mine);
    mine.sa_sigaction = on_segv;
    mine.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
    sigemptyset(&mine.sa_mask);
    previous = now;
    return sigaction(SIGSEGV, &mine, NULL);
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
    PyThread_acquire_lock(install_lock, WAIT_LOCK);
    int failed = ensure_handler();
    PyThread_release_lock(install_lock);
    if (failed)
        return PyErr_SetFromErrno(PyExc_OSError);
    for (int i = 0; i < SLOTS; i++) {
        int free_ = 0;
        if (!atomic_compare_exchange_strong(&ranges[i].claimed, &free_, 1))
            continue;
        atomic_store(&ranges[i].fault, 0);
        atomic_store(&ranges[i].end, (uintptr_t)(address + nbytes));
        atomic_store(&ranges[i].start, (uintptr_t)address);
        if (mprotect((void *)(uintptr_t)address, nbytes, PROT_READ) != 0) {
            int e = errno;
            atomic_store(&ranges[i].start, 0);
            atomic_store(&ranges[i].claimed, 0);
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
    if (i < 0 || i >= SLOTS || !atomic_load(&ranges[i].claimed)) {
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
    uintptr_t start = atomic_load(&r->start), end = atomic_load(&r->end);
    int failed = mprotect((void *)start, end - start, PROT_READ | PROT_WRITE);
    int e = errno;
    uintptr_t fault = atomic_load(&r->fault);
    atomic_store(&r->start, 0);
    atomic_store(&r->claimed, 0);
    if (failed) {
        errno = e;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong(fault);
}

static PyMethodDef methods[] = {
    {"protect", guard_protect, METH_VARARGS,
     "protect(address, nbytes) -> slot: make whole pages read-only, noting the first write."},
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

PyMODINIT_FUNC PyInit__write_guard(void) {
    install_lock = PyThread_allocate_lock();
    if (install_lock == NULL)
        return PyErr_NoMemory();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "SLOTS", SLOTS) != 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
