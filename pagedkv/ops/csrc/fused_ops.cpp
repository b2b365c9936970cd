// Fused small per-layer ops of the decoder (float32, CPU): RoPE over q and k in one pass, SiLU(gate)
// x up, and the residual add with the RMSNorm that follows it.
//
// Why: at decode batch sizes each of these is a few microseconds of arithmetic behind several
// torch dispatches and temporaries (RoPE alone is a multiply, two addcmul_ and their slices); 30
// layers x ~10 such ops is milliseconds per step at batch 1. Each op here is one dispatch and one
// pass over its rows. Plain-PyTorch equivalents live in pagedkv/ops/fused.py, which falls back to
// them where this extension is missing and which the tests compare these kernels against.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd_common.h"  // exp256 (shared with the attention kernels)

namespace {

// Rotate one head, "rotate half" layout over its first rd dims: o[i] = x1 c - x2 s,
// o[i + half] = x2 c' + x1 s' (i < half). o may equal x: iteration i touches only i and i + half.
inline void rotate_head(float* o, const float* x, const float* c, const float* s, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    o[i] = x1 * c[i] - x2 * s[i];
    o[i + half] = x2 * c[i + half] + x1 * s[i + half];
  }
}

// qkv [T, >= heads + kv_heads, d] float32, last dim contiguous and heads packed (stride(1) == d),
// rows at any stride (a slice of the fused projection's output). cos, sin [T, rd] (or [T, 1, rd])
// contiguous, rd even and <= d (partial rotary: dims rd.. pass through). Returns the rotated q heads
// as a new [T, heads, d] tensor (contiguous, so the attention kernels take it without a copy) and
// rotates the k heads (heads .. heads + kv_heads) in place. Outputs are allocated here, not by the
// caller: a torch.empty from Python costs as much as a whole op at decode sizes.
at::Tensor rope_qk(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                   int64_t kv_heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == at::kFloat && qkv.stride(2) == 1 &&
                  qkv.stride(1) == qkv.size(2),
              "rope_qk: qkv must be [T, heads, d] float32 with packed heads");
  const int64_t T = qkv.size(0), d = qkv.size(2);
  TORCH_CHECK(heads >= 1 && kv_heads >= 0 && qkv.size(1) >= heads + kv_heads, "rope_qk: qkv has ", qkv.size(1),
              " heads, fewer than heads + kv_heads = ", heads + kv_heads);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.sizes() == sin.sizes(),
              "rope_qk: cos and sin must be float32 contiguous, of one shape");
  const int64_t rd = cos.size(-1);
  TORCH_CHECK(rd % 2 == 0 && rd <= d && cos.numel() == T * rd, "rope_qk: cos/sin must be [T, rd] with rd even "
              "and <= head_dim ", d, ", got ", cos.sizes());
  at::Tensor q_out = at::empty({T, heads, d}, qkv.options());
  const int64_t half = rd / 2, row_stride = qkv.stride(0);
  float* base = qkv.data_ptr<float>();
  float* qo = q_out.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = base + t * row_stride;
      const float* c = cp + t * rd;
      const float* s = sp + t * rd;
      for (int64_t h = 0; h < heads; ++h) {
        float* o = qo + (t * heads + h) * d;
        const float* x = row + h * d;
        rotate_head(o, x, c, s, half);
        if (rd < d) std::memcpy(o + rd, x + rd, sizeof(float) * (d - rd));
      }
      for (int64_t h = heads; h < heads + kv_heads; ++h) {
        float* x = row + h * d;
        rotate_head(x, x, c, s, half);
      }
    }
  });
  return q_out;
}

// silu(gate) * up [T, I] (a new tensor) of gate_up [T, 2 I] (gate first, as the fused projection
// stores them), float32 contiguous.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.is_contiguous() &&
                  gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be [T, 2 * I] float32 contiguous");
  const int64_t T = gate_up.size(0), n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gp + t * 2 * n;
      const float* u = g + n;
      float* o = op + t * n;
      int64_t i = 0;
#ifdef PAGEDKV_SIMD_AVX2
      // silu(x) = x / (1 + e^-x) from e = e^-|x| <= 1 (exp256 takes x <= 0): x / (1 + e) for x >= 0,
      // x e / (1 + e) below; no overflow either way.
      const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.f);
      for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 e = pagedkv_simd::exp256(_mm256_or_ps(x, sign));  // -|x|
        const __m256 num = _mm256_blendv_ps(_mm256_mul_ps(x, e), x, _mm256_cmp_ps(x, zero, _CMP_GE_OQ));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// x += residual (x becomes the new residual stream), then out = x / sqrt(mean(x^2) + eps) * weight,
// row by row: the add that closes a sublayer and the norm that opens the next, in one pass.
// x, residual [rows, hidden] float32 contiguous; weight [hidden]; returns out (a new tensor).
at::Tensor add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "add_rms_norm: x must be [rows, hidden] float32 contiguous");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == at::kFloat && residual.is_contiguous(),
              "add_rms_norm: residual must be like x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == at::kFloat &&
                  weight.is_contiguous(),
              "add_rms_norm: weight must be [hidden] float32");
  at::Tensor out = at::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  float* xp = x.data_ptr<float>();
  const float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = xp + r * n;
      const float* rr = rp + r * n;
      float* orow = op + r * n;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) {
        const float v = xr[i] + rr[i];
        xr[i] = v;
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) orow[i] = xr[i] * inv * wp[i];
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedkv, m) {
  m.def("rope_qk(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads, int kv_heads) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor residual, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("rope_qk", &rope_qk);
  m.impl("silu_mul", &silu_mul);
  m.impl("add_rms_norm", &add_rms_norm);
}
