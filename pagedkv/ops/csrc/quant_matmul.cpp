// Linear layers over GGUF Q8_0 weights kept quantized: out [M, N] = x [M, K] @ W^T, where
// W [N, K] is stored as int8 values q [N, K] and one float32 scale d per run of 32 values along K
// (W[n, k] = d[n, k / 32] * q[n, k], exactly GGUF's Q8_0 with its fp16 scales widened).
//
// Few rows (M <= 32, decode): the weights are streamed once per group of up to 4 rows and
// dequantized in registers: 32 int8 values become four vectors of 8 floats, multiplied with the
// rows' activations and scaled once per block. The weights take 1.125 bytes per value against 4
// for float32, and at batch 1 a linear layer is bound by reading them.
// Many rows (prefill, large batches): tiles of 256 weight rows are dequantized into a float32
// buffer and multiplied by the BLAS matmul, which is compute-bound there.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDKV_Q8_AVX2 1
#endif

namespace {

constexpr int64_t QK = 32;        // values per scale (GGUF Q8_0 block)
// Up to this many rows take the streaming path: measured against the BLAS tiles on one AVX2 core
// (SmolLM2's layer shapes), streaming is 10-20% faster at 24 and 32 rows, 10% slower at 64.
constexpr int64_t GEMV_ROWS = 32;
constexpr int64_t TILE_N = 256;   // weight rows dequantized per BLAS tile

#ifdef PAGEDKV_Q8_AVX2
inline __m256 load8_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[m, n] for rows m0 .. m0 + MR - 1 and weight rows n0 .. n1 - 1
template <int MR>
void gemv_rows(const float* x, const int8_t* q, const float* d, float* out, int64_t K, int64_t N, int64_t m0,
               int64_t n0, int64_t n1) {
  const int64_t nb = K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* qn = q + n * K;
    const float* dn = d + n * nb;
    __m256 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* qb = qn + b * QK;
      const __m256 w0 = load8_i8(qb), w1 = load8_i8(qb + 8), w2 = load8_i8(qb + 16), w3 = load8_i8(qb + 24);
      const __m256 db = _mm256_broadcast_ss(dn + b);
      for (int r = 0; r < MR; ++r) {
        const float* xb = x + (m0 + r) * K + b * QK;
        __m256 s = _mm256_mul_ps(w0, _mm256_loadu_ps(xb));
        s = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), s);
        s = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), s);
        s = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), s);
        acc[r] = _mm256_fmadd_ps(s, db, acc[r]);
      }
    }
    for (int r = 0; r < MR; ++r) out[(m0 + r) * N + n] = hsum(acc[r]);
  }
}
#endif

void gemv_portable(const float* x, const int8_t* q, const float* d, float* out, int64_t K, int64_t N, int64_t m0,
                   int64_t m1, int64_t n0, int64_t n1) {
  const int64_t nb = K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = m0; m < m1; ++m) {
      float total = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        float s = 0.f;
        for (int64_t i = 0; i < QK; ++i) s += static_cast<float>(q[n * K + b * QK + i]) * x[m * K + b * QK + i];
        total += s * d[n * nb + b];
      }
      out[m * N + n] = total;
    }
  }
}

void gemv(const float* x, const int8_t* q, const float* d, float* out, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
#ifdef PAGEDKV_Q8_AVX2
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      switch (std::min<int64_t>(4, M - m0)) {
        case 1: gemv_rows<1>(x, q, d, out, K, N, m0, n0, n1); break;
        case 2: gemv_rows<2>(x, q, d, out, K, N, m0, n0, n1); break;
        case 3: gemv_rows<3>(x, q, d, out, K, N, m0, n0, n1); break;
        default: gemv_rows<4>(x, q, d, out, K, N, m0, n0, n1); break;
      }
    }
#else
    gemv_portable(x, q, d, out, K, N, 0, M, n0, n1);
#endif
  });
}

void dequantize_rows(const int8_t* q, const float* d, float* buf, int64_t K, int64_t n0, int64_t n1) {
  const int64_t nb = K / QK;
  at::parallel_for(n0, n1, 8, [&](int64_t a, int64_t e) {
    for (int64_t n = a; n < e; ++n) {
      float* row = buf + (n - n0) * K;
      for (int64_t b = 0; b < nb; ++b) {
        const float scale = d[n * nb + b];
        const int8_t* qb = q + n * K + b * QK;
#pragma omp simd
        for (int64_t i = 0; i < QK; ++i) row[b * QK + i] = scale * static_cast<float>(qb[i]);
      }
    }
  });
}

void q8_0_linear(const at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [M, K] float32, contiguous");
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.is_contiguous(),
              "qweight: [N, K] int8, contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == K && K % QK == 0, "qweight: [N, K] with K = x.size(1), a multiple of 32");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / QK &&
              scales.scalar_type() == at::kFloat && scales.is_contiguous(), "scales: [N, K / 32] float32");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && out.scalar_type() == at::kFloat &&
              out.is_contiguous(), "out: [M, N] float32, contiguous");
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = qweight.data_ptr<int8_t>();
  const float* dp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (M <= GEMV_ROWS) {
    gemv(xp, qp, dp, op, M, K, N);
    return;
  }
  at::Tensor buf = at::empty({std::min(TILE_N, N), K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += TILE_N) {
    const int64_t n1 = std::min(N, n0 + TILE_N);
    dequantize_rows(qp, dp, buf.data_ptr<float>(), K, n0, n1);
    out.narrow(1, n0, n1 - n0).copy_(at::mm(x, buf.narrow(0, 0, n1 - n0).t()));
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedkv, m) {
  m.def("q8_0_linear(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales) -> ()");
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("q8_0_linear", &q8_0_linear);
}
