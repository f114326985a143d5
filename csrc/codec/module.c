/*
 * offloadd.codec._kernels: the CPython binding of the codec's fused kernels (codec.h).
 *
 *   encode(src, dtype, n, group, bits, affine, codes, params, fp8) -> groups not finite
 *   decode(codes, params, n, group, bits, affine, dst, dtype, fp8)
 *
 * Addresses are integers (tensor.data_ptr()); the arguments are codec.c's.  The work runs on the
 * calling thread, the GIL released: inside a training step torch's OpenMP workers spin on the
 * other cores between ops, and threads of our own fought them (slower, see
 * offloadd/codec/quant.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#include "codec.h"

static int check(int dtype, long long n, long long group, int bits, int affine, int fp8) {
    if (dtype != 0 && dtype != 1) {
        PyErr_Format(PyExc_ValueError, "dtype code must be 0 (float32) or 1 (bfloat16), got %d",
                     dtype);
        return -1;
    }
    if (fp8 < 0 || fp8 > 2 || (fp8 && (bits != 8 || affine))) {
        PyErr_Format(PyExc_ValueError, "fp8 must be 0, 1 (e4m3) or 2 (e5m2), symmetric 8-bit codes; got %d",
                     fp8);
        return -1;
    }
    if (n < 0 || group < 1 || (bits != 8 && bits != 4 && bits != 2) || (bits < 8 && !affine)) {
        PyErr_SetString(PyExc_ValueError, "bad n, group or bits (symmetric codes are 8 bits)");
        return -1;
    }
    return 0;
}

static PyObject *py_encode(PyObject *self, PyObject *args) {
    unsigned long long src, codes, params;
    long long n, group;
    int dtype, bits, affine, fp8;
    if (!PyArg_ParseTuple(args, "KiLLiiKKi", &src, &dtype, &n, &group, &bits, &affine, &codes,
                          &params, &fp8))
        return NULL;
    if (check(dtype, n, group, bits, affine, fp8) < 0) return NULL;
    Job job = {(const void *)(uintptr_t)src, NULL, (uint8_t *)(uintptr_t)codes,
               (float *)(uintptr_t)params, dtype, fp8, n, group, bits, affine};
    int64_t not_finite;
    Py_BEGIN_ALLOW_THREADS
    not_finite = codec_encode(&job);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong((long long)not_finite);
}

static PyObject *py_decode(PyObject *self, PyObject *args) {
    unsigned long long codes, params, dst;
    long long n, group;
    int dtype, bits, affine, fp8;
    if (!PyArg_ParseTuple(args, "KKLLiiKii", &codes, &params, &n, &group, &bits, &affine, &dst,
                          &dtype, &fp8))
        return NULL;
    if (check(dtype, n, group, bits, affine, fp8) < 0) return NULL;
    Job job = {NULL, (void *)(uintptr_t)dst, (uint8_t *)(uintptr_t)codes,
               (float *)(uintptr_t)params, dtype, fp8, n, group, bits, affine};
    Py_BEGIN_ALLOW_THREADS
    codec_decode(&job);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"encode", py_encode, METH_VARARGS,
     "encode(src, dtype, n, group, bits, affine, codes, params, fp8) -> groups not finite"},
    {"decode", py_decode, METH_VARARGS,
     "decode(codes, params, n, group, bits, affine, dst, dtype, fp8)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels",
                                    "offloadd's fused per-group quantisation (csrc/codec/)",
                                    -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
    codec_init();
    PyObject *m = PyModule_Create(&module);
    /* 2: encode returns the groups not finite (quant.py uses no older build) */
    if (m != NULL && PyModule_AddIntConstant(m, "VERSION", 2) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
