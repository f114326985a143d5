/*
 * memsave's kernels (the ops of kernel_ops.cpp call them; offloadd/memsave/kernels.py loads
 * them): bit masks for ReLU, LeakyReLU and Dropout, and window offsets for MaxPool.
 *
 * The torch-op path of offloadd/memsave/bits.py makes a ReLU's mask in five passes over memory
 * in forward and turns it back into a tensor in four in backward; these do each direction in
 * the one pass that plain PyTorch's ReLU makes anyway (Note [fused relu] in pointwise.py):
 *
 *   relu_f32(x, out, bits, n)          out = relu(x) as torch computes it, bits = !(out <= 0)
 *   pack(src, dtype, pred, bits, n)    bits of pred(src): 0 is !(v <= 0), 1 is v > 0
 *   select_f32(grad, bits, out, n)     out = bit ? grad : +0 (threshold_backward's result)
 *   expand(bits, out, n, dtype)        out = bit ? 1 : 0 in dtype
 *   pool_compact(indices, offsets, ...) MaxPool's int64 indices as offsets in their windows
 *   pool_expand(offsets, indices, ...)  and back (Note in offloadd/memsave/pool.py)
 *
 * Addresses are integers (tensor.data_ptr()), every tensor contiguous; out may be x (in place).
 * dtype 0 is float32, 1 bfloat16.  Bit i of the mask is bit i % 8 of byte i / 8; the last
 * byte's unused bits are 0.
 *
 * The results are bitwise those of the torch ops they replace:
 *  - torch's CPU relu is clamp_min(x, 0): vectorised, max_ps(0, x), which returns its second
 *    operand when either is NaN or both are zeros, so NaN (with its payload) and -0.0 pass
 *    through; its scalar tail is `isnan(a) ? a : std::max(a, 0)`, the same function.  Here:
 *    the same max_ps, and the same scalar expression for the tail.
 *  - The mask compares in float, as torch's ops do, so it follows the same MXCSR (a flushed
 *    denormal compares as zero in both).
 *  - select and expand move bits only: no arithmetic, nothing to round.
 *  - There is no bfloat16 select: torch's bfloat16 threshold_backward computes in float and
 *    turns NaN gradients into 0xffff in its vectorised loop (not in its scalar tail), so Python
 *    gives it the expanded mask instead.
 *  - pool_compact and pool_expand are integer arithmetic, exact: pool.py's torch ops in one pass.
 *
 * The work is split over torch's own intra-op threads (at::parallel_for, torch's OpenMP
 * runtime), so it takes the cores plain PyTorch's ReLU would.  The source is x86-64 only (setup.py
 * builds it nowhere else), and Python calls nothing here unless offloadd_masks_vectorised() says
 * the CPU has AVX2 (elsewhere it keeps the torch-op path); the scalar loops finish each chunk's
 * tail.
 */
#include "kernels.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if !defined(__x86_64__)
#error "memsave's kernels are x86-64 only (setup.py does not build them elsewhere)"
#endif
#include <immintrin.h>

namespace {

constexpr int64_t kGrain = 1 << 15; /* elements; a multiple of 8: chunks own whole mask bytes */

inline float bf16_to_float(uint16_t v) {
  uint32_t b = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline bool predicate(float v, int pred) { return pred == 0 ? !(v <= 0.0f) : v > 0.0f; }

/* Runs body(begin, end) over [0, n) in chunks that start at multiples of 8 elements. */
template <typename F>
void over_bytes(int64_t n, F body) {
  int64_t bytes = (n + 7) / 8;
  at::parallel_for(0, bytes, kGrain / 8, [&](int64_t b, int64_t e) {
    body(b * 8, e * 8 < n ? e * 8 : n);
  });
}

/* ---- scalar: the tails of the AVX2 loops -------------------------------------------------- */

void relu_scalar(const float* x, float* out, uint8_t* bits, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += 8) {
    unsigned byte = 0;
    int64_t stop = i + 8 < end ? i + 8 : end;
    for (int64_t j = i; j < stop; ++j) {
      float a = x[j];
      float r = std::isnan(a) ? a : (a < 0.0f ? 0.0f : a); /* std::max(a, 0.f) keeps -0.0 */
      out[j] = r;
      byte |= static_cast<unsigned>(!(r <= 0.0f)) << (j - i);
    }
    bits[i / 8] = static_cast<uint8_t>(byte);
  }
}

void pack_scalar(const void* src, int dtype, int pred, uint8_t* bits, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += 8) {
    unsigned byte = 0;
    int64_t stop = i + 8 < end ? i + 8 : end;
    for (int64_t j = i; j < stop; ++j) {
      float v = dtype == 0 ? static_cast<const float*>(src)[j]
                           : bf16_to_float(static_cast<const uint16_t*>(src)[j]);
      byte |= static_cast<unsigned>(predicate(v, pred)) << (j - i);
    }
    bits[i / 8] = static_cast<uint8_t>(byte);
  }
}

/* out = bit ? src : 0, src[j] (select) or, broadcast, src[0] (expand: src is the one) */
template <typename T>
void mask_scalar(const T* src, bool broadcast, const uint8_t* bits, T* out, int64_t begin,
                 int64_t end) {
  for (int64_t j = begin; j < end; ++j)
    out[j] = (bits[j / 8] >> (j % 8)) & 1 ? src[broadcast ? 0 : j] : T(0);
}

/* ---- AVX2 ---------------------------------------------------------------------------------- */

/* 8 lanes of 32 bits, all ones where bit i of byte is set */
__attribute__((target("avx2"))) inline __m256i lanes32(unsigned byte) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256i b = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(byte)), sel);
  return _mm256_cmpeq_epi32(b, sel);
}

/* 16 lanes of 16 bits for two mask bytes */
__attribute__((target("avx2"))) inline __m256i lanes16(unsigned two) {
  const __m256i sel = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                        8192, 16384, static_cast<int16_t>(-32768));
  __m256i b = _mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(two)), sel);
  return _mm256_cmpeq_epi16(b, sel);
}

__attribute__((target("avx2"))) void relu_avx2(const float* x, float* out, uint8_t* bits,
                                                int64_t begin, int64_t end) {
  const __m256 zero = _mm256_setzero_ps();
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 r = _mm256_max_ps(zero, _mm256_loadu_ps(x + i)); /* torch's vectorised relu */
    _mm256_storeu_ps(out + i, r);
    bits[i / 8] = static_cast<uint8_t>(_mm256_movemask_ps(_mm256_cmp_ps(r, zero, _CMP_NLE_UQ)));
  }
  if (i < end) relu_scalar(x, out, bits, i, end);
}

__attribute__((target("avx2"))) void pack_avx2(const void* src, int dtype, int pred, uint8_t* bits,
                                               int64_t begin, int64_t end) {
  const __m256 zero = _mm256_setzero_ps();
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 v;
    if (dtype == 0) {
      v = _mm256_loadu_ps(static_cast<const float*>(src) + i);
    } else {
      __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
          static_cast<const uint16_t*>(src) + i));
      v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    __m256 m = pred == 0 ? _mm256_cmp_ps(v, zero, _CMP_NLE_UQ) : _mm256_cmp_ps(v, zero, _CMP_GT_OQ);
    bits[i / 8] = static_cast<uint8_t>(_mm256_movemask_ps(m));
  }
  if (i < end) pack_scalar(src, dtype, pred, bits, i, end);
}

__attribute__((target("avx2"))) void mask32_avx2(const uint32_t* src, bool broadcast,
                                                 const uint8_t* bits, uint32_t* out,
                                                 int64_t begin, int64_t end) {
  const __m256i one = _mm256_set1_epi32(static_cast<int>(src[0]));
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256i v = broadcast ? one : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm256_and_si256(v, lanes32(bits[i / 8])));
  }
  mask_scalar(src, broadcast, bits, out, i, end);
}

__attribute__((target("avx2"))) void expand16_avx2(const uint8_t* bits, uint16_t* out,
                                                   const uint16_t* one, int64_t begin,
                                                   int64_t end) {
  const __m256i ones = _mm256_set1_epi16(static_cast<int16_t>(*one));
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    unsigned two = bits[i / 8] | (static_cast<unsigned>(bits[i / 8 + 1]) << 8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm256_and_si256(ones, lanes16(two)));
  }
  mask_scalar(one, true, bits, out, i, end);
}

bool has_avx2() { return __builtin_cpu_supports("avx2"); }

/* ---- max pool window offsets ------------------------------------------------------------ */

/* a / d for 0 <= a < 2^50 and d >= 1, exact: a multiplication by the reciprocal in double, then
 * one correction step (the estimate is off by at most one); a hardware 64-bit division costs
 * tens of cycles, and there are five per index. */
struct Divider {
  int64_t d;
  double inv;
  explicit Divider(int64_t by = 1) : d(by), inv(1.0 / static_cast<double>(by)) {}
  inline int64_t operator()(int64_t a) const {
    if (d == 1) return a;
    int64_t q = static_cast<int64_t>(static_cast<double>(a) * inv);
    if (q * d > a) --q;
    else if ((q + 1) * d <= a) ++q;
    return q;
  }
};

/* A pool's geometry, 2d given as 3d with a depth of 1 (and 1d as 2d by the caller). */
struct Pool {
  int64_t in[3], out[3], k[3], s[3], p[3], d[3];
};

Pool read_pool(const int64_t* g) {
  Pool q;
  for (int i = 0; i < 3; ++i) {
    q.in[i] = g[i];
    q.out[i] = g[3 + i];
    q.k[i] = g[6 + i];
    q.s[i] = g[9 + i];
    q.p[i] = g[12 + i];
    q.d[i] = g[15 + i];
  }
  return q;
}

/* Calls body(first element, d0, h0) for each row of out[2] outputs, rows split over threads;
 * d0 and h0 are where the row's windows start in depth and height. */
template <typename F>
void over_rows(int64_t planes, const Pool& q, F body) {
  int64_t rows = planes * q.out[0] * q.out[1];
  int64_t grain = q.out[2] > 0 ? (kGrain + q.out[2] - 1) / q.out[2] : rows;
  at::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      int64_t oh = r % q.out[1], od = (r / q.out[1]) % q.out[0];
      body(r * q.out[2], od * q.s[0] - q.p[0], oh * q.s[1] - q.p[1]);
    }
  });
}

/* An index is a position in its input plane, so 0 <= i < in[0] * in[1] * in[2]; a window
 * offset's coordinate (position - window start) / dilation is >= 0 for a position inside the
 * window, which is where max pooling's indices point. */
template <typename O>
void compact(const int64_t* idx, O* off, int64_t planes, const Pool& q) {
  if (q.d[0] == 1 && q.d[1] == 1 && q.d[2] == 1 && q.k[1] <= q.in[1] && q.k[2] <= q.in[2]) {
    /* No dilation, windows no wider than the plane: an index's distance from its window's
     * first position is kd * hw + kh * w + kw with kh * w + kw < hw and kw < w, so kd and kh
     * are counted by k - 1 comparisons each (ResNet's 3x3 pool: none for kd, two for kh),
     * where the general path below divides five times. */
    over_rows(planes, q, [=](int64_t first, int64_t d0, int64_t h0) {
      const int64_t w = q.in[2], hw = q.in[1] * w, ow_n = q.out[2];
      const int64_t k0 = q.k[0], k1 = q.k[1], k2 = q.k[2];
      const int64_t row = (d0 * q.in[1] + h0) * w - q.p[2], s2 = q.s[2];
      const int64_t* __restrict in = idx + first;
      O* __restrict out = off + first;
      for (int64_t ow = 0; ow < ow_n; ++ow) {
        int64_t rest = in[ow] - (row + ow * s2), kd = 0, kh = 0;
        for (int64_t j = 1; j < k0; ++j) kd += rest >= j * hw; /* compares, not branches */
        rest -= kd * hw;
        for (int64_t j = 1; j < k1; ++j) kh += rest >= j * w;
        out[ow] = static_cast<O>((kd * k1 + kh) * k2 + rest - kh * w);
      }
    });
    return;
  }
  const Divider by_hw(q.in[1] * q.in[2]), by_w(q.in[2]), dil0(q.d[0]), dil1(q.d[1]), dil2(q.d[2]);
  /* by value: stores through O* (a char type for uint8) could alias the geometry otherwise */
  over_rows(planes, q, [=](int64_t first, int64_t d0, int64_t h0) {
    const int64_t w = q.in[2], hw = q.in[1] * w, ow_n = q.out[2], k1 = q.k[1], k2 = q.k[2];
    const int64_t s2 = q.s[2], p2 = q.p[2];
    const int64_t* __restrict in = idx + first;
    O* __restrict out = off + first;
    for (int64_t ow = 0; ow < ow_n; ++ow) {
      int64_t i = in[ow];
      int64_t id = by_hw(i), r = i - id * hw;
      int64_t ih = by_w(r), iw = r - ih * w;
      int64_t kd = dil0(id - d0), kh = dil1(ih - h0);
      int64_t kw = dil2(iw - (ow * s2 - p2));
      out[ow] = static_cast<O>((kd * k1 + kh) * k2 + kw);
    }
  });
}

template <typename O>
void expand_offsets(const O* off, int64_t* idx, int64_t planes, const Pool& q) {
  const int64_t volume = q.k[0] * q.k[1] * q.k[2];
  if (volume <= 4096) {
    /* An offset's index is its window's first position plus a distance that depends on the
     * offset alone: a table of them, one load and one add per index. */
    std::vector<int64_t> distances(static_cast<size_t>(volume));
    for (int64_t kd = 0; kd < q.k[0]; ++kd)
      for (int64_t kh = 0; kh < q.k[1]; ++kh)
        for (int64_t kw = 0; kw < q.k[2]; ++kw)
          distances[(kd * q.k[1] + kh) * q.k[2] + kw] =
              (kd * q.d[0] * q.in[1] + kh * q.d[1]) * q.in[2] + kw * q.d[2];
    const int64_t* table = distances.data();
    over_rows(planes, q, [=](int64_t first, int64_t d0, int64_t h0) {
      const int64_t row = (d0 * q.in[1] + h0) * q.in[2] - q.p[2], s2 = q.s[2], ow_n = q.out[2];
      const O* __restrict in = off + first;
      int64_t* __restrict out = idx + first;
      for (int64_t ow = 0; ow < ow_n; ++ow) out[ow] = row + ow * s2 + table[in[ow]];
    });
    return;
  }
  const Divider by_khw(q.k[1] * q.k[2]), by_kw(q.k[2]);
  over_rows(planes, q, [=](int64_t first, int64_t d0, int64_t h0) {
    const int64_t khw = q.k[1] * q.k[2], k2 = q.k[2], ow_n = q.out[2];
    const int64_t dd = q.d[0], dh = q.d[1], dw = q.d[2], s2 = q.s[2], p2 = q.p[2];
    const int64_t h = q.in[1], w = q.in[2];
    const O* __restrict in = off + first;
    int64_t* __restrict out = idx + first;
    for (int64_t ow = 0; ow < ow_n; ++ow) {
      int64_t o = static_cast<int64_t>(in[ow]);
      int64_t kd = by_khw(o), rest = o - kd * khw;
      int64_t kh = by_kw(rest), kw = rest - kh * k2;
      int64_t id = d0 + kd * dd, ih = h0 + kh * dh;
      int64_t iw = ow * s2 - p2 + kw * dw;
      out[ow] = (id * h + ih) * w + iw;
    }
  });
}

}  // namespace

extern "C" {

int offloadd_masks_vectorised(void) { return has_avx2() ? 1 : 0; }

void offloadd_masks_relu_f32(intptr_t x, intptr_t out, intptr_t bits, int64_t n) {
  auto* px = reinterpret_cast<const float*>(x);
  auto* po = reinterpret_cast<float*>(out);
  auto* pb = reinterpret_cast<uint8_t*>(bits);
  over_bytes(n, [&](int64_t b, int64_t e) { relu_avx2(px, po, pb, b, e); });
}

void offloadd_masks_pack(intptr_t src, int dtype, int pred, intptr_t bits, int64_t n) {
  auto* ps = reinterpret_cast<const void*>(src);
  auto* pb = reinterpret_cast<uint8_t*>(bits);
  over_bytes(n, [&](int64_t b, int64_t e) { pack_avx2(ps, dtype, pred, pb, b, e); });
}

void offloadd_masks_select_f32(intptr_t grad, intptr_t bits, intptr_t out, int64_t n) {
  auto* g = reinterpret_cast<const uint32_t*>(grad);
  auto* pb = reinterpret_cast<const uint8_t*>(bits);
  auto* o = reinterpret_cast<uint32_t*>(out);
  over_bytes(n, [&](int64_t b, int64_t e) { mask32_avx2(g, false, pb, o, b, e); });
}

void offloadd_masks_expand(intptr_t bits, intptr_t out, int64_t n, int dtype) {
  auto* pb = reinterpret_cast<const uint8_t*>(bits);
  over_bytes(n, [&](int64_t b, int64_t e) {
    if (dtype == 0) {
      auto* o = reinterpret_cast<uint32_t*>(out);
      const uint32_t one = 0x3f800000u; /* 1.0f */
      mask32_avx2(&one, true, pb, o, b, e);
    } else {
      auto* o = reinterpret_cast<uint16_t*>(out);
      const uint16_t one = 0x3f80u; /* 1.0 in bfloat16 */
      expand16_avx2(pb, o, &one, b, e);
    }
  });
}

/* geometry: in[3], out[3], kernel[3], stride[3], padding[3], dilation[3]; otype 0 uint8, 1 int16,
 * 2 int32 (the offsets' dtype) */
void offloadd_pool_compact(intptr_t indices, intptr_t offsets, int otype, int64_t planes,
                           intptr_t geometry) {
  Pool q = read_pool(reinterpret_cast<const int64_t*>(geometry));
  auto* idx = reinterpret_cast<const int64_t*>(indices);
  if (otype == 0) compact(idx, reinterpret_cast<uint8_t*>(offsets), planes, q);
  else if (otype == 1) compact(idx, reinterpret_cast<int16_t*>(offsets), planes, q);
  else compact(idx, reinterpret_cast<int32_t*>(offsets), planes, q);
}

void offloadd_pool_expand(intptr_t offsets, intptr_t indices, int otype, int64_t planes,
                          intptr_t geometry) {
  Pool q = read_pool(reinterpret_cast<const int64_t*>(geometry));
  auto* idx = reinterpret_cast<int64_t*>(indices);
  if (otype == 0) expand_offsets(reinterpret_cast<const uint8_t*>(offsets), idx, planes, q);
  else if (otype == 1) expand_offsets(reinterpret_cast<const int16_t*>(offsets), idx, planes, q);
  else expand_offsets(reinterpret_cast<const int32_t*>(offsets), idx, planes, q);
}

}  /* extern "C" */
