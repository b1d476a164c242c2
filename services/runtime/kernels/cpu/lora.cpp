// Batched LoRA for the CPU, punica's BGMV/SGMV arrangement:
//
//   y[t] += scales[s] * B_s (A_s x[t])      for every row t of slot s = row_slots[t] >= 0
//
// A step mixes rows of many adapters (and rows of none). The rows are first grouped by slot (a
// counting sort), so each adapter's A and B are read from memory once per call for all of its
// rows, however the rows are interleaved in the batch:
//   shrink: h [rows_s, R] = x[rows_s] A_s^T, one task per (slot, a few ranks): each A_s row
//           streams past every row of the slot, a dot product along `in`;
//   expand: y[rows_s] += scale_s h B_s^T, one task per (slot, a tile of kCols outputs): the
//           tile of B_s [kCols, R] is transposed once into [R, kCols] (L1-sized), so each row's
//           update is R broadcast multiply-adds along contiguous outputs.
// Two parallel loops with the shrink finished before the expand. Plain loops the compiler
// vectorizes for the build's -march (an AVX2-only build is tested like the AVX-512 one); each
// output is summed over the ranks in order whatever tile or batch it falls in, so a row's result
// does not depend on the rows around it.
//
// Adapters are fp32; x and y are fp32, bf16 or fp16 (16-bit x is widened once, the update is
// added to y in fp32 and rounded once). The reference is services/runtime/kernels/lora.py.

#include "lora.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "worker_pool.h"

namespace tokenmill_cpu {
namespace {

constexpr int64_t kRanksPerTask = 4;
constexpr int64_t kCols = 64;  // expand tile: R x 64 fp32 (16 KB at R = 64) stays in L1
constexpr int64_t kMaxRank = 256;
constexpr int64_t kTaskWork = int64_t{1} << 15;  // multiply-adds worth waking a thread for

template <typename index_t>
int64_t group_rows(const index_t* row_slots, int64_t T, int64_t S, LoraRows& grouped) {
  grouped.begin.assign(S + 2, 0);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = row_slots[t];
    if (s < -1 || s >= S) return t;
    if (s >= 0) ++grouped.begin[s + 2];
  }
  for (int64_t s = 0; s < S; ++s) grouped.begin[s + 2] += grouped.begin[s + 1];  // begin[s + 1] = start of s
  grouped.rows.resize(grouped.begin[S + 1]);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = row_slots[t];
    if (s >= 0) grouped.rows[grouped.begin[s + 1]++] = static_cast<int32_t>(t);
  }
  grouped.begin.pop_back();  // now begin[s] = start of s, begin[S] = end
  return -1;
}

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(at::Half v) { return static_cast<float>(v); }

template <typename y_t>
void apply_rows(const LoraStack& w, const float* x, int64_t x_stride, y_t* y, int64_t y_stride, LoraRows& g,
                WorkerPool* pool) {
  const int64_t S = w.S, R = w.R, in = w.in, out = w.out;
  const int64_t total = g.begin[S];
  if (total == 0 || R == 0) return;
  g.shrunk.resize(total * R);
  float* h = g.shrunk.data();
  const int32_t* rows = g.rows.data();
  const int64_t* begin = g.begin.data();
  const int64_t rank_tasks = (R + kRanksPerTask - 1) / kRanksPerTask;
  const int64_t rows_per_slot = std::max<int64_t>(1, total / S);

  // shrink: task = (slot, ranks [k0, k0 + kRanksPerTask)); slots without rows return at once
  const int64_t shrink_grain = std::max<int64_t>(1, kTaskWork / std::max<int64_t>(1, rows_per_slot * kRanksPerTask * in));
  parallel_for(pool, S * rank_tasks, shrink_grain, [&](int64_t task_begin, int64_t task_end) {
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t s = task / rank_tasks, k0 = (task % rank_tasks) * kRanksPerTask;
      const int64_t k1 = std::min(R, k0 + kRanksPerTask);
      for (int64_t k = k0; k < k1; ++k) {
        const float* a = w.a + (s * R + k) * in;
        for (int64_t p = begin[s]; p < begin[s + 1]; ++p) {
          const float* xr = x + static_cast<int64_t>(rows[p]) * x_stride;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t i = 0; i < in; ++i) sum += xr[i] * a[i];
          h[p * R + k] = sum;
        }
      }
    }
  });

  // expand: task = (slot, outputs [o0, o0 + kCols))
  const int64_t col_tasks = (out + kCols - 1) / kCols;
  const int64_t expand_grain = std::max<int64_t>(1, kTaskWork / std::max<int64_t>(1, rows_per_slot * R * kCols));
  parallel_for(pool, S * col_tasks, expand_grain, [&](int64_t task_begin, int64_t task_end) {
    alignas(64) float bt[kMaxRank * kCols];
    alignas(64) float acc[kCols];
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t s = task / col_tasks, o0 = (task % col_tasks) * kCols;
      if (begin[s] == begin[s + 1]) continue;
      const int64_t cols = std::min(kCols, out - o0);
      const float* b = w.b + (s * out + o0) * R;  // [cols, R]
      for (int64_t c = 0; c < cols; ++c) {
        for (int64_t k = 0; k < R; ++k) bt[k * kCols + c] = b[c * R + k];
      }
      const float scale = w.scales[s];
      for (int64_t p = begin[s]; p < begin[s + 1]; ++p) {
        const float* hp = h + p * R;
#pragma omp simd
        for (int64_t c = 0; c < kCols; ++c) acc[c] = 0.f;
        for (int64_t k = 0; k < R; ++k) {
          const float hk = hp[k];
          const float* btk = bt + k * kCols;
#pragma omp simd
          for (int64_t c = 0; c < kCols; ++c) acc[c] += hk * btk[c];
        }
        y_t* yr = y + static_cast<int64_t>(rows[p]) * y_stride + o0;
        for (int64_t c = 0; c < cols; ++c) yr[c] = static_cast<y_t>(to_float(yr[c]) + scale * acc[c]);
      }
    }
  });
}

}  // namespace

int64_t group_rows_by_slot(const int32_t* row_slots, int64_t T, int64_t S, LoraRows& grouped) {
  return group_rows(row_slots, T, S, grouped);
}

int64_t group_rows_by_slot(const int64_t* row_slots, int64_t T, int64_t S, LoraRows& grouped) {
  return group_rows(row_slots, T, S, grouped);
}

void lora_rows(const LoraStack& w, const float* x, int64_t x_stride, float* y, int64_t y_stride, LoraRows& grouped,
               WorkerPool* pool) {
  apply_rows(w, x, x_stride, y, y_stride, grouped, pool);
}

}  // namespace tokenmill_cpu

namespace {

// The op behind services/runtime/kernels/lora.py: y updated in place. Returns -1, or the first
// row whose slot is outside [-1, S) (nothing is written then): an exception thrown here does
// not reach Python on every torch build, so the caller raises.
int64_t lora_apply(at::Tensor y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                   const at::Tensor& row_slots, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.stride(1) == 1 && y.stride(1) == 1,
              "x [T, in] and y [T, out] need unit last strides");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "x and y must share a dtype");
  TORCH_CHECK(lora_a.dim() == 3 && lora_a.is_contiguous() && lora_a.scalar_type() == at::kFloat &&
                  lora_a.size(2) == x.size(1), "lora_a must be [S, R, in] fp32 contiguous");
  const int64_t S = lora_a.size(0), R = lora_a.size(1), T = x.size(0);
  TORCH_CHECK(lora_b.dim() == 3 && lora_b.is_contiguous() && lora_b.scalar_type() == at::kFloat &&
                  lora_b.size(0) == S && lora_b.size(1) == y.size(1) && lora_b.size(2) == R,
              "lora_b must be [S, out, R] fp32 contiguous");
  TORCH_CHECK(R <= tokenmill_cpu::kMaxRank, "rank above ", tokenmill_cpu::kMaxRank);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == S, "scales [S] fp32");
  TORCH_CHECK(row_slots.dim() == 1 && row_slots.size(0) == T && row_slots.is_contiguous() &&
                  (row_slots.scalar_type() == at::kInt || row_slots.scalar_type() == at::kLong),
              "row_slots [T] int32 or int64");
  thread_local tokenmill_cpu::LoraRows grouped;
  const int64_t bad = row_slots.scalar_type() == at::kInt
                          ? tokenmill_cpu::group_rows_by_slot(row_slots.data_ptr<int32_t>(), T, S, grouped)
                          : tokenmill_cpu::group_rows_by_slot(row_slots.data_ptr<int64_t>(), T, S, grouped);
  if (bad >= 0) return bad;
  tokenmill_cpu::LoraStack w;
  w.a = lora_a.data_ptr<float>(), w.b = lora_b.data_ptr<float>(), w.scales = scales.data_ptr<float>();
  w.S = S, w.R = R, w.in = x.size(1), w.out = y.size(1);
  if (x.scalar_type() == at::kFloat) {
    tokenmill_cpu::apply_rows(w, x.data_ptr<float>(), x.stride(0), y.data_ptr<float>(), y.stride(0), grouped, nullptr);
    return -1;
  }
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "lora_apply", [&] {
    // Only the rows some adapter reads are widened.
    const int64_t in = w.in;
    grouped.x.resize(T * in);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    for (int32_t t : grouped.rows) {
      for (int64_t i = 0; i < in; ++i) grouped.x[t * in + i] = static_cast<float>(xp[t * x.stride(0) + i]);
    }
    tokenmill_cpu::apply_rows(w, grouped.x.data(), in, y.data_ptr<scalar_t>(), y.stride(0), grouped, nullptr);
  });
  return -1;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("lora_apply(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor row_slots, Tensor scales) -> int");
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) { m.impl("lora_apply", &lora_apply); }
