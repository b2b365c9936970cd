// Linear layers over GGUF weights kept at their own width (4, 5 or 6 bits): out [M, N] = x [M, K] @ W^T,
// W [N, K] held per run of 32 values along K as (pagedkv/weight_quant.py, LowBitFormat):
//
//     nibbles [N, K / 2] uint8    16 bytes a run: byte i holds value i (low half), i + 16 (high)
//     planes  [N, K / 8 * P]      P = 0, 1, 2 bit planes of 4 bytes a run: bit j is value j's bit 4 + p
//     scales  [N, K / G] float32  G = 32, or 16 (Q6_K)
//     offsets [N, K / 32] float32 or none
//     W[n, k] = scale * v + offset,  v = lut[nibble] (IQ4_NL) or (nibble | planes << 4) - zero
//
// The offsets cost no work per weight (as in quant_matmul.cpp): per run of 32,
// sum_k W x = scale * dot(v, x) + offset * sum(x), the run sums of x taken once per call.
//
// Few rows (decode): the weights are streamed once per group of up to 8 rows. One or two rows
// (INT_ROWS_MAX) take integer activations (gemv_common.h: x quantized to int16 per run of 32 once per
// call, an error of at most half a step, 2^-16 of a run's largest value): a run's 32 codes widened
// to two vectors of 16 int16 lanes (4-bit runs: the 16 bytes zero-extended once, the high nibbles
// shifted down) and multiplied by integer dot products. More rows keep float activations: a run's codes are
// converted to floats shared by the rows (two vectors of 16 with AVX-512, else four of 8):
// Q4_0/Q4_1/Q4_K runs zero-extend their 16 bytes to 32-bit lanes and mask / shift the nibbles there
// (one shuffle a run with AVX-512, two with AVX2, where splitting a byte register takes eight);
// IQ4_NL and the 5- and 6-bit runs unpack to bytes first (a byte shuffle looks
// up IQ4_NL's grid; the bit planes are spread over bytes with a shuffle and a compare; one byte
// subtraction applies the zero), then sign-extend.
// Many rows (prefill, large batches): tiles of 256 weight rows are dequantized into a float32
// buffer and multiplied by the BLAS matmul, as for the 8-bit layout.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "gemv_common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDKV_LB_AVX2 1
#endif

namespace {

using namespace pagedkv_gemv;

constexpr int64_t ROWS_PER_THREAD = 16;  // the same split as the 8-bit kernel (quant_matmul.cpp)
constexpr int64_t ROWS_MAX = 32;
constexpr int64_t TILE_N = 256;

struct Lb {
  const float* x;        // [M, K]
  const uint8_t* q;      // [N, K / 2]
  const uint8_t* pl;     // [N, K / 8 * P] or null
  const float* d;        // [N, K / G]
  const float* o;        // [N, K / 32] or null
  const float* xs;       // [M, K / 32] run sums of x, or null
  const int8_t* lut;     // [16] or null
  float* out;            // [M, N]
  int64_t M, K, N;
  int P, G, zero;
};

// the 32 int8 values of run b of row n (portable)
inline void decode_scalar(const Lb& g, int64_t n, int64_t b, int8_t* v) {
  const uint8_t* qb = g.q + n * (g.K / 2) + b * 16;
  const uint8_t* pb = g.pl != nullptr ? g.pl + n * (g.K / 8 * g.P) + b * 4 * g.P : nullptr;
  for (int i = 0; i < QK; ++i) {
    int code = i < 16 ? (qb[i] & 0x0F) : (qb[i - 16] >> 4);
    if (g.lut != nullptr) {
      v[i] = g.lut[code];
      continue;
    }
    for (int p = 0; p < g.P; ++p) code |= ((pb[4 * p + i / 8] >> (i % 8)) & 1) << (4 + p);
    v[i] = static_cast<int8_t>(code - g.zero);
  }
}

#ifdef PAGEDKV_LB_AVX2
// 32 bits (4 bytes, little-endian) -> 32 bytes, 0xFF where the bit is set
inline __m256i bits_to_bytes(const uint8_t* p) {
  uint32_t x32;
  std::memcpy(&x32, p, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x32)), shuf);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

// the 32 int8 values of a run: 16 bytes of nibbles, P planes of 4 bytes
template <int P, bool LUT>
inline __m256i decode32(const uint8_t* qb, const uint8_t* pb, __m256i lut, __m256i zero) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qb));
  __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
  if constexpr (LUT) return _mm256_shuffle_epi8(lut, v);
  if constexpr (P >= 1) v = _mm256_or_si256(v, _mm256_and_si256(bits_to_bytes(pb), _mm256_set1_epi8(0x10)));
  if constexpr (P >= 2) v = _mm256_or_si256(v, _mm256_and_si256(bits_to_bytes(pb + 4), _mm256_set1_epi8(0x20)));
  return _mm256_sub_epi8(v, zero);
}

inline void widen(__m256i v, __m256& w0, __m256& w1, __m256& w2, __m256& w3) {
  const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

// A 4-bit run without a lookup (i4, u4) straight to floats: the 16 bytes zero-extended to 32-bit
// lanes (two shuffles for the 32 values, where splitting a byte register takes eight), then the low
// nibbles masked and the high ones shifted down.
template <bool ZERO>
inline void widen_nibbles(const uint8_t* qb, __m256i zero, __m256& w0, __m256& w1, __m256& w2, __m256& w3) {
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8)));
  const __m256i m = _mm256_set1_epi32(0x0F);
  __m256i v0 = _mm256_and_si256(a, m), v1 = _mm256_and_si256(b, m);  // values 0..7, 8..15
  __m256i v2 = _mm256_srli_epi32(a, 4), v3 = _mm256_srli_epi32(b, 4);  // values 16..23, 24..31
  if constexpr (ZERO) {
    v0 = _mm256_sub_epi32(v0, zero);
    v1 = _mm256_sub_epi32(v1, zero);
    v2 = _mm256_sub_epi32(v2, zero);
    v3 = _mm256_sub_epi32(v3, zero);
  }
  w0 = _mm256_cvtepi32_ps(v0);
  w1 = _mm256_cvtepi32_ps(v1);
  w2 = _mm256_cvtepi32_ps(v2);
  w3 = _mm256_cvtepi32_ps(v3);
}

inline __m256i lut_vector(const int8_t* lut) {
  if (lut == nullptr) return _mm256_setzero_si256();
  const __m128i l = _mm_loadu_si128(reinterpret_cast<const __m128i*>(lut));
  return _mm256_set_m128i(l, l);
}

#ifdef PAGEDKV_GEMV_AVX512
// a run's 32 values as two vectors of 16 floats (values 0..15, 16..31): 4-bit runs zero-extend their 16
// bytes to 32-bit lanes (one shuffle) and mask / shift the nibbles there, the others decode to bytes
template <int P, bool LUT, bool NIB, bool ZERO>
inline void widen16(const uint8_t* qb, const uint8_t* pb, __m256i lut, __m256i zero, __m512& lo, __m512& hi) {
  if constexpr (NIB) {
    const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb)));
    __m512i vl = _mm512_and_si512(a, _mm512_set1_epi32(0x0F)), vh = _mm512_srli_epi32(a, 4);
    if constexpr (ZERO) {
      const __m512i z = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(zero));
      vl = _mm512_sub_epi32(vl, z);
      vh = _mm512_sub_epi32(vh, z);
    }
    lo = _mm512_cvtepi32_ps(vl);
    hi = _mm512_cvtepi32_ps(vh);
  } else {
    const __m256i v = decode32<P, LUT>(qb, pb, lut, zero);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
  }
}
#endif

// weight row n's streams into the cache (gemv_common.h: PREFETCH_ROWS), if it is below n1
inline void prefetch_row(const Lb& g, int64_t n, int64_t n1) {
  if (n >= n1) return;
  const int64_t nb = g.K / QK;
  prefetch(g.q + n * (g.K / 2), g.K / 2);
  if (g.pl != nullptr) prefetch(g.pl + n * (g.K / 8 * g.P), g.K / 8 * g.P);
  prefetch(g.d + n * (g.K / g.G), g.K / g.G * 4);
  if (g.o != nullptr) prefetch(g.o + n * nb, nb * 4);
}

// a run's 32 values as int16 lanes (integer activations)
template <int P, bool LUT, bool NIB, bool ZERO>
inline Codes codes(const uint8_t* qb, const uint8_t* pb, __m256i lut, __m256i zero) {
  if constexpr (NIB) {  // byte i: value i (low nibble), i + 16 (high), zero-extended to 16-bit lanes
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb)));
    Codes c{_mm256_and_si256(v, _mm256_set1_epi16(0x0F)), _mm256_srli_epi16(v, 4)};
    if constexpr (ZERO) {
      const __m256i z = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(zero));
      c.lo = _mm256_sub_epi16(c.lo, z);
      c.hi = _mm256_sub_epi16(c.hi, z);
    }
    return c;
  }
  const __m256i v = decode32<P, LUT>(qb, pb, lut, zero);
  return Codes{_mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1))};
}

// the same with integer activations (xq: x quantized)
template <int MR, int P, bool LUT, bool G16, bool NIB, bool ZERO>
void gemv_rows_int(const Lb& g, const QuantizedRows& xq, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t K = g.K, nb = K / QK, qrow = K / 2, prow = K / 8 * P, drow = K / (G16 ? 16 : 32);
  const __m256i lut = lut_vector(g.lut), zero = _mm256_set1_epi8(static_cast<char>(g.zero));
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qn = g.q + n * qrow;
    const uint8_t* pn = P > 0 ? g.pl + n * prow : nullptr;
    prefetch_row(g, n + PREFETCH_ROWS, n1);
    const auto run = [&](int64_t b) { return codes<P, LUT, NIB, ZERO>(qn + b * 16, P > 0 ? pn + b * 4 * P : nullptr, lut, zero); };
    int_row<MR, G16>(run, g.d + n * drow, g.o != nullptr ? g.o + n * nb : nullptr, xq, g.xs, m0, g.out, g.N, n);
  }
}

// out[m, n] for rows m0 .. m0 + MR - 1 and weight rows n0 .. n1 - 1
template <int MR, int P, bool LUT, bool G16, bool NIB, bool ZERO>
void gemv_rows(const Lb& g, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t K = g.K, nb = K / QK, qrow = K / 2, prow = K / 8 * P, drow = K / (G16 ? 16 : 32);
  const __m256i lut = lut_vector(g.lut), zero = _mm256_set1_epi8(static_cast<char>(g.zero));
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qn = g.q + n * qrow;
    const uint8_t* pn = P > 0 ? g.pl + n * prow : nullptr;
    const float* dn = g.d + n * drow;
    prefetch_row(g, n + PREFETCH_ROWS, n1);
    Acc acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = acc_zero();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* qb = qn + b * 16;
      const uint8_t* pb = P > 0 ? pn + b * 4 * P : nullptr;
      const float* xb = g.x + m0 * K + b * QK;
#ifdef PAGEDKV_GEMV_AVX512
      __m512 lo, hi;
      widen16<P, LUT, NIB, ZERO>(qb, pb, lut, zero, lo, hi);
      const __m512 d0 = _mm512_set1_ps(dn[G16 ? 2 * b : b]), d1 = G16 ? _mm512_set1_ps(dn[2 * b + 1]) : d0;
      dot_run<MR, G16>(acc, lo, hi, d0, d1, xb, K);
#else
      __m256 w0, w1, w2, w3;
      if constexpr (NIB) widen_nibbles<ZERO>(qb, _mm256_set1_epi32(g.zero), w0, w1, w2, w3);
      else widen(decode32<P, LUT>(qb, pb, lut, zero), w0, w1, w2, w3);
      const __m256 d0 = _mm256_broadcast_ss(dn + (G16 ? 2 * b : b)), d1 = G16 ? _mm256_broadcast_ss(dn + 2 * b + 1) : d0;
      dot_run<MR, G16>(acc, w0, w1, w2, w3, d0, d1, xb, K);
#endif
    }
    finish_row<MR>(acc, g.o != nullptr ? g.o + n * nb : nullptr, g.xs, nb, m0, g.out, g.N, n);
  }
}

template <int P, bool LUT, bool G16, bool NIB = false, bool ZERO = false>
void gemv_kind(const Lb& g, const QuantizedRows* xq, int64_t n0, int64_t n1) {
  row_groups(g.M, n0, n1, [&](auto mr, int64_t m0, int64_t t0, int64_t t1) {
    if (xq != nullptr) gemv_rows_int<decltype(mr)::value, P, LUT, G16, NIB, ZERO>(g, *xq, m0, t0, t1);
    else gemv_rows<decltype(mr)::value, P, LUT, G16, NIB, ZERO>(g, m0, t0, t1);
  });
}

// buf row = scale * v + offset over rows n0 .. n1 - 1 (the tiles' dequantization, vectorized)
template <int P, bool LUT, bool G16, bool NIB = false, bool ZERO = false>
void dequantize_kind(const Lb& g, float* buf, int64_t row0, int64_t n0, int64_t n1) {
  const int64_t K = g.K, nb = K / QK, qrow = K / 2, prow = K / 8 * P, drow = K / (G16 ? 16 : 32);
  const __m256i lut = lut_vector(g.lut), zero = _mm256_set1_epi8(static_cast<char>(g.zero));
  const __m256i zero32 = _mm256_set1_epi32(g.zero);
  for (int64_t n = n0; n < n1; ++n) {
    float* row = buf + (n - row0) * K;
    const float* dn = g.d + n * drow;
    for (int64_t b = 0; b < nb; ++b) {
      __m256 w0, w1, w2, w3;
      if constexpr (NIB) {
        widen_nibbles<ZERO>(g.q + n * qrow + b * 16, zero32, w0, w1, w2, w3);
      } else {
        widen(decode32<P, LUT>(g.q + n * qrow + b * 16, P > 0 ? g.pl + n * prow + b * 4 * P : nullptr, lut, zero),
              w0, w1, w2, w3);
      }
      const __m256 d0 = _mm256_broadcast_ss(dn + (G16 ? 2 * b : b)), d1 = G16 ? _mm256_broadcast_ss(dn + 2 * b + 1) : d0;
      const __m256 o = _mm256_set1_ps(g.o != nullptr ? g.o[n * nb + b] : 0.f);
      float* r = row + b * QK;
      _mm256_storeu_ps(r, _mm256_fmadd_ps(w0, d0, o));
      _mm256_storeu_ps(r + 8, _mm256_fmadd_ps(w1, d0, o));
      _mm256_storeu_ps(r + 16, _mm256_fmadd_ps(w2, d1, o));
      _mm256_storeu_ps(r + 24, _mm256_fmadd_ps(w3, d1, o));
    }
  }
}
#endif

void gemv_portable(const Lb& g, int64_t n0, int64_t n1) {
  const int64_t nb = g.K / QK;
  int8_t v[QK];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < g.M; ++m) {
      float total = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        decode_scalar(g, n, b, v);
        for (int64_t h = 0; h < QK; h += g.G) {
          float s = 0.f;
          for (int64_t i = h; i < h + g.G; ++i) s += static_cast<float>(v[i]) * g.x[m * g.K + b * QK + i];
          total += s * g.d[n * (g.K / g.G) + (b * QK + h) / g.G];
        }
        if (g.o != nullptr) total += g.o[n * nb + b] * g.xs[m * nb + b];
      }
      g.out[m * g.N + n] = total;
    }
  }
}

// the streaming path: integer activations for up to INT_ROWS_MAX rows (gemv_common.h), else float
void gemv(Lb g) {
  std::vector<float> xs(g.o != nullptr ? g.M * (g.K / QK) : 0);  // x's run sums, for the offsets
  if (g.o != nullptr) {
    run_sums(g.x, xs.data(), g.M, g.K);
    g.xs = xs.data();
  }
#ifdef PAGEDKV_LB_AVX2
  std::optional<QuantizedRows> quantized;
  if (g.M <= INT_ROWS_MAX) quantized.emplace(g.x, g.M, g.K);
  const QuantizedRows* xq = quantized ? &*quantized : nullptr;
  at::parallel_for(0, g.N, 16, [&](int64_t n0, int64_t n1) {
    if (g.lut != nullptr) gemv_kind<0, true, false>(g, xq, n0, n1);
    else if (g.P == 0 && g.zero == 0) gemv_kind<0, false, false, true, false>(g, xq, n0, n1);
    else if (g.P == 0) gemv_kind<0, false, false, true, true>(g, xq, n0, n1);
    else if (g.P == 1 && g.G == 32) gemv_kind<1, false, false>(g, xq, n0, n1);
    else if (g.P == 2 && g.G == 16) gemv_kind<2, false, true>(g, xq, n0, n1);
    else gemv_portable(g, n0, n1);
  });
#else
  at::parallel_for(0, g.N, 16, [&](int64_t n0, int64_t n1) { gemv_portable(g, n0, n1); });
#endif
}

// buf [n1 - n0, K] = the float weight rows n0 .. n1 - 1 (scale * v + offset, possibly fused)
void dequantize_rows(const Lb& g, float* buf, int64_t n0, int64_t n1) {
  const int64_t K = g.K, nb = K / QK;
  at::parallel_for(n0, n1, 8, [&](int64_t a, int64_t e) {
#ifdef PAGEDKV_LB_AVX2
    if (g.lut != nullptr) return dequantize_kind<0, true, false>(g, buf, n0, a, e);
    if (g.P == 0 && g.zero == 0) return dequantize_kind<0, false, false, true, false>(g, buf, n0, a, e);
    if (g.P == 0) return dequantize_kind<0, false, false, true, true>(g, buf, n0, a, e);
    if (g.P == 1 && g.G == 32) return dequantize_kind<1, false, false>(g, buf, n0, a, e);
    if (g.P == 2 && g.G == 16) return dequantize_kind<2, false, true>(g, buf, n0, a, e);
#endif
    int8_t v[QK];
    for (int64_t n = a; n < e; ++n) {
      float* row = buf + (n - n0) * K;
      for (int64_t b = 0; b < nb; ++b) {
        decode_scalar(g, n, b, v);
        const float offset = g.o != nullptr ? g.o[n * nb + b] : 0.f;
        const float* d = g.d + n * (K / g.G) + b * (QK / g.G);
        for (int64_t i = 0; i < QK; ++i) row[b * QK + i] = d[i / g.G] * static_cast<float>(v[i]) + offset;
      }
    }
  });
}

void lowbit_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& nibbles,
                   const std::optional<at::Tensor>& planes, const at::Tensor& scales,
                   const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& lut, int64_t zero) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [M, K] float32, contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = nibbles.size(0);
  TORCH_CHECK(K % QK == 0, "x: K must be a multiple of 32, got ", K);
  TORCH_CHECK(nibbles.dim() == 2 && nibbles.scalar_type() == at::kByte && nibbles.is_contiguous() &&
              nibbles.size(1) == K / 2, "nibbles: [N, K / 2] uint8, contiguous");
  int P = 0;
  if (planes.has_value()) {
    TORCH_CHECK(planes->dim() == 2 && planes->scalar_type() == at::kByte && planes->is_contiguous() &&
                planes->size(0) == N && planes->size(1) % (K / 8) == 0, "planes: [N, K / 8 * P] uint8, contiguous");
    P = static_cast<int>(planes->size(1) / (K / 8));
    TORCH_CHECK(P == 1 || P == 2, "planes: 1 or 2 bit planes, got ", P);
  }
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.scalar_type() == at::kFloat &&
              scales.is_contiguous() && (scales.size(1) == K / 32 || scales.size(1) == K / 16),
              "scales: [N, K / 32] or [N, K / 16] float32, contiguous");
  const int G = static_cast<int>(K / scales.size(1));
  TORCH_CHECK(!offsets.has_value() ||
              (offsets->dim() == 2 && offsets->size(0) == N && offsets->size(1) == K / QK &&
               offsets->scalar_type() == at::kFloat && offsets->is_contiguous()),
              "offsets: [N, K / 32] float32, contiguous");
  TORCH_CHECK(!lut.has_value() || (lut->numel() == 16 && lut->scalar_type() == at::kChar && lut->is_contiguous() && P == 0),
              "lut: 16 int8 values, only without bit planes");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.scalar_type() == at::kFloat &&
              out.is_contiguous(), "out: [M, N] float32, contiguous");
  const float* op = offsets.has_value() ? offsets->data_ptr<float>() : nullptr;
  Lb g{x.data_ptr<float>(), nibbles.data_ptr<uint8_t>(), planes.has_value() ? planes->data_ptr<uint8_t>() : nullptr,
       scales.data_ptr<float>(), op, nullptr, lut.has_value() ? lut->data_ptr<int8_t>() : nullptr,
       out.data_ptr<float>(), M, K, N, P, G, static_cast<int>(zero)};
  if (M <= std::min<int64_t>(ROWS_MAX, ROWS_PER_THREAD * std::max(1, at::get_num_threads()))) {
    gemv(g);
    return;
  }
  at::Tensor buf = at::empty({std::min(TILE_N, N), K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += TILE_N) {
    const int64_t n1 = std::min(N, n0 + TILE_N);
    dequantize_rows(g, buf.data_ptr<float>(), n0, n1);
    out.narrow(1, n0, n1 - n0).copy_(at::mm(x, buf.narrow(0, 0, n1 - n0).t()));
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedkv, m) {
  m.def("lowbit_linear(Tensor(a!) out, Tensor x, Tensor nibbles, Tensor? planes, Tensor scales, Tensor? offsets, "
        "Tensor? lut, int zero) -> ()");
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("lowbit_linear", &lowbit_linear);
}
