// One pre-norm decoder layer (Llama's: RMSNorm, fused q/k/v, RoPE, paged attention, o_proj, the
// residual add with the second RMSNorm, fused gate/up, SiLU x up, down, the residual add) in one
// call, for rows that all attend through the native paged kernels.
//
// Why: at batch 1 a layer is ~0.5 ms of weight streaming behind ~20 Python-level calls (module
// calls, torch dispatches, temporaries), ~0.1 ms of interpreter a layer, 3-4 ms of a 20 ms token on
// this machine's cores. Here the same ops run from C++: each kernel is the very op the module path
// calls (through the dispatcher, so the results are bit for bit those of the Python layer), only
// the interpreter between them is gone. The Python side (pagedkv/models/native_layer.py) decides when
// a layer and a step can take this path and packs the weights; everything else stays on the module
// path.
//
// Linears: kinds[2 i] says how linear i (q/k/v, o, gate/up, down) is stored, kinds[2 i + 1] is the
// low-bit zero point; its tensors are w[2 + 6 i .. 2 + 6 i + 6) = (a, b, c, d, e, bias):
//   0 float [N, K]: a = weight                       (nn.Linear: at::linear)
//   1 float [K, N]: a = weight_t                     (InputMajorLinear: x @ W^T, addmm with a bias)
//   2 Q8_0:         a = qweight, c = scales, d = offsets       (pagedkv::q8_0_linear, + bias)
//   3 low-bit:      a = qweight, b = planes, c = scales, d = offsets, e = lut (pagedkv::lowbit_linear)
// w[0], w[1]: the two RMSNorm weights; w[26], w[27]: the q and k heads' RMSNorm weights (qwen3's
// q/k norms, before RoPE) or both None; w[28], w[29]: Gemma's pre- and post-feed-forward norms.
// kinds[8]: the layer's form, 0 Llama's (pre-norm, SwiGLU), 1 Gemma's (every sublayer's output
// normed before the residual add, w[1] the post-attention norm; GeGLU with tanh GELU).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

using OptT = std::optional<at::Tensor>;

constexpr int64_t LINEARS = 4;  // q/k/v, o, gate/up, down
constexpr int64_t SLOTS = 6;    // tensors per linear in w
constexpr int64_t QK_NORMS = 2 + SLOTS * LINEARS;  // w[QK_NORMS], w[QK_NORMS + 1]: q/k norm weights or None
constexpr int64_t FF_NORMS = QK_NORMS + 2;         // Gemma's pre/post feed-forward norms
constexpr int64_t ENTRIES = FF_NORMS + 2;

enum Kind : int64_t { FLOAT = 0, INPUT_MAJOR = 1, Q8_0 = 2, LOWBIT = 3 };

template <typename Fn>
c10::TypedOperatorHandle<Fn> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

// The ops' signatures, as their schemas in the other sources declare them.
using In = const at::Tensor&;
using Opt = const OptT&;
using RmsNormFn = void(In, In, In, double);
using AddRmsNormFn = at::Tensor(In, In, In, double);
using RopeQkFn = at::Tensor(In, In, In, int64_t, int64_t);
using SiluMulFn = at::Tensor(In);
using Q8LinearFn = void(In, In, In, In, Opt);
using LowbitLinearFn = void(In, In, In, Opt, In, Opt, Opt, int64_t);
using PagedAttentionFn = void(In, In, In, In, In, In, In, double, int64_t, Opt, Opt, double);
using CascadeAttentionFn = void(In, In, In, In, In, In, In, double, int64_t, Opt, Opt, double, In, In, In, In, In,
                                In, Opt, Opt, int64_t);
using WriteKvScaledFn = void(In, In, In, In, In);

// The ops of the module path, looked up once (the other sources of this extension register them).
struct Ops {
  c10::TypedOperatorHandle<RmsNormFn> rms_norm = handle<RmsNormFn>("pagedkv::rms_norm");
  c10::TypedOperatorHandle<AddRmsNormFn> add_rms_norm = handle<AddRmsNormFn>("pagedkv::add_rms_norm");
  c10::TypedOperatorHandle<RopeQkFn> rope_qk = handle<RopeQkFn>("pagedkv::rope_qk");
  c10::TypedOperatorHandle<SiluMulFn> silu_mul = handle<SiluMulFn>("pagedkv::silu_mul");
  c10::TypedOperatorHandle<Q8LinearFn> q8_0_linear = handle<Q8LinearFn>("pagedkv::q8_0_linear");
  c10::TypedOperatorHandle<LowbitLinearFn> lowbit_linear = handle<LowbitLinearFn>("pagedkv::lowbit_linear");
  c10::TypedOperatorHandle<PagedAttentionFn> paged_attention =
      handle<PagedAttentionFn>("pagedkv::paged_attention");
  c10::TypedOperatorHandle<CascadeAttentionFn> cascade_attention =
      handle<CascadeAttentionFn>("pagedkv::cascade_attention");
  c10::TypedOperatorHandle<WriteKvScaledFn> write_kv_scaled = handle<WriteKvScaledFn>("pagedkv::write_kv_scaled");
};

const Ops& ops() {
  static const Ops instance;  // after every source's registrations: first called from Python
  return instance;
}

at::Tensor need(const c10::List<OptT>& w, int64_t i, const char* what) {
  OptT t = w.get(i);  // (List::get returns a copy: a handle, no data copied)
  TORCH_CHECK(t.has_value(), "decoder_layer: w[", i, "] (", what, ") is missing");
  return *std::move(t);
}

// y = linear i of the layer over x [M, K], as the module path computes it.
at::Tensor linear(const c10::List<OptT>& w, const std::vector<int64_t>& kinds, int64_t i, const at::Tensor& x) {
  const int64_t s = 2 + SLOTS * i;
  const OptT bias = w.get(s + 5);
  switch (kinds[2 * i]) {
    case FLOAT:
      return at::linear(x, need(w, s, "weight"), bias);
    case INPUT_MAJOR:
      return bias.has_value() ? at::addmm(*bias, x, need(w, s, "weight_t")) : at::mm(x, need(w, s, "weight_t"));
    case Q8_0:
    case LOWBIT: {
      const at::Tensor q = need(w, s, "qweight");
      at::Tensor out = at::empty({x.size(0), q.size(0)}, x.options());
      if (kinds[2 * i] == Q8_0) {
        ops().q8_0_linear.call(out, x, q, need(w, s + 2, "scales"), w.get(s + 3));
      } else {
        ops().lowbit_linear.call(out, x, q, w.get(s + 1), need(w, s + 2, "scales"), w.get(s + 3), w.get(s + 4),
                                 kinds[2 * i + 1]);
      }
      if (bias.has_value()) out.add_(*bias);
      return out;
    }
    default:
      TORCH_CHECK(false, "decoder_layer: unknown linear kind ", kinds[2 * i]);
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {  // RMSNorm.forward's native path
  at::Tensor out = at::empty_like(x);
  ops().rms_norm.call(out, x, weight, eps);
  return out;
}

// Gemma's layer after o_proj's output o: x + norm(o), then that + norm(down(gelu(gate) * up)) of
// its pre-feed-forward norm (GemmaDecoderLayer.forward, LlamaMLP.forward with gelu).
at::Tensor gemma_mlp(const c10::List<OptT>& w, const std::vector<int64_t>& kinds, const at::Tensor& x,
                     const at::Tensor& o, double eps) {
  at::Tensor x1 = rms_norm(o, need(w, 1, "post-attention norm"), eps).add_(x);
  at::Tensor gate_up = linear(w, kinds, 2, rms_norm(x1, need(w, FF_NORMS, "pre-feed-forward norm"), eps));
  const int64_t inter = gate_up.size(1) / 2;
  at::Tensor act = at::gelu(gate_up.narrow(1, 0, inter), "tanh").mul_(gate_up.narrow(1, inter, inter));
  gate_up.reset();
  return rms_norm(linear(w, kinds, 3, act), need(w, FF_NORMS + 1, "post-feed-forward norm"), eps).add_(x1);
}

// x [T, hidden] float32 contiguous (the residual stream) -> the layer's output (a new tensor).
// cos, sin [T, 1, rd]; k_cache, v_cache [num_blocks, block_size, kv_heads, d] (float32, or 8-bit
// with k_scales, v_scales [num_blocks, kv_heads] and write_err [2, 2] float64 as write_kv_scaled);
// slots [T] int64; block_tables, row_seq, row_len as paged_attention (every row_len > 0); plan:
// empty, or cascade_attention's six node tensors (node_seq .. row_own_start); rotation [d, d] or
// None: the Hadamard basis 8-bit blocks are stored in (q, k, v rotated before, the output after).
at::Tensor decoder_layer(const at::Tensor& x, const c10::List<OptT>& w, at::IntArrayRef kinds_ref, double eps,
                         int64_t heads, int64_t kv_heads, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& k_cache, const at::Tensor& v_cache, const OptT& k_scales,
                         const OptT& v_scales, const OptT& write_err, const at::Tensor& slots,
                         const at::Tensor& block_tables, const at::Tensor& row_seq, const at::Tensor& row_len,
                         double scale, int64_t sliding_window, double softcap, at::TensorList plan,
                         const OptT& rotation) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "decoder_layer: x must be [T, hidden] float32 contiguous");
  TORCH_CHECK(static_cast<int64_t>(w.size()) == ENTRIES, "decoder_layer: w must hold ", ENTRIES,
              " entries, got ", w.size());
  TORCH_CHECK(static_cast<int64_t>(kinds_ref.size()) == 2 * LINEARS + 1, "decoder_layer: kinds must hold ",
              2 * LINEARS + 1, " entries");
  TORCH_CHECK(plan.empty() || plan.size() == 6, "decoder_layer: plan must be empty or hold 6 tensors");
  TORCH_CHECK(k_cache.dim() == 4 && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == x.size(0),
              "decoder_layer: k_cache [blocks, block_size, kv_heads, d] and one int64 slot per row, contiguous");
  const std::vector<int64_t> kinds(kinds_ref.begin(), kinds_ref.end());
  const Ops& op = ops();
  const int64_t T = x.size(0), d = k_cache.size(3);
  const bool scaled = k_scales.has_value();

  // attention sublayer (each temporary is released as soon as it is used, as Python's refcounts do on
  // the module path: a long extend chunk's peak stays the module path's)
  at::Tensor qkv = linear(w, kinds, 0, rms_norm(x, need(w, 0, "input norm"), eps));
  qkv = qkv.view({T, heads + 2 * kv_heads, d});
  const OptT q_norm = w.get(QK_NORMS), k_norm = w.get(QK_NORMS + 1);
  if (q_norm.has_value()) {  // each q and k head RMS-normed (the module path's F.rms_norm over 3-d views)
    TORCH_CHECK(k_norm.has_value(), "decoder_layer: a q norm needs a k norm");
    qkv = at::cat({at::rms_norm(qkv.narrow(1, 0, heads), {d}, *q_norm, eps),
                   at::rms_norm(qkv.narrow(1, heads, kv_heads), {d}, *k_norm, eps),
                   qkv.narrow(1, heads + kv_heads, kv_heads)}, 1);
  }
  at::Tensor q = op.rope_qk.call(qkv, cos, sin, heads, kv_heads);  // k rotated in place in qkv
  at::Tensor k = qkv.narrow(1, heads, kv_heads), v = qkv.narrow(1, heads + kv_heads, kv_heads);
  if (rotation.has_value()) {  // 8-bit blocks in a Hadamard basis: q.k and p.v unchanged, outliers spread
    q = at::matmul(q, *rotation);
    k = at::matmul(k, *rotation);
    v = at::matmul(v, *rotation);
  }
  if (scaled) {
    TORCH_CHECK(v_scales.has_value() && write_err.has_value(), "decoder_layer: 8-bit caches need both scales "
                "and write_err");
    op.write_kv_scaled.call(k_cache, *k_scales, k.contiguous(), slots, write_err->select(0, 0));
    op.write_kv_scaled.call(v_cache, *v_scales, v.contiguous(), slots, write_err->select(0, 1));
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat &&
                    k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(2) == kv_heads &&
                    v_cache.sizes() == k_cache.sizes(),
                "decoder_layer: float caches must be float32 [blocks, block_size, kv_heads, d], contiguous");
    TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == d && v.stride(2) == 1 && v.stride(1) == d,
                "decoder_layer: k and v rows must hold packed heads");
    const int64_t slots_total = k_cache.size(0) * k_cache.size(1), row = kv_heads * d;
    const int64_t* sp = slots.data_ptr<int64_t>();
    const float* kp = k.data_ptr<float>();
    const float* vp = v.data_ptr<float>();
    float* kc = k_cache.data_ptr<float>();
    float* vc = v_cache.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {  // write_kv's index_copy_, row by row
      TORCH_CHECK(sp[t] >= 0 && sp[t] < slots_total, "decoder_layer: slot ", sp[t], " outside the cache");
      std::memcpy(kc + sp[t] * row, kp + t * k.stride(0), sizeof(float) * row);
      std::memcpy(vc + sp[t] * row, vp + t * v.stride(0), sizeof(float) * row);
    }
  }
  at::Tensor att = at::empty({T, heads, d}, x.options());
  if (plan.empty()) {
    op.paged_attention.call(att, q, k_cache, v_cache, block_tables, row_seq, row_len, scale, sliding_window,
                            k_scales, v_scales, softcap);
  } else {
    op.cascade_attention.call(att, q, k_cache, v_cache, block_tables, row_seq, row_len, scale, sliding_window,
                              k_scales, v_scales, softcap, plan[0], plan[1], plan[2], plan[3], plan[4], plan[5],
                              std::nullopt, std::nullopt, 0);
  }
  if (rotation.has_value()) att = at::matmul(att, *rotation);  // H H = I: back from the rotated V basis
  q.reset();
  k.reset();
  v.reset();
  qkv.reset();
  at::Tensor o = linear(w, kinds, 1, att.reshape({T, heads * d}));
  att.reset();

  if (kinds[2 * LINEARS] == 1) return gemma_mlp(w, kinds, x, o, eps);
  // MLP sublayer: add_rms_norm makes o += x the new residual stream and returns its norm
  at::Tensor act = op.silu_mul.call(linear(w, kinds, 2, op.add_rms_norm.call(o, x, need(w, 1, "post-attn norm"), eps)));
  return linear(w, kinds, 3, act).add_(o);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedkv, m) {
  m.def("decoder_layer(Tensor x, Tensor?[] w, int[] kinds, float eps, int heads, int kv_heads, Tensor cos, "
        "Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!)? k_scales, Tensor(d!)? v_scales, "
        "Tensor(e!)? write_err, Tensor slots, Tensor block_tables, Tensor row_seq, Tensor row_len, float scale, "
        "int sliding_window, float softcap, Tensor[] plan, Tensor? rotation) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("decoder_layer", &decoder_layer);
}
