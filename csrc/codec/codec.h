/*
 * The codec's fused kernels without Python (codec.c says what they compute).
 */
#ifndef OFFLOADD_CODEC_H
#define OFFLOADD_CODEC_H

#include <stdint.h>

typedef struct {
    const void *src; /* encode: n values of dtype */
    void *dst;       /* decode: n values of dtype */
    uint8_t *codes;  /* a code per value (8 bits), or 8/bits of them packed to a byte */
    float *params;   /* per group: a scale (symmetric), or lo and step (affine) */
    int dtype, fp8;
    int64_t n, group, bits, affine;
} Job;

/* Fill the table of float8 values decode reads; call once before any other function. */
void codec_init(void);

/* Encode src into codes and params (packed codes are zeroed first); returns how many groups
 * were not finite (NaN params, codes 0).  The arguments must be valid (module.c checks them). */
int64_t codec_encode(const Job *j);

/* Decode codes and params into dst. */
void codec_decode(const Job *j);

#endif
