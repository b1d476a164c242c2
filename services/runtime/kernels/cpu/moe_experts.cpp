// A sparse layer's routed experts over quantized weights kept in their GGUF type, grouped: the
// (token, slot) pairs sorted by expert, each expert with tokens multiplying all its rows at once,
// so each expert's weights are read once per step whatever its number of tokens, and an expert no
// token chose costs nothing. Per projection one parallel region spans every (expert, tile run)
// item, so a step with one busy expert and a step with many spread over the threads alike.
//
//   gu  = rows_e . W13_e^T      [n_e, 2I]   (gate rows first, then up: moe.py's w_gate_up)
//   h   = silu(gate) * up       [n_e, I]
//   y_p = h . W2_e^T            [n_e, H]
//   out[t] = sum_j w[t, j] y_(t, j)          (fp32, slots in order)
//
// Both products are the existing integer ones with activations rounded to int8 per 32 values
// (quant_dot.cpp for q4_0 / q4_1 / q8_0, kquant_dot.cpp for the K-quants and q5_0 / q5_1), on
// the weights repacked into their tiles of 16 outputs, one expert after another in one buffer
// ([E, bytes per expert]); their AVX-512 VNNI, AVX2 and portable paths are chosen at run time.
// The PyTorch reference is services/runtime/kernels/moe_experts.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu_isa.h"
#include "quant_kernels.h"

namespace tokenmill_cpu {
namespace {

constexpr int64_t kTile = 16;

// One projection's stacked weights: the format's family, its code there and one expert's bytes.
struct Projection {
  bool kquant = false;
  int64_t code = 0;
  const uint8_t* data = nullptr;
  int64_t expert_bytes = 0, N = 0, K = 0;
};

struct Acts {
  QuantizedActivations int8;
  KquantActivations kq;
};

Projection projection_of(const at::Tensor& w, const std::string& fmt, int64_t E, int64_t N, int64_t K,
                         const char* name) {
  Projection p;
  static const char* int8_names[] = {"q4_0", "q4_1", "q8_0"};
  static const char* kquant_names[] = {"q4_k", "q5_k", "q6_k", "q5_0", "q5_1"};
  bool found = false;
  for (int64_t i = 0; i < 3 && !found; ++i) {
    if (fmt == int8_names[i]) p.kquant = false, p.code = i, found = true;
  }
  for (int64_t i = 0; i < 5 && !found; ++i) {
    if (fmt == kquant_names[i]) p.kquant = true, p.code = i, found = true;
  }
  TORCH_CHECK(found, name, " format must be one of q4_0, q4_1, q8_0, q4_k, q5_k, q6_k, q5_0, q5_1; got ", fmt);
  const int64_t block = p.kquant ? kquant_block(p.code) : 32;
  TORCH_CHECK(K > 0 && K % block == 0, name, ": in_features ", K, " must be a positive multiple of ", block);
  const int64_t tile_bytes = p.kquant ? kquant_tile_bytes(p.code, K)
                                      : K / 32 * int8_block_bytes(static_cast<QuantFormat>(p.code));
  p.expert_bytes = (N + kTile - 1) / kTile * tile_bytes;
  p.N = N, p.K = K;
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(0) == E &&
                  w.size(1) == p.expert_bytes,
              name, " must be [", E, ", ", p.expert_bytes, "] uint8 (the experts' packed tiles), got ", w.sizes());
  p.data = w.data_ptr<uint8_t>();
  return p;
}

// out [P, N] = in [P, K] times each expert's weight over its run of rows [start[e], start[e] + n[e]).
void grouped_product(const Projection& p, const float* in, float* out, const std::vector<int64_t>& active,
                     const std::vector<int64_t>& start, const std::vector<int64_t>& count, Isa isa) {
  const int64_t A = static_cast<int64_t>(active.size());
  std::vector<Acts> acts(A);
  at::parallel_for(0, A, 1, [&](int64_t a0, int64_t a1) {
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t e = active[a];
      if (p.kquant) {
        kquant_quantize_rows(in + start[e] * p.K, count[e], p.K, p.K, acts[a].kq);
      } else {
        quantize_activations(in + start[e] * p.K, count[e], p.K, p.K, isa, acts[a].int8);
      }
    }
  });
  // Each expert's tiles in runs, enough runs that every thread has a few items to take.
  const int64_t tiles = (p.N + kTile - 1) / kTile;
  const int64_t threads = at::get_num_threads();
  const int64_t runs = std::min(tiles, std::max<int64_t>(1, (2 * threads + A - 1) / A));
  const int64_t per_run = (tiles + runs - 1) / runs;
  at::parallel_for(0, A * runs, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t a = i / runs, t0 = (i % runs) * per_run, t1 = std::min(tiles, t0 + per_run);
      if (t0 >= t1) continue;
      const int64_t e = active[a];
      const uint8_t* w = p.data + e * p.expert_bytes;
      float* o = out + start[e] * p.N;
      if (p.kquant) {
        kquant_matmul_tiles(w, p.code, p.N, p.K, acts[a].kq, o, p.N, t0, t1, isa);
      } else {
        PackedInt8Weight pw;
        pw.data = w, pw.format = static_cast<QuantFormat>(p.code), pw.N = p.N, pw.K = p.K;
        pw.block_bytes = int8_block_bytes(pw.format);
        int8_matmul_tiles(pw, acts[a].int8, o, p.N, t0, t1, isa);
      }
    }
  });
}

// x [T, H] fp32; w13 [E, bytes] the packed [2I, H] gate|up weights; w2 [E, bytes] the packed [H, I]
// down weights; topk_weights [T, k] fp32; topk_ids [T, k] int64 -> [T, H] fp32.
at::Tensor moe_experts_int8(const at::Tensor& x, const at::Tensor& w13, const std::string& fmt13,
                            const at::Tensor& w2, const std::string& fmt2, const at::Tensor& topk_weights,
                            const at::Tensor& topk_ids, int64_t inter) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [T, H] fp32 contiguous");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T && topk_ids.scalar_type() == at::kLong &&
                  topk_ids.is_contiguous(),
              "topk_ids must be [T, k] int64 contiguous");
  const int64_t k = topk_ids.size(1);
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.scalar_type() == at::kFloat &&
                  topk_weights.is_contiguous(),
              "topk_weights must be [T, k] fp32 contiguous like topk_ids");
  TORCH_CHECK(inter > 0, "the expert size must be positive");
  const int64_t E = w13.dim() == 2 ? w13.size(0) : 0;
  const Projection p13 = projection_of(w13, fmt13, E, 2 * inter, H, "w13");
  const Projection p2 = projection_of(w2, fmt2, E, H, inter, "w2");
  at::Tensor out = at::zeros({T, H}, x.options());
  const int64_t P = T * k;
  if (P == 0) return out;

  // Counting sort of the pairs by expert (stable: tokens in order within an expert).
  const int64_t* ids = topk_ids.data_ptr<int64_t>();
  std::vector<int64_t> count(E, 0), start(E, 0), pos(P), row(P);
  for (int64_t i = 0; i < P; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < E, "topk_ids holds expert ", ids[i], "; the layer has ", E);
    ++count[ids[i]];
  }
  std::vector<int64_t> active;
  for (int64_t e = 0, s = 0; e < E; ++e) {
    start[e] = s;
    s += count[e];
    if (count[e] > 0) active.push_back(e);
  }
  std::vector<int64_t> next(start);
  for (int64_t i = 0; i < P; ++i) {
    pos[i] = next[ids[i]]++;
    row[pos[i]] = i / k;
  }

  const Isa isa = active_isa();
  const float* xp = x.data_ptr<float>();
  std::vector<float> xs(P * H), gu(P * 2 * inter), h(P * inter), ys(P * H);
  at::parallel_for(0, P, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) std::copy(xp + row[p] * H, xp + (row[p] + 1) * H, xs.data() + p * H);
  });
  grouped_product(p13, xs.data(), gu.data(), active, start, count, isa);
  at::parallel_for(0, P, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const float* g = gu.data() + p * 2 * inter;
      const float* u = g + inter;
      float* hp = h.data() + p * inter;
      for (int64_t j = 0; j < inter; ++j) hp[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
    }
  });
  grouped_product(p2, h.data(), ys.data(), active, start, count, isa);
  const float* wts = topk_weights.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const float wt = wts[t * k + j];
        const float* y = ys.data() + pos[t * k + j] * H;
        for (int64_t c = 0; c < H; ++c) o[t * H + c] += wt * y[c];
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace tokenmill_cpu

TORCH_LIBRARY_FRAGMENT(tokenmill_quant, m) {
  m.def("moe_experts_int8(Tensor x, Tensor w13, str fmt13, Tensor w2, str fmt2, Tensor topk_weights, "
        "Tensor topk_ids, int inter) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill_quant, CPU, m) {
  m.impl("moe_experts_int8", &tokenmill_cpu::moe_experts_int8);
}
