// Shared by the weight-streaming linear kernels (quant_matmul.cpp: the 8-bit layout; lowbit_matmul.cpp:
// GGUF's 4-, 5- and 6-bit types): out [M, N] = x [M, K] @ W^T for few rows M (decode), W held per run of
// 32 values along K with a scale per run (or per 16) and, optionally, an offset per run.
//
// AVX-512 (where the compiler targets it): a run's 32 values become two vectors of 16 floats, half the
// conversions and multiply-adds of AVX2's four vectors of 8; the activations stay float32, so the
// results are the float model's within float rounding. (Integer activations, llama.cpp's way, were
// measured too: int16 per run of 32 took 25-45% off a batch-1 kernel call, but its rounding, 2^-16 of a
// run's largest activation, moved a tiny model's logits by 1e-4 to 9e-4, past the 1e-4 the greedy tests
// hold the packed model to; 8 bits flipped the default model's greedy tokens.)
//
// Rows are grouped by 8 (the weights decoded once per group, the conversion shared by its rows); more
// than one group shares 16-weight-row tiles from cache.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDKV_GEMV_AVX2 1
#endif

namespace pagedkv_gemv {

constexpr int64_t QK = 32;         // values per run (GGUF's block of 32)
constexpr int64_t GEMV_TILE = 16;  // weight rows per tile when several row groups share them

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
inline __m256 to8(__m256 v) { return v; }

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
template <int MR>
inline void finish_row(Acc (&wide)[MR], const float* o, const float* xs, int64_t nb, int64_t m0, float* out,
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
#endif

}  // namespace pagedkv_gemv
