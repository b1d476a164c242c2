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
#include <vector>

#include "paged_decode.h"
#include "vec_exp.h"

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

void linear_rows(const float* x, int64_t T, int64_t in, const float* w_t, const float* bias, int64_t out, float* y) {
  const int64_t row_tiles = (T + kRows - 1) / kRows, col_tiles = (out + kCols - 1) / kCols;
  // Threads only where a product is big enough to pay for waking them.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, kRows * in * out));
  at::parallel_for(0, row_tiles, grain, [&](int64_t begin, int64_t end) {
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

struct Layer {
  at::Tensor input_norm, qkv_t, qkv_bias, o_t, post_norm, gate_up_t, down_t;
};

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

struct LlamaDecoder : torch::CustomClassHolder {
  // layer_tensors: per layer, in this order: input_norm [D], qkv [Q+2KV, D], qkv bias ([Q+2KV] or
  // empty), o [D, Q], post_norm [D], gate_up [2F, D], down [D, F]. caches: per layer K and V
  // pools; scales empty for plain pools, else per layer K and V scales (kv_quant.ScaledCache).
  // lm_head: [V, D], or empty when the logits are not computed here (see logits()).
  LlamaDecoder(at::Tensor embed, std::vector<at::Tensor> layer_tensors, at::Tensor final_norm, at::Tensor lm_head,
               at::Tensor cos_full, at::Tensor sin_signed, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               double eps, std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
               std::vector<at::Tensor> k_scales, std::vector<at::Tensor> v_scales)
      : embed_(embed.contiguous()), cos_full_(cos_full.contiguous()), sin_signed_(sin_signed.contiguous()),
        H_(num_heads), KH_(num_kv_heads), hd_(head_dim), eps_(static_cast<float>(eps)), k_caches_(k_caches),
        v_caches_(v_caches), k_scales_(k_scales), v_scales_(v_scales) {
    TORCH_CHECK(embed_.dim() == 2 && embed_.scalar_type() == at::kFloat, "embed must be fp32 [V, D]");
    TORCH_CHECK(layer_tensors.size() % 7 == 0 && !layer_tensors.empty(), "7 tensors per layer");
    TORCH_CHECK(H_ % KH_ == 0 && hd_ % 2 == 0, "query heads must be a multiple of kv heads, head_dim even");
    D_ = embed_.size(1);
    const int64_t L = static_cast<int64_t>(layer_tensors.size()) / 7;
    const int64_t qkv = (H_ + 2 * KH_) * hd_;
    for (int64_t l = 0; l < L; ++l) {
      const at::Tensor* w = layer_tensors.data() + 7 * l;
      Layer layer;
      layer.input_norm = vector_of(w[0], D_, "input_norm");
      layer.qkv_t = transposed(w[1]);
      TORCH_CHECK(layer.qkv_t.size(0) == D_ && layer.qkv_t.size(1) == qkv, "qkv must be [(H + 2 KH) hd, D]");
      if (w[2].numel() > 0) layer.qkv_bias = vector_of(w[2], qkv, "qkv bias");
      layer.o_t = transposed(w[3]);
      TORCH_CHECK(layer.o_t.size(0) == H_ * hd_ && layer.o_t.size(1) == D_, "o must be [D, H hd]");
      layer.post_norm = vector_of(w[4], D_, "post_norm");
      layer.gate_up_t = transposed(w[5]);
      TORCH_CHECK(layer.gate_up_t.size(0) == D_ && layer.gate_up_t.size(1) % 2 == 0, "gate_up must be [2F, D]");
      layer.down_t = transposed(w[6]);
      TORCH_CHECK(layer.down_t.size(0) * 2 == layer.gate_up_t.size(1) && layer.down_t.size(1) == D_,
                  "down must be [D, F]");
      layers_.push_back(std::move(layer));
    }
    final_norm_ = vector_of(final_norm, D_, "final_norm");
    if (lm_head.numel() > 0) {
      lm_head_t_ = transposed(lm_head);
      TORCH_CHECK(lm_head_t_.size(0) == D_, "lm_head must be [V, D]");
    }
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
    TORCH_CHECK(input_ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                    slot_mapping.scalar_type() == at::kLong,
                "input_ids, positions and slot_mapping must be int64");
    input_ids = input_ids.contiguous();
    positions = positions.contiguous();
    slot_mapping = slot_mapping.contiguous();
    const int64_t B = input_ids.numel();
    TORCH_CHECK(positions.numel() == B && slot_mapping.numel() == B, "one position and slot per token");
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
    const int64_t F = layers_.empty() ? 0 : layers_[0].down_t.size(0);
    at::Tensor gate_up = at::empty({B, 2 * F}, f32), act = at::empty({B, F}, f32);
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
    const float* cos_tab = cos_full_.data_ptr<float>();
    const float* sin_tab = sin_signed_.data_ptr<float>();
    const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
    // Views of the fused projection's k and v columns, for the quantized write (plain pools are
    // written here directly).
    at::Tensor k_view, v_view;
    if (quantized_) {
      k_view = qkv.narrow(1, q_size, kv_size).view({B, KH_, hd});
      v_view = qkv.narrow(1, q_size + kv_size, kv_size).view({B, KH_, hd});
    }
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      rms_norm_rows(h, B, D, layer.input_norm.data_ptr<float>(), eps_, xp);
      linear_rows(xp, B, D, layer.qkv_t.data_ptr<float>(),
                  layer.qkv_bias.defined() ? layer.qkv_bias.data_ptr<float>() : nullptr, qkv_size, qkvp);
      for (int64_t b = 0; b < B; ++b) {
        float* row = qkvp + b * qkv_size;
        rotate_heads(row, H_ + KH_, hd, cos_tab + pos[b] * hd, sin_tab + pos[b] * hd);
        std::memcpy(qp + b * q_size, row, sizeof(float) * q_size);
      }
      if (quantized_) {
        tokenmill_cpu::store_kv(k_view, v_view, k_caches_[l], v_caches_[l], &k_scales_[l], &v_scales_[l],
                                slot_mapping);
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
                                      quantized_ ? &v_scales_[l] : nullptr, block_tables, context_lens, scale);
      linear_rows(ap, B, q_size, layer.o_t.data_ptr<float>(), nullptr, D, tp);
#pragma omp simd
      for (int64_t i = 0; i < B * D; ++i) h[i] += tp[i];
      rms_norm_rows(h, B, D, layer.post_norm.data_ptr<float>(), eps_, xp);
      linear_rows(xp, B, D, layer.gate_up_t.data_ptr<float>(), nullptr, 2 * F, gup);
      for (int64_t b = 0; b < B; ++b) {
        const float* g = gup + b * 2 * F;
        const float* u = g + F;
        float* a = actp + b * F;
#pragma omp simd
        for (int64_t f = 0; f < F; ++f) a[f] = g[f] / (1.f + exp_vec(-g[f])) * u[f];
      }
      linear_rows(actp, B, F, layer.down_t.data_ptr<float>(), nullptr, D, tp);
#pragma omp simd
      for (int64_t i = 0; i < B * D; ++i) h[i] += tp[i];
    }
    rms_norm_rows(h, B, D, final_norm_.data_ptr<float>(), eps_, xp);
    return x;
  }

  // hidden [N, D] -> logits [N, V]. Each row is summed in one fixed order whatever N (the same
  // register tiles as the layers' products), so a request's logits, and the logprobs it is
  // shown, do not depend on how many other rows sample in its step: BLAS picks another kernel
  // for one or two rows than for more, which moves the last bits.
  at::Tensor logits(at::Tensor hidden) {
    TORCH_CHECK(lm_head_t_.defined(), "this decoder was built without an LM head");
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == D_ && hidden.scalar_type() == at::kFloat &&
                    hidden.device().is_cpu(),
                "hidden must be fp32 CPU [N, ", D_, "]");
    hidden = hidden.contiguous();
    const int64_t N = hidden.size(0), V = lm_head_t_.size(1);
    at::Tensor out = at::empty({N, V}, at::TensorOptions().dtype(at::kFloat));
    linear_rows(hidden.data_ptr<float>(), N, D_, lm_head_t_.data_ptr<float>(), nullptr, V, out.data_ptr<float>());
    return out;
  }

 private:
  at::Tensor embed_, cos_full_, sin_signed_, final_norm_, lm_head_t_;
  std::vector<Layer> layers_;
  int64_t H_, KH_, hd_, D_ = 0;
  float eps_;
  std::vector<at::Tensor> k_caches_, v_caches_, k_scales_, v_scales_;
  bool quantized_ = false;
};

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.class_<LlamaDecoder>("LlamaDecoder")
      .def(torch::init<at::Tensor, std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t,
                       int64_t, int64_t, double, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>>())
      .def("forward", &LlamaDecoder::forward)
      .def("logits", &LlamaDecoder::logits);
}
