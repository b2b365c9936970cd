// Shared-block (cascade) paged attention on the CPU: the rows of a step that hold the same run of
// blocks at the same positions attend to that run together, K and V read once for all of them.
//
// Same contract as paged_attention (csrc/paged_attention.cpp): row r is query q[r] of sequence
// row_seq[r] (a row of the block tables) over its first row_len[r] tokens (the last `window` of
// them with a sliding window; rows with length 0 are skipped), scores soft-capped when cap > 0,
// blocks of any format the pool holds (8-bit ones with per-(block, KV head) scales).
//
// The sharing is found by the caller (pagedkv/ops/cascade.py, once per step for every layer) as
// nodes: node n covers token positions [node_start[n], node_end[n]) of the block table of
// sequence node_seq[n], and every row in node_rows[node_row_ptr[n] .. node_row_ptr[n + 1]) holds
// exactly those blocks at those positions. A row's nodes cover its context from position 0 up to
// row_own_start[r]; the rest, [row_own_start[r], row_len[r]), is its own.
//
// Phase 1, work item = (node, part of its rows, KV head): the node's K and V rows are gathered
// once (converted to float32 with their block scales folded in, piece by piece) and attended by
// every query head of every row of the part as matrix products (ATen's: MKL / oneDNN, near the
// core's arithmetic peak; a per-query loop over the same keys stays far below it), with the
// online softmax between pieces; a part with few queries takes the per-query loop instead.
// Each (row, query head) leaves a partial online-softmax state (max m, sum l, accumulator acc),
// over its visible part of the node (clipped to its length and window).
// Phase 2, work item = (tile of consecutive rows of one sequence, KV head), as in paged_attention:
// the row's partial states are merged by the log-sum-exp rule (m = max, l and acc rescaled by
// e^(m_i - m)) into the starting state of the same online softmax over its own blocks; then the
// accumulator is divided by l.
//
// The arithmetic per key is the one of paged_attention (same scaled queries, same exp, float32
// accumulation); only the order of the sums differs, so results agree to float32 rounding.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <ATen/ATen.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "simd_common.h"  // Vec<S>, exp256 / exp512, reduce8, hsum (shared with paged_attention.cpp)

#ifdef PAGEDKV_SIMD_AVX2
#define PAGEDKV_CASCADE_AVX2 1
using namespace pagedkv_simd;
#endif

namespace {

constexpr int TILE = 16;         // rows of one sequence per phase-2 item
constexpr int SHARED_ROWS = 64;  // most rows per phase-1 item

template <typename S>
inline float to_f(S x) { return static_cast<float>(x); }

// Where one layer's blocks live. Block ids below `base` are full-precision blocks of `kf`/`vf`
// (F: float32, float16, bfloat16; values as stored); ids from `base` on are 8-bit blocks of
// `kq`/`vq` (Q: int8, fp8) at index id - base, with one float32 scale per (block, KV head) in
// `ks`/`vs` (value = stored * scale). A float pool has base = num_blocks, an 8-bit pool base = 0,
// a mixed pool (a format per block) anything between: one code path reads all three.
template <typename F, typename Q>
struct Cache {
  const F* kf;
  const F* vf;
  const Q* kq;
  const Q* vq;
  const float* ks;
  const float* vs;
  int64_t base;
};

// One item's online-softmax state: scaled queries qs [nr * group][d], acc [nr * group][d],
// m, l [nr * group]; rows i attend tokens [start[i], end[i]) of `table`, all within [lo, hi).
struct Item {
  const float* qs;
  const int64_t* start;
  const int64_t* end;
  int64_t nr, group;
  const int32_t* table;
  int64_t lo, hi;
  float* acc;
  float* m;
  float* l;
};

// One block of one format for every row of an item (the portable loop; any head_dim).
template <typename S>
void attend_block(const Item& it, const S* kb, const S* vb, float k_scale, float v_scale, int64_t base,
                  int64_t block_size, int64_t row_stride, int64_t d, float cap, float* p) {
  for (int64_t i = 0; i < it.nr; ++i) {
    const int64_t t0 = std::max<int64_t>(base, it.start[i]) - base;
    const int64_t t1 = std::min<int64_t>(base + block_size, it.end[i]) - base;
    if (t1 <= t0) continue;
    for (int64_t g = 0; g < it.group; ++g) {
      const int64_t j = i * it.group + g;
      const float* qj = it.qs + j * d;
      float mb = it.m[j];
      for (int64_t t = t0; t < t1; ++t) {
        const S* kr = kb + t * row_stride;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t x = 0; x < d; ++x) s += qj[x] * to_f(kr[x]);
        s *= k_scale;
        if (cap > 0.f) s = cap * std::tanh(s / cap);
        p[t] = s;
        mb = std::max(mb, s);
      }
      const float corr = std::exp(it.m[j] - mb);
      float sum = 0.f;
      for (int64_t t = t0; t < t1; ++t) {
        p[t] = std::exp(p[t] - mb);
        sum += p[t];
      }
      float* aj = it.acc + j * d;
      if (corr != 1.f) {
        for (int64_t x = 0; x < d; ++x) aj[x] *= corr;
      }
      it.l[j] = it.l[j] * corr + sum;
      it.m[j] = mb;
      for (int64_t t = t0; t < t1; ++t) {
        const float a = p[t] * v_scale;
        const S* vr = vb + t * row_stride;
#pragma omp simd
        for (int64_t x = 0; x < d; ++x) aj[x] += a * to_f(vr[x]);
      }
    }
  }
}

// The portable loop (any head_dim, any format), block by block, each block in its own format.
template <typename F, typename Q>
void attend_portable(const Item& it, const Cache<F, Q>& cache, int64_t block_size, int64_t kv_heads, int64_t h,
                     int64_t d, float cap, float* p) {
  const int64_t row_stride = kv_heads * d;
  for (int64_t b = it.lo / block_size; b * block_size < it.hi; ++b) {
    const int64_t blk = it.table[b];
    if (blk < cache.base) {
      const int64_t off = blk * block_size * row_stride + h * d;
      attend_block<F>(it, cache.kf + off, cache.vf + off, 1.f, 1.f, b * block_size, block_size, row_stride, d, cap, p);
    } else {
      const int64_t qb = blk - cache.base;
      const int64_t off = qb * block_size * row_stride + h * d;
      attend_block<Q>(it, cache.kq + off, cache.vq + off, cache.ks[qb * kv_heads + h], cache.vs[qb * kv_heads + h],
                      b * block_size, block_size, row_stride, d, cap, p);
    }
  }
}

#ifdef PAGEDKV_CASCADE_AVX2
// The vector path (head_dim D = 64, 128, 256): the item's tokens in chunks of CHUNK, each chunk's
// K and V rows located (float32: read in place) or converted once into `conv` (2 * CHUNK * D
// floats, 32-byte aligned, block scales folded in), then every (row, query head) of the item
// through simd_common.h's attend_rows (the per-row kernel's loops: scores, online softmax, V sum).
template <int D, typename F, typename Q>
void attend_vec(const Item& it, const Cache<F, Q>& cache, int64_t block_size, int64_t kv_heads, int64_t h,
                float* conv, float cap) {
  constexpr int NV = D / 8;
  float* kbuf = conv;
  float* vbuf = conv + CHUNK * D;
  const int64_t row_stride = kv_heads * D;
  const float* kp[CHUNK];
  const float* vp[CHUNK];
  // 8 stored values of either format -> floats times `scale` (Vec<S>::unit folded in)
  auto convert = [](const auto* src, float* dst, float scale) {
    using S = std::remove_cv_t<std::remove_pointer_t<decltype(src)>>;
    const __m256 sv = _mm256_set1_ps(scale * Vec<S>::unit);
    for (int v = 0; v < NV; ++v) _mm256_store_ps(dst + 8 * v, _mm256_mul_ps(Vec<S>::load(src + 8 * v), sv));
  };
  for (int64_t c0 = it.lo; c0 < it.hi; c0 += CHUNK) {
    const int64_t c1 = std::min<int64_t>(c0 + CHUNK, it.hi);
    for (int64_t t = c0; t < c1; ++t) {
      const int64_t blk = it.table[t / block_size];
      float* kd = kbuf + (t - c0) * D;
      float* vd = vbuf + (t - c0) * D;
      if (blk < cache.base) {
        const int64_t off = (blk * block_size + t % block_size) * row_stride + h * D;
        if constexpr (std::is_same_v<F, float>) {  // read in place
          kp[t - c0] = cache.kf + off;
          vp[t - c0] = cache.vf + off;
          continue;
        } else {
          convert(cache.kf + off, kd, 1.f);
          convert(cache.vf + off, vd, 1.f);
        }
      } else {
        const int64_t qb = blk - cache.base;
        const int64_t off = (qb * block_size + t % block_size) * row_stride + h * D;
        convert(cache.kq + off, kd, cache.ks[qb * kv_heads + h]);
        convert(cache.vq + off, vd, cache.vs[qb * kv_heads + h]);
      }
      kp[t - c0] = kd;
      vp[t - c0] = vd;
    }
    attend_rows<D>(it.qs, it.start, it.end, it.nr, it.group, c0, c1, kp, vp, it.acc, it.m, it.l, cap);
  }
}

#endif

// Phase 1 when an item has many queries (a shared run's rows x query heads): the online softmax
// as matrix products, in pieces of PIECE tokens: the piece's K and V rows gathered once into
// contiguous float buffers (block scales folded in), scores S [nq, n] = Qs K^T and acc += P V by
// ATen's matrix multiply (MKL / oneDNN: near the core's arithmetic peak, where per-query
// matrix-vector loops stay far below it). Tokens outside a row's [start, end) weigh exactly 0.
constexpr int64_t PIECE = 512;
constexpr int64_t GEMM_MIN_QUERIES = 16;

struct GemmScratch {
  std::vector<float> k, v, s;
  GemmScratch(int64_t queries, int64_t d) : k(PIECE * d), v(PIECE * d), s(queries * PIECE) {}
};

template <typename S>
inline void gather_row(const S* src, float* dst, float scale, int64_t d) {
  if constexpr (std::is_same_v<S, float>) {
    std::copy(src, src + d, dst);
  } else {
#pragma omp simd
    for (int64_t x = 0; x < d; ++x) dst[x] = to_f(src[x]) * scale;
  }
}

// max(m, x[0..n)), 8 lanes at a time (a scalar max is a 4-cycle dependency chain per element).
inline float max_of(const float* x, int64_t n, float m) {
  int64_t t = 0;
#ifdef PAGEDKV_SIMD_AVX512
  __m512 mw = _mm512_set1_ps(m);
  for (; t + 16 <= n; t += 16) mw = _mm512_max_ps(mw, _mm512_loadu_ps(x + t));
  m = _mm512_reduce_max_ps(mw);
#endif
#ifdef PAGEDKV_CASCADE_AVX2
  __m256 mv = _mm256_set1_ps(m);
  for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  for (int u = 0; u < 8; ++u) m = std::max(m, lanes[u]);
#endif
  for (; t < n; ++t) m = std::max(m, x[t]);
  return m;
}

// e^(x - m) over n floats in place (exp256 on AVX2 machines), their sum returned.
inline float exp_sum(float* x, int64_t n, float m) {
  int64_t t = 0;
  float sum = 0.f;
#ifdef PAGEDKV_SIMD_AVX512
  {  // 16 lanes at a time where the core has them: a long shared run's scores are most of a step's exps
    const __m512 mw = _mm512_set1_ps(m);
    __m512 sw = _mm512_setzero_ps();
    for (; t + 16 <= n; t += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(x + t), mw));
      _mm512_storeu_ps(x + t, e);
      sw = _mm512_add_ps(sw, e);
    }
    sum = _mm512_reduce_add_ps(sw);
  }
#endif
#ifdef PAGEDKV_CASCADE_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sv = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + t), mv));
    _mm256_storeu_ps(x + t, e);
    sv = _mm256_add_ps(sv, e);
  }
  sum += hsum(sv);
#endif
  for (; t < n; ++t) {
    x[t] = std::exp(x[t] - m);
    sum += x[t];
  }
  return sum;
}

template <typename F, typename Q>
void attend_gemm(const Item& it, const Cache<F, Q>& cache, int64_t block_size, int64_t kv_heads, int64_t h,
                 int64_t d, float cap, GemmScratch& g, float* corr) {
  const int64_t nq = it.nr * it.group;
  const int64_t row_stride = kv_heads * d;
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor qs = at::from_blob(const_cast<float*>(it.qs), {nq, d}, opts);
  at::Tensor acc = at::from_blob(it.acc, {nq, d}, opts);
  for (int64_t p0 = it.lo; p0 < it.hi; p0 += PIECE) {
    const int64_t p1 = std::min(p0 + PIECE, it.hi), n = p1 - p0;
    for (int64_t t = p0; t < p1; ++t) {
      const int64_t blk = it.table[t / block_size];
      float* kd = g.k.data() + (t - p0) * d;
      float* vd = g.v.data() + (t - p0) * d;
      if (blk < cache.base) {
        const int64_t off = (blk * block_size + t % block_size) * row_stride + h * d;
        gather_row(cache.kf + off, kd, 1.f, d);
        gather_row(cache.vf + off, vd, 1.f, d);
      } else {
        const int64_t qb = blk - cache.base;
        const int64_t off = (qb * block_size + t % block_size) * row_stride + h * d;
        gather_row(cache.kq + off, kd, cache.ks[qb * kv_heads + h], d);
        gather_row(cache.vq + off, vd, cache.vs[qb * kv_heads + h], d);
      }
    }
    const at::Tensor keys = at::from_blob(g.k.data(), {n, d}, opts);
    const at::Tensor values = at::from_blob(g.v.data(), {n, d}, opts);
    at::Tensor scores = at::from_blob(g.s.data(), {nq, n}, opts);
    at::mm_out(scores, qs, keys.t());
    for (int64_t i = 0; i < it.nr; ++i) {
      const int64_t a = std::max(p0, it.start[i]) - p0, e = std::min(p1, it.end[i]) - p0;
      for (int64_t gq = 0; gq < it.group; ++gq) {
        const int64_t j = i * it.group + gq;
        float* sj = g.s.data() + j * n;
        if (e <= a) {  // nothing of this piece is visible to the row: weight 0, state kept
          std::fill(sj, sj + n, 0.f);
          corr[j] = 1.f;
          continue;
        }
        if (cap > 0.f) {
          for (int64_t t = a; t < e; ++t) sj[t] = cap * std::tanh(sj[t] / cap);
        }
        const float mb = max_of(sj + a, e - a, it.m[j]);
        const float sum = exp_sum(sj + a, e - a, mb);
        std::fill(sj, sj + a, 0.f);
        std::fill(sj + e, sj + n, 0.f);
        corr[j] = std::exp(it.m[j] - mb);  // 0 on the first piece (m = -inf)
        it.l[j] = it.l[j] * corr[j] + sum;
        it.m[j] = mb;
      }
    }
    for (int64_t j = 0; j < nq; ++j) {
      if (corr[j] != 1.f) {
        float* aj = it.acc + j * d;
        for (int64_t x = 0; x < d; ++x) aj[x] *= corr[j];
      }
    }
    acc.addmm_(scores, values);
  }
}

// Per-thread scratch for one item: queries, state, score and conversion buffers.
struct Scratch {
  std::vector<float> qs, acc, m, l, p, corr, conv_store;
  std::vector<int64_t> start, end;
  float* conv = nullptr;  // 2 * CHUNK * d floats, 32-byte aligned (the vector path)
  std::unique_ptr<GemmScratch> gemm;  // phase 1's matrix products
  Scratch(int64_t rows, int64_t group, int64_t d, int64_t block_size, bool gemm_path)
      : qs(rows * group * d), acc(rows * group * d), m(rows * group), l(rows * group),
        p(std::max<int64_t>(block_size, 64)), corr(rows * group), start(rows), end(rows) {
#ifdef PAGEDKV_CASCADE_AVX2
    conv_store.resize(2 * CHUNK * d + 8);
    conv = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(conv_store.data()) + 31) & ~uintptr_t(31));
#endif
    if (gemm_path) gemm = std::make_unique<GemmScratch>(rows * group, d);
  }
};

template <typename F, typename Q>
void attend(const Item& it, const Cache<F, Q>& cache, int64_t block_size, int64_t kv_heads, int64_t h, int64_t d,
            float cap, Scratch& sc) {
  if (it.hi <= it.lo) return;
  if (sc.gemm && it.nr * it.group >= GEMM_MIN_QUERIES) {
    return attend_gemm<F, Q>(it, cache, block_size, kv_heads, h, d, cap, *sc.gemm, sc.corr.data());
  }
#ifdef PAGEDKV_CASCADE_AVX2
  if constexpr (Vec<F>::ok && Vec<Q>::ok) {
    if (d == 64) return attend_vec<64, F, Q>(it, cache, block_size, kv_heads, h, sc.conv, cap);
    if (d == 128) return attend_vec<128, F, Q>(it, cache, block_size, kv_heads, h, sc.conv, cap);
    if (d == 256) return attend_vec<256, F, Q>(it, cache, block_size, kv_heads, h, sc.conv, cap);
  }
#endif
  attend_portable<F, Q>(it, cache, block_size, kv_heads, h, d, cap, sc.p.data());
}

struct Plan {
  const int32_t* node_seq;
  const int32_t* node_start;
  const int32_t* node_end;
  const int32_t* node_row_ptr;
  const int32_t* node_rows;
  const int32_t* row_own_start;
  int64_t nodes;
};

template <typename F, typename Q>
void cascade_impl(const float* q, const Cache<F, Q>& cache, const int32_t* tables, int64_t max_blocks,
                  const int32_t* row_seq, const int32_t* row_len, float* out, int64_t rows, int64_t heads,
                  int64_t kv_heads, int64_t d, int64_t block_size, float scale, int64_t window, float cap,
                  const Plan& plan) {
  const int64_t group = heads / kv_heads;
  auto win_start = [&](int64_t len) { return window > 0 ? std::max<int64_t>(0, len - window) : int64_t(0); };
  // Phase-1 items: (node, part of its rows, KV head). Parts of at most SHARED_ROWS rows; smaller
  // when that leaves threads idle (each part reads the node's K and V once more).
  struct Part {
    int64_t node, first, count;
  };
  std::vector<Part> parts;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t entries = plan.node_row_ptr[plan.nodes];
  for (int64_t n = 0; n < plan.nodes; ++n) {
    const int64_t first = plan.node_row_ptr[n], count = plan.node_row_ptr[n + 1] - first;
    if (count <= 0) continue;
    int64_t want = (threads + kv_heads * plan.nodes - 1) / (kv_heads * plan.nodes);  // parts for all threads
    want = std::max<int64_t>(want, (count + SHARED_ROWS - 1) / SHARED_ROWS);
    want = std::min<int64_t>(want, std::max<int64_t>(1, count / 4));  // >= 4 rows a part
    const int64_t per = (count + want - 1) / want;
    for (int64_t f = 0; f < count; f += per) parts.push_back({n, first + f, std::min(per, count - f)});
  }
  // Partial states per (entry, query head): the entry's row is node_rows[entry].
  std::vector<float> pm(entries * heads), pl(entries * heads), pacc(entries * heads * d);
  at::parallel_for(0, static_cast<int64_t>(parts.size()) * kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch sc(SHARED_ROWS, group, d, block_size, true);
    for (int64_t w = begin; w < end; ++w) {
      const Part& part = parts[w / kv_heads];
      const int64_t h = w % kv_heads;
      const int64_t n = part.node;
      int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
      for (int64_t i = 0; i < part.count; ++i) {
        const int64_t r = plan.node_rows[part.first + i];
        const int64_t len = row_len[r];
        sc.start[i] = std::max<int64_t>(plan.node_start[n], win_start(len));
        sc.end[i] = std::min<int64_t>(plan.node_end[n], len);
        if (sc.end[i] > sc.start[i]) {
          lo = std::min(lo, sc.start[i]);
          hi = std::max(hi, sc.end[i]);
        }
        for (int64_t g = 0; g < group; ++g) {
          const float* src = q + (r * heads + h * group + g) * d;
          float* dst = sc.qs.data() + (i * group + g) * d;
          for (int64_t x = 0; x < d; ++x) dst[x] = src[x] * scale;
        }
      }
      const int64_t nq = part.count * group;
      std::fill(sc.acc.begin(), sc.acc.begin() + nq * d, 0.f);
      std::fill(sc.m.begin(), sc.m.begin() + nq, -std::numeric_limits<float>::infinity());
      std::fill(sc.l.begin(), sc.l.begin() + nq, 0.f);
      Item it{sc.qs.data(), sc.start.data(), sc.end.data(), part.count, group,
              tables + static_cast<int64_t>(plan.node_seq[n]) * max_blocks, lo, hi,
              sc.acc.data(), sc.m.data(), sc.l.data()};
      attend<F, Q>(it, cache, block_size, kv_heads, h, d, cap, sc);
      for (int64_t i = 0; i < part.count; ++i) {
        const int64_t e = part.first + i;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t j = i * group + g, hq = h * group + g;
          pm[e * heads + hq] = sc.m[j];
          pl[e * heads + hq] = sc.l[j];
          std::copy(sc.acc.begin() + j * d, sc.acc.begin() + (j + 1) * d, pacc.begin() + (e * heads + hq) * d);
        }
      }
    }
  });
  // Each row's entries (a row is in at most one node per depth of the tree).
  std::vector<int64_t> row_ptr(rows + 1, 0), row_entries(entries);
  for (int64_t e = 0; e < entries; ++e) ++row_ptr[plan.node_rows[e] + 1];
  for (int64_t r = 0; r < rows; ++r) row_ptr[r + 1] += row_ptr[r];
  {
    std::vector<int64_t> fill(row_ptr.begin(), row_ptr.end() - 1);
    for (int64_t e = 0; e < entries; ++e) row_entries[fill[plan.node_rows[e]]++] = e;
  }
  // Phase 2: tiles of consecutive rows of one sequence, as paged_attention.
  struct Tile {
    int64_t first, count, seq;
  };
  std::vector<Tile> tiles;
  for (int64_t r = 0; r < rows;) {
    if (row_len[r] <= 0) { ++r; continue; }
    int64_t n = 1;
    while (r + n < rows && n < TILE && row_seq[r + n] == row_seq[r] && row_len[r + n] > 0) ++n;
    tiles.push_back({r, n, row_seq[r]});
    r += n;
  }
  at::parallel_for(0, static_cast<int64_t>(tiles.size()) * kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch sc(TILE, group, d, block_size, false);
    for (int64_t w = begin; w < end; ++w) {
      const Tile& tile = tiles[w / kv_heads];
      const int64_t h = w % kv_heads;
      int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
      for (int64_t i = 0; i < tile.count; ++i) {
        const int64_t r = tile.first + i;
        const int64_t len = row_len[r];
        sc.start[i] = std::max<int64_t>(plan.row_own_start[r], win_start(len));
        sc.end[i] = len;
        if (sc.end[i] > sc.start[i]) {
          lo = std::min(lo, sc.start[i]);
          hi = std::max(hi, sc.end[i]);
        }
        for (int64_t g = 0; g < group; ++g) {
          const int64_t j = i * group + g, hq = h * group + g;
          const float* src = q + (r * heads + hq) * d;
          float* dst = sc.qs.data() + j * d;
          for (int64_t x = 0; x < d; ++x) dst[x] = src[x] * scale;
          // the starting state: the row's shared partials merged (log-sum-exp rule)
          float m = -std::numeric_limits<float>::infinity(), l = 0.f;
          float* acc = sc.acc.data() + j * d;
          std::fill(acc, acc + d, 0.f);
          for (int64_t k = row_ptr[r]; k < row_ptr[r + 1]; ++k) {
            const int64_t e = row_entries[k];
            const float m2 = pm[e * heads + hq];
            if (m2 == -std::numeric_limits<float>::infinity()) continue;  // nothing visible there
            const float mn = std::max(m, m2);
            const float a = std::exp(m - mn), b = std::exp(m2 - mn);
            const float* acc2 = pacc.data() + (e * heads + hq) * d;
            for (int64_t x = 0; x < d; ++x) acc[x] = acc[x] * a + acc2[x] * b;
            l = l * a + pl[e * heads + hq] * b;
            m = mn;
          }
          sc.m[j] = m;
          sc.l[j] = l;
        }
      }
      Item it{sc.qs.data(), sc.start.data(), sc.end.data(), tile.count, group,
              tables + tile.seq * max_blocks, lo, hi, sc.acc.data(), sc.m.data(), sc.l.data()};
      attend<F, Q>(it, cache, block_size, kv_heads, h, d, cap, sc);
      for (int64_t i = 0; i < tile.count; ++i) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t j = i * group + g;
          float* dst = out + ((tile.first + i) * heads + h * group + g) * d;
          const float inv = sc.l[j] > 0.f ? 1.f / sc.l[j] : 0.f;
          const float* aj = sc.acc.data() + j * d;
          for (int64_t x = 0; x < d; ++x) dst[x] = aj[x] * inv;
        }
      }
    }
  });
}

bool scaled_format(at::ScalarType t) {
  return t == at::kChar || t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

void check_i32(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous() && t.dim() == 1 && t.numel() == n,
              "cascade_attention: ", what, " must be a contiguous int32 vector of ", n, " values, got ",
              t.sizes(), " ", t.scalar_type());
}

void check_scales(const std::optional<at::Tensor>& s, int64_t blocks, int64_t kv_heads) {
  TORCH_CHECK(s.has_value() && s->scalar_type() == at::kFloat && s->is_contiguous() && s->dim() == 2 &&
                  s->size(0) == blocks && s->size(1) == kv_heads,
              "cascade_attention: 8-bit blocks need k_scales and v_scales: [8-bit blocks, kv_heads] float32");
}

// paged_attention's arguments, then the step's shared runs (see the top of this file): node_seq,
// node_start, node_end [N] int32; node_row_ptr [N + 1] int32; node_rows [E] int32; row_own_start
// [rows] int32. A mixed pool (paged_attention_mixed's): k_cache / v_cache hold the full-precision
// blocks (ids below quant_base), k_quant / v_quant [Q, block_size, kv_heads, d] the 8-bit ones
// (id - quant_base) with k_scales / v_scales [Q, kv_heads]. Otherwise k_cache / v_cache are the
// whole pool (8-bit pools with their scales, as paged_attention).
void cascade_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& row_seq,
                       const at::Tensor& row_len, double scale, int64_t sliding_window,
                       const std::optional<at::Tensor>& k_scales, const std::optional<at::Tensor>& v_scales,
                       double softcap, const at::Tensor& node_seq, const at::Tensor& node_start,
                       const at::Tensor& node_end, const at::Tensor& node_row_ptr, const at::Tensor& node_rows,
                       const at::Tensor& row_own_start, const std::optional<at::Tensor>& k_quant,
                       const std::optional<at::Tensor>& v_quant, int64_t quant_base) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [rows, heads, d] float32");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(), "out like q");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(), "k/v cache layout");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(), "k/v cache");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables: [seqs, max_blocks] int32");
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && heads % kv_heads == 0, "head_dim / GQA mismatch");
  check_i32(row_seq, rows, "row_seq");
  check_i32(row_len, rows, "row_len");
  const int64_t nodes = node_seq.numel();
  check_i32(node_seq, nodes, "node_seq");
  check_i32(node_start, nodes, "node_start");
  check_i32(node_end, nodes, "node_end");
  check_i32(node_row_ptr, nodes + 1, "node_row_ptr");
  const int64_t entries = node_row_ptr.data_ptr<int32_t>()[nodes];
  check_i32(node_rows, entries, "node_rows");
  check_i32(row_own_start, rows, "row_own_start");
  const int64_t seqs = block_tables.size(0), max_blocks = block_tables.size(1);
  for (int64_t n = 0; n < nodes; ++n) {
    const int32_t s = node_seq.data_ptr<int32_t>()[n];
    TORCH_CHECK(s >= 0 && s < seqs, "cascade_attention: node_seq ", s, " is not a row of block_tables");
    TORCH_CHECK(node_start.data_ptr<int32_t>()[n] >= 0 &&
                    node_end.data_ptr<int32_t>()[n] <= max_blocks * block_size,
                "cascade_attention: node ", n, " reaches past the block table");
  }
  for (int64_t e = 0; e < entries; ++e) {
    const int32_t r = node_rows.data_ptr<int32_t>()[e];
    TORCH_CHECK(r >= 0 && r < rows, "cascade_attention: node_rows holds ", r, ", not a row");
  }
  // The two storages: full (F) below base, 8-bit (Q) from base on.
  const at::Tensor* full = nullptr;
  const at::Tensor* kq = nullptr;
  const at::Tensor* vq = nullptr;
  int64_t base = 0;
  if (k_quant.has_value()) {
    TORCH_CHECK(v_quant.has_value() && k_quant->sizes() == v_quant->sizes() && k_quant->is_contiguous() &&
                    v_quant->is_contiguous() && k_quant->dim() == 4 && k_quant->size(1) == block_size &&
                    k_quant->size(2) == kv_heads && k_quant->size(3) == d &&
                    k_quant->scalar_type() == v_quant->scalar_type() && scaled_format(k_quant->scalar_type()),
                "cascade_attention: k_quant / v_quant: [8-bit blocks, block_size, kv_heads, d] int8 / fp8, "
                "contiguous, alike");
    TORCH_CHECK(!scaled_format(k_cache.scalar_type()), "cascade_attention: a mixed pool's k_cache is full precision");
    TORCH_CHECK(quant_base >= 0 && quant_base <= k_cache.size(0), "cascade_attention: quant_base out of range");
    full = &k_cache;
    kq = &*k_quant;
    vq = &*v_quant;
    base = quant_base;
  } else if (scaled_format(k_cache.scalar_type())) {
    kq = &k_cache;
    vq = &v_cache;
    base = 0;
  } else {
    full = &k_cache;
    base = k_cache.size(0);
  }
  if (kq != nullptr) {
    check_scales(k_scales, kq->size(0), kv_heads);
    check_scales(v_scales, kq->size(0), kv_heads);
  }
  Plan plan{node_seq.data_ptr<int32_t>(), node_start.data_ptr<int32_t>(), node_end.data_ptr<int32_t>(),
            node_row_ptr.data_ptr<int32_t>(), node_rows.data_ptr<int32_t>(), row_own_start.data_ptr<int32_t>(),
            nodes};
  auto run = [&](auto ftag, auto qtag) {
    using F = decltype(ftag);
    using Q = decltype(qtag);
    Cache<F, Q> cache{full ? reinterpret_cast<const F*>(k_cache.data_ptr()) : nullptr,
                      full ? reinterpret_cast<const F*>(v_cache.data_ptr()) : nullptr,
                      kq ? reinterpret_cast<const Q*>(kq->data_ptr()) : nullptr,
                      vq ? reinterpret_cast<const Q*>(vq->data_ptr()) : nullptr,
                      kq ? k_scales->data_ptr<float>() : nullptr, kq ? v_scales->data_ptr<float>() : nullptr, base};
    cascade_impl<F, Q>(q.data_ptr<float>(), cache, block_tables.data_ptr<int32_t>(), max_blocks,
                       row_seq.data_ptr<int32_t>(), row_len.data_ptr<int32_t>(), out.data_ptr<float>(), rows, heads,
                       kv_heads, d, block_size, static_cast<float>(scale), sliding_window,
                       static_cast<float>(softcap), plan);
  };
  auto with_quant = [&](auto ftag) {
    switch (kq ? kq->scalar_type() : at::kChar) {
      case at::kChar: run(ftag, int8_t{}); break;
      case at::kFloat8_e4m3fn: run(ftag, c10::Float8_e4m3fn{}); break;
      case at::kFloat8_e5m2: run(ftag, c10::Float8_e5m2{}); break;
      default: TORCH_CHECK(false, "cascade_attention: unsupported 8-bit block dtype ", kq->scalar_type());
    }
  };
  switch (full ? full->scalar_type() : at::kFloat) {
    case at::kFloat: with_quant(float{}); break;
    case at::kHalf: with_quant(c10::Half{}); break;
    case at::kBFloat16: with_quant(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, "cascade_attention: unsupported cache dtype ", full->scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedkv, m) {
  m.def("cascade_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor row_seq, Tensor row_len, float scale, int sliding_window, Tensor? k_scales, Tensor? v_scales, "
        "float softcap, Tensor node_seq, Tensor node_start, Tensor node_end, Tensor node_row_ptr, "
        "Tensor node_rows, Tensor row_own_start, Tensor? k_quant=None, Tensor? v_quant=None, "
        "int quant_base=0) -> ()");
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("cascade_attention", &cascade_attention);
}

