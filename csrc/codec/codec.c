/*
 * The codec's fused kernels: per-group integer and fp8 quantisation of host tensors in one pass
 * (codec.h; module.c binds them as offloadd.codec._kernels).
 *
 * The same arithmetic as the torch path of offloadd/codec/quant.py (Note [the codes]), fused:
 * each group of `group` values is read once from memory into cache, its range found, its codes
 * written, instead of five passes of whole-tensor torch ops.  Results are bitwise those of the
 * torch path: the same float32 operations in the same order (a true division, round half to
 * even, the same clamps), the padding of the last group with zeros included in its range.
 *
 * dtype 0 is float32, 1 bfloat16.  bits is 8, 4 or 2; affine 0 is symmetric (int8 only: a scale
 * per group, codes -127..127 as int8), 1 a minimum and a step per group (codes 0..2^bits-1,
 * packed 8/bits to a byte, the first in the low bits).  params holds a float32 scale per group,
 * or lo and step.  A group holding an infinity, a NaN or a magnitude above EDGE gets NaN params
 * (its codes are 0), and encode returns how many groups did: the range pass finds them, so the
 * coder saves such a tensor exactly at no extra cost.  fp8 is 0 for integer codes, 1 for float8
 * e4m3fn, 2 for e5m2 (8 bits, symmetric: a scale per group, codes as torch's float8 bytes, see
 * fp8_code).  Stochastic rounding stays with the torch path.
 */
#include "codec.h"

#include <math.h>
#include <string.h>

static inline float load(const void *src, int dtype, int64_t i, int64_t n) {
    if (i >= n) return 0.0f;
    if (dtype == 0) return ((const float *)src)[i];
    uint32_t b = (uint32_t)((const uint16_t *)src)[i] << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline void store(void *dst, int dtype, int64_t i, float v) {
    if (dtype == 0) {
        ((float *)dst)[i] = v;
        return;
    }
    uint32_t b;
    memcpy(&b, &v, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) { /* NaN: keep it a NaN */
        ((uint16_t *)dst)[i] = (uint16_t)((b >> 16) | 0x40u);
        return;
    }
    b += 0x7fffu + ((b >> 16) & 1u); /* round to nearest even, as torch's .to(bfloat16) */
    ((uint16_t *)dst)[i] = (uint16_t)(b >> 16);
}

static inline void put_code(uint8_t *codes, int64_t i, int64_t bits, unsigned q) {
    if (bits == 8) {
        codes[i] = (uint8_t)q;
        return;
    }
    int64_t per = 8 / bits;
    codes[i / per] |= (uint8_t)(q << (bits * (i % per)));
}

/* Round half to even for |v| <= 2^22 (every code here: |v| is at most 2^bits plus a rounding):
 * adding 1.5 * 2^23 moves v into the binade whose spacing is 1, where the addition itself rounds
 * it as nearbyintf would in the default rounding mode; no call, so the loops vectorise. */
static inline float rne(float v) {
    const float magic = 12582912.0f;
    return (v + magic) - magic;
}

/* float8 formats: exponent bits, mantissa bits, bias, largest finite value. */
typedef struct {
    int m, bias;
    float max;
} Fp8;
static const Fp8 FP8[3] = {{0, 0, 127.0f}, {3, 7, 448.0f}, {2, 15, 57344.0f}};

/* The float8 byte of v (finite, |v| <= the format's max), rounded to nearest even, as torch's
 * .to(float8_e4m3fn / float8_e5m2): below the smallest normal 2^(1-bias), v scaled by 2^(bias-1+m)
 * (exact) and rounded to an integer is the subnormal's code (2^m, the carry, is the smallest
 * normal's); above, the float32 bits lose 23-m mantissa bits, rounding half to even, and the
 * exponent is rebased from 127 to bias. */
static inline uint8_t fp8_code(float v, Fp8 f) {
    uint32_t u;
    memcpy(&u, &v, 4);
    const uint32_t sign = (u >> 24) & 0x80u;
    u &= 0x7fffffffu;
    float a;
    memcpy(&a, &u, 4);
    const int drop = 23 - f.m;
    /* both, then a select by mask: no branch, so the loops calling this vectorise */
    const int32_t sub = (int32_t)rne(a * (float)(1 << (f.bias - 1 + f.m)));
    const uint32_t up = u + (1u << (drop - 1)) - 1u + ((u >> drop) & 1u);
    const int32_t normal = (int32_t)((up >> drop) - ((uint32_t)(127 - f.bias) << f.m));
    const int32_t is_sub = -(int32_t)(u < (uint32_t)(128 - f.bias) << 23);
    return (uint8_t)(sign | (uint32_t)((sub & is_sub) | (normal & ~is_sub)));
}

/* The value of every float8 byte, per format (filled by codec_init; NaN codes decode to NaN). */
static float FP8_VALUE[3][256];

void codec_init(void) {
    for (int k = 1; k < 3; k++) {
        const Fp8 f = FP8[k];
        const int e_bits = 7 - f.m;
        for (int c = 0; c < 256; c++) {
            const int e = (c >> f.m) & ((1 << e_bits) - 1), mant = c & ((1 << f.m) - 1);
            float v;
            if (e == 0)
                v = ldexpf((float)mant, 1 - f.bias - f.m);
            else if (k == 1 && e == 15 && mant == 7)
                v = NAN;
            else if (k == 2 && e == 31)
                v = mant ? NAN : INFINITY;
            else
                v = ldexpf((float)((1 << f.m) + mant), e - f.bias - f.m);
            FP8_VALUE[k][c] = (c & 0x80) ? -v : v;
        }
    }
}

/* Fused per group: a clone per instruction set where the compiler supports it. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HOT __attribute__((target_clones("avx2", "default")))
#else
#define HOT
#endif

#define LANES 8

/* The largest magnitude encoded, as quant.py's _EDGE: a quarter of float32's largest value, so
 * that no decoded value (at most about 127 * scale, or lo + top * step) can overflow. */
#define EDGE 0x1p126f

/* lo and hi of x[0..g) (g a multiple of LANES), and whether any value is a NaN: LANES running
 * minima side by side, which the compiler turns into vector compares and blends. */
static inline int range_f32(const float *x, int64_t g, float *lo_out, float *hi_out) {
    float lo[LANES], hi[LANES];
    int nan[LANES];
    for (int l = 0; l < LANES; l++) lo[l] = INFINITY, hi[l] = -INFINITY, nan[l] = 0;
    for (int64_t i = 0; i < g; i += LANES)
        for (int l = 0; l < LANES; l++) {
            float v = x[i + l];
            lo[l] = v < lo[l] ? v : lo[l];
            hi[l] = v > hi[l] ? v : hi[l];
            nan[l] |= v != v;
        }
    float a = lo[0], b = hi[0];
    int bad = nan[0];
    for (int l = 1; l < LANES; l++) {
        a = lo[l] < a ? lo[l] : a;
        b = hi[l] > b ? hi[l] : b;
        bad |= nan[l];
    }
    *lo_out = a;
    *hi_out = b;
    return bad;
}

#define CHUNK 64

/* CHUNK codes of `bits` bits into CHUNK * bits / 8 bytes, the first in the low bits. */
static inline void pack_codes(const uint8_t *q, uint8_t *out, int64_t bits) {
    if (bits == 8) {
        memcpy(out, q, CHUNK);
    } else if (bits == 4) {
        for (int i = 0; i < CHUNK / 2; i++) out[i] = (uint8_t)(q[2 * i] | (q[2 * i + 1] << 4));
    } else {
        for (int i = 0; i < CHUNK / 4; i++)
            out[i] = (uint8_t)(q[4 * i] | (q[4 * i + 1] << 2) | (q[4 * i + 2] << 4) |
                               (q[4 * i + 3] << 6));
    }
}

static inline void unpack_codes(const uint8_t *in, uint8_t *q, int64_t bits) {
    if (bits == 8) {
        memcpy(q, in, CHUNK);
    } else if (bits == 4) {
        for (int i = 0; i < CHUNK / 2; i++) q[2 * i] = in[i] & 15, q[2 * i + 1] = in[i] >> 4;
    } else {
        for (int i = 0; i < CHUNK / 4; i++)
            q[4 * i] = in[i] & 3, q[4 * i + 1] = (in[i] >> 2) & 3, q[4 * i + 2] = (in[i] >> 4) & 3,
            q[4 * i + 3] = in[i] >> 6;
    }
}

HOT static int64_t encode_groups(const Job *j) {
    const int64_t g = j->group, top = (1 << j->bits) - 1;
    int64_t not_finite = 0;
    for (int64_t k = 0; k * g < j->n; k++) {
        const int64_t base = k * g;
        float lo = INFINITY, hi = -INFINITY;
        int bad = 0;
        const int fast = j->dtype == 0 && base + g <= j->n && g % LANES == 0;
        if (fast) {
            bad = range_f32((const float *)j->src + base, g, &lo, &hi);
        } else {
            for (int64_t i = 0; i < g; i++) {
                float v = load(j->src, j->dtype, base + i, j->n);
                lo = v < lo ? v : lo;
                hi = v > hi ? v : hi;
                bad |= v != v;
            }
        }
        bad |= !(lo >= -EDGE && hi <= EDGE); /* infinities and magnitudes past the edge */
        not_finite += bad;
        if (j->affine) {
            float step = (hi - lo) / (float)top;
            if (!(step > 0.0f)) step = 1.0f;
            j->params[2 * k] = bad ? NAN : lo;
            j->params[2 * k + 1] = bad ? NAN : step;
            const int64_t per = 8 / j->bits;
            if (fast && !bad && base % per == 0 && g % (CHUNK) == 0) {
                const float *x = (const float *)j->src + base;
                uint8_t q[CHUNK];
                for (int64_t c = 0; c < g; c += CHUNK) {
                    for (int i = 0; i < CHUNK; i++) {
                        float v = rne((x[c + i] - lo) / step);
                        v = v < 0.0f ? 0.0f : v;
                        v = v > (float)top ? (float)top : v;
                        q[i] = (uint8_t)(int)v;
                    }
                    pack_codes(q, j->codes + (base + c) / per, j->bits);
                }
                continue;
            }
            for (int64_t i = 0; i < g; i++) {
                float v = bad ? 0.0f : rne((load(j->src, j->dtype, base + i, j->n) - lo) / step);
                v = v < 0.0f ? 0.0f : v;
                v = v > (float)top ? (float)top : v;
                put_code(j->codes, base + i, j->bits, (unsigned)v);
            }
        } else if (j->fp8) {
            const Fp8 f = FP8[j->fp8];
            float amax = -lo > hi ? -lo : hi;
            float scale = amax / f.max;
            if (!(scale > 0.0f)) scale = 1.0f;
            j->params[k] = bad ? NAN : scale;
            uint8_t *out = j->codes + base;
            if (fast && !bad) {
                const float *x = (const float *)j->src + base;
                for (int64_t i = 0; i < g; i++) {
                    float v = x[i] / scale;
                    v = v < -f.max ? -f.max : v; /* two clamps, not nested: vectorises */
                    v = v > f.max ? f.max : v;
                    out[i] = fp8_code(v, f);
                }
            } else {
                for (int64_t i = 0; i < g; i++) {
                    float v = bad ? 0.0f : load(j->src, j->dtype, base + i, j->n) / scale;
                    v = v < -f.max ? -f.max : v; /* two clamps, not nested: vectorises */
                    v = v > f.max ? f.max : v;
                    out[i] = fp8_code(v, f);
                }
            }
        } else {
            float amax = -lo > hi ? -lo : hi;
            float scale = amax / 127.0f;
            if (!(scale > 0.0f)) scale = 1.0f;
            j->params[k] = bad ? NAN : scale;
            int8_t *out = (int8_t *)j->codes + base;
            if (fast && !bad) {
                const float *x = (const float *)j->src + base;
                for (int64_t i = 0; i < g; i++) {
                    float v = rne(x[i] / scale);
                    v = v < -127.0f ? -127.0f : v;
                    v = v > 127.0f ? 127.0f : v;
                    out[i] = (int8_t)v;
                }
            } else {
                for (int64_t i = 0; i < g; i++) {
                    float v = bad ? 0.0f : rne(load(j->src, j->dtype, base + i, j->n) / scale);
                    v = v < -127.0f ? -127.0f : v;
                    v = v > 127.0f ? 127.0f : v;
                    out[i] = (int8_t)v;
                }
            }
        }
    }
    return not_finite;
}

HOT static void decode_groups(const Job *j) {
    const int64_t g = j->group, per = 8 / j->bits, mask = (1 << j->bits) - 1;
    for (int64_t k = 0; k * g < j->n; k++) {
        const int64_t base = k * g;
        const int64_t end = base + g < j->n ? base + g : j->n;
        if (j->affine) {
            const float lo = j->params[2 * k], step = j->params[2 * k + 1];
            if (j->dtype == 0 && end - base == g && g % CHUNK == 0 && base % per == 0) {
                float *y = (float *)j->dst + base;
                uint8_t q[CHUNK];
                for (int64_t c = 0; c < g; c += CHUNK) {
                    unpack_codes(j->codes + (base + c) / per, q, j->bits);
                    for (int i = 0; i < CHUNK; i++) y[c + i] = (float)q[i] * step + lo;
                }
                continue;
            }
            for (int64_t i = base; i < end; i++) {
                unsigned q = (j->codes[i / per] >> (j->bits * (i % per))) & mask;
                store(j->dst, j->dtype, i, (float)q * step + lo);
            }
        } else if (j->fp8) {
            const float scale = j->params[k];
            const float *value = FP8_VALUE[j->fp8];
            if (j->dtype == 0) {
                float *y = (float *)j->dst;
                for (int64_t i = base; i < end; i++) y[i] = value[j->codes[i]] * scale;
            } else {
                for (int64_t i = base; i < end; i++)
                    store(j->dst, j->dtype, i, value[j->codes[i]] * scale);
            }
        } else {
            const float scale = j->params[k];
            const int8_t *q = (const int8_t *)j->codes;
            if (j->dtype == 0) {
                float *y = (float *)j->dst;
                for (int64_t i = base; i < end; i++) y[i] = (float)q[i] * scale;
            } else {
                for (int64_t i = base; i < end; i++) store(j->dst, j->dtype, i, (float)q[i] * scale);
            }
        }
    }
}

int64_t codec_encode(const Job *j) {
    if (j->bits < 8) { /* packed codes are or-ed in: start from zero */
        const int64_t groups = (j->n + j->group - 1) / j->group, per = 8 / j->bits;
        memset(j->codes, 0, (size_t)((groups * j->group + per - 1) / per));
    }
    return encode_groups(j);
}

void codec_decode(const Job *j) { decode_groups(j); }
