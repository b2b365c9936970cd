// Vector helpers of the attention kernels (csrc/paged_attention.cpp, csrc/cascade_attention.cpp;
// fused_ops.cpp's SiLU takes exp256), one copy for all: Vec<S>::load (8 stored values of a block
// format -> 8 floats), exp256 (and exp512 where the core has AVX-512), reduce8, hsum, and
// attend_rows (the online-softmax loops over one chunk of K/V rows). Include it at file scope (not
// inside an anonymous namespace): everything here is inline, in namespace pagedkv_simd.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDKV_SIMD_AVX2 1
#if defined(__AVX512F__)
#define PAGEDKV_SIMD_AVX512 1
#endif

namespace pagedkv_simd {

// Vec<S>::load: 8 stored values -> 8 floats (times 1/unit: fp8 e4m3 goes through float16 with its
// exponent bias off by 8, so its loads are 2^-8 of the value and its scales carry unit = 256).
template <typename S>
struct Vec {
  static constexpr bool ok = false;
};
template <>
struct Vec<float> {
  static constexpr bool ok = true;
  static constexpr float unit = 1.f;
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
};
template <>
struct Vec<c10::BFloat16> {
  static constexpr bool ok = true;
  static constexpr float unit = 1.f;
  static __m256 load(const c10::BFloat16* p) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
  }
};
template <>
struct Vec<int8_t> {
  static constexpr bool ok = true;
  static constexpr float unit = 1.f;
  static __m256 load(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
};
#ifdef __F16C__
template <>
struct Vec<c10::Half> {
  static constexpr bool ok = true;
  static constexpr float unit = 1.f;
  static __m256 load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
};
template <>
struct Vec<c10::Float8_e5m2> {  // e5m2 is the top byte of a float16
  static constexpr bool ok = true;
  static constexpr float unit = 1.f;
  static __m256 load(const c10::Float8_e5m2* p) {
    const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_cvtph_ps(_mm_slli_epi16(x, 8));
  }
};
template <>
struct Vec<c10::Float8_e4m3fn> {  // s.eeee.mmm -> float16 s.0eeee.mmm0000000 = value * 2^-8
  static constexpr bool ok = true;  // (subnormals included; the NaN code is never stored)
  static constexpr float unit = 256.f;
  static __m256 load(const c10::Float8_e4m3fn* p) {
    const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i mag = _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7F)), 7);
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8);
    return _mm256_cvtph_ps(_mm_or_si128(mag, sign));
  }
};
#endif

// e^x for x <= 0 (Cephes' polynomial; relative error ~1e-7); very negative x gives 0.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

// [sum(a[0]), ..., sum(a[7])]
inline __m256 reduce8(const __m256* a) {
  __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

inline float hsum(__m256 v) {
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  return ((tmp[0] + tmp[1]) + (tmp[2] + tmp[3])) + ((tmp[4] + tmp[5]) + (tmp[6] + tmp[7]));
}

#ifdef PAGEDKV_SIMD_AVX512
// exp256's polynomial 16 lanes wide (the same operations lane by lane, so the same values).
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f));
  __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(n));
}
#endif

constexpr int CHUNK = 64;

// The vector paths' inner loops (paged_attention.cpp's attend_vec and attend_vec_mixed, cascade_attention.cpp's
// attend_vec) over one chunk [c0, c1) of the context whose K and V rows (as floats, block scales folded
// in) are kp[t - c0] and vp[t - c0]: scores, online softmax and the V sum of every (row, query head) of
// the tile. qs: the tile's scaled queries [nr * group][D];
// acc/m/l: the online-softmax state per (row, query head).
template <int D>
__attribute__((always_inline)) inline void attend_rows(const float* qs, const int64_t* row_start,
                                                       const int64_t* row_end, int64_t nr, int64_t group,
                                                       int64_t c0, int64_t c1, const float* const* kp,
                                                       const float* const* vp, float* acc, float* m, float* l,
                                                       float cap) {
  constexpr int NV = D / 8;
  alignas(32) float p[CHUNK];
  for (int64_t i = 0; i < nr; ++i) {
    const int64_t a = std::max(c0, row_start[i]), e = std::min(c1, row_end[i]);
    if (e <= a) continue;
    const int64_t n = e - a;
    const float* const* kr = kp + (a - c0);
    const float* const* vr = vp + (a - c0);
    for (int64_t g = 0; g < group; ++g) {
      const int64_t j = i * group + g;
      const float* qj = qs + j * D;
      int64_t t = 0;
      for (; t + 8 <= n; t += 8) {
        __m256 s[8];
        for (int u = 0; u < 8; ++u) s[u] = _mm256_setzero_ps();
        for (int v = 0; v < NV; ++v) {
          const __m256 qv = _mm256_loadu_ps(qj + 8 * v);
          for (int u = 0; u < 8; ++u) s[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[t + u] + 8 * v), s[u]);
        }
        _mm256_store_ps(p + t, reduce8(s));
      }
      for (; t < n; ++t) {
        __m256 s = _mm256_setzero_ps();
        for (int v = 0; v < NV; ++v) s = _mm256_fmadd_ps(_mm256_loadu_ps(qj + 8 * v), _mm256_loadu_ps(kr[t] + 8 * v), s);
        p[t] = hsum(s);
      }
      if (cap > 0.f) {  // Gemma 2's soft-cap on the scores: cap * tanh(score / cap)
        for (t = 0; t < n; ++t) p[t] = cap * std::tanh(p[t] / cap);
      }
      float mb = m[j];
      {  // the chunk's max, 8 lanes at a time (a scalar max is a 4-cycle dependency chain per token)
        __m256 mx = _mm256_set1_ps(mb);
        for (t = 0; t + 8 <= n; t += 8) mx = _mm256_max_ps(mx, _mm256_load_ps(p + t));
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, mx);
        for (int u = 0; u < 8; ++u) mb = std::max(mb, lanes[u]);
        for (; t < n; ++t) mb = std::max(mb, p[t]);
      }
      const float corr = std::exp(m[j] - mb);
      const __m256 mv = _mm256_set1_ps(mb);
      __m256 sumv = _mm256_setzero_ps();
      t = 0;
      for (; t + 8 <= n; t += 8) {
        const __m256 ev = exp256(_mm256_sub_ps(_mm256_load_ps(p + t), mv));
        _mm256_store_ps(p + t, ev);
        sumv = _mm256_add_ps(sumv, ev);
      }
      float sum = hsum(sumv);
      for (; t < n; ++t) {
        p[t] = std::exp(p[t] - mb);
        sum += p[t];
      }
      float* aj = acc + j * D;
      __m256 av[NV];
      const __m256 cv = _mm256_set1_ps(corr);
      for (int v = 0; v < NV; ++v) av[v] = _mm256_mul_ps(_mm256_loadu_ps(aj + 8 * v), cv);
      for (t = 0; t < n; ++t) {
        const __m256 pv = _mm256_set1_ps(p[t]);
        const float* vrow = vr[t];
        for (int v = 0; v < NV; ++v) av[v] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vrow + 8 * v), av[v]);
      }
      for (int v = 0; v < NV; ++v) _mm256_storeu_ps(aj + 8 * v, av[v]);
      l[j] = l[j] * corr + sum;
      m[j] = mb;
    }
  }
}

}  // namespace pagedkv_simd

#endif
