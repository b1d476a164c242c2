// A small Llama's whole decode step in one C++ call, for the CPU.
//
// A decode step of a model like stories260K (dim 64) is ~170 torch operations, each ~4-5 us
// of dispatch from Python while its arithmetic takes nanoseconds: the step is bound by
// dispatch, not by the machine. This class holds the model's weights (transposed once, so
// every product is a run of contiguous multiply-adds) and runs the embedding lookup, every
// layer (RMSNorm, q|k|v, rotary, K/V write, paged decode attention, o, residual, RMSNorm,
// gate|up, SiLU-and-mul, down, residual) and the final RMSNorm as plain loops, calling the
// paged attention kernel (paged_decode.cpp) directly. Only decode-only steps in fp32 come
// here; the Python side (services/runtime/model/fused_decode.py) decides when, and checks
// the step's block tables and slots against the pool once before the call.
//
// A projection (Projection below) is a plain fp32 matrix, transposed once and multiplied by the
// loops here, or a quantized one multiplied by the kernels the eager QuantLinear uses
// (quant_matmul.cpp exactly, quant_dot.cpp with int8 activations), called directly.
//
// Under tensor parallelism each rank holds a decoder over its shard (its heads, KV heads and MLP
// columns) and the group's shared-memory all-reduce (shm_all_reduce.h), which sums the o and
// down products' partial outputs over the ranks before they join the residual, where the eager
// model's forward hooks sum them. A failed all-reduce ends the step early (its output is then
// garbage) and leaves its status on the all-reduce object, which the caller checks.
//
// LoRA adapters (forward_lora, set_lora): after each of the q|k|v, o, gate|up and down products,
// the rows that carry an adapter add its low-rank update through lora.cpp's batched kernel (the
// rows grouped by slot once per step), where the eager layer calls the same kernel.
//
// The math is the eager model's (services/runtime/model/llama.py) with the same rounding
// points in fp32; sums run in a different order, so results agree to ~1e-6, not bitwise.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "lora.h"
#include "paged_decode.h"
#include "quant_kernels.h"
#include "shm_all_reduce.h"
#include "vec_exp.h"
#include "worker_pool.h"

namespace {

// y[t, :] = x[t, :] @ w_t (+ bias) for t < T, with w_t = W^T stored [in, out]. A tile of kRows
// tokens x kCols outputs is accumulated in registers while the weight rows stream past: each
// weight vector loaded serves kRows multiply-adds, with no horizontal sums. Every output is
// summed over i in order whatever tile it falls in, so a token's result does not depend on the
// batch around it.
constexpr int64_t kRows = 4;
constexpr int64_t kCols = 16;

template <int64_t R, int64_t C>
inline void linear_tile(const float* x, int64_t in, const float* w_t, const float* bias, int64_t out, float* y,
                        int64_t rows, int64_t cols) {
  float acc[R][C];
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) acc[r][c] = (bias != nullptr && c < cols) ? bias[c] : 0.f;
  }
  if (rows == R && cols == C) {
    for (int64_t i = 0; i < in; ++i) {
      const float* wi = w_t + i * out;
      for (int64_t r = 0; r < R; ++r) {
        const float xi = x[r * in + i];
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) acc[r][c] += xi * wi[c];
      }
    }
  } else if (cols == C) {  // the batch's ragged edge
    for (int64_t i = 0; i < in; ++i) {
      const float* wi = w_t + i * out;
      for (int64_t r = 0; r < rows; ++r) {
        const float xi = x[r * in + i];
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) acc[r][c] += xi * wi[c];
      }
    }
  } else {  // the matrix's ragged edge: the same sums, fewer lanes
    for (int64_t i = 0; i < in; ++i) {
      const float* wi = w_t + i * out;
      for (int64_t r = 0; r < rows; ++r) {
        const float xi = x[r * in + i];
        for (int64_t c = 0; c < cols; ++c) acc[r][c] += xi * wi[c];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) std::memcpy(y + r * out, acc[r], sizeof(float) * cols);
}

void linear_rows(const float* x, int64_t T, int64_t in, const float* w_t, const float* bias, int64_t out, float* y,
                 tokenmill_cpu::WorkerPool* pool) {
  const int64_t row_tiles = (T + kRows - 1) / kRows, col_tiles = (out + kCols - 1) / kCols;
  // Threads only where a product is big enough to pay for waking them.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, kRows * in * out));
  tokenmill_cpu::parallel_for(pool, row_tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t rt = begin; rt < end; ++rt) {
      const int64_t t0 = rt * kRows, rows = std::min(kRows, T - t0);
      for (int64_t ct = 0; ct < col_tiles; ++ct) {
        const int64_t o0 = ct * kCols, cols = std::min(kCols, out - o0);
        linear_tile<kRows, kCols>(x + t0 * in, in, w_t + o0, bias != nullptr ? bias + o0 : nullptr, out,
                                  y + t0 * out + o0, rows, cols);
      }
    }
  });
}

// out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * weight, as torch's fp32 rms_norm.
void rms_norm_rows(const float* x, int64_t T, int64_t D, const float* weight, float eps, float* out) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * D;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t d = 0; d < D; ++d) sum += xt[d] * xt[d];
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(D) + eps);
    float* ot = out + t * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) ot[d] = xt[d] * inv * weight[d];
  }
}

// The rotate-half rotary of layers.RotaryEmbedding, in place on n heads of one token:
// x1' = x1 * cos - x2 * sin, x2' = x2 * cos + x1 * sin over the tables at the token's position.
void rotate_heads(float* heads, int64_t n, int64_t D, const float* cos_full, const float* sin_signed) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < n; ++h) {
    float* x = heads + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      x[i] = x1 * cos_full[i] + x2 * sin_signed[i];
      x[i + half] = x2 * cos_full[i + half] + x1 * sin_signed[i + half];
    }
  }
}

// exp(x) for the SiLU over the range vec_exp.h covers (e^-87 ~ 0 and e^88 ~ inf next to 1 + e^x).
inline float exp_vec(float x) { return tokenmill_cpu::exp_in_range(std::min(std::max(x, -87.0f), 88.0f)); }

at::Tensor transposed(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "fused decode weights must be fp32 CPU matrices [out, in]");
  return w.t().contiguous();
}

at::Tensor vector_of(const at::Tensor& v, int64_t n, const char* what) {
  TORCH_CHECK(v.dim() == 1 && v.numel() == n && v.scalar_type() == at::kFloat && v.device().is_cpu(), what,
              " must be an fp32 CPU vector of ", n);
  return v.contiguous();
}

}  // namespace

// A projection's reusable buffers: the quantized activations, the exact path's per-32 sums.
struct Workspace {
  tokenmill_cpu::QuantizedActivations activations;
  tokenmill_cpu::KquantActivations kquant_activations;
  std::vector<float> xsum;
  std::vector<float> part;  // a stacked projection's part, before its columns join the output
};

// One projection y = x W^T (+ bias) of the fused step, [out, in]: a plain fp32 matrix (held
// transposed, multiplied by linear_rows), a quantized weight with fp32 activations (the exact
// kernel, quant_matmul.cpp) or a GGUF block weight repacked for int8 activations
// (quant_dot.cpp). Built in Python from the model's Linear / QuantLinear (fused_decode.py).
struct Projection : torch::CustomClassHolder {
  enum class Kind { kPlain, kExact, kInt8, kKquant, kStacked };

  static c10::intrusive_ptr<Projection> plain(at::Tensor weight, at::Tensor bias) {
    auto p = c10::make_intrusive<Projection>();
    p->kind = Kind::kPlain;
    p->w_t = transposed(weight);
    p->in = p->w_t.size(0), p->out = p->w_t.size(1);
    p->set_bias(bias);
    return p;
  }

  // qweight / scales / zeros as QuantLinear's cpu_kernel path holds them (cpu_kernel_operands).
  static c10::intrusive_ptr<Projection> exact(at::Tensor qweight, at::Tensor scales, at::Tensor zeros, int64_t bits,
                                              int64_t group, at::Tensor bias) {
    TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
    TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() &&
                    qweight.scalar_type() == (bits == 4 ? at::kByte : at::kChar),
                "qweight must be contiguous [N, K/2] uint8 (4-bit) or [N, K] int8");
    auto p = c10::make_intrusive<Projection>();
    p->kind = Kind::kExact;
    p->tensors = {qweight, scales.contiguous(), zeros.contiguous()};
    tokenmill_cpu::QuantWeight& w = p->exact_weight;
    w.N = qweight.size(0), w.K = bits == 4 ? 2 * qweight.size(1) : qweight.size(1), w.group = group;
    TORCH_CHECK(group > 0 && group % 32 == 0 && w.K % group == 0, "group must be a multiple of 32 dividing K");
    TORCH_CHECK(p->tensors[1].scalar_type() == at::kFloat && p->tensors[1].numel() == w.N * (w.K / group),
                "scales must be [N, K / group] fp32");
    TORCH_CHECK(zeros.numel() == 0 || (zeros.scalar_type() == at::kFloat && zeros.numel() == scales.numel()),
                "zeros must be empty or like scales");
    w.q4 = bits == 4 ? qweight.data_ptr<uint8_t>() : nullptr;
    w.q8 = bits == 8 ? qweight.data_ptr<int8_t>() : nullptr;
    w.scales = p->tensors[1].data_ptr<float>();
    w.zeros = zeros.numel() ? p->tensors[2].data_ptr<float>() : nullptr;
    p->in = w.K, p->out = w.N;
    p->set_bias(bias);
    return p;
  }

  // packed: repack_int8's tiles of an [out, in] weight of `format` (0 q4_0, 1 q4_1, 2 q8_0).
  static c10::intrusive_ptr<Projection> int8(at::Tensor packed, int64_t format, int64_t out, int64_t in,
                                             at::Tensor bias) {
    TORCH_CHECK(format >= 0 && format <= 2, "format must be 0 (q4_0), 1 (q4_1) or 2 (q8_0)");
    TORCH_CHECK(out > 0 && in > 0 && in % 32 == 0, "in must be a positive multiple of 32");
    auto p = c10::make_intrusive<Projection>();
    p->kind = Kind::kInt8;
    tokenmill_cpu::PackedInt8Weight& w = p->int8_weight;
    w.format = static_cast<tokenmill_cpu::QuantFormat>(format);
    w.N = out, w.K = in, w.block_bytes = tokenmill_cpu::int8_block_bytes(w.format);
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                    packed.numel() == (out + 15) / 16 * (in / 32) * w.block_bytes,
                "packed must be repack_int8's tensor for this format and shape");
    p->tensors = {packed};
    w.data = packed.data_ptr<uint8_t>();
    p->in = in, p->out = out;
    p->set_bias(bias);
    return p;
  }

  // packed: kquant_act.pack_tiles' tiles of an [out, in] GGUF K-quant or q5_0/q5_1 weight of
  // `code` (KQUANT_FORMAT_CODES), multiplied with int8 activations (kquant_dot.cpp).
  static c10::intrusive_ptr<Projection> kquant(at::Tensor packed, int64_t code, int64_t out, int64_t in,
                                               at::Tensor bias) {
    TORCH_CHECK(out > 0 && in > 0 && in % tokenmill_cpu::kquant_block(code) == 0,
                "in must be a positive multiple of the format's block");
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                    packed.numel() == (out + 15) / 16 * tokenmill_cpu::kquant_tile_bytes(code, in),
                "packed must be pack_tiles' tensor for this format and shape");
    auto p = c10::make_intrusive<Projection>();
    p->kind = Kind::kKquant;
    p->kquant_code = code;
    p->tensors = {packed};
    p->in = in, p->out = out;
    p->set_bias(bias);
    return p;
  }

  // Projections of one input stacked along the output axis (QuantLinear's StackedLinear: a file
  // mixing formats in q|k|v, as Q4_K_M does), each multiplied by its own kernel.
  static c10::intrusive_ptr<Projection> stacked(std::vector<c10::intrusive_ptr<Projection>> parts, at::Tensor bias) {
    TORCH_CHECK(!parts.empty(), "a stacked projection needs parts");
    auto p = c10::make_intrusive<Projection>();
    p->kind = Kind::kStacked;
    p->in = parts[0]->in;
    for (const auto& part : parts) {
      TORCH_CHECK(part->in == p->in && part->kind != Kind::kStacked && !part->bias.defined(),
                  "stacked parts must share the input size, without biases or stacks of their own");
      p->out += part->out;
    }
    p->parts = std::move(parts);
    p->set_bias(bias);
    return p;
  }

  // y [T, out] = x [T, in] W^T (+ bias), on `pool`.
  void apply(const float* x, int64_t T, float* y, Workspace& ws, tokenmill_cpu::WorkerPool* pool) const {
    if (kind == Kind::kStacked) {
      int64_t offset = 0;
      for (const auto& part : parts) {
        ws.part.resize(T * part->out);
        part->apply(x, T, ws.part.data(), ws, pool);
        for (int64_t t = 0; t < T; ++t) {
          std::memcpy(y + t * out + offset, ws.part.data() + t * part->out, sizeof(float) * part->out);
        }
        offset += part->out;
      }
      add_bias(y, T);
      return;
    }
    if (kind == Kind::kPlain) {
      linear_rows(x, T, in, w_t.data_ptr<float>(), bias.defined() ? bias.data_ptr<float>() : nullptr, out, y, pool);
      return;
    }
    if (kind == Kind::kInt8) {
      tokenmill_cpu::int8_matmul(int8_weight, x, T, in, y, out, ws.activations, pool);
    } else if (kind == Kind::kKquant) {
      tokenmill_cpu::kquant_quantize_rows(x, T, in, in, ws.kquant_activations);
      const tokenmill_cpu::Isa isa = tokenmill_cpu::active_isa();
      const uint8_t* packed = tensors[0].data_ptr<uint8_t>();
      // The grain of kquant_matmul's own loop: ~64k weights a task.
      const int64_t grain = std::max<int64_t>(1, 65536 / (16 * in));
      tokenmill_cpu::parallel_for(pool, (out + 15) / 16, grain, [&](int64_t begin, int64_t end) {
        tokenmill_cpu::kquant_matmul_tiles(packed, kquant_code, out, in, ws.kquant_activations, y, out, begin, end,
                                           isa);
      });
    } else {
      const tokenmill_cpu::QuantWeight& w = exact_weight;
      const float* xsum = nullptr;
      if (w.zeros) {  // sums of x over every 32 values, for the zero terms
        ws.xsum.resize(T * (in / 32));
        for (int64_t i = 0; i < T * (in / 32); ++i) {
          float sum = 0.f;
          for (int64_t j = 0; j < 32; ++j) sum += x[i * 32 + j];
          ws.xsum[i] = sum;
        }
        xsum = ws.xsum.data();
      }
      const tokenmill_cpu::Isa isa = tokenmill_cpu::active_isa();
      tokenmill_cpu::parallel_for(pool, out, 16, [&](int64_t begin, int64_t end) {
        tokenmill_cpu::quant_matmul_rows(w, x, xsum, T, y, out, begin, end, isa);
      });
    }
    add_bias(y, T);
  }

  void add_bias(float* y, int64_t T) const {
    if (bias.defined()) {
      const float* b = bias.data_ptr<float>();
      for (int64_t t = 0; t < T; ++t) {
#pragma omp simd
        for (int64_t o = 0; o < out; ++o) y[t * out + o] += b[o];
      }
    }
  }

  int64_t in_features() const { return in; }
  int64_t out_features() const { return out; }

  Kind kind = Kind::kPlain;
  int64_t in = 0, out = 0, kquant_code = 0;
  at::Tensor w_t, bias;
  std::vector<at::Tensor> tensors;  // keeps the quantized parts alive
  std::vector<c10::intrusive_ptr<Projection>> parts;  // kStacked's
  tokenmill_cpu::QuantWeight exact_weight;
  tokenmill_cpu::PackedInt8Weight int8_weight;

 private:
  void set_bias(const at::Tensor& b) {
    if (b.numel() > 0) bias = vector_of(b, out, "bias");
  }
};

namespace {

// A sparse layer's MLP (set_moe, services/runtime/model/moe.py): the router [E, D], each expert's
// gate|up [2I, D] and down [D, I], and Qwen2-MoE's shared expert with its [1, D] sigmoid gate.
struct Moe {
  c10::intrusive_ptr<Projection> router;
  std::vector<c10::intrusive_ptr<Projection>> gate_up, down;
  c10::intrusive_ptr<Projection> shared_gate_up, shared_down, shared_gate;  // null without one
  int64_t top_k = 1;
  bool renormalize = false;
  bool topk_softmax = false;  // softmax over the k largest logits, not top-k of a softmax over all
  at::Tensor load;            // [E] int64: tokens routed to each expert, added to in place
};

// One token's router: the k experts and their weights, as moe.route computes them (the largest
// first; among equal values the lower expert, as torch.topk).
void route_row(const float* logits, int64_t E, const Moe& m, float* probs, int64_t* ids, float* weights) {
  const int64_t k = m.top_k;
  std::vector<int64_t> order(E);
  for (int64_t e = 0; e < E; ++e) order[e] = e;
  auto softmax = [](const float* in, int64_t n, float* out) {
    float mx = in[0];
    for (int64_t i = 1; i < n; ++i) mx = std::max(mx, in[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += (out[i] = std::exp(in[i] - mx));
    for (int64_t i = 0; i < n; ++i) out[i] /= sum;
  };
  const float* ranked = logits;
  if (!m.topk_softmax) {
    softmax(logits, E, probs);
    ranked = probs;
  }
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
    return ranked[a] > ranked[b] || (ranked[a] == ranked[b] && a < b);
  });
  for (int64_t j = 0; j < k; ++j) ids[j] = order[j], weights[j] = ranked[order[j]];
  if (m.topk_softmax) {
    softmax(weights, k, weights);
  } else if (m.renormalize) {
    float sum = 0.f;
    for (int64_t j = 0; j < k; ++j) sum += weights[j];
    for (int64_t j = 0; j < k; ++j) weights[j] /= sum;
  }
}

struct Layer {
  at::Tensor input_norm, post_norm;
  c10::intrusive_ptr<Projection> qkv, o, gate_up, down;
  // Gemma 3 (set_gemma): the norms of the attention's and the MLP's outputs, and q's and k's
  // per-head norms (undefined where the model has none).
  at::Tensor post_attn_norm, post_mlp_norm, q_norm, k_norm;
  int64_t window = 0;  // keys a query sees (0: the whole context); set_layout
  int64_t group = 0;   // the KV group whose slots and block table the layer reads; set_layout
  bool qk_whole = false;  // OLMoE (set_qk_norms): q and k normed over all their heads at once
  std::shared_ptr<Moe> moe;  // set_moe: the routed experts in place of gate_up and down
};

// GELU with the tanh approximation (Gemma's GeGLU), tanh(u) = 1 - 2 / (1 + e^{2u}) over exp_vec.
inline float gelu_tanh(float g) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  const float u = kSqrt2OverPi * (g + 0.044715f * g * g * g);
  const float t = 1.f - 2.f / (1.f + exp_vec(2.f * u));
  return 0.5f * g * (1.f + t);
}

}  // namespace

struct LlamaDecoder : torch::CustomClassHolder {
  // norms: per layer input_norm [D] and post_norm [D]. projections: per layer q|k|v
  // [(H + 2 KH) hd, D] (its bias, if any, inside), o [D, H hd], gate|up [2F, D], down [D, F];
  // then the LM head [V, D] when the logits are computed here (see logits()). caches: per layer
  // K and V pools; scales empty for plain pools, else per layer K and V scales (kv_quant.ScaledCache).
  LlamaDecoder(at::Tensor embed, std::vector<at::Tensor> norms, std::vector<c10::intrusive_ptr<Projection>> projections,
               at::Tensor final_norm, at::Tensor cos_full, at::Tensor sin_signed, int64_t num_heads,
               int64_t num_kv_heads, int64_t head_dim, double eps, std::vector<at::Tensor> k_caches,
               std::vector<at::Tensor> v_caches, std::vector<at::Tensor> k_scales, std::vector<at::Tensor> v_scales,
               int64_t threads)
      : pool_(std::make_unique<tokenmill_cpu::WorkerPool>(static_cast<int>(std::max<int64_t>(1, threads)))),
        embed_(embed.contiguous()), cos_full_(cos_full.contiguous()), sin_signed_(sin_signed.contiguous()),
        H_(num_heads), KH_(num_kv_heads), hd_(head_dim), eps_(static_cast<float>(eps)), k_caches_(k_caches),
        v_caches_(v_caches), k_scales_(k_scales), v_scales_(v_scales) {
    TORCH_CHECK(embed_.dim() == 2 && embed_.scalar_type() == at::kFloat, "embed must be fp32 [V, D]");
    TORCH_CHECK(norms.size() % 2 == 0 && !norms.empty(), "2 norms per layer");
    const int64_t L = static_cast<int64_t>(norms.size()) / 2;
    TORCH_CHECK(static_cast<int64_t>(projections.size()) == 4 * L || static_cast<int64_t>(projections.size()) == 4 * L + 1,
                "4 projections per layer, then the LM head or nothing");
    TORCH_CHECK(H_ % KH_ == 0 && hd_ % 2 == 0, "query heads must be a multiple of kv heads, head_dim even");
    D_ = embed_.size(1);
    const int64_t qkv = (H_ + 2 * KH_) * hd_;
    auto shaped = [](const c10::intrusive_ptr<Projection>& p, int64_t out, int64_t in, const char* what) {
      TORCH_CHECK(p->out == out && p->in == in, what, " must be [", out, ", ", in, "], got [", p->out, ", ", p->in, "]");
      return p;
    };
    for (int64_t l = 0; l < L; ++l) {
      const c10::intrusive_ptr<Projection>* w = projections.data() + 4 * l;
      Layer layer;
      layer.input_norm = vector_of(norms[2 * l], D_, "input_norm");
      layer.post_norm = vector_of(norms[2 * l + 1], D_, "post_norm");
      layer.qkv = shaped(w[0], qkv, D_, "qkv");
      layer.o = shaped(w[1], D_, H_ * hd_, "o");
      TORCH_CHECK(w[2]->in == D_ && w[2]->out % 2 == 0, "gate_up must be [2F, D]");
      layer.gate_up = w[2];
      layer.down = shaped(w[3], D_, w[2]->out / 2, "down");
      layers_.push_back(std::move(layer));
    }
    if (static_cast<int64_t>(projections.size()) == 4 * L + 1) {
      lm_head_ = projections.back();
      TORCH_CHECK(lm_head_->in == D_ && !lm_head_->bias.defined(), "lm_head must be [V, D] without a bias");
    }
    final_norm_ = vector_of(final_norm, D_, "final_norm");
    TORCH_CHECK(cos_full_.dim() == 2 && cos_full_.size(1) == hd_ && sin_signed_.sizes() == cos_full_.sizes(),
                "rotary tables must be [P, head_dim]");
    TORCH_CHECK(static_cast<int64_t>(k_caches_.size()) == L && v_caches_.size() == k_caches_.size(),
                "one K and one V pool per layer");
    quantized_ = !k_scales_.empty();
    TORCH_CHECK(!quantized_ || (static_cast<int64_t>(k_scales_.size()) == L && v_scales_.size() == k_scales_.size()),
                "scales: none, or one K and one V per layer");
    for (int64_t l = 0; l < L; ++l) {
      const at::Tensor& k = k_caches_[l];
      TORCH_CHECK(k.dim() == 4 && k.size(2) == KH_ && k.size(3) == hd_ && k.is_contiguous(),
                  "pools must be contiguous [NB, BS, KH, head_dim]");
      TORCH_CHECK(quantized_ || k.scalar_type() == at::kFloat, "a plain pool must be fp32 for the fused step");
    }
  }

  // input_ids, positions [B] int64; slot_mapping [B] int64; block_tables [B, max_blocks] int32;
  // context_lens [B] int32 -> final hidden states [B, D], normed.
  at::Tensor forward(at::Tensor input_ids, at::Tensor positions, at::Tensor slot_mapping, at::Tensor block_tables,
                     at::Tensor context_lens) {
    return step(input_ids, positions, slot_mapping, block_tables, context_lens, false);
  }

  // forward with each row's LoRA adapter: row_slots [B] int32 or int64, a slot of the adapters
  // set_lora gave (-1: the base model alone). Rows without an adapter cost nothing more.
  at::Tensor forward_lora(at::Tensor input_ids, at::Tensor positions, at::Tensor slot_mapping, at::Tensor block_tables,
                          at::Tensor context_lens, at::Tensor row_slots) {
    TORCH_CHECK(lora_, "this decoder was given no adapters (set_lora)");
    TORCH_CHECK(row_slots.dim() == 1 && row_slots.numel() == input_ids.numel(), "one adapter slot per token");
    const bool any = lora_->group(row_slots.contiguous());
    return step(input_ids, positions, slot_mapping, block_tables, context_lens, any);
  }

  // The model's resident adapters (their stacks are read in place at every forward_lora).
  void set_lora(c10::intrusive_ptr<tokenmill_cpu::ModelLoras> lora) {
    TORCH_CHECK(lora->layers() == static_cast<int64_t>(layers_.size()), "adapters for ", lora->layers(),
                " layers; the decoder has ", layers_.size());
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      const Projection* kinds[] = {layer.qkv.get(), layer.o.get(), layer.gate_up.get(), layer.down.get()};
      for (int64_t kind = 0; kind < tokenmill_cpu::ModelLoras::kKinds; ++kind) {
        TORCH_CHECK(lora->in_features(l, kind) == kinds[kind]->in && lora->out_features(l, kind) == kinds[kind]->out,
                    "layer ", l, " adapter stack ", kind, " is [", lora->out_features(l, kind), ", ",
                    lora->in_features(l, kind), "]; its projection is [", kinds[kind]->out, ", ", kinds[kind]->in, "]");
      }
    }
    lora_ = std::move(lora);
  }

 private:
  // The step; with_lora: add the rows' adapters (grouped by forward_lora) after each product.
  at::Tensor step(at::Tensor input_ids, at::Tensor positions, at::Tensor slot_mapping, at::Tensor block_tables,
                  at::Tensor context_lens, bool with_lora) {
    tokenmill_cpu::ModelLoras* lora = with_lora ? lora_.get() : nullptr;
    TORCH_CHECK(input_ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                    slot_mapping.scalar_type() == at::kLong,
                "input_ids, positions and slot_mapping must be int64");
    input_ids = input_ids.contiguous();
    positions = positions.contiguous();
    slot_mapping = slot_mapping.contiguous();
    const int64_t B = input_ids.numel();
    // With KV groups (set_layout) every group's slots and block table rows are stacked, group 0's first.
    TORCH_CHECK(positions.numel() == B && slot_mapping.numel() == groups_ * B &&
                    (B == 0 || block_tables.size(0) == groups_ * B),
                "one position per token, and one slot and block table row per token and KV group (", groups_,
                ")");
    const int64_t V = embed_.size(0), P = cos_full_.size(0), D = D_, hd = hd_;
    const int64_t q_size = H_ * hd, kv_size = KH_ * hd, qkv_size = q_size + 2 * kv_size;
    const int64_t* ids = input_ids.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(ids[b] >= 0 && ids[b] < V, "input_ids[", b, "] = ", ids[b], " is outside the vocabulary of ", V);
      TORCH_CHECK(pos[b] >= 0 && pos[b] < P, "positions[", b, "] = ", pos[b], " is outside the rotary table of ", P);
    }
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    at::Tensor hidden = at::empty({B, D}, f32), x = at::empty({B, D}, f32);
    at::Tensor qkv = at::empty({B, qkv_size}, f32);
    at::Tensor q = at::empty({B, H_, hd}, f32), attn = at::empty({B, H_, hd}, f32);
    int64_t F_max = 0;  // dense and sparse layers' widths differ (Qwen's mlp_only_layers)
    for (const Layer& layer : layers_) F_max = std::max(F_max, layer.down->in);
    at::Tensor gate_up = at::empty({B, 2 * F_max}, f32), act = at::empty({B, F_max}, f32);
    at::Tensor tmp = at::empty({B, D}, f32);
    float* h = hidden.data_ptr<float>();
    float* xp = x.data_ptr<float>();
    float* qkvp = qkv.data_ptr<float>();
    float* qp = q.data_ptr<float>();
    float* ap = attn.data_ptr<float>();
    float* gup = gate_up.data_ptr<float>();
    float* actp = act.data_ptr<float>();
    float* tp = tmp.data_ptr<float>();
    const float* emb = embed_.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) std::memcpy(h + b * D, emb + ids[b] * D, sizeof(float) * D);
    if (gemma_) {
#pragma omp simd
      for (int64_t i = 0; i < B * D; ++i) h[i] *= embed_scale_;
    }
    const float* cos_tab = cos_full_.data_ptr<float>();
    const float* sin_tab = sin_signed_.data_ptr<float>();
    const float* cos_local = gemma_ ? cos_local_.data_ptr<float>() : cos_tab;
    const float* sin_local = gemma_ ? sin_local_.data_ptr<float>() : sin_tab;
    const int64_t P_local = gemma_ ? cos_local_.size(0) : P;
    if (gemma_) {
      for (int64_t b = 0; b < B; ++b) {
        TORCH_CHECK(pos[b] < P_local, "positions[", b, "] = ", pos[b], " is outside the local rotary table of ",
                    P_local);
      }
    }
    const double scale = gemma_ ? attn_scale_ : 1.0 / std::sqrt(static_cast<double>(hd));
    // Views of the fused projection's k and v columns, for the quantized write (plain pools are
    // written here directly).
    at::Tensor k_view, v_view;
    if (quantized_) {
      k_view = qkv.narrow(1, q_size, kv_size).view({B, KH_, hd});
      v_view = qkv.narrow(1, q_size + kv_size, kv_size).view({B, KH_, hd});
    }
    const int64_t* all_slots = slots;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      // This layer's KV group: its rows of the stacked slots and block tables.
      slots = all_slots + layer.group * B;
      const at::Tensor group_tables = groups_ > 1 ? block_tables.narrow(0, layer.group * B, B) : block_tables;
      rms_norm_rows(h, B, D, layer.input_norm.data_ptr<float>(), eps_, xp);
      layer.qkv->apply(xp, B, qkvp, workspace_, pool_.get());
      if (lora) lora->apply(l, 0, xp, qkvp, pool_.get());
      const bool local = layer.window > 0;
      const float* cos_l = local ? cos_local : cos_tab;
      const float* sin_l = local ? sin_local : sin_tab;
      for (int64_t b = 0; b < B; ++b) {
        float* row = qkvp + b * qkv_size;
        if (layer.qk_whole) {  // OLMoE: q and k each RMS-normed over all their heads
          rms_norm_rows(row, 1, q_size, layer.q_norm.data_ptr<float>(), eps_, row);
          rms_norm_rows(row + q_size, 1, kv_size, layer.k_norm.data_ptr<float>(), eps_, row + q_size);
        } else if (layer.q_norm.defined()) {  // Gemma 3, Qwen3: each q and k head RMS-normed before RoPE
          rms_norm_rows(row, H_, hd, layer.q_norm.data_ptr<float>(), eps_, row);
          rms_norm_rows(row + q_size, KH_, hd, layer.k_norm.data_ptr<float>(), eps_, row + q_size);
        }
        rotate_heads(row, H_ + KH_, hd, cos_l + pos[b] * hd, sin_l + pos[b] * hd);
        std::memcpy(qp + b * q_size, row, sizeof(float) * q_size);
      }
      if (quantized_) {
        tokenmill_cpu::store_kv(k_view, v_view, k_caches_[l], v_caches_[l], &k_scales_[l], &v_scales_[l],
                                groups_ > 1 ? slot_mapping.narrow(0, layer.group * B, B) : slot_mapping);
      } else {
        float* kc = k_caches_[l].data_ptr<float>();
        float* vc = v_caches_[l].data_ptr<float>();
        const int64_t num_slots = k_caches_[l].size(0) * k_caches_[l].size(1);
        for (int64_t b = 0; b < B; ++b) {
          TORCH_CHECK(slots[b] >= 0 && slots[b] < num_slots, "slot_mapping[", b, "] = ", slots[b],
                      " is outside the pool of ", num_slots, " slots");
          const float* row = qkvp + b * qkv_size;
          std::memcpy(kc + slots[b] * kv_size, row + q_size, sizeof(float) * kv_size);
          std::memcpy(vc + slots[b] * kv_size, row + q_size + kv_size, sizeof(float) * kv_size);
        }
      }
      tokenmill_cpu::decode_attention(attn, q, k_caches_[l], v_caches_[l], quantized_ ? &k_scales_[l] : nullptr,
                                      quantized_ ? &v_scales_[l] : nullptr, group_tables, context_lens, scale,
                                      pool_.get(), layer.window, attn_softcap_);
      layer.o->apply(ap, B, tp, workspace_, pool_.get());
      if (lora) lora->apply(l, 1, ap, tp, pool_.get());
      if (reducer_ && reducer_->reduce(tp, B * D) != tokenmill_cpu::kReduceOk) return x;
      if (gemma_) rms_norm_rows(tp, B, D, layer.post_attn_norm.data_ptr<float>(), eps_, tp);
#pragma omp simd
      for (int64_t i = 0; i < B * D; ++i) h[i] += tp[i];
      rms_norm_rows(h, B, D, layer.post_norm.data_ptr<float>(), eps_, xp);
      if (layer.moe) {
        moe_mlp(*layer.moe, xp, B, tp);
#pragma omp simd
        for (int64_t i = 0; i < B * D; ++i) h[i] += tp[i];
        continue;
      }
      const int64_t F = layer.down->in;
      layer.gate_up->apply(xp, B, gup, workspace_, pool_.get());
      if (lora) lora->apply(l, 2, xp, gup, pool_.get());
      for (int64_t b = 0; b < B; ++b) {
        const float* g = gup + b * 2 * F;
        const float* u = g + F;
        float* a = actp + b * F;
        if (gemma_) {
#pragma omp simd
          for (int64_t f = 0; f < F; ++f) a[f] = gelu_tanh(g[f]) * u[f];
        } else {
#pragma omp simd
          for (int64_t f = 0; f < F; ++f) a[f] = g[f] / (1.f + exp_vec(-g[f])) * u[f];
        }
      }
      layer.down->apply(actp, B, tp, workspace_, pool_.get());
      if (lora) lora->apply(l, 3, actp, tp, pool_.get());
      if (reducer_ && reducer_->reduce(tp, B * D) != tokenmill_cpu::kReduceOk) return x;
      if (gemma_) rms_norm_rows(tp, B, D, layer.post_mlp_norm.data_ptr<float>(), eps_, tp);
#pragma omp simd
      for (int64_t i = 0; i < B * D; ++i) h[i] += tp[i];
    }
    rms_norm_rows(h, B, D, final_norm_.data_ptr<float>(), eps_, xp);
    return x;
  }

 public:
  // hidden [N, D] -> logits [N, V]. Each row is summed in one fixed order whatever N (the same
  // kernels as the layers' products, whose rows never mix), so a request's logits, and the
  // logprobs it is shown, do not depend on how many other rows sample in its step: BLAS picks
  // another kernel for one or two rows than for more, which moves the last bits.
  at::Tensor logits(at::Tensor hidden) {
    TORCH_CHECK(lm_head_, "this decoder was built without an LM head");
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == D_ && hidden.scalar_type() == at::kFloat &&
                    hidden.device().is_cpu(),
                "hidden must be fp32 CPU [N, ", D_, "]");
    hidden = hidden.contiguous();
    const int64_t N = hidden.size(0);
    at::Tensor out = at::empty({N, lm_head_->out}, at::TensorOptions().dtype(at::kFloat));
    lm_head_->apply(hidden.data_ptr<float>(), N, out.data_ptr<float>(), workspace_, pool_.get());
    if (final_softcap_ > 0.f) {
      float* o = out.data_ptr<float>();
      const float c = final_softcap_;
      tokenmill_cpu::parallel_for(pool_.get(), out.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) o[i] = c * std::tanh(o[i] / c);
      });
    }
    return out;
  }

  // Sliding windows and KV groups, per layer: windows[l] keys a query sees (0: the whole context),
  // groups[l] the KV group whose slots and block table rows the layer reads (forward then takes
  // every group's, stacked).
  void set_layout(std::vector<int64_t> windows, std::vector<int64_t> groups) {
    TORCH_CHECK(windows.size() == layers_.size() && groups.size() == layers_.size(), "one window and group per layer");
    int64_t num_groups = 1;
    for (size_t l = 0; l < layers_.size(); ++l) {
      TORCH_CHECK(windows[l] >= 0 && groups[l] >= 0, "windows and groups must be >= 0");
      layers_[l].window = windows[l];
      layers_[l].group = groups[l];
      num_groups = std::max(num_groups, groups[l] + 1);
    }
    groups_ = num_groups;
  }

  // Gemma 3's layer (gemma3.py): norms per layer (attention output, MLP output, then q's and k's
  // per-head [head_dim] norms, or two empty tensors where the model has none), all already
  // ``1 + w``; the local layers' rotary tables; the embedding's scale and the attention's.
  // The MLP becomes GeGLU with tanh GELU.
  void set_gemma(std::vector<at::Tensor> norms, at::Tensor cos_local, at::Tensor sin_local, double embed_scale,
                 double attn_scale) {
    TORCH_CHECK(norms.size() == 4 * layers_.size(), "4 norms per layer");
    for (size_t l = 0; l < layers_.size(); ++l) {
      Layer& layer = layers_[l];
      layer.post_attn_norm = vector_of(norms[4 * l], D_, "post_attn_norm");
      layer.post_mlp_norm = vector_of(norms[4 * l + 1], D_, "post_mlp_norm");
      TORCH_CHECK(norms[4 * l + 2].numel() == norms[4 * l + 3].numel(), "q and k norms: both or neither");
      if (norms[4 * l + 2].numel() > 0) {
        layer.q_norm = vector_of(norms[4 * l + 2], hd_, "q_norm");
        layer.k_norm = vector_of(norms[4 * l + 3], hd_, "k_norm");
      }
    }
    cos_local_ = cos_local.contiguous();
    sin_local_ = sin_local.contiguous();
    TORCH_CHECK(cos_local_.dim() == 2 && cos_local_.size(1) == hd_ && sin_local_.sizes() == cos_local_.sizes() &&
                    cos_local_.scalar_type() == at::kFloat && sin_local_.scalar_type() == at::kFloat,
                "local rotary tables must be fp32 [P, head_dim]");
    embed_scale_ = static_cast<float>(embed_scale);
    attn_scale_ = attn_scale;
    gemma_ = true;
  }

  // Per layer q's and k's RMSNorm weights before RoPE (Qwen3, OLMoE; two empty tensors for a layer
  // without), over each head ([head_dim] norms) or, with whole, over all heads at once (OLMoE).
  void set_qk_norms(std::vector<at::Tensor> norms, bool whole) {
    TORCH_CHECK(norms.size() == 2 * layers_.size(), "2 norms per layer");
    for (size_t l = 0; l < layers_.size(); ++l) {
      if (norms[2 * l].numel() == 0) continue;
      layers_[l].q_norm = vector_of(norms[2 * l], whole ? H_ * hd_ : hd_, "q_norm");
      layers_[l].k_norm = vector_of(norms[2 * l + 1], whole ? KH_ * hd_ : hd_, "k_norm");
      layers_[l].qk_whole = whole;
    }
  }

  // Layer l's MLP becomes routed experts: router [E, D]; experts: every expert's gate|up [2I, D],
  // then every expert's down [D, I]; shared: none, or the shared expert's gate|up, down and its
  // [1, D] gate; load [E] int64, which each step adds its tokens per expert to. order: 0 softmax
  // then top-k, 1 top-k logits then softmax.
  void set_moe(int64_t l, c10::intrusive_ptr<Projection> router, std::vector<c10::intrusive_ptr<Projection>> experts,
               std::vector<c10::intrusive_ptr<Projection>> shared, int64_t top_k, bool renormalize, int64_t order,
               at::Tensor load) {
    TORCH_CHECK(l >= 0 && l < static_cast<int64_t>(layers_.size()), "layer ", l, " is outside the model");
    const int64_t E = router->out;
    TORCH_CHECK(router->in == D_, "the router must be [E, ", D_, "]");
    TORCH_CHECK(top_k >= 1 && top_k <= E, "top_k must be in [1, ", E, "]");
    TORCH_CHECK(static_cast<int64_t>(experts.size()) == 2 * E, "a gate|up and a down per expert");
    TORCH_CHECK(shared.empty() || shared.size() == 3, "shared: none or gate|up, down and gate");
    TORCH_CHECK(order == 0 || order == 1, "order must be 0 or 1");
    TORCH_CHECK(load.dim() == 1 && load.numel() == E && load.scalar_type() == at::kLong && load.is_contiguous(),
                "load must be [E] int64");
    auto m = std::make_shared<Moe>();
    m->router = router;
    const int64_t I = experts[E]->in;
    for (int64_t e = 0; e < E; ++e) {
      TORCH_CHECK(experts[e]->in == D_ && experts[e]->out == 2 * I && experts[E + e]->out == D_ &&
                      experts[E + e]->in == I,
                  "expert ", e, ": gate|up must be [", 2 * I, ", ", D_, "] and down [", D_, ", ", I, "]");
      m->gate_up.push_back(experts[e]);
      m->down.push_back(experts[E + e]);
    }
    if (!shared.empty()) {
      TORCH_CHECK(shared[0]->in == D_ && shared[1]->out == D_ && shared[0]->out == 2 * shared[1]->in &&
                      shared[2]->in == D_ && shared[2]->out == 1,
                  "the shared expert must be gate|up [2S, D], down [D, S] and gate [1, D]");
      m->shared_gate_up = shared[0], m->shared_down = shared[1], m->shared_gate = shared[2];
    }
    m->top_k = top_k, m->renormalize = renormalize, m->topk_softmax = order == 1, m->load = load;
    layers_[l].moe = std::move(m);
    layers_[l].gate_up = experts[0];  // the widths the step sizes its buffers by
    layers_[l].down = experts[E];
  }

  // Gemma 2's soft caps, c * tanh(s / c) (0: none): attention's on the scaled scores before the
  // softmax, final's on the logits.
  void set_softcap(double attention, double final_logits) {
    TORCH_CHECK(attention >= 0.0 && final_logits >= 0.0 && std::isfinite(attention) && std::isfinite(final_logits),
                "soft caps must be finite numbers >= 0 (0: none)");
    attn_softcap_ = attention;
    final_softcap_ = static_cast<float>(final_logits);
  }

  // Sum the o and down outputs over a tensor-parallel group's ranks (this decoder holds one shard).
  void set_all_reduce(c10::intrusive_ptr<tokenmill_cpu::ShmAllReduce> reducer) { reducer_ = std::move(reducer); }

 private:
  std::unique_ptr<tokenmill_cpu::WorkerPool> pool_;  // first: the last member destroyed
  c10::intrusive_ptr<tokenmill_cpu::ShmAllReduce> reducer_;
  c10::intrusive_ptr<tokenmill_cpu::ModelLoras> lora_;
  at::Tensor embed_, cos_full_, sin_signed_, final_norm_;
  bool gemma_ = false;  // set_gemma's layer
  at::Tensor cos_local_, sin_local_;
  float embed_scale_ = 1.f;
  double attn_scale_ = 0.0;
  double attn_softcap_ = 0.0;   // set_softcap
  float final_softcap_ = 0.f;  // set_softcap
  int64_t groups_ = 1;
  c10::intrusive_ptr<Projection> lm_head_;
  std::vector<Layer> layers_;
  Workspace workspace_;  // one step at a time: the executor never runs two concurrently
  int64_t H_, KH_, hd_, D_ = 0;
  float eps_;
  std::vector<at::Tensor> k_caches_, v_caches_, k_scales_, v_scales_;
  bool quantized_ = false;
  std::vector<float> moe_buf_;  // a sparse layer's router logits, rows and products (moe_mlp)

  // y [B, D] = the routed experts' weighted sum over x [B, D] (+ the gated shared expert), as
  // moe.py's SparseMoe: the (token, slot) pairs grouped by expert, each expert with tokens
  // multiplying all its rows at once through its projections (the eager grouped kernel's
  // products), so its weights are read once per step and an expert no token chose costs nothing.
  void moe_mlp(const Moe& m, const float* x, int64_t B, float* y) {
    const int64_t E = m.router->out, k = m.top_k, D = D_, I = m.down[0]->in, P = B * k;
    const int64_t S = m.shared_gate_up ? m.shared_down->in : 0;
    const int64_t width = std::max(2 * I, 2 * S);
    moe_buf_.resize(B * E * 2 + P + P * D + P * width + P * I + B * (D + 1));
    float* logits = moe_buf_.data();
    float* probs = logits + B * E;
    float* weights = probs + B * E;
    float* rows = weights + P;    // [P, D]: each pair's input row, grouped by expert; then its output
    float* gu = rows + P * D;     // [P, 2I]
    float* act = gu + P * width;  // [P, I]
    float* shared_gate = act + P * I;
    std::vector<int64_t> ids(P), count(E, 0), start(E, 0), pos(P);
    m.router->apply(x, B, logits, workspace_, pool_.get());
    for (int64_t b = 0; b < B; ++b) route_row(logits + b * E, E, m, probs + b * E, ids.data() + b * k, weights + b * k);
    for (int64_t i = 0; i < P; ++i) ++count[ids[i]];
    for (int64_t e = 1; e < E; ++e) start[e] = start[e - 1] + count[e - 1];
    std::vector<int64_t> next(start);
    for (int64_t i = 0; i < P; ++i) {  // stable: an expert's tokens in order
      pos[i] = next[ids[i]]++;
      std::memcpy(rows + pos[i] * D, x + (i / k) * D, sizeof(float) * D);
    }
    int64_t* load = m.load.data_ptr<int64_t>();
    for (int64_t e = 0; e < E; ++e) {
      load[e] += count[e];
      if (count[e] == 0) continue;
      const int64_t n = count[e];
      m.gate_up[e]->apply(rows + start[e] * D, n, gu, workspace_, pool_.get());
      silu_mul(gu, n, I, act);
      m.down[e]->apply(act, n, rows + start[e] * D, workspace_, pool_.get());  // its rows are read: reuse them
    }
    std::fill(y, y + B * D, 0.f);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t j = 0; j < k; ++j) {
        const float w = weights[b * k + j];
        const float* r = rows + pos[b * k + j] * D;
#pragma omp simd
        for (int64_t c = 0; c < D; ++c) y[b * D + c] += w * r[c];
      }
    }
    if (!m.shared_gate_up) return;
    m.shared_gate_up->apply(x, B, gu, workspace_, pool_.get());
    silu_mul(gu, B, S, act);
    m.shared_down->apply(act, B, rows, workspace_, pool_.get());
    m.shared_gate->apply(x, B, shared_gate, workspace_, pool_.get());
    for (int64_t b = 0; b < B; ++b) {
      const float g = 1.f / (1.f + std::exp(-shared_gate[b]));
#pragma omp simd
      for (int64_t c = 0; c < D; ++c) y[b * D + c] += g * rows[b * D + c];
    }
  }

  // a [n, I] = silu(gate) * up over gu [n, 2I] (gate columns first).
  static void silu_mul(const float* gu, int64_t n, int64_t I, float* a) {
    for (int64_t r = 0; r < n; ++r) {
      const float* g = gu + r * 2 * I;
      const float* u = g + I;
#pragma omp simd
      for (int64_t f = 0; f < I; ++f) a[r * I + f] = g[f] / (1.f + exp_vec(-g[f])) * u[f];
    }
  }
};

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  tokenmill_cpu::register_shm_all_reduce(m);
  tokenmill_cpu::register_model_loras(m);
  m.class_<Projection>("Projection")
      .def_static("plain", &Projection::plain)
      .def_static("exact", &Projection::exact)
      .def_static("int8", &Projection::int8)
      .def_static("kquant", &Projection::kquant)
      .def_static("stacked", &Projection::stacked)
      .def("in_features", &Projection::in_features)
      .def("out_features", &Projection::out_features);
  m.class_<LlamaDecoder>("LlamaDecoder")
      .def(torch::init<at::Tensor, std::vector<at::Tensor>, std::vector<c10::intrusive_ptr<Projection>>, at::Tensor,
                       at::Tensor, at::Tensor, int64_t, int64_t, int64_t, double, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t>())
      .def("forward", &LlamaDecoder::forward)
      .def("forward_lora", &LlamaDecoder::forward_lora)
      .def("set_lora", &LlamaDecoder::set_lora)
      .def("logits", &LlamaDecoder::logits)
      .def("set_layout", &LlamaDecoder::set_layout)
      .def("set_gemma", &LlamaDecoder::set_gemma)
      .def("set_qk_norms", &LlamaDecoder::set_qk_norms)
      .def("set_moe", &LlamaDecoder::set_moe)
      .def("set_softcap", &LlamaDecoder::set_softcap)
      .def("set_all_reduce", &LlamaDecoder::set_all_reduce);
}
