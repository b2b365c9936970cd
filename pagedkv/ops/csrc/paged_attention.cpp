// Paged attention on the CPU, reading K and V where they lie in the block pool.
//
// One kernel serves decode and prefill/extend: every query row r has a sequence (a row of the
// block tables) and a visible length len[r] (its position + 1, so causality is a length limit);
// with a sliding window w it sees positions [len - w, len). Rows with len 0 are skipped.
//
// Work item = (tile of up to TILE consecutive rows of one sequence, KV head). Each key block is
// read once per tile and used by every query row of the tile and every query head of the KV
// head's group (GQA), with an online softmax per (row, query head): no gathered or padded copy of
// K or V is ever made.
//
// Block format: K/V of one dtype (float32, float16, bfloat16), accumulated in float32. Formats
// with per-block scales (int8, fp8) add a scale per (block, KV head) here.
//
// float32 caches with head_dim 64 or 128 on AVX2+FMA take a vector path: the context is walked
// in chunks of CHUNK tokens (row pointers through the block table, so the block size does not
// matter), scores of 8 tokens at a time with independent accumulators, a vector exp, and the
// V sum in registers. Everything else takes the portable loop (auto-vectorized over head_dim).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDKV_AVX2 1
#endif

namespace {

constexpr int TILE = 16;

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

template <typename T>
inline float dot(const float* __restrict q, const T* __restrict k, int d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < d; ++i) s += q[i] * to_f(k[i]);
  return s;
}

template <typename T>
inline void axpy(float a, const T* __restrict v, float* __restrict acc, int d) {
#pragma omp simd
  for (int i = 0; i < d; ++i) acc[i] += a * to_f(v[i]);
}

struct Tile {
  int64_t first, count, seq;
};

#ifdef PAGEDKV_AVX2
constexpr int CHUNK = 64;

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

// One work item (a tile of rows x one KV head) on the vector path. qs: the tile's scaled queries
// [nr * group][D]; acc/m/l: the online-softmax state per (row, query head).
template <int D>
void attend_avx2(const float* qs, const int64_t* row_start, const int64_t* row_end, int64_t nr,
                 int64_t group, const float* kc, const float* vc, const int32_t* table, int64_t block_size,
                 int64_t row_stride, int64_t h, int64_t lo, int64_t hi, float* acc, float* m, float* l) {
  constexpr int NV = D / 8;
  const float* kp[CHUNK];
  const float* vp[CHUNK];
  alignas(32) float p[CHUNK];
  for (int64_t c0 = lo; c0 < hi; c0 += CHUNK) {
    const int64_t c1 = std::min<int64_t>(c0 + CHUNK, hi);
    for (int64_t t = c0; t < c1; ++t) {
      const int64_t off = (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * row_stride + h * D;
      kp[t - c0] = kc + off;
      vp[t - c0] = vc + off;
    }
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
          alignas(32) float tmp[8];
          _mm256_store_ps(tmp, s);
          p[t] = ((tmp[0] + tmp[1]) + (tmp[2] + tmp[3])) + ((tmp[4] + tmp[5]) + (tmp[6] + tmp[7]));
        }
        float mb = m[j];
        for (t = 0; t < n; ++t) mb = std::max(mb, p[t]);
        const float corr = std::exp(m[j] - mb);
        const __m256 mv = _mm256_set1_ps(mb);
        __m256 sumv = _mm256_setzero_ps();
        t = 0;
        for (; t + 8 <= n; t += 8) {
          const __m256 ev = exp256(_mm256_sub_ps(_mm256_load_ps(p + t), mv));
          _mm256_store_ps(p + t, ev);
          sumv = _mm256_add_ps(sumv, ev);
        }
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, sumv);
        float sum = ((tmp[0] + tmp[1]) + (tmp[2] + tmp[3])) + ((tmp[4] + tmp[5]) + (tmp[6] + tmp[7]));
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
}
#endif

template <typename T>
void paged_attention_impl(const float* q, const T* kc, const T* vc, const int32_t* tables,
                          int64_t max_blocks, const int32_t* row_seq, const int32_t* row_len,
                          float* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t d,
                          int64_t block_size, float scale, int64_t window) {
  const int64_t group = heads / kv_heads;
  std::vector<Tile> tiles;
  for (int64_t r = 0; r < rows;) {
    if (row_len[r] <= 0) { ++r; continue; }
    int64_t n = 1;
    while (r + n < rows && n < TILE && row_seq[r + n] == row_seq[r] && row_len[r + n] > 0) ++n;
    tiles.push_back({r, n, row_seq[r]});
    r += n;
  }
  const int64_t work = static_cast<int64_t>(tiles.size()) * kv_heads;
  const int64_t row_stride = kv_heads * d;  // between consecutive tokens of a block
  at::parallel_for(0, work, 1, [&](int64_t begin, int64_t end) {
    const int64_t nq = TILE * group;
    std::vector<float> qs(nq * d), acc(nq * d), m(nq), l(nq), p(nq * block_size);
    for (int64_t w = begin; w < end; ++w) {
      const Tile& tile = tiles[w / kv_heads];
      const int64_t h = w % kv_heads;
      const int64_t nr = tile.count, nqt = nr * group;
      int64_t hi = 0, lo = std::numeric_limits<int64_t>::max();
      for (int64_t i = 0; i < nr; ++i) {
        const int64_t len = row_len[tile.first + i];
        hi = std::max(hi, len);
        lo = std::min(lo, window > 0 ? std::max<int64_t>(0, len - window) : 0);
        for (int64_t g = 0; g < group; ++g) {  // scaled queries of this KV head's query heads
          const float* src = q + ((tile.first + i) * heads + h * group + g) * d;
          float* dst = qs.data() + (i * group + g) * d;
          for (int64_t x = 0; x < d; ++x) dst[x] = src[x] * scale;
        }
      }
      std::fill(acc.begin(), acc.begin() + nqt * d, 0.f);
      std::fill(m.begin(), m.begin() + nqt, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + nqt, 0.f);
      const int32_t* table = tables + tile.seq * max_blocks;
#ifdef PAGEDKV_AVX2
      if constexpr (std::is_same_v<T, float>) {
        if (d == 64 || d == 128) {
          int64_t starts[TILE], ends[TILE];
          for (int64_t i = 0; i < nr; ++i) {
            ends[i] = row_len[tile.first + i];
            starts[i] = window > 0 ? std::max<int64_t>(0, ends[i] - window) : 0;
          }
          auto fn = d == 64 ? attend_avx2<64> : attend_avx2<128>;
          fn(qs.data(), starts, ends, nr, group, kc, vc, table, block_size, row_stride, h, lo, hi, acc.data(),
             m.data(), l.data());
          goto finish;
        }
      }
#endif
      for (int64_t b = lo / block_size; b * block_size < hi; ++b) {
        const int64_t base = b * block_size;
        const int64_t off = static_cast<int64_t>(table[b]) * block_size * row_stride + h * d;
        const T* kb = kc + off;
        const T* vb = vc + off;
        for (int64_t i = 0; i < nr; ++i) {
          const int64_t len = row_len[tile.first + i];
          const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
          const int64_t t0 = std::max<int64_t>(base, start) - base;
          const int64_t t1 = std::min<int64_t>(base + block_size, len) - base;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t j = i * group + g;
            float* pj = p.data() + j * block_size;
            if (t1 <= t0) continue;
            const float* qj = qs.data() + j * d;
            float mb = m[j];
            for (int64_t t = t0; t < t1; ++t) {
              pj[t] = dot(qj, kb + t * row_stride, static_cast<int>(d));
              mb = std::max(mb, pj[t]);
            }
            const float corr = std::exp(m[j] - mb);  // 0 on the first block (m = -inf)
            float sum = 0.f;
            for (int64_t t = t0; t < t1; ++t) {
              pj[t] = std::exp(pj[t] - mb);
              sum += pj[t];
            }
            float* aj = acc.data() + j * d;
            if (corr != 1.f) {
              for (int64_t x = 0; x < d; ++x) aj[x] *= corr;
            }
            l[j] = l[j] * corr + sum;
            m[j] = mb;
            for (int64_t t = t0; t < t1; ++t) axpy(pj[t], vb + t * row_stride, aj, static_cast<int>(d));
          }
        }
      }
#ifdef PAGEDKV_AVX2
    finish:
#endif
      for (int64_t i = 0; i < nr; ++i) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t j = i * group + g;
          float* dst = out + ((tile.first + i) * heads + h * group + g) * d;
          const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
          const float* aj = acc.data() + j * d;
          for (int64_t x = 0; x < d; ++x) dst[x] = aj[x] * inv;
        }
      }
    }
  });
}

// q [rows, heads, d] float32; k_cache, v_cache [num_blocks, block_size, kv_heads, d];
// block_tables [seqs, max_blocks] int32; row_seq, row_len [rows] int32; out [rows, heads, d]
// float32 (rows with row_len 0 are left as they are).
void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& row_seq, const at::Tensor& row_len, double scale,
                     int64_t sliding_window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [rows, heads, d] float32");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(), "out like q");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(), "k/v cache layout");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(), "k/v cache");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables: [seqs, max_blocks] int32");
  TORCH_CHECK(row_seq.scalar_type() == at::kInt && row_len.scalar_type() == at::kInt, "row_seq/row_len int32");
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && heads % kv_heads == 0, "head_dim / GQA mismatch");
  TORCH_CHECK(row_seq.numel() == rows && row_len.numel() == rows, "row_seq/row_len: one per row");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(), "paged_attention", [&] {
    paged_attention_impl<scalar_t>(q.data_ptr<float>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                   block_tables.data_ptr<int32_t>(), block_tables.size(1),
                                   row_seq.data_ptr<int32_t>(), row_len.data_ptr<int32_t>(),
                                   out.data_ptr<float>(), rows, heads, kv_heads, d, block_size,
                                   static_cast<float>(scale), sliding_window);
  });
}

// out = x / sqrt(mean(x^2) + eps) * weight, row by row (float32, [rows, hidden] contiguous): one
// pass instead of the several ops torch's CPU rms_norm takes, which dominate at decode sizes.
void rms_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: [rows, hidden] float32");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(), "out like x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == at::kFloat &&
              weight.is_contiguous(), "weight: [hidden] float32");
  const int64_t rows = x.size(0), n = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * n;
      float* orow = op + r * n;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) orow[i] = xr[i] * inv * wp[i];
    }
  });
}

}  // namespace

TORCH_LIBRARY(pagedkv, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor row_seq, Tensor row_len, float scale, int sliding_window) -> ()");
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("rms_norm", &rms_norm);
}
