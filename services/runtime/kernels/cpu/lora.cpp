// Batched LoRA for the CPU, punica's BGMV/SGMV arrangement:
//
//   y[t] += scales[s] * B_s (A_s x[t])      for every row t of slot s = row_slots[t] >= 0
//
// A step mixes rows of many adapters (and rows of none). The rows are first grouped by slot (a
// counting sort), so each adapter's A and B are read from memory once per call for all of its
// rows, however the rows are interleaved in the batch:
//   shrink: h [rows_s, R] = x[rows_s] A_s^T, one task per (slot, a few ranks): each A_s row
//           streams past every row of the slot, a dot product along `in`;
//   expand: y[rows_s] += scale_s h B_s^T, one task per (slot, 256 outputs), reading B_s as
//           [R, out]: per rank, a few vectors of B along the outputs serve four rows each with
//           broadcast multiply-adds, no horizontal sums. B stored [S, R, out] (passed as the
//           transposed view, lora_b.transpose(1, 2)) is read in place; PEFT's [S, out, R] is
//           transposed per call first, a scalar pass over the slots in use that costs about as
//           much as the expand itself at a few rows per slot.
// A fused projection's members (out_splits) are bands: one shrink over all their ranks, then each
// band of outputs expands from its own ranks. Two parallel loops, the shrink finished before the
// expand. The inner loops are written in
// GCC's vector extension at the build's widest float vector (16 lanes under AVX-512, 8 under
// AVX2; an AVX2-only build is tested like the AVX-512 one). Each output is summed over the ranks
// in order whatever tile or batch it falls in, so a row's result does not depend on the rows
// around it (the shrink's dot products along `in` do depend on the build's vector width).
//
// Adapters are stored fp32 or bf16 (half the bytes to stream: at one row per adapter the step is
// bound by reading them) and multiplied in fp32; x and y are fp32, bf16 or fp16 (16-bit x is
// widened once, the update is added to y in fp32 and rounded once). The reference is services/runtime/kernels/lora.py.

#include "lora.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "worker_pool.h"

namespace tokenmill_cpu {
namespace {

// GCC's vector extension: one register of the build's widest float vector (AVX-512 or AVX2;
// the compiler lowers it for the -march the extension is built with).
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));

typedef uint16_t vbits16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t vbits32 __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// bf16 adapters (their bits as uint16_t): a bf16 is the top half of the fp32 of the same value.
inline vfloat load(const uint16_t* p) {
  vbits16 bits;
  std::memcpy(&bits, p, sizeof(bits));
  return reinterpret_cast<vfloat>(__builtin_convertvector(bits, vbits32) << 16);
}

inline float scalar(const float* p, int64_t i) { return p[i]; }
inline float scalar(const uint16_t* p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

inline float lane_sum(vfloat v) {
  float sum = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) sum += v[l];
  return sum;
}

constexpr int64_t kTileRows = 4;   // rows sharing each loaded vector of A or B
constexpr int64_t kTileRanks = 4;  // shrink: ranks per tile (16 dot products in registers)
// expand: outputs per tile, 4 x 4 accumulators with AVX-512's 32 registers, 4 x 2 with AVX2's 16
constexpr int64_t kTileVecs = kLanes == 16 ? 4 : 2;
constexpr int64_t kTileCols = kTileVecs * kLanes;
constexpr int64_t kColsPerTask = 256;  // a multiple of kTileCols on either
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

// h[p, k] = x[rows[p]] . a[k] for NR grouped rows from p0 and NK ranks from k0: NR x NK dot
// products along `in`, each loaded vector of x or A used NK or NR times.
template <int NR, int NK, typename w_t>
void shrink_tile(const float* x, int64_t x_stride, const int32_t* rows, int64_t p0, const w_t* a, int64_t k0,
                 int64_t in, float* h, int64_t R) {
  const float* xr[NR];
  for (int r = 0; r < NR; ++r) xr[r] = x + static_cast<int64_t>(rows[p0 + r]) * x_stride;
  vfloat acc[NR][NK];
  for (int r = 0; r < NR; ++r) {
    for (int k = 0; k < NK; ++k) acc[r][k] = vfloat{};
  }
  const int64_t body = in - in % kLanes;
  for (int64_t i = 0; i < body; i += kLanes) {
    vfloat av[NK];
    for (int k = 0; k < NK; ++k) av[k] = load(a + (k0 + k) * in + i);
    for (int r = 0; r < NR; ++r) {
      const vfloat xv = load(xr[r] + i);
      for (int k = 0; k < NK; ++k) acc[r][k] += xv * av[k];
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int k = 0; k < NK; ++k) {
      float sum = lane_sum(acc[r][k]);
      for (int64_t i = body; i < in; ++i) sum += xr[r][i] * scalar(a, (k0 + k) * in + i);
      h[(p0 + r) * R + k0 + k] = sum;
    }
  }
}

template <int NR, typename w_t>
void shrink_rows(const float* x, int64_t x_stride, const int32_t* rows, int64_t p0, const w_t* a, int64_t k0,
                 int64_t nk, int64_t in, float* h, int64_t R) {
  switch (nk) {
    case 1: shrink_tile<NR, 1>(x, x_stride, rows, p0, a, k0, in, h, R); break;
    case 2: shrink_tile<NR, 2>(x, x_stride, rows, p0, a, k0, in, h, R); break;
    case 3: shrink_tile<NR, 3>(x, x_stride, rows, p0, a, k0, in, h, R); break;
    default: shrink_tile<NR, 4>(x, x_stride, rows, p0, a, k0, in, h, R); break;
  }
}

// y[rows[p]][o0 .. o0 + kTileCols) += scale * sum_k h[p, k] bt[k, o] for NR rows from p0, with
// bt the slot's B as [R, out] at row stride ldb: per rank, kTileVecs loaded vectors of B serve
// NR broadcast multiply-adds each.
template <int NR, typename y_t, typename w_t>
void expand_tile(const float* h, int64_t R, int64_t nranks, const int32_t* rows, int64_t p0, const w_t* bt, int64_t ldb,
                 int64_t o0, float scale, y_t* y, int64_t y_stride) {
  vfloat acc[NR][kTileVecs];
  for (int r = 0; r < NR; ++r) {
    for (int j = 0; j < kTileVecs; ++j) acc[r][j] = vfloat{};
  }
  for (int64_t k = 0; k < nranks; ++k) {
    vfloat bv[kTileVecs];
    for (int j = 0; j < kTileVecs; ++j) bv[j] = load(bt + k * ldb + o0 + j * kLanes);
    for (int r = 0; r < NR; ++r) {
      const float hk = h[(p0 + r) * R + k];
      for (int j = 0; j < kTileVecs; ++j) acc[r][j] += hk * bv[j];
    }
  }
  for (int r = 0; r < NR; ++r) {
    y_t* yr = y + static_cast<int64_t>(rows[p0 + r]) * y_stride + o0;
    for (int j = 0; j < kTileVecs; ++j) {
      for (int64_t l = 0; l < kLanes; ++l) {
        yr[j * kLanes + l] = static_cast<y_t>(to_float(yr[j * kLanes + l]) + scale * acc[r][j][l]);
      }
    }
  }
}

template <typename y_t, typename w_t>
void expand_rows(const float* h, int64_t R, int64_t nranks, const int32_t* rows, int64_t p0, int64_t nr,
                 const w_t* bt, int64_t ldb, int64_t o0, float scale, y_t* y, int64_t y_stride) {
  switch (nr) {
    case 1: expand_tile<1>(h, R, nranks, rows, p0, bt, ldb, o0, scale, y, y_stride); break;
    case 2: expand_tile<2>(h, R, nranks, rows, p0, bt, ldb, o0, scale, y, y_stride); break;
    case 3: expand_tile<3>(h, R, nranks, rows, p0, bt, ldb, o0, scale, y, y_stride); break;
    default: expand_tile<4>(h, R, nranks, rows, p0, bt, ldb, o0, scale, y, y_stride); break;
  }
}

// The expand over every slot's rows from the shrunk h, with bt [Rb, out] per slot at
// bt_base + s * bt_slot_stride (Rb = w.band_rank): band j's outputs read h's ranks [j Rb, (j + 1) Rb).
template <typename y_t, typename w_t>
void expand_all(const LoraStack& w, const w_t* bt_base, int64_t bt_slot_stride, y_t* y, int64_t y_stride, LoraRows& g,
                WorkerPool* pool) {
  const int64_t S = w.S, R = w.R, Rb = w.band_rank, out = w.out;
  const float* h = g.shrunk.data();
  const int32_t* rows = g.rows.data();
  const int64_t* begin = g.begin.data();
  const int64_t rows_per_slot = std::max<int64_t>(1, begin[S] / S);
  // task = (slot, up to kColsPerTask outputs of one band); the columns past a band's last whole
  // tile one by one
  g.chunks.clear();
  for (int64_t j = 0, c = 0; j < w.bands; c = w.band_ends[j++]) {
    for (int64_t c0 = c; c0 < w.band_ends[j]; c0 += kColsPerTask) {
      g.chunks.push_back({c0, std::min(w.band_ends[j], c0 + kColsPerTask), j});
    }
  }
  const int64_t chunks = static_cast<int64_t>(g.chunks.size());
  const int64_t expand_grain =
      std::max<int64_t>(1, kTaskWork / std::max<int64_t>(1, rows_per_slot * Rb * kColsPerTask));
  parallel_for(pool, S * chunks, expand_grain, [&](int64_t task_begin, int64_t task_end) {
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t s = task / chunks;
      if (begin[s] == begin[s + 1]) continue;
      const LoraRows::Chunk chunk = g.chunks[task % chunks];
      const int64_t c0 = chunk.begin, c1 = chunk.end, tiled = c0 + (c1 - c0) / kTileCols * kTileCols;
      const w_t* bt = bt_base + s * bt_slot_stride;
      const float* hb = h + chunk.band * Rb;  // row p's band ranks at hb + p * R
      const float scale = w.scales[s];
      for (int64_t p = begin[s]; p < begin[s + 1]; p += kTileRows) {
        const int64_t nr = std::min(kTileRows, begin[s + 1] - p);
        for (int64_t o0 = c0; o0 < tiled; o0 += kTileCols) {
          expand_rows(hb, R, Rb, rows, p, nr, bt, out, o0, scale, y, y_stride);
        }
        for (int64_t o = tiled; o < c1; ++o) {
          for (int64_t r = 0; r < nr; ++r) {
            float sum = 0.f;
            for (int64_t k = 0; k < Rb; ++k) sum += hb[(p + r) * R + k] * scalar(bt, k * out + o);
            y_t& yo = y[static_cast<int64_t>(rows[p + r]) * y_stride + o];
            yo = static_cast<y_t>(to_float(yo) + scale * sum);
          }
        }
      }
    }
  });
}

// Shrink then expand over the grouped rows: a [S, R, in] and b (slot s at b + s * b_slot_stride,
// rank-major [R, out] or PEFT's [out, R]) in w_t, fp32 or bf16 bits.
template <typename y_t, typename w_t>
void apply_rows(const LoraStack& w, const w_t* a_base, const w_t* b_base, const float* x, int64_t x_stride, y_t* y,
                int64_t y_stride, LoraRows& g, WorkerPool* pool) {
  const int64_t S = w.S, R = w.R, in = w.in, out = w.out;
  const int64_t total = g.begin[S];
  if (total == 0 || R == 0) return;
  g.shrunk.resize(total * R);
  float* h = g.shrunk.data();
  const int32_t* rows = g.rows.data();
  const int64_t* begin = g.begin.data();
  const int64_t rows_per_slot = std::max<int64_t>(1, total / S);

  // shrink: task = (slot, kTileRanks ranks); slots without rows return at once
  const int64_t rank_tasks = (R + kTileRanks - 1) / kTileRanks;
  const int64_t shrink_grain = std::max<int64_t>(1, kTaskWork / std::max<int64_t>(1, rows_per_slot * kTileRanks * in));
  parallel_for(pool, S * rank_tasks, shrink_grain, [&](int64_t task_begin, int64_t task_end) {
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t s = task / rank_tasks, k0 = (task % rank_tasks) * kTileRanks;
      const int64_t nk = std::min(kTileRanks, R - k0);
      const w_t* a = a_base + s * R * in;
      for (int64_t p = begin[s]; p < begin[s + 1]; p += kTileRows) {
        switch (std::min(kTileRows, begin[s + 1] - p)) {
          case 1: shrink_rows<1>(x, x_stride, rows, p, a, k0, nk, in, h, R); break;
          case 2: shrink_rows<2>(x, x_stride, rows, p, a, k0, nk, in, h, R); break;
          case 3: shrink_rows<3>(x, x_stride, rows, p, a, k0, nk, in, h, R); break;
          default: shrink_rows<4>(x, x_stride, rows, p, a, k0, nk, in, h, R); break;
        }
      }
    }
  });

  if (w.b_rank_major) {
    expand_all(w, b_base, w.b_slot_stride, y, y_stride, g, pool);
    return;
  }
  // B as [Rb, out] per slot: a transposed fp32 copy of the slots that have rows.
  const int64_t Rb = w.band_rank;
  g.b.resize(S * Rb * out);
  for (int64_t s = 0; s < S; ++s) {
    if (begin[s] == begin[s + 1]) continue;
    const w_t* b = b_base + s * w.b_slot_stride;
    float* bt = g.b.data() + s * Rb * out;
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t k = 0; k < Rb; ++k) bt[k * out + o] = scalar(b, o * Rb + k);
    }
  }
  expand_all(w, g.b.data(), Rb * out, y, y_stride, g, pool);
}

}  // namespace

int64_t group_rows_by_slot(const int32_t* row_slots, int64_t T, int64_t S, LoraRows& grouped) {
  return group_rows(row_slots, T, S, grouped);
}

int64_t group_rows_by_slot(const int64_t* row_slots, int64_t T, int64_t S, LoraRows& grouped) {
  return group_rows(row_slots, T, S, grouped);
}

template <typename y_t>
void apply_stack(const LoraStack& stack, const float* x, int64_t x_stride, y_t* y, int64_t y_stride, LoraRows& grouped,
                 WorkerPool* pool) {
  LoraStack w = stack;
  const int64_t whole = w.out;
  if (w.band_ends == nullptr) w.bands = 1, w.band_rank = w.R, w.band_ends = &whole;  // one band: all of y
  if (w.a16 != nullptr) {
    apply_rows(w, w.a16, w.b16, x, x_stride, y, y_stride, grouped, pool);
  } else {
    apply_rows(w, w.a, w.b, x, x_stride, y, y_stride, grouped, pool);
  }
}

void lora_rows(const LoraStack& w, const float* x, int64_t x_stride, float* y, int64_t y_stride, LoraRows& grouped,
               WorkerPool* pool) {
  apply_stack(w, x, x_stride, y, y_stride, grouped, pool);
}

}  // namespace tokenmill_cpu

namespace {

// One projection's stack over lora_a [S, R, in], lora_b [S, out, R / bands] and scales [S]
// (lora_apply's layout), the bands' end columns in band_ends (kept alive by the caller).
tokenmill_cpu::LoraStack stack_of(const at::Tensor& lora_a, const at::Tensor& lora_b, const at::Tensor& scales,
                                  const std::vector<int64_t>& band_ends) {
  const bool bf16 = lora_a.scalar_type() == at::kBFloat16;
  TORCH_CHECK(lora_a.dim() == 3 && lora_a.is_contiguous() && (bf16 || lora_a.scalar_type() == at::kFloat),
              "lora_a must be [S, R, in] fp32 or bf16 contiguous");
  const int64_t S = lora_a.size(0), R = lora_a.size(1);
  const int64_t bands = static_cast<int64_t>(band_ends.size());
  TORCH_CHECK(bands >= 1 && R % bands == 0, "out_splits: one width per band of lora_a's ranks");
  const int64_t Rb = R / bands, out = band_ends.back();
  TORCH_CHECK(lora_b.dim() == 3 && lora_b.scalar_type() == lora_a.scalar_type() && lora_b.size(0) == S &&
                  lora_b.size(1) == out && lora_b.size(2) == Rb, "lora_b must be [S, out, R / bands] in lora_a's dtype");
  const bool rank_major = lora_b.stride(1) == 1 && lora_b.stride(2) == out && lora_b.stride(0) >= Rb * out;
  TORCH_CHECK(rank_major || lora_b.is_contiguous(), "lora_b must be contiguous, or the transposed view of [S, R, out]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == S, "scales [S] fp32");
  tokenmill_cpu::LoraStack w;
  if (bf16) {
    w.a16 = reinterpret_cast<const uint16_t*>(lora_a.data_ptr<at::BFloat16>());
    w.b16 = reinterpret_cast<const uint16_t*>(lora_b.data_ptr<at::BFloat16>());
  } else {
    w.a = lora_a.data_ptr<float>(), w.b = lora_b.data_ptr<float>();
  }
  w.scales = scales.data_ptr<float>();
  w.S = S, w.R = R, w.in = lora_a.size(2), w.out = out;
  w.b_slot_stride = lora_b.stride(0), w.b_rank_major = rank_major;
  w.band_rank = Rb, w.bands = bands, w.band_ends = band_ends.data();
  return w;
}

std::vector<int64_t> band_ends_of(c10::IntArrayRef out_splits) {
  std::vector<int64_t> ends;
  for (int64_t width : out_splits) {
    TORCH_CHECK(width >= 1, "out_splits must be positive");
    ends.push_back((ends.empty() ? 0 : ends.back()) + width);
  }
  TORCH_CHECK(!ends.empty(), "out_splits: one width per band of lora_a's ranks");
  return ends;
}

// The op behind services/runtime/kernels/lora.py: y updated in place. Returns -1, or the first
// row whose slot is outside [-1, S) (nothing is written then): an exception thrown here does
// not reach Python on every torch build, so the caller raises.
int64_t lora_apply(at::Tensor y, const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                   const at::Tensor& row_slots, const at::Tensor& scales, c10::IntArrayRef out_splits) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.stride(1) == 1 && y.stride(1) == 1,
              "x [T, in] and y [T, out] need unit last strides");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "x and y must share a dtype");
  thread_local std::vector<int64_t> band_ends;
  band_ends = band_ends_of(out_splits);
  TORCH_CHECK(band_ends.back() == y.size(1), "out_splits must sum to y's columns");
  const tokenmill_cpu::LoraStack w = stack_of(lora_a, lora_b, scales, band_ends);
  TORCH_CHECK(w.in == x.size(1), "lora_a must be [S, R, in] with x's in");
  const int64_t T = x.size(0), S = w.S;
  TORCH_CHECK(row_slots.dim() == 1 && row_slots.size(0) == T && row_slots.is_contiguous() &&
                  (row_slots.scalar_type() == at::kInt || row_slots.scalar_type() == at::kLong),
              "row_slots [T] int32 or int64");
  thread_local tokenmill_cpu::LoraRows grouped;
  const int64_t bad = row_slots.scalar_type() == at::kInt
                          ? tokenmill_cpu::group_rows_by_slot(row_slots.data_ptr<int32_t>(), T, S, grouped)
                          : tokenmill_cpu::group_rows_by_slot(row_slots.data_ptr<int64_t>(), T, S, grouped);
  if (bad >= 0) return bad;
  if (x.scalar_type() == at::kFloat) {
    tokenmill_cpu::apply_stack(w, x.data_ptr<float>(), x.stride(0), y.data_ptr<float>(), y.stride(0), grouped, nullptr);
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
    tokenmill_cpu::apply_stack(w, grouped.x.data(), in, y.data_ptr<scalar_t>(), y.stride(0), grouped, nullptr);
  });
  return -1;
}

}  // namespace

namespace tokenmill_cpu {

ModelLoras::ModelLoras(std::vector<at::Tensor> lora_a, std::vector<at::Tensor> lora_b, at::Tensor scales,
                       std::vector<int64_t> bands, std::vector<int64_t> out_splits) {
  TORCH_CHECK(static_cast<int64_t>(bands.size()) == kKinds, "bands: one count per kind (q|k|v, o, gate|up, down)");
  TORCH_CHECK(!lora_a.empty() && lora_a.size() % kKinds == 0 && lora_b.size() == lora_a.size(),
              "lora_a and lora_b: ", kKinds, " stacks per layer");
  int64_t offset = 0;
  for (int64_t kind = 0; kind < kKinds; ++kind) {
    TORCH_CHECK(bands[kind] >= 1 && offset + bands[kind] <= static_cast<int64_t>(out_splits.size()),
                "out_splits: the widths of every kind's bands");
    band_ends_[kind] = band_ends_of(c10::IntArrayRef(out_splits.data() + offset, bands[kind]));
    offset += bands[kind];
  }
  TORCH_CHECK(offset == static_cast<int64_t>(out_splits.size()), "out_splits: the widths of every kind's bands");
  S_ = scales.numel();
  tensors_ = lora_a;
  tensors_.insert(tensors_.end(), lora_b.begin(), lora_b.end());
  tensors_.push_back(scales);
  for (size_t i = 0; i < lora_a.size(); ++i) stacks_.push_back(stack_of(lora_a[i], lora_b[i], scales, band_ends_[i % kKinds]));
}

bool ModelLoras::group(const at::Tensor& row_slots) {
  TORCH_CHECK(row_slots.dim() == 1 && row_slots.is_contiguous() &&
                  (row_slots.scalar_type() == at::kInt || row_slots.scalar_type() == at::kLong),
              "row_slots must be [T] int32 or int64");
  const int64_t T = row_slots.size(0);
  const int64_t bad = row_slots.scalar_type() == at::kInt
                          ? group_rows_by_slot(row_slots.data_ptr<int32_t>(), T, S_, grouped_)
                          : group_rows_by_slot(row_slots.data_ptr<int64_t>(), T, S_, grouped_);
  TORCH_CHECK(bad < 0, "row_slots[", bad, "] must be -1 (no adapter) or a slot in [0, ", S_, ")");
  return grouped_.begin[S_] > 0;
}

void register_model_loras(torch::Library& m) {
  m.class_<ModelLoras>("ModelLoras")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor, std::vector<int64_t>,
                       std::vector<int64_t>>());
}

}  // namespace tokenmill_cpu

TORCH_LIBRARY_FRAGMENT(tokenmill_cpu, m) {
  m.def("lora_apply(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor row_slots, Tensor scales, "
        "int[] out_splits) -> int");
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) { m.impl("lora_apply", &lora_apply); }
