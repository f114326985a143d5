/*
 * offloadd.io._native: the CPython binding of the native I/O engine (engine.h).
 *
 * Engine wraps one engine_t.  No backend thread ever takes the GIL: Python collects finished
 * requests as (token, errno, bytes done) with reap(), which waits on the engine's eventfd with
 * the GIL released, or watches fileno() from an event loop.  If reap() cannot build its result
 * (MemoryError), the completions stay queued for the next call.
 *
 * A test build (-DOFFLOADD_FAULTS, with faults.c) adds the module functions _inject_fault,
 * _hold_copies and _held_copies; the production build has none of them (faults.h).
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "engine.h"
#include "faults.h"

typedef struct {
    PyObject_HEAD
    engine_t e;
} EngineObject;

/* Raise the exception for an engine return code (engine.h) that is not 0. */
static PyObject *raise_engine_error(int rc) {
    switch (rc) {
    case ENGINE_NOMEM:
        return PyErr_NoMemory();
    case ENGINE_NO_URING:
        PyErr_SetString(PyExc_OSError, "offloadd.io._native was built without io_uring support");
        return NULL;
    case ENGINE_CLOSED:
        PyErr_SetString(PyExc_RuntimeError, "offloadd: native engine is closed");
        return NULL;
    case ENGINE_UNALIGNED: {
        PyObject *exc = PyObject_CallFunction(
            PyExc_OSError, "is", EINVAL, "file offset is not a multiple of 4096 on an O_DIRECT file");
        if (exc) {
            PyErr_SetObject(PyExc_OSError, exc);
            Py_DECREF(exc);
        }
        return NULL;
    }
    default:
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
}

static PyObject *Engine_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"threads", "chunk_bytes", "backend", "depth", NULL};
    int threads = 4;
    unsigned long long chunk = 1u << 20;
    const char *backend = "threads";
    unsigned depth = 32;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$iKsI", kwlist, &threads, &chunk, &backend,
                                     &depth))
        return NULL;
    if (threads < 1 || threads > ENGINE_MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "threads must be in 1..256, got %d", threads);
        return NULL;
    }
    if (chunk < ALIGN || chunk % ALIGN || chunk > ENGINE_MAX_CHUNK) {
        PyErr_Format(PyExc_ValueError,
                     "chunk_bytes must be a multiple of 4096 between 4096 and 1 GiB, got %llu",
                     chunk);
        return NULL;
    }
    if (depth < 1 || depth > ENGINE_MAX_DEPTH) {
        PyErr_Format(PyExc_ValueError, "depth must be in 1..4096, got %u", depth);
        return NULL;
    }
    int want_uring;
    if (strcmp(backend, "threads") == 0) want_uring = 0;
    else if (strcmp(backend, "uring") == 0) want_uring = 1;
    else {
        PyErr_Format(PyExc_ValueError, "backend must be 'threads' or 'uring', got '%s'", backend);
        return NULL;
    }
    EngineObject *self = (EngineObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    engine_init(&self->e);
    int rc = engine_start(&self->e, threads, chunk, want_uring, depth);
    if (rc) { /* dealloc stops the threads already started and tears the ring down */
        raise_engine_error(rc);
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void Engine_dealloc(EngineObject *self) {
    Py_BEGIN_ALLOW_THREADS
    engine_stop(&self->e);
    Py_END_ALLOW_THREADS
    engine_free(&self->e);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Engine_submit(EngineObject *self, PyObject *args) {
    unsigned long long token, offset, address, nbytes, head = 0, tail = 0;
    int op, fd;
    if (!PyArg_ParseTuple(args, "KiiKKK|KK", &token, &op, &fd, &offset, &address, &nbytes, &head,
                          &tail))
        return NULL;
    int rc = engine_submit(&self->e, token, op, fd, offset, (char *)(uintptr_t)address, nbytes,
                           (char *)(uintptr_t)head, (char *)(uintptr_t)tail);
    switch (rc) {
    case 0:
        Py_RETURN_NONE;
    case ENGINE_BAD_OP:
        PyErr_Format(PyExc_ValueError, "op must be 0 (read) or 1 (write), got %d", op);
        return NULL;
    case ENGINE_BAD_PAGES:
        PyErr_SetString(PyExc_ValueError,
                        "head/tail pages are for writes of at least one page (two with a tail)");
        return NULL;
    default:
        return raise_engine_error(rc);
    }
}

static PyObject *Engine_cancel(EngineObject *self, PyObject *arg) {
    unsigned long long token = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    return PyBool_FromLong(engine_cancel(&self->e, token));
}

static PyObject *Engine_reap(EngineObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"timeout", NULL};
    double timeout = -1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|d", kwlist, &timeout)) return NULL;
    request_t *got;
    size_t n;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = engine_wait(&self->e, timeout, &got, &n);
    Py_END_ALLOW_THREADS
    if (err) { /* engine_wait fails only while nothing was taken: nothing to give back */
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    /* Nothing is freed before the whole list is built: on MemoryError every completion taken
     * goes back to the engine, and a later reap() delivers it. */
    PyObject *list = fault(FAULT_COMPLETION) ? PyErr_NoMemory() : PyList_New((Py_ssize_t)n);
    if (!list) {
        engine_give_back(&self->e, got, n);
        return NULL;
    }
    Py_ssize_t i = 0;
    for (request_t *r = got; r; r = r->dnext, i++) {
        PyObject *t = Py_BuildValue("(KiK)", (unsigned long long)r->token, r->err,
                                    (unsigned long long)r->done);
        if (!t) {
            Py_DECREF(list);
            engine_give_back(&self->e, got, n);
            return NULL;
        }
        PyList_SET_ITEM(list, i, t);
    }
    engine_release(got);
    return list;
}

static PyObject *Engine_close(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    Py_BEGIN_ALLOW_THREADS
    engine_stop(&self->e);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Engine_fileno(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLong(self->e.efd);
}

static PyObject *Engine_counters(EngineObject *self, PyObject *Py_UNUSED(ignored)) {
    uint64_t rd, wr, pend;
    engine_counters(&self->e, &rd, &wr, &pend);
    return Py_BuildValue("{sKsKsK}", "bytes_read", (unsigned long long)rd, "bytes_written",
                         (unsigned long long)wr, "pending", (unsigned long long)pend);
}

static PyObject *Engine_get_backend(EngineObject *self, void *Py_UNUSED(closure)) {
    return PyUnicode_FromString(engine_uses_uring(&self->e) ? "uring" : "threads");
}

static PyObject *Engine_get_fallback(EngineObject *self, void *Py_UNUSED(closure)) {
    int err = engine_fallback_errno(&self->e);
    if (!err) Py_RETURN_NONE;
    return PyUnicode_FromFormat("io_uring_enter: [Errno %d] %s", err, strerror(err));
}

static PyMethodDef Engine_methods[] = {
    {"submit", (PyCFunction)Engine_submit, METH_VARARGS,
     "submit(token, op, fd, offset, address, nbytes): queue one transfer"},
    {"cancel", (PyCFunction)Engine_cancel, METH_O,
     "cancel(token) -> bool: drop a request none of whose chunks has started"},
    {"reap", (PyCFunction)(void (*)(void))Engine_reap, METH_VARARGS | METH_KEYWORDS,
     "reap(timeout=-1) -> list[(token, errno, bytes)]: wait (GIL released) for completions; "
     "on MemoryError they stay queued for the next call"},
    {"close", (PyCFunction)Engine_close, METH_NOARGS,
     "close(): finish every submitted request, then stop the threads"},
    {"fileno", (PyCFunction)Engine_fileno, METH_NOARGS,
     "fileno() -> int: an eventfd that is readable when completions are waiting"},
    {"counters", (PyCFunction)Engine_counters, METH_NOARGS,
     "counters() -> dict: bytes read and written, requests pending"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Engine_getset[] = {
    {"backend", (getter)Engine_get_backend, NULL,
     "'threads' or 'uring' ('threads' for good once the ring has failed)", NULL},
    {"fallback", (getter)Engine_get_fallback, NULL,
     "None, or why the io_uring backend moved to threads (the error io_uring_enter returned)",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "offloadd.io._native.Engine",
    .tp_basicsize = sizeof(EngineObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Native I/O engine: pthread pool or io_uring, completions through an eventfd.",
    .tp_new = Engine_new,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
    .tp_getset = Engine_getset,
};

/* copy(dst, src, nbytes): memcpy between two addresses of this process (ctypes.memmove
 * converts each argument through its own objects, which cost about as much as copying a
 * relayed group of 64 KiB). A copy of COPY_RELEASES_GIL bytes or more runs with the GIL
 * released, as ctypes' did. */
#define COPY_RELEASES_GIL (1 << 20)

static PyObject *copy_bytes(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "copy(dst, src, nbytes) takes 3 arguments, got %zd", nargs);
        return NULL;
    }
    void *dst = PyLong_AsVoidPtr(args[0]);
    if (dst == NULL && PyErr_Occurred()) return NULL;
    const void *src = PyLong_AsVoidPtr(args[1]);
    if (src == NULL && PyErr_Occurred()) return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "copy: nbytes must be >= 0, got %zd", n);
        return NULL;
    }
    if (n > 0 && (dst == NULL || src == NULL)) {
        PyErr_SetString(PyExc_ValueError, "copy: an address is 0");
        return NULL;
    }
    if (n >= COPY_RELEASES_GIL) {
        Py_BEGIN_ALLOW_THREADS
        memmove(dst, src, (size_t)n);
        Py_END_ALLOW_THREADS
    } else if (n > 0) {
        memmove(dst, src, (size_t)n);
    }
    Py_RETURN_NONE;
}

static PyObject *probe_uring(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(ignored)) {
#ifdef OFFLOADD_HAVE_URING
    char why[160];
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = ring_selftest(why, sizeof why);
    Py_END_ALLOW_THREADS
    if (!ok) return Py_BuildValue("(Os)", Py_False, why);
    return Py_BuildValue("(Os)", Py_True, "io_uring read test succeeded");
#else
    return Py_BuildValue("(Os)", Py_False, "built without <linux/io_uring.h>");
#endif
}

#ifdef OFFLOADD_FAULTS
static PyObject *inject_fault(PyObject *Py_UNUSED(self), PyObject *args) {
    const char *name;
    int count, err;
    if (!PyArg_ParseTuple(args, "sii", &name, &count, &err)) return NULL;
    int which = fault_index(name);
    if (which < 0) {
        PyErr_Format(PyExc_ValueError, "unknown fault point '%s'", name);
        return NULL;
    }
    if (count != 0 && err <= 0) {
        PyErr_Format(PyExc_ValueError, "errno must be > 0, got %d", err);
        return NULL;
    }
    fault_arm(which, count, err);
    Py_RETURN_NONE;
}

static PyObject *hold_copies_py(PyObject *Py_UNUSED(self), PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    hold_copies(on);
    Py_RETURN_NONE;
}

static PyObject *held_copies_py(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromLong(held_copies());
}
#endif

static PyMethodDef module_methods[] = {
#ifdef OFFLOADD_FAULTS
    {"_inject_fault", inject_fault, METH_VARARGS,
     "_inject_fault(name, count, errno): for tests, the next `count` passes through the fault "
     "point `name` ('uring_enter', 'alloc', 'completion') fail with `errno` (every pass if "
     "count < 0); count 0 disarms"},
    {"_hold_copies", hold_copies_py, METH_O,
     "_hold_copies(on): for tests, every bounce-buffer copy waits (at most 5 s) while on"},
    {"_held_copies", held_copies_py, METH_NOARGS,
     "_held_copies() -> int: bounce-buffer copies waiting in _hold_copies now"},
#endif
    {"copy", (PyCFunction)(void (*)(void))copy_bytes, METH_FASTCALL,
     "copy(dst, src, nbytes): copy nbytes from address src to address dst (memmove)"},
    {"probe_uring", probe_uring, METH_NOARGS,
     "probe_uring() -> (bool, str): whether io_uring works in this process, and why not"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "offloadd.io._native", "offloadd's native I/O engine.", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&EngineType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(&EngineType);
        Py_DECREF(m);
        return NULL;
    }
#ifdef OFFLOADD_HAVE_URING
    PyModule_AddIntConstant(m, "HAVE_URING", 1);
#else
    PyModule_AddIntConstant(m, "HAVE_URING", 0);
#endif
    PyModule_AddIntConstant(m, "ALIGN", ALIGN);
    return m;
}
