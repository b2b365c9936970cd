// Paged attention on the CPU, reading K and V where they lie in the block pool.
//
// One kernel serves decode and prefill/extend: every query row r has a sequence (a row of the
// block tables) and a visible length len[r] (its position + 1, so causality is a length limit);
// with a sliding window w it sees positions [len - w, len). Rows with len 0 are skipped. A
// soft-cap c > 0 (Gemma 2) bounds each scaled score s to c * tanh(s / c) before the softmax.
//
// Work item = (tile of up to TILE consecutive rows of one sequence, KV head). Each key block is
// read once per tile and used by every query row of the tile and every query head of the KV
// head's group (GQA), with an online softmax per (row, query head): no gathered or padded copy of
// K or V is ever made.
//
// Block formats: float32, float16, bfloat16 (values as stored), and the 8-bit formats int8,
// fp8 e4m3 and fp8 e5m2, which carry one float32 scale per (block, KV head) for K and one for V
// (value = stored * scale). Scales are constant over a block, so they are folded into the scores
// (K) and the softmax weights (V): a quantized block is never expanded to full precision.
// A mixed pool (paged_attention_mixed) holds both: block ids [0, base) in a float format, ids from
// base in an 8-bit one with their scales, so the kernel picks each block's format from its id; K and
// V have a base each (kv_quant_parts "v": K of every block at full precision, only V mixed).
// Everything accumulates in float32. write_kv_scaled stores new tokens into 8-bit blocks (see
// there for how a block's scale follows the tokens appended to it).
//
// With AVX2+FMA (and F16C for float16 / fp8), head_dim 64 or 128 takes a vector path: the context
// is walked in chunks of CHUNK tokens (row pointers through the block table, so the block size
// does not matter), scores of 8 tokens at a time with independent accumulators, a vector exp,
// and the V sum in registers; 8 stored values become 8 floats in one or two instructions.
// Everything else takes the portable loop (auto-vectorized over head_dim).

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd_common.h"  // Vec<S>, exp256, reduce8, hsum (shared with cascade_attention.cpp)

#ifdef PAGEDKV_SIMD_AVX2
#define PAGEDKV_AVX2 1
using namespace pagedkv_simd;
#endif

namespace {

constexpr int TILE = 16;

// The 8-bit formats: the largest stored magnitude, and float -> stored (round to nearest, saturating).
template <typename S>
struct Quant;
template <>
struct Quant<int8_t> {
  static constexpr float qmax = 127.f;
  static int8_t q(float x) { return static_cast<int8_t>(std::nearbyint(std::clamp(x, -qmax, qmax))); }
};
template <>
struct Quant<c10::Float8_e4m3fn> {
  static constexpr float qmax = 448.f;
  static c10::Float8_e4m3fn q(float x) { return c10::Float8_e4m3fn(std::clamp(x, -qmax, qmax)); }
};
template <>
struct Quant<c10::Float8_e5m2> {
  static constexpr float qmax = 57344.f;
  static c10::Float8_e5m2 q(float x) { return c10::Float8_e5m2(std::clamp(x, -qmax, qmax)); }
};

template <typename S>
inline float to_f(S x) { return static_cast<float>(x); }

template <typename S>
inline float dot(const float* __restrict q, const S* __restrict k, int d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < d; ++i) s += q[i] * to_f(k[i]);
  return s;
}

template <typename S>
inline void axpy(float a, const S* __restrict v, float* __restrict acc, int d) {
#pragma omp simd
  for (int i = 0; i < d; ++i) acc[i] += a * to_f(v[i]);
}

struct Tile {
  int64_t first, count, seq;
};

// Where one layer's K and V live: the caches [num_blocks, block_size, kv_heads, d] and, for the
// 8-bit formats, their scales [num_blocks, kv_heads] (null otherwise).
template <typename S>
struct Cache {
  const S* k;
  const S* v;
  const float* k_scale;
  const float* v_scale;
};

// A mixed pool's one layer: block ids [0, v_base) have V at full precision (SF) in v [v_base,
// block_size, kv_heads, d]; ids >= v_base have V 8-bit (SQ) at id - v_base in qv [num_quant_v,
// block_size, kv_heads, d] with scales [num_quant_v, kv_heads]; K alike with its own k_base (equal
// to v_base when K and V are both 8-bit, the number of blocks when K is all full precision). The
// format of a block's K and V is its id's range.
template <typename SF, typename SQ>
struct MixedCache {
  const SF* k;
  const SF* v;
  const SQ* qk;
  const SQ* qv;
  const float* k_scale;
  const float* v_scale;
  int64_t k_base;
  int64_t v_base;
};

#ifdef PAGEDKV_AVX2
// One work item (a tile of rows x one KV head) on the vector path. qs: the tile's scaled queries
// [nr * group][D]; acc/m/l: the online-softmax state per (row, query head). float32 rows are read
// where they lie; any other format is converted chunk by chunk into an L1/L2-resident float buffer
// (its block scale folded in; ``conv`` holds 2 * CHUNK * D floats), so each stored value is
// converted once per tile, not once per query head of the group, and the inner loops are the
// float32 ones.
template <int D, typename S, bool SCALED>
void attend_vec(const float* qs, const int64_t* row_start, const int64_t* row_end, int64_t nr, int64_t group,
                const Cache<S>& cache, const int32_t* table, int64_t block_size, int64_t kv_heads, int64_t h,
                int64_t lo, int64_t hi, float* acc, float* m, float* l, float* conv, float cap) {
  constexpr int NV = D / 8;
  constexpr bool convert = !std::is_same_v<S, float>;
  float* kbuf = conv;  // [CHUNK * D] each, 32-byte aligned (converted formats only)
  float* vbuf = conv + CHUNK * D;
  const int64_t row_stride = kv_heads * D;
  const float* kp[CHUNK];
  const float* vp[CHUNK];
  for (int64_t c0 = lo; c0 < hi; c0 += CHUNK) {
    const int64_t c1 = std::min<int64_t>(c0 + CHUNK, hi);
    for (int64_t t = c0; t < c1; ++t) {
      const int64_t blk = table[t / block_size];
      const int64_t off = (blk * block_size + t % block_size) * row_stride + h * D;
      if constexpr (convert) {
        float* kd = kbuf + (t - c0) * D;
        float* vd = vbuf + (t - c0) * D;
        const S* ksrc = cache.k + off;
        const S* vsrc = cache.v + off;
        const __m256 kscale = _mm256_set1_ps(SCALED ? cache.k_scale[blk * kv_heads + h] * Vec<S>::unit : 1.f);
        const __m256 vscale = _mm256_set1_ps(SCALED ? cache.v_scale[blk * kv_heads + h] * Vec<S>::unit : 1.f);
        for (int v = 0; v < NV; ++v) {
          _mm256_store_ps(kd + 8 * v, _mm256_mul_ps(Vec<S>::load(ksrc + 8 * v), kscale));
          _mm256_store_ps(vd + 8 * v, _mm256_mul_ps(Vec<S>::load(vsrc + 8 * v), vscale));
        }
        kp[t - c0] = kd;
        vp[t - c0] = vd;
      } else {
        kp[t - c0] = cache.k + off;
        vp[t - c0] = cache.v + off;
      }
    }
    attend_rows<D>(qs, row_start, row_end, nr, group, c0, c1, kp, vp, acc, m, l, cap);
  }
}

// D stored values of type S times ``scale`` (unit folded in) -> dst (32-byte aligned floats).
template <int D, typename S>
__attribute__((always_inline)) inline void convert_row(const S* src, float scale, float* dst) {
  const __m256 sv = _mm256_set1_ps(scale * Vec<S>::unit);
  for (int v = 0; v < D / 8; ++v) _mm256_store_ps(dst + 8 * v, _mm256_mul_ps(Vec<S>::load(src + 8 * v), sv));
}

// One K (or V) row of a mixed pool as float32: a full-precision block's row where it lies (float32)
// or converted into dst, an 8-bit block's (id >= base, at id - base) converted with its scale.
template <int D, typename SF, typename SQ>
__attribute__((always_inline)) inline const float* mixed_row(const SF* full, const SQ* quant, const float* scales,
                                                             int64_t base, int64_t blk, int64_t in_block,
                                                             int64_t block_size, int64_t row_stride,
                                                             int64_t kv_heads, int64_t h, float* dst) {
  if (blk >= base) {
    const int64_t qb = blk - base;
    convert_row<D>(quant + (qb * block_size + in_block) * row_stride + h * D, scales[qb * kv_heads + h], dst);
    return dst;
  }
  const int64_t off = (blk * block_size + in_block) * row_stride + h * D;
  if constexpr (std::is_same_v<SF, float>) {
    return full + off;
  } else {
    convert_row<D>(full + off, 1.f, dst);
    return dst;
  }
}

// The same over a mixed pool (MixedCache): per block, rows of a full-precision block are read in
// place (float32) or converted, rows of an 8-bit block converted with their block's scales (K and
// V each by its own base).
template <int D, typename SF, typename SQ>
void attend_vec_mixed(const float* qs, const int64_t* row_start, const int64_t* row_end, int64_t nr,
                      int64_t group, const MixedCache<SF, SQ>& cache, const int32_t* table, int64_t block_size,
                      int64_t kv_heads, int64_t h, int64_t lo, int64_t hi, float* acc, float* m, float* l,
                      float* conv, float cap) {
  float* kbuf = conv;
  float* vbuf = conv + CHUNK * D;
  const int64_t row_stride = kv_heads * D;
  const float* kp[CHUNK];
  const float* vp[CHUNK];
  for (int64_t c0 = lo; c0 < hi; c0 += CHUNK) {
    const int64_t c1 = std::min<int64_t>(c0 + CHUNK, hi);
    for (int64_t t = c0; t < c1; ++t) {
      const int64_t blk = table[t / block_size];
      const int64_t in_block = t % block_size;
      kp[t - c0] = mixed_row<D>(cache.k, cache.qk, cache.k_scale, cache.k_base, blk, in_block, block_size,
                                row_stride, kv_heads, h, kbuf + (t - c0) * D);
      vp[t - c0] = mixed_row<D>(cache.v, cache.qv, cache.v_scale, cache.v_base, blk, in_block, block_size,
                                row_stride, kv_heads, h, vbuf + (t - c0) * D);
    }
    attend_rows<D>(qs, row_start, row_end, nr, group, c0, c1, kp, vp, acc, m, l, cap);
  }
}
#endif

template <typename S, bool SCALED>
void paged_attention_impl(const float* q, const Cache<S>& cache, const int32_t* tables, int64_t max_blocks,
                          const int32_t* row_seq, const int32_t* row_len, float* out, int64_t rows,
                          int64_t heads, int64_t kv_heads, int64_t d, int64_t block_size, float scale,
                          int64_t window, float cap) {
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
#ifdef PAGEDKV_AVX2
    // chunk buffers of the converted formats, 32-byte aligned for the vector stores
    std::vector<float> conv_store(std::is_same_v<S, float> ? 0 : 2 * CHUNK * d + 8);
    float* conv = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(conv_store.data()) + 31) & ~uintptr_t(31));
#endif
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
      bool done = false;
#ifdef PAGEDKV_AVX2
      if constexpr (Vec<S>::ok) {
        if (d == 64 || d == 128 || d == 256) {  // 256: Gemma 2/3
          int64_t starts[TILE], ends[TILE];
          for (int64_t i = 0; i < nr; ++i) {
            ends[i] = row_len[tile.first + i];
            starts[i] = window > 0 ? std::max<int64_t>(0, ends[i] - window) : 0;
          }
          auto fn = d == 64 ? attend_vec<64, S, SCALED> : d == 128 ? attend_vec<128, S, SCALED>
                                                                   : attend_vec<256, S, SCALED>;
          fn(qs.data(), starts, ends, nr, group, cache, table, block_size, kv_heads, h, lo, hi, acc.data(),
             m.data(), l.data(), conv, cap);
          done = true;
        }
      }
#endif
      for (int64_t b = lo / block_size; !done && b * block_size < hi; ++b) {
        const int64_t base = b * block_size;
        const int64_t blk = table[b];
        const int64_t off = blk * block_size * row_stride + h * d;
        const S* kb = cache.k + off;
        const S* vb = cache.v + off;
        const float k_scale = SCALED ? cache.k_scale[blk * kv_heads + h] : 1.f;
        const float v_scale = SCALED ? cache.v_scale[blk * kv_heads + h] : 1.f;
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
              pj[t] = dot(qj, kb + t * row_stride, static_cast<int>(d)) * k_scale;
              if (cap > 0.f) pj[t] = cap * std::tanh(pj[t] / cap);
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
            for (int64_t t = t0; t < t1; ++t) axpy(pj[t] * v_scale, vb + t * row_stride, aj, static_cast<int>(d));
          }
        }
      }
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

// The portable loop over one key block of a tile (block ``b`` of the sequence, its K and V rows
// at kb / vb, row_stride apart, times k_scale / v_scale): scores, online softmax, V sum.
template <typename SK, typename SV>
inline void attend_block(const SK* kb, const SV* vb, float k_scale, float v_scale, int64_t b, const float* qs,
                         const int32_t* lens, int64_t nr, int64_t group, int64_t d, int64_t block_size,
                         int64_t row_stride, int64_t window, float cap, float* acc, float* m, float* l, float* p) {
  const int64_t base = b * block_size;
  for (int64_t i = 0; i < nr; ++i) {
    const int64_t len = lens[i];
    const int64_t start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t t0 = std::max<int64_t>(base, start) - base;
    const int64_t t1 = std::min<int64_t>(base + block_size, len) - base;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t j = i * group + g;
      float* pj = p + j * block_size;
      if (t1 <= t0) continue;
      const float* qj = qs + j * d;
      float mb = m[j];
      for (int64_t t = t0; t < t1; ++t) {
        pj[t] = dot(qj, kb + t * row_stride, static_cast<int>(d)) * k_scale;
        if (cap > 0.f) pj[t] = cap * std::tanh(pj[t] / cap);
        mb = std::max(mb, pj[t]);
      }
      const float corr = std::exp(m[j] - mb);  // 0 on the first block (m = -inf)
      float sum = 0.f;
      for (int64_t t = t0; t < t1; ++t) {
        pj[t] = std::exp(pj[t] - mb);
        sum += pj[t];
      }
      float* aj = acc + j * d;
      if (corr != 1.f) {
        for (int64_t x = 0; x < d; ++x) aj[x] *= corr;
      }
      l[j] = l[j] * corr + sum;
      m[j] = mb;
      for (int64_t t = t0; t < t1; ++t) axpy(pj[t] * v_scale, vb + t * row_stride, aj, static_cast<int>(d));
    }
  }
}

// A mixed pool as the driver below sees it: ``block(blk, h, f)`` calls f with the block's K and V rows
// of KV head h (typed) and their scales; ``vec<D>`` runs a work item on the vector path.
template <typename SF, typename SQ>
struct TwoFormats {
  MixedCache<SF, SQ> c;
  int64_t block_size, row_stride, kv_heads, d;
  static constexpr bool converts = true;
  template <typename F>
  void block(int64_t blk, int64_t h, F&& f) const {
    // K and V each from its own storage (a block may hold full-precision K beside 8-bit V)
    auto with_v = [&](const auto* kb, float k_scale) {
      if (blk >= c.v_base) {
        const int64_t qb = blk - c.v_base;
        f(kb, c.qv + qb * block_size * row_stride + h * d, k_scale, c.v_scale[qb * kv_heads + h]);
      } else {
        f(kb, c.v + blk * block_size * row_stride + h * d, k_scale, 1.f);
      }
    };
    if (blk >= c.k_base) {
      const int64_t qb = blk - c.k_base;
      with_v(c.qk + qb * block_size * row_stride + h * d, c.k_scale[qb * kv_heads + h]);
    } else {
      with_v(c.k + blk * block_size * row_stride + h * d, 1.f);
    }
  }
#ifdef PAGEDKV_AVX2
  static constexpr bool vec_ok = Vec<SF>::ok && Vec<SQ>::ok;
  template <int D>
  void vec(const float* qs, const int64_t* starts, const int64_t* ends, int64_t nr, int64_t group,
           const int32_t* table, int64_t h, int64_t lo, int64_t hi, float* acc, float* m, float* l, float* conv,
           float cap) const {
    if constexpr (vec_ok)
      attend_vec_mixed<D, SF, SQ>(qs, starts, ends, nr, group, c, table, block_size, kv_heads, h, lo, hi, acc, m,
                                  l, conv, cap);
  }
#endif
};

// The tile driver of paged_attention_impl over a mixed pool (kept apart, so the single-format
// path above stays as it was).
template <typename Pool>
void paged_attention_mixed_impl(const float* q, const Pool& pool, const int32_t* tables, int64_t max_blocks,
                          const int32_t* row_seq, const int32_t* row_len, float* out, int64_t rows,
                          int64_t heads, int64_t kv_heads, int64_t d, int64_t block_size, float scale,
                          int64_t window, float cap) {
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
#ifdef PAGEDKV_AVX2
    // chunk buffers of the converted formats, 32-byte aligned for the vector stores
    std::vector<float> conv_store(Pool::converts ? 2 * CHUNK * d + 8 : 0);
    float* conv = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(conv_store.data()) + 31) & ~uintptr_t(31));
#endif
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
      bool done = false;
#ifdef PAGEDKV_AVX2
      if constexpr (Pool::vec_ok) {
        if (d == 64 || d == 128 || d == 256) {  // 256: Gemma 2/3
          int64_t starts[TILE], ends[TILE];
          for (int64_t i = 0; i < nr; ++i) {
            ends[i] = row_len[tile.first + i];
            starts[i] = window > 0 ? std::max<int64_t>(0, ends[i] - window) : 0;
          }
          if (d == 64) {
            pool.template vec<64>(qs.data(), starts, ends, nr, group, table, h, lo, hi, acc.data(), m.data(),
                                  l.data(), conv, cap);
          } else if (d == 128) {
            pool.template vec<128>(qs.data(), starts, ends, nr, group, table, h, lo, hi, acc.data(), m.data(),
                                   l.data(), conv, cap);
          } else {
            pool.template vec<256>(qs.data(), starts, ends, nr, group, table, h, lo, hi, acc.data(), m.data(),
                                   l.data(), conv, cap);
          }
          done = true;
        }
      }
#endif
      const int32_t* lens = row_len + tile.first;
      for (int64_t b = lo / block_size; !done && b * block_size < hi; ++b) {
        pool.block(table[b], h, [&](const auto* kb, const auto* vb, float k_scale, float v_scale) {
          attend_block(kb, vb, k_scale, v_scale, b, qs.data(), lens, nr, group, d, block_size, row_stride, window,
                       cap, acc.data(), m.data(), l.data(), p.data());
        });
      }
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

bool is_scaled(at::ScalarType t) {
  return t == at::kChar || t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

// q [rows, heads, d] float32; k_cache, v_cache [num_blocks, block_size, kv_heads, d];
// block_tables [seqs, max_blocks] int32; row_seq, row_len [rows] int32; out [rows, heads, d]
// float32 (rows with row_len 0 are left as they are); k_scales, v_scales [num_blocks, kv_heads]
// float32 for the 8-bit formats (None for the float ones).
void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& row_seq, const at::Tensor& row_len, double scale,
                     int64_t sliding_window, const std::optional<at::Tensor>& k_scales,
                     const std::optional<at::Tensor>& v_scales, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [rows, heads, d] float32");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(), "out like q");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(), "k/v cache layout");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(), "k/v cache");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables: [seqs, max_blocks] int32");
  TORCH_CHECK(row_seq.scalar_type() == at::kInt && row_len.scalar_type() == at::kInt, "row_seq/row_len int32");
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && heads % kv_heads == 0, "head_dim / GQA mismatch");
  TORCH_CHECK(row_seq.numel() == rows && row_len.numel() == rows, "row_seq/row_len: one per row");
  const at::ScalarType st = k_cache.scalar_type();
  const bool scaled = is_scaled(st);
  if (scaled) {
    for (const auto* s : {&k_scales, &v_scales}) {
      TORCH_CHECK(s->has_value() && (*s)->scalar_type() == at::kFloat && (*s)->is_contiguous() &&
                      (*s)->dim() == 2 && (*s)->size(0) == num_blocks && (*s)->size(1) == kv_heads,
                  "8-bit caches need k_scales and v_scales: [num_blocks, kv_heads] float32");
    }
  }
  auto run = [&](auto tag) {
    using S = decltype(tag);
    Cache<S> cache{reinterpret_cast<const S*>(k_cache.data_ptr()), reinterpret_cast<const S*>(v_cache.data_ptr()),
                   scaled ? k_scales->data_ptr<float>() : nullptr, scaled ? v_scales->data_ptr<float>() : nullptr};
    auto impl = scaled ? paged_attention_impl<S, true> : paged_attention_impl<S, false>;
    impl(q.data_ptr<float>(), cache, block_tables.data_ptr<int32_t>(), block_tables.size(1),
         row_seq.data_ptr<int32_t>(), row_len.data_ptr<int32_t>(), out.data_ptr<float>(), rows, heads, kv_heads,
         d, block_size, static_cast<float>(scale), sliding_window, static_cast<float>(softcap));
  };
  switch (st) {
    case at::kFloat: run(float{}); break;
    case at::kHalf: run(c10::Half{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kChar: run(int8_t{}); break;
    case at::kFloat8_e4m3fn: run(c10::Float8_e4m3fn{}); break;
    case at::kFloat8_e5m2: run(c10::Float8_e5m2{}); break;
    default: TORCH_CHECK(false, "paged_attention: unsupported cache dtype ", st);
  }
}

// A mixed pool (see MixedCache): k_cache [k_base, block_size, kv_heads, d] in a float format
// (float32, float16, bfloat16) holds the K of block ids [0, k_base); k_quant [num_blocks - k_base,
// block_size, kv_heads, d] in an 8-bit format (int8, fp8 e4m3, e5m2) with k_scales [num_blocks -
// k_base, kv_heads] float32 the K of ids [k_base, num_blocks); V alike with its own base v_base =
// v_cache.size(0) (K and V both 8-bit: k_base = v_base; kv_quant_parts "v": k_base = num_blocks,
// k_quant and k_scales empty). Everything else as paged_attention.
void paged_attention_mixed(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& k_quant, const at::Tensor& v_quant,
                           const at::Tensor& k_scales, const at::Tensor& v_scales, const at::Tensor& block_tables,
                           const at::Tensor& row_seq, const at::Tensor& row_len, double scale,
                           int64_t sliding_window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [rows, heads, d] float32");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(), "out like q");
  auto same_blocks = [](const at::Tensor& a, const at::Tensor& b) {
    return a.dim() == 4 && b.dim() == 4 && a.size(1) == b.size(1) && a.size(2) == b.size(2) && a.size(3) == b.size(3);
  };
  TORCH_CHECK(same_blocks(k_cache, v_cache) && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == v_cache.scalar_type() && !is_scaled(k_cache.scalar_type()),
              "k_cache/v_cache: [k_base / v_base, block_size, kv_heads, d] float32/float16/bfloat16, contiguous");
  TORCH_CHECK(same_blocks(k_quant, v_quant) && k_quant.is_contiguous() && v_quant.is_contiguous() &&
                  k_quant.scalar_type() == v_quant.scalar_type() && is_scaled(k_quant.scalar_type()),
              "k_quant/v_quant: [num_quant, block_size, kv_heads, d] int8/fp8, contiguous");
  TORCH_CHECK(same_blocks(k_quant, k_cache), "the two storages' blocks differ in shape");
  TORCH_CHECK(k_cache.size(0) + k_quant.size(0) == v_cache.size(0) + v_quant.size(0),
              "K and V must cover the same block ids (k_cache + k_quant blocks == v_cache + v_quant blocks)");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "block_tables: [seqs, max_blocks] int32");
  TORCH_CHECK(row_seq.scalar_type() == at::kInt && row_len.scalar_type() == at::kInt, "row_seq/row_len int32");
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && heads % kv_heads == 0, "head_dim / GQA mismatch");
  TORCH_CHECK(row_seq.numel() == rows && row_len.numel() == rows, "row_seq/row_len: one per row");
  for (const auto& [s, quant] : {std::pair{&k_scales, &k_quant}, std::pair{&v_scales, &v_quant}}) {
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && s->dim() == 2 &&
                    s->size(0) == quant->size(0) && s->size(1) == kv_heads,
                "k_scales/v_scales: [num_quant, kv_heads] float32 (one row per block of k_quant/v_quant)");
  }
  auto run = [&](auto full_tag, auto quant_tag) {
    using SF = decltype(full_tag);
    using SQ = decltype(quant_tag);
    MixedCache<SF, SQ> cache{reinterpret_cast<const SF*>(k_cache.data_ptr()),
                             reinterpret_cast<const SF*>(v_cache.data_ptr()),
                             reinterpret_cast<const SQ*>(k_quant.data_ptr()),
                             reinterpret_cast<const SQ*>(v_quant.data_ptr()), k_scales.data_ptr<float>(),
                             v_scales.data_ptr<float>(), k_cache.size(0), v_cache.size(0)};
    paged_attention_mixed_impl(q.data_ptr<float>(), TwoFormats<SF, SQ>{cache, block_size, kv_heads * d, kv_heads, d},
                         block_tables.data_ptr<int32_t>(), block_tables.size(1), row_seq.data_ptr<int32_t>(),
                         row_len.data_ptr<int32_t>(), out.data_ptr<float>(), rows, heads, kv_heads, d, block_size,
                         static_cast<float>(scale), sliding_window, static_cast<float>(softcap));
  };
  auto with_quant = [&](auto full_tag) {
    switch (k_quant.scalar_type()) {
      case at::kChar: run(full_tag, int8_t{}); break;
      case at::kFloat8_e4m3fn: run(full_tag, c10::Float8_e4m3fn{}); break;
      default: run(full_tag, c10::Float8_e5m2{}); break;
    }
  };
  switch (k_cache.scalar_type()) {
    case at::kFloat: with_quant(float{}); break;
    case at::kHalf: with_quant(c10::Half{}); break;
    default: with_quant(c10::BFloat16{}); break;
  }
}

// Store T new tokens x [T, kv_heads, d] (float32) at their slots (block * block_size + offset) of an
// 8-bit cache [num_blocks, block_size, kv_heads, d] with scales [num_blocks, kv_heads].
//
// A block's scale is absmax / qmax of what it holds, per KV head. Tokens fill a block in order, so
// the tokens of one call that land in one block are a run of consecutive slots: a run that starts
// at offset 0 opens the block and sets its scale from the run alone; a later run whose absmax
// exceeds the scale grows it and requantizes the block's filled slots [0, first offset) to the new
// scale (one extra rounding for those values; the scale never shrinks while the block fills).
// err (float64 [2]) accumulates sum((dequantized - x)^2) and sum(x^2) over the stored rows.
template <typename S>
void write_kv_scaled_impl(S* cache, float* scales, const float* x, const int64_t* slots, int64_t T,
                          int64_t kv_heads, int64_t d, int64_t block_size, double* err) {
  using Q = Quant<S>;
  const int64_t row_stride = kv_heads * d;
  double e2 = 0.0, r2 = 0.0;
  for (int64_t i = 0; i < T;) {
    const int64_t b = slots[i] / block_size;
    int64_t j = i + 1;
    while (j < T && slots[j] / block_size == b && slots[j] == slots[j - 1] + 1) ++j;
    const int64_t first = slots[i] % block_size;
    for (int64_t h = 0; h < kv_heads; ++h) {
      float amax = 0.f;
      for (int64_t r = i; r < j; ++r) {
        const float* src = x + r * row_stride + h * d;
        for (int64_t c = 0; c < d; ++c) {
          const float a = std::fabs(src[c]);
          if (a > amax) amax = a;  // NaN never compares greater
        }
      }
      const float need = std::min(amax, FLT_MAX) / Q::qmax;
      float& s = scales[b * kv_heads + h];
      if (first == 0) {
        s = need;
      } else if (need > s) {
        const float ratio = s / need;
        for (int64_t t = 0; t < first; ++t) {
          S* row = cache + (b * block_size + t) * row_stride + h * d;
          for (int64_t c = 0; c < d; ++c) row[c] = Q::q(static_cast<float>(row[c]) * ratio);
        }
        s = need;
      }
      const float inv = s > 0.f ? 1.f / s : 0.f;
      for (int64_t r = i; r < j; ++r) {
        const float* src = x + r * row_stride + h * d;
        S* dst = cache + slots[r] * row_stride + h * d;
        for (int64_t c = 0; c < d; ++c) {
          const S v = Q::q(src[c] * inv);
          dst[c] = v;
          const double diff = static_cast<double>(static_cast<float>(v) * s) - src[c];
          if (std::isfinite(diff)) {
            e2 += diff * diff;
            r2 += static_cast<double>(src[c]) * src[c];
          }
        }
      }
    }
    i = j;
  }
  err[0] += e2;
  err[1] += r2;
}

void write_kv_scaled(const at::Tensor& cache, const at::Tensor& scales, const at::Tensor& x,
                     const at::Tensor& slot_mapping, const at::Tensor& err) {
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous() && is_scaled(cache.scalar_type()),
              "cache: [num_blocks, block_size, kv_heads, d] int8 / fp8, contiguous");
  const int64_t num_blocks = cache.size(0), block_size = cache.size(1), kv_heads = cache.size(2), d = cache.size(3);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == num_blocks && scales.size(1) == kv_heads,
              "scales: [num_blocks, kv_heads] float32");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 3 && x.size(1) == kv_heads &&
                  x.size(2) == d, "x: [T, kv_heads, d] float32, contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == x.size(0), "slot_mapping: [T] int64");
  TORCH_CHECK(err.scalar_type() == at::kDouble && err.is_contiguous() && err.numel() == 2, "err: [2] float64");
  const int64_t T = x.size(0);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < T; ++i) {
    TORCH_CHECK(slots[i] >= 0 && slots[i] < num_blocks * block_size, "slot ", slots[i], " out of range");
  }
  auto run = [&](auto tag) {
    using S = decltype(tag);
    write_kv_scaled_impl<S>(reinterpret_cast<S*>(cache.data_ptr()), scales.data_ptr<float>(), x.data_ptr<float>(),
                            slots, T, kv_heads, d, block_size, err.data_ptr<double>());
  };
  switch (cache.scalar_type()) {
    case at::kChar: run(int8_t{}); break;
    case at::kFloat8_e4m3fn: run(c10::Float8_e4m3fn{}); break;
    default: run(c10::Float8_e5m2{}); break;
  }
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
        "Tensor row_seq, Tensor row_len, float scale, int sliding_window, Tensor? k_scales=None, "
        "Tensor? v_scales=None, float softcap=0.0) -> ()");
  m.def("paged_attention_mixed(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_quant, "
        "Tensor v_quant, Tensor k_scales, Tensor v_scales, Tensor block_tables, Tensor row_seq, Tensor row_len, "
        "float scale, int sliding_window, float softcap=0.0) -> ()");
  m.def("write_kv_scaled(Tensor(a!) cache, Tensor(b!) scales, Tensor x, Tensor slot_mapping, Tensor(c!) err) -> ()");
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_mixed", &paged_attention_mixed);
  m.impl("rms_norm", &rms_norm);
  m.impl("write_kv_scaled", &write_kv_scaled);
}
