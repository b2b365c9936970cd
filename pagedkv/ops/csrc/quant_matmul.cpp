// Linear layers over 8-bit weights kept quantized: out [M, N] = x [M, K] @ W^T, where W [N, K] is
// stored as int8 values q [N, K], one float32 scale d per run of 32 values along K and, optionally,
// one float32 offset o per run:
//
//     W[n, k] = d[n, k / 32] * q[n, k] (+ o[n, k / 32])
//
// Without offsets this is GGUF's Q8_0 (and Q4_0, Q5_0) with the fp16 scales widened; with them,
// Q4_1, Q5_1 (o = m) and the K-quants Q4_K, Q5_K (d = d * sc, o = -dmin * m per 32 values).
// The offset needs no work per weight: per block of 32,
//
//     sum_k W[n, k] x[m, k] = d[n, b] * dot(q[n, b], x[m, b]) + o[n, b] * sum(x[m, b])
//
// so the block sums of x are taken once per call and the offsets add one multiply-add per block.
//
// Few rows (decode: up to 16 per thread, at most 32): the weights are streamed once per group of
// up to 8 rows and dequantized in registers: 32 int8 values become four vectors of 8 floats (two of 16
// with AVX-512, gemv_common.h), multiplied with the rows' activations and scaled once per block (8
// accumulators + 4 weight vectors + the scale fit AVX2's 16 registers; the conversion shared by 8 rows
// rather than 4 took 20-30% off 5 to 32 rows). The weights take 1.125 bytes per value (1.25 with
// offsets) against 4 for float32, and at batch 1 a linear layer is bound by reading them.
// Many rows (prefill, large batches): tiles of 256 weight rows are dequantized into a float32
// buffer and multiplied by the BLAS matmul, which is compute-bound there.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "gemv_common.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDKV_Q8_AVX2 1
#endif

namespace {

using namespace pagedkv_gemv;

// Up to GEMV_ROWS_PER_THREAD rows per thread (at most GEMV_ROWS_MAX) take the streaming path,
// more take the BLAS tiles. Measured with 8-row groups on SmolLM2's shapes, alternating builds:
// on one thread the BLAS tiles win from about 16 rows (an engine at batch 32: +20%), on two the
// streaming path still holds its own at 32 rows (batch 32 within noise).
constexpr int64_t GEMV_ROWS_PER_THREAD = 16;
constexpr int64_t GEMV_ROWS_MAX = 32;
constexpr int64_t TILE_N = 256;   // weight rows dequantized per BLAS tile

// One call's operands (the streaming path); o and xs are null without offsets.
struct Gemv {
  const float* x;    // [M, K]
  const int8_t* q;   // [N, K]
  const float* d;    // [N, K / 32]
  const float* o;    // [N, K / 32] or null
  const float* xs;   // [M, K / 32] block sums of x, or null
  float* out;        // [M, N]
  int64_t M, K, N;
};

#ifdef PAGEDKV_Q8_AVX2
inline __m256 load8_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// out[m, n] for rows m0 .. m0 + MR - 1 and weight rows n0 .. n1 - 1
template <int MR>
void gemv_rows(const Gemv& g, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t K = g.K, nb = K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* qn = g.q + n * K;
    const float* dn = g.d + n * nb;
    if (n + PREFETCH_ROWS < n1) {  // gemv_common.h
      prefetch(qn + PREFETCH_ROWS * K, K);
      prefetch(dn + PREFETCH_ROWS * nb, nb * 4);
      if (g.o != nullptr) prefetch(g.o + (n + PREFETCH_ROWS) * nb, nb * 4);
    }
    Acc acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = acc_zero();
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* qb = qn + b * QK;
#ifdef PAGEDKV_GEMV_AVX512
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb))));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 16))));
      const __m512 db = _mm512_set1_ps(dn[b]);
      dot_run<MR, false>(acc, lo, hi, db, db, g.x + m0 * K + b * QK, K);
#else
      const __m256 db = _mm256_broadcast_ss(dn + b);
      dot_run<MR, false>(acc, load8_i8(qb), load8_i8(qb + 8), load8_i8(qb + 16), load8_i8(qb + 24), db, db,
                         g.x + m0 * K + b * QK, K);
#endif
    }
    finish_row<MR>(acc, g.o != nullptr ? g.o + n * nb : nullptr, g.xs, nb, m0, g.out, g.N, n);
  }
}
#endif

void gemv_portable(const Gemv& g, int64_t n0, int64_t n1) {
  const int64_t K = g.K, nb = K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < g.M; ++m) {
      float total = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        float s = 0.f;
        for (int64_t i = 0; i < QK; ++i) s += static_cast<float>(g.q[n * K + b * QK + i]) * g.x[m * K + b * QK + i];
        total += s * g.d[n * nb + b];
        if (g.o != nullptr) total += g.o[n * nb + b] * g.xs[m * nb + b];
      }
      g.out[m * g.N + n] = total;
    }
  }
}

// the streaming path
void gemv(Gemv g) {
  std::vector<float> xs(g.o != nullptr ? g.M * (g.K / QK) : 0);  // block sums of x, for the offsets
  if (g.o != nullptr) {
    run_sums(g.x, xs.data(), g.M, g.K);
    g.xs = xs.data();
  }
#ifdef PAGEDKV_Q8_AVX2
  at::parallel_for(0, g.N, 16, [&](int64_t n0, int64_t n1) {
    row_groups(g.M, n0, n1, [&](auto mr, int64_t m0, int64_t t0, int64_t t1) {
      gemv_rows<decltype(mr)::value>(g, m0, t0, t1);
    });
  });
#else
  at::parallel_for(0, g.N, 16, [&](int64_t n0, int64_t n1) { gemv_portable(g, n0, n1); });
#endif
}

// buf [n1 - n0, K] = the float weight rows n0 .. n1 - 1 (o null: no offsets)
void dequantize_rows(const int8_t* q, const float* d, const float* o, float* buf, int64_t K, int64_t n0, int64_t n1) {
  const int64_t nb = K / QK;
  at::parallel_for(n0, n1, 8, [&](int64_t a, int64_t e) {
    for (int64_t n = a; n < e; ++n) {
      float* row = buf + (n - n0) * K;
      for (int64_t b = 0; b < nb; ++b) {
        const float scale = d[n * nb + b], offset = o != nullptr ? o[n * nb + b] : 0.f;
        const int8_t* qb = q + n * K + b * QK;
#pragma omp simd
        for (int64_t i = 0; i < QK; ++i) row[b * QK + i] = scale * static_cast<float>(qb[i]) + offset;
      }
    }
  });
}

void q8_0_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                 const std::optional<at::Tensor>& offsets) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [M, K] float32, contiguous");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "qweight: [N, K] int8, contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == K && K % QK == 0, "qweight: [N, K] with K = x.size(1), a multiple of 32");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / QK &&
              scales.scalar_type() == at::kFloat && scales.is_contiguous(), "scales: [N, K / 32] float32");
  TORCH_CHECK(!offsets.has_value() ||
              (offsets->dim() == 2 && offsets->size(0) == N && offsets->size(1) == K / QK &&
               offsets->scalar_type() == at::kFloat && offsets->is_contiguous()),
              "offsets: [N, K / 32] float32, contiguous");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.scalar_type() == at::kFloat &&
              out.is_contiguous(), "out: [M, N] float32, contiguous");
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = qweight.data_ptr<int8_t>();
  const float* dp = scales.data_ptr<float>();
  const float* op = offsets.has_value() ? offsets->data_ptr<float>() : nullptr;
  if (M <= std::min<int64_t>(GEMV_ROWS_MAX, GEMV_ROWS_PER_THREAD * std::max(1, at::get_num_threads()))) {
    gemv({xp, qp, dp, op, nullptr, out.data_ptr<float>(), M, K, N});
    return;
  }
  at::Tensor buf = at::empty({std::min(TILE_N, N), K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += TILE_N) {
    const int64_t n1 = std::min(N, n0 + TILE_N);
    dequantize_rows(qp, dp, op, buf.data_ptr<float>(), K, n0, n1);
    out.narrow(1, n0, n1 - n0).copy_(at::mm(x, buf.narrow(0, 0, n1 - n0).t()));
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedkv, m) {
  m.def("q8_0_linear(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, Tensor? offsets=None) -> ()");
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("q8_0_linear", &q8_0_linear);
}
