// Shared by the weight-streaming linear kernels (quant_matmul.cpp: the 8-bit layout; lowbit_matmul.cpp:
// GGUF's 4-, 5- and 6-bit types): out [M, N] = x [M, K] @ W^T for few rows M (decode), W held per run of
// 32 values along K with a scale per run (or per 16) and, optionally, an offset per run.
//
// AVX-512 (where the compiler targets it): a run's 32 values become two vectors of 16 floats, half the
// conversions and multiply-adds of AVX2's four vectors of 8.
//
// Integer activations (lowbit_matmul.cpp at up to INT_ROWS_MAX rows: batch-1 decode; llama.cpp's way,
// at 16 bits rather than its 8): each row of x is quantized once per call to int16 with a float scale
// per run of 32, dx = absmax / 32767 and q = round(x / dx), and a run's weight values (int16 lanes)
// are multiplied with them by integer dot products (AVX-VNNI's `vpdpwssd`, else `madd_epi16`, in
// 256-bit registers: three vector ports where 512-bit work has two), two accumulators a row so a
// run's multiply-add need not wait on the previous one's. The only error is the rounding of x,
// |x - dx q| <= dx / 2, so
//
//     |out[m, n] - (x W^T)[m, n]| <= sum over runs b of dx[m, b] / 2 * sum_{k in b} |W[n, k] - offset[n, b]|
//
// plus float rounding (pagedkv_testing/activation_rounding.py checks it): 2^-16 of a run's largest
// activation per unit of weight (8 bits, 2^-8, flipped the default model's greedy tokens). The
// offsets take the exact float run sums of x. Measured per run of 32 weights, in cache, one thread
// (float -> integer): Q4_1's u4 2.1 -> 1.7 ns, Q4_0's i4 2.4 -> 1.7, u5 3.3 -> 2.7, Q6_K's i6 4.0 -> 3.3
// at one row, 10-20% less at two, even at three, more beyond (the float path's conversion of the weights is
// shared by 8 rows): more rows keep float activations, the float model's results within float
// rounding. The 8-bit layout (quant_matmul.cpp) keeps float activations: 1.59 -> 1.55 ns at one row,
// slower at two.

// Rows are grouped by 8 (the weights decoded once per group, the conversion shared by its rows); more
// than one group shares 16-weight-row tiles from cache.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDKV_GEMV_AVX2 1
#endif

namespace pagedkv_gemv {

constexpr int64_t QK = 32;         // values per run (GGUF's block of 32)
constexpr int64_t GEMV_TILE = 16;  // weight rows per tile when several row groups share them
constexpr int64_t INT_ROWS_MAX = 2;  // rows that take integer activations (the file comment)

// Each weight row's streams (codes, scales, offsets) are short (a few hundred bytes), too short for the
// hardware prefetcher to run far enough ahead: the kernels prefetch the row PREFETCH_ROWS ahead. Out of
// cache at one row that took half off the 8-bit layout's call (12288 x 576: 0.8-1.0 -> 0.4 ms; the
// default model's LM head) and 10-40% off the low-bit ones (Q4_1's u4 576 x 1536: 75-90 -> 57-72 us);
// 8 and 32 rows within noise.
constexpr int64_t PREFETCH_ROWS = 4;

inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i);
}

// xs [M, K / 32] = the sums of x's runs of 32
inline void run_sums(const float* x, float* xs, int64_t M, int64_t K) {
  for (int64_t j = 0; j < M * (K / QK); ++j) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < QK; ++i) s += x[j * QK + i];
    xs[j] = s;
  }
}

// Calls rows(std::integral_constant<int, MR>{}, m0, t0, t1) for the groups of up to 8 rows m0 .. m0 + MR - 1
// over weight rows t0 .. t1 - 1 covering n0 .. n1 - 1: one group (M <= 8) streams its whole range in one
// call (a tile loop around a single group made the LM head 30% slower at one row); several groups run
// over one GEMV_TILE tile before the next is read, so it is streamed from memory once and re-read from
// cache by the others (a decode batch, or a decode verifying speculative tokens).
template <typename Rows>
inline void row_groups(int64_t M, int64_t n0, int64_t n1, Rows&& rows) {
  const int64_t tile = M <= 8 ? n1 - n0 : GEMV_TILE;
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(n1, t0 + tile);
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      switch (std::min<int64_t>(8, M - m0)) {
        case 1: rows(std::integral_constant<int, 1>{}, m0, t0, t1); break;
        case 2: rows(std::integral_constant<int, 2>{}, m0, t0, t1); break;
        case 3: rows(std::integral_constant<int, 3>{}, m0, t0, t1); break;
        case 4: rows(std::integral_constant<int, 4>{}, m0, t0, t1); break;
        case 5: rows(std::integral_constant<int, 5>{}, m0, t0, t1); break;
        case 6: rows(std::integral_constant<int, 6>{}, m0, t0, t1); break;
        case 7: rows(std::integral_constant<int, 7>{}, m0, t0, t1); break;
        default: rows(std::integral_constant<int, 8>{}, m0, t0, t1); break;
      }
    }
  }
}

#ifdef PAGEDKV_GEMV_AVX2
inline __m256 to8(__m256 v) { return v; }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#ifdef __AVX512F__
#define PAGEDKV_GEMV_AVX512 1
using Acc = __m512;  // a row's accumulator: 16 float lanes with AVX-512, else 8
inline Acc acc_zero() { return _mm512_setzero_ps(); }
inline __m256 to8(__m512 v) {  // the pairwise sums of the 16 lanes
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// acc[r] += (lo . x[m0 + r, 0..15]) * d0 + (hi . x[m0 + r, 16..31]) * d1, x at xb + r * K: one run of 32
// as two vectors of 16 floats (SPLIT: two scales, else d0 alone)
template <int MR, bool SPLIT>
inline void dot_run(__m512 (&acc)[MR], __m512 lo, __m512 hi, __m512 d0, __m512 d1, const float* xb, int64_t K) {
  for (int r = 0; r < MR; ++r) {
    const __m512 s0 = _mm512_mul_ps(lo, _mm512_loadu_ps(xb + r * K));
    if constexpr (SPLIT) {
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(hi, _mm512_loadu_ps(xb + r * K + 16)), d1, _mm512_fmadd_ps(s0, d0, acc[r]));
    } else {
      acc[r] = _mm512_fmadd_ps(_mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + r * K + 16), s0), d0, acc[r]);
    }
  }
}
#else
using Acc = __m256;
inline Acc acc_zero() { return _mm256_setzero_ps(); }

// the same with a run as four vectors of 8 floats (values 0..7, .., 24..31; SPLIT: d0 for the first 16)
template <int MR, bool SPLIT>
inline void dot_run(__m256 (&acc)[MR], __m256 w0, __m256 w1, __m256 w2, __m256 w3, __m256 d0, __m256 d1,
                    const float* xb, int64_t K) {
  for (int r = 0; r < MR; ++r) {
    const float* x = xb + r * K;
    __m256 s = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), _mm256_mul_ps(w0, _mm256_loadu_ps(x)));
    if constexpr (SPLIT) {
      const __m256 s1 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), _mm256_mul_ps(w2, _mm256_loadu_ps(x + 16)));
      acc[r] = _mm256_fmadd_ps(s1, d1, _mm256_fmadd_ps(s, d0, acc[r]));
    } else {
      s = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 16), s));
      acc[r] = _mm256_fmadd_ps(s, d0, acc[r]);
    }
  }
}
#endif

// out[m0 + r, n] = the sum of acc[r] + sum_b o[b] * xs[m0 + r, b], xs [M, nb] x's run sums (8 runs at a
// time into the same lanes; o null: no offsets)
template <int MR, typename A>
inline void finish_row(A (&wide)[MR], const float* o, const float* xs, int64_t nb, int64_t m0, float* out,
                       int64_t N, int64_t n) {
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = to8(wide[r]);
  if (o != nullptr) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t b = 0; b < nb; b += 8) {
      const int left = static_cast<int>(std::min<int64_t>(8, nb - b));
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(left), lane);  // lanes < left
      const __m256 ov = _mm256_maskload_ps(o + b, mask);
      for (int r = 0; r < MR; ++r)
        acc[r] = _mm256_fmadd_ps(ov, _mm256_maskload_ps(xs + (m0 + r) * nb + b, mask), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) out[(m0 + r) * N + n] = hsum(acc[r]);
}

// x [M, K] quantized per run (the file comment): q [M, K] int16, d [M, K / 32] the runs' scales. A run
// with a NaN or infinity gets a NaN scale (the outputs it feeds are NaN, as in float); one whose
// largest value is below 1e-30 is taken as zeros (an error of at most 1e-30 a value, where 32767 / absmax
// would overflow).
struct QuantizedRows {
  std::vector<int16_t> q;
  std::vector<float> d;
  int64_t K = 0, nb = 0;

  QuantizedRows(const float* x, int64_t M, int64_t K_) : q(M * K_), d(M * (K_ / QK)), K(K_), nb(K_ / QK) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t j = 0; j < M * nb; ++j) {
      const float* xb = x + j * QK;
      const __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
      const __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
      const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
      const __m256 nan = _mm256_or_ps(_mm256_cmp_ps(v0, v1, _CMP_UNORD_Q), _mm256_cmp_ps(v2, v3, _CMP_UNORD_Q));
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      m = _mm_max_ss(m, _mm_movehdup_ps(m));
      const float amax = _mm_cvtss_f32(m);
      const bool finite = _mm256_movemask_ps(nan) == 0 && std::isfinite(amax);
      const bool zeros = !finite || !(amax >= 1e-30f);
      d[j] = finite ? (zeros ? 0.f : amax / 32767.f) : __builtin_nanf("");
      // |x| * 32767 / absmax rounds to at most 32767 (packs saturates in any case)
      const __m256 inv = _mm256_set1_ps(zeros ? 0.f : 32767.f / amax);
      const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
      const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
      // packs interleaves the 128-bit halves: the permute puts the values back in order
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + j * QK),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q.data() + j * QK + 16),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xD8));
    }
  }
};

// a run's 32 weight values as int16 lanes: lo values 0..15, hi 16..31 (256-bit integer work: three
// vector ports on recent x86 cores where 512-bit work has two)
struct Codes {
  __m256i lo, hi;
};

// int32 lanes += the pairwise products of w's and x's 16 int16 lanes
inline __m256i dot16(__m256i acc, __m256i w, const int16_t* x) {
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
#ifdef __AVXVNNI__
  return _mm256_dpwssd_avx_epi32(acc, w, xv);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, xv));
#endif
}

// acc[r] += dot(w, x's run) * dx * scale, x's run at xb + r * K, its scale dx at dxb[r * nb]: d[0] for
// values 0..15, d[1] for 16..31 (SPLIT)
template <int MR, bool SPLIT>
inline void dot_run_int(__m256 (&acc)[MR], Codes w, const float* d, const int16_t* xb0, const float* dxb, int64_t K,
                        int64_t nb) {
  const __m256 d0 = _mm256_broadcast_ss(d), d1 = _mm256_broadcast_ss(d + (SPLIT ? 1 : 0));
  for (int r = 0; r < MR; ++r) {
    const int16_t* xb = xb0 + r * K;
    const __m256 dx = _mm256_broadcast_ss(dxb + r * nb);
    if constexpr (SPLIT) {
      const __m256i plo = dot16(_mm256_setzero_si256(), w.lo, xb), phi = dot16(_mm256_setzero_si256(), w.hi, xb + 16);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(plo), _mm256_mul_ps(d0, dx), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(phi), _mm256_mul_ps(d1, dx), acc[r]);
    } else {
      const __m256i p = dot16(dot16(_mm256_setzero_si256(), w.lo, xb), w.hi, xb + 16);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(d0, dx), acc[r]);
    }
  }
}

// out[m0 + r, n] for one weight row n, integer activations: run(b) gives run b's values, d the row's
// scales (two a run with SPLIT), o its offsets or null. One or two rows take two accumulators each:
// a run's multiply-add would wait on the previous one's otherwise (its latency, not the ports, bounds
// a batch-1 call then).
template <int MR, bool SPLIT, typename Run>
inline void int_row(Run&& run, const float* d, const float* o, const QuantizedRows& xq, const float* xs, int64_t m0,
                    float* out, int64_t N, int64_t n) {
  constexpr int U = MR <= 2 ? 2 : 1;
  __m256 acc[U][MR];
  for (int u = 0; u < U; ++u)
    for (int r = 0; r < MR; ++r) acc[u][r] = _mm256_setzero_ps();
  const int64_t K = xq.K, nb = xq.nb, ds = SPLIT ? 2 : 1;
  const int16_t* x = xq.q.data() + m0 * K;
  const float* dx = xq.d.data() + m0 * nb;
  int64_t b = 0;
  for (; b + U <= nb; b += U)
    for (int u = 0; u < U; ++u)
      dot_run_int<MR, SPLIT>(acc[u], run(b + u), d + (b + u) * ds, x + (b + u) * QK, dx + b + u, K, nb);
  for (; b < nb; ++b) dot_run_int<MR, SPLIT>(acc[0], run(b), d + b * ds, x + b * QK, dx + b, K, nb);
  for (int u = 1; u < U; ++u)
    for (int r = 0; r < MR; ++r) acc[0][r] = _mm256_add_ps(acc[0][r], acc[u][r]);
  finish_row<MR>(acc[0], o, xs, nb, m0, out, N, n);
}
#endif

}  // namespace pagedkv_gemv
