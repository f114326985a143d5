/*
 * offloadd.memsave._bits: ReLU's bit mask in one pass each way.
 *
 *   nonzero_bits(src, n, elsize, bits, threads)
 *       bit i of `bits` (byte i / 8, bit i % 8) = element i of `src` is not +-0: its bits with
 *       the sign bit cleared are not all zero. For a float that is `x != 0` (a NaN is not
 *       zero), which for a ReLU's result is `not (result <= 0)` (Note [relu mask] in
 *       offloadd/memsave/pointwise.py). The last byte's unused bits are zero.
 *   select_bits(grad, bits, n, elsize, out, threads)
 *       out[i] = bit i ? grad[i] : +0, element by element, copying the bits: exactly what
 *       aten's threshold_backward(grad, result, 0) returns for `result <= 0 ? 0 : grad`.
 *
 * The torch path (offloadd/memsave/bits.py) takes four passes over the tensor for the first and
 * three for the second; these take one. Addresses are integers (data_ptr()); elsize is 2, 4 or
 * 8; work is split over `threads` pthreads in multiples of 64 elements (whole bytes of `bits`),
 * with the GIL released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define MAX_THREADS 64

typedef struct {
    const uint8_t *src; /* nonzero: the tensor; select: grad */
    uint8_t *bits;
    uint8_t *out;
    int64_t n, elsize, i0, i1; /* elements [i0, i1), i0 a multiple of 64 */
    int select;
} Job;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HOT __attribute__((target_clones("avx2", "default")))
#else
#define HOT
#endif

#define DEFINE_NONZERO(T, MASK)                                                                  \
    HOT static void nonzero_##T(const T *x, uint8_t *bits, int64_t i0, int64_t i1) {             \
        for (int64_t b = i0; b < i1; b += 8) {                                                   \
            unsigned byte = 0;                                                                   \
            int64_t m = i1 - b < 8 ? i1 - b : 8;                                                 \
            if (m == 8) {                                                                        \
                for (int k = 0; k < 8; k++) byte |= (unsigned)((x[b + k] & (MASK)) != 0) << k;   \
            } else {                                                                             \
                for (int k = 0; k < m; k++) byte |= (unsigned)((x[b + k] & (MASK)) != 0) << k;   \
            }                                                                                    \
            bits[b / 8] = (uint8_t)byte;                                                         \
        }                                                                                        \
    }                                                                                            \
    HOT static void select_##T(const T *g, const uint8_t *bits, T *out, int64_t i0, int64_t i1) { \
        for (int64_t b = i0; b < i1; b += 8) {                                                   \
            const unsigned byte = bits[b / 8];                                                   \
            if (i1 - b >= 8) {                                                                   \
                for (int k = 0; k < 8; k++) out[b + k] = g[b + k] & ((T)0 - (T)((byte >> k) & 1)); \
            } else {                                                                             \
                for (int64_t k = 0; k < i1 - b; k++)                                             \
                    out[b + k] = g[b + k] & ((T)0 - (T)((byte >> k) & 1));                       \
            }                                                                                    \
        }                                                                                        \
    }

DEFINE_NONZERO(uint16_t, 0x7fffu)
DEFINE_NONZERO(uint32_t, 0x7fffffffu)
DEFINE_NONZERO(uint64_t, 0x7fffffffffffffffull)

static void run_job(const Job *j) {
    if (j->i0 >= j->i1) return;
    switch (j->elsize) {
    case 2:
        if (j->select)
            select_uint16_t((const uint16_t *)j->src, j->bits, (uint16_t *)j->out, j->i0, j->i1);
        else
            nonzero_uint16_t((const uint16_t *)j->src, j->bits, j->i0, j->i1);
        break;
    case 4:
        if (j->select)
            select_uint32_t((const uint32_t *)j->src, j->bits, (uint32_t *)j->out, j->i0, j->i1);
        else
            nonzero_uint32_t((const uint32_t *)j->src, j->bits, j->i0, j->i1);
        break;
    default:
        if (j->select)
            select_uint64_t((const uint64_t *)j->src, j->bits, (uint64_t *)j->out, j->i0, j->i1);
        else
            nonzero_uint64_t((const uint64_t *)j->src, j->bits, j->i0, j->i1);
    }
}

static void *run_thread(void *arg) {
    run_job((const Job *)arg);
    return NULL;
}

static void run_split(Job job, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (job.n < (int64_t)threads * 65536) threads = (int)(job.n / 65536 > 0 ? job.n / 65536 : 1);
    const int64_t share = ((job.n + threads - 1) / threads + 63) / 64 * 64;
    Job jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++) {
        jobs[t] = job;
        jobs[t].i0 = t * share < job.n ? t * share : job.n;
        jobs[t].i1 = (t + 1) * share < job.n ? (t + 1) * share : job.n;
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, run_thread, &jobs[t]) == 0;
    for (int t = 0; t < threads; t++)
        if (t == 0 || !started[t]) run_job(&jobs[t]);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(ids[t], NULL);
}

static int check_elsize(long long elsize, long long n) {
    if ((elsize != 2 && elsize != 4 && elsize != 8) || n < 0) {
        PyErr_Format(PyExc_ValueError, "element size must be 2, 4 or 8 and n >= 0, got %lld, %lld",
                     elsize, n);
        return -1;
    }
    return 0;
}

static PyObject *py_nonzero_bits(PyObject *self, PyObject *args) {
    unsigned long long src, bits;
    long long n, elsize;
    int threads;
    if (!PyArg_ParseTuple(args, "KLLKi", &src, &n, &elsize, &bits, &threads)) return NULL;
    if (check_elsize(elsize, n) < 0) return NULL;
    Job job = {(const uint8_t *)(uintptr_t)src, (uint8_t *)(uintptr_t)bits, NULL, n, elsize, 0,
               0, 0};
    Py_BEGIN_ALLOW_THREADS run_split(job, threads);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_select_bits(PyObject *self, PyObject *args) {
    unsigned long long grad, bits, out;
    long long n, elsize;
    int threads;
    if (!PyArg_ParseTuple(args, "KKLLKi", &grad, &bits, &n, &elsize, &out, &threads)) return NULL;
    if (check_elsize(elsize, n) < 0) return NULL;
    Job job = {(const uint8_t *)(uintptr_t)grad, (uint8_t *)(uintptr_t)bits,
               (uint8_t *)(uintptr_t)out, n, elsize, 0, 0, 1};
    Py_BEGIN_ALLOW_THREADS run_split(job, threads);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"nonzero_bits", py_nonzero_bits, METH_VARARGS, "nonzero_bits(src, n, elsize, bits, threads)"},
    {"select_bits", py_select_bits, METH_VARARGS,
     "select_bits(grad, bits, n, elsize, out, threads)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bits",
                                    "memsave's fused bit-mask kernels (see csrc/bits.c)", -1,
                                    methods};

PyMODINIT_FUNC PyInit__bits(void) { return PyModule_Create(&module); }
