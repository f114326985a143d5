/*
 * The codec's fused kernels (csrc/codec/codec.h): known codes for known values, packing, the
 * padding of a last partial group, non-finite groups, bfloat16 in and out, float8 bytes, and
 * the error bound of a round trip.
 */
#include "check.h"

#include <math.h>
#include <stdint.h>

#include "codec.h"

static Job job(const void *src, void *dst, uint8_t *codes, float *params, int64_t n,
               int64_t group, int64_t bits, int64_t affine, int fp8) {
    return (Job){src, dst, codes, params, 0, fp8, n, group, bits, affine};
}

static uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* Symmetric int8: a scale of amax / 127 per group, codes rounded half to even. */
static void test_int8_codes(void) {
    const float x[4] = {-1.0f, 0.0f, 0.5f, 1.0f};
    int8_t codes[4];
    float scale, y[4];
    Job j = job(x, y, (uint8_t *)codes, &scale, 4, 4, 8, 0, 0);
    CHECK_EQ(codec_encode(&j), 0);
    CHECK(scale == 1.0f / 127.0f);
    CHECK_EQ(codes[0], -127);
    CHECK_EQ(codes[1], 0);
    CHECK_EQ(codes[2], 64); /* 63.5 rounds to the even 64 */
    CHECK_EQ(codes[3], 127);
    codec_decode(&j);
    for (int i = 0; i < 4; i++) CHECK(y[i] == (float)codes[i] * scale);
}

/* Affine codes are packed 8/bits to a byte, the first in the low bits. */
static void test_affine_packing(void) {
    float x[16];
    for (int i = 0; i < 16; i++) x[i] = (float)i;
    uint8_t codes[8];
    float params[2], y[16];
    Job j = job(x, y, codes, params, 16, 16, 4, 1, 0);
    memset(codes, 0xff, sizeof codes); /* encode zeroes packed codes itself */
    CHECK_EQ(codec_encode(&j), 0);
    CHECK(params[0] == 0.0f && params[1] == 1.0f);
    for (int i = 0; i < 8; i++) CHECK_EQ(codes[i], (2 * i) | ((2 * i + 1) << 4));
    codec_decode(&j);
    for (int i = 0; i < 16; i++) CHECK(y[i] == x[i]);

    const float two[4] = {0.0f, 1.0f, 2.0f, 3.0f};
    uint8_t packed = 0xff;
    j = job(two, y, &packed, params, 4, 4, 2, 1, 0);
    CHECK_EQ(codec_encode(&j), 0);
    CHECK_EQ(packed, 0xe4); /* 0 | 1 << 2 | 2 << 4 | 3 << 6 */
}

/* The last group is padded with zeros, and the zeros count in its range. */
static void test_last_group_padding(void) {
    const float x[5] = {1.0f, 2.0f, 3.0f, 4.0f, 2.0f};
    uint8_t codes[8]; /* a code for every value of every group, padding included */
    float params[4], y[5];
    Job j = job(x, y, codes, params, 5, 4, 8, 1, 0);
    CHECK_EQ(codec_encode(&j), 0);
    CHECK(params[0] == 1.0f);             /* the first group: 1..4 */
    CHECK(params[2] == 0.0f);             /* the second: 2 and three zeros of padding */
    CHECK(params[3] == 2.0f / 255.0f);
    codec_decode(&j);
    CHECK(fabsf(y[4] - 2.0f) <= params[3] / 2);
}

/* A group with a NaN, an infinity or a magnitude past the edge (2^126) gets NaN params and
 * codes 0; encode counts it; the other groups are coded as usual. */
static void test_non_finite_groups(void) {
    float x[16];
    for (int i = 0; i < 16; i++) x[i] = (float)(i % 4) - 1.5f;
    x[1] = NAN;
    x[6] = INFINITY;
    x[9] = 0x1p127f;
    int8_t codes[16];
    float scale[4];
    Job j = job(x, NULL, (uint8_t *)codes, scale, 16, 4, 8, 0, 0);
    CHECK_EQ(codec_encode(&j), 3);
    for (int g = 0; g < 3; g++) {
        CHECK(isnan(scale[g]));
        for (int i = 0; i < 4; i++) CHECK_EQ(codes[4 * g + i], 0);
    }
    CHECK(scale[3] == 1.5f / 127.0f);
    CHECK_EQ(codes[12], -127);
}

/* bfloat16 in (the top half of a float32) and out (rounded to nearest even, NaN kept NaN). */
static void test_bfloat16(void) {
    uint16_t in[4], out[4];
    const float values[4] = {1.0f, -0.5f, 0.25f, 0.0f};
    for (int i = 0; i < 4; i++) in[i] = (uint16_t)(bits_of(values[i]) >> 16);
    int8_t codes[4];
    float scale;
    Job j = job(in, out, (uint8_t *)codes, &scale, 4, 4, 8, 0, 0);
    j.dtype = 1;
    CHECK_EQ(codec_encode(&j), 0);
    CHECK(scale == 1.0f / 127.0f);
    codec_decode(&j);
    for (int i = 0; i < 4; i++) {
        float want = (float)codes[i] * scale;
        uint32_t b = bits_of(want);
        b += 0x7fffu + ((b >> 16) & 1u);
        CHECK_EQ(out[i], (uint16_t)(b >> 16));
    }
}

/* float8 bytes as torch's .to(float8_e4m3fn / float8_e5m2), the scale amax / the format's max. */
static void test_fp8_bytes(void) {
    const float e4[4] = {448.0f, 1.0f, -2.0f, 0x1p-9f}; /* max, one, minus two, least subnormal */
    uint8_t codes[4];
    float scale, y[4];
    Job j = job(e4, y, codes, &scale, 4, 4, 8, 0, 1);
    CHECK_EQ(codec_encode(&j), 0);
    CHECK(scale == 1.0f);
    CHECK_EQ(codes[0], 0x7e);
    CHECK_EQ(codes[1], 0x38);
    CHECK_EQ(codes[2], 0xc0);
    CHECK_EQ(codes[3], 0x01);
    codec_decode(&j);
    for (int i = 0; i < 4; i++) CHECK(y[i] == e4[i]);

    const float e5[2] = {57344.0f, 1.0f};
    j = job(e5, y, codes, &scale, 2, 2, 8, 0, 2);
    CHECK_EQ(codec_encode(&j), 0);
    CHECK_EQ(codes[0], 0x7b);
    CHECK_EQ(codes[1], 0x3c);
}

/* Every finite e4m3 value encodes to its own byte and decodes back to itself. */
static void test_fp8_every_value(void) {
    for (int c = 0; c < 256; c++) {
        if ((c & 0x7f) == 0x7f) continue; /* NaN */
        uint8_t probe[2] = {0x7e, (uint8_t)c};
        float params = 1.0f, v[2];
        Job j = job(NULL, v, probe, &params, 2, 2, 8, 0, 1);
        codec_decode(&j); /* the value of byte c */
        uint8_t codes[2];
        float scale;
        Job k = job(v, NULL, codes, &scale, 2, 2, 8, 0, 1);
        CHECK_EQ(codec_encode(&k), 0);
        CHECK(scale == 1.0f);
        CHECK_EQ(codes[1], c);
    }
}

/* Random data: each decoded value is within half a step of the original (and the float32
 * rounding of that arithmetic), on the vectorised path (whole groups of 64) and off it. */
static void test_round_trip_error(void) {
    enum { N = 64 * 33 + 17 };
    static float x[N], y[N], params[2 * (N / 64 + 1)];
    static uint8_t codes[(N / 64 + 1) * 64]; /* whole groups */
    uint32_t s = 12345;
    for (int i = 0; i < N; i++) {
        s = s * 1664525u + 1013904223u;
        x[i] = ((float)(s >> 8) / 16777216.0f - 0.5f) * 8.0f;
    }
    const int64_t bits[3] = {8, 4, 2};
    for (int b = 0; b < 3; b++) {
        Job j = job(x, y, codes, params, N, 64, bits[b], 1, 0);
        CHECK_EQ(codec_encode(&j), 0);
        codec_decode(&j);
        for (int i = 0; i < N; i++) {
            const float step = params[2 * (i / 64) + 1];
            CHECK(fabsf(y[i] - x[i]) <= step * 0.5f * 1.0001f + 1e-6f);
        }
    }
    Job j = job(x, y, codes, params, N, 64, 8, 0, 0);
    CHECK_EQ(codec_encode(&j), 0);
    codec_decode(&j);
    for (int i = 0; i < N; i++) CHECK(fabsf(y[i] - x[i]) <= params[i / 64] * 0.5f * 1.0001f);
}

int main(int argc, char **argv) {
    codec_init();
    static const test_t tests[] = {
        {"int8_codes", test_int8_codes},
        {"affine_packing", test_affine_packing},
        {"last_group_padding", test_last_group_padding},
        {"non_finite_groups", test_non_finite_groups},
        {"bfloat16", test_bfloat16},
        {"fp8_bytes", test_fp8_bytes},
        {"fp8_every_value", test_fp8_every_value},
        {"round_trip_error", test_round_trip_error},
    };
    return RUN_TESTS(tests, argc, argv);
}
