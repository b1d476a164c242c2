// Batched LoRA on the CPU (lora.cpp): what the other C++ files of the extension can call.
#pragma once

#include <cstdint>
#include <vector>

namespace tokenmill_cpu {

class WorkerPool;

// One module's adapters, stacked by slot (rank zero-padded to R): a [S, R, in] contiguous;
// b, slot s at b + s * b_slot_stride, either [R, out] (b_rank_major: the layout the expand
// reads) or [out, R] (PEFT's lora_B, transposed per call); fp32 (a, b) or bf16 (a16, b16: the
// bits; a16 non-null selects them); scales [S] fp32.
struct LoraStack {
  const float* a = nullptr;
  const float* b = nullptr;
  const uint16_t* a16 = nullptr;
  const uint16_t* b16 = nullptr;
  const float* scales = nullptr;
  int64_t S = 0, R = 0, in = 0, out = 0;
  int64_t b_slot_stride = 0;
  bool b_rank_major = false;
  // A fused projection's members: `bands` bands of band_rank = R / bands ranks each, band j
  // writing outputs [band_ends[j - 1], band_ends[j]) (b is then [.., out, band_rank]); null
  // band_ends: one band, all of y.
  int64_t band_rank = 0, bands = 1;
  const int64_t* band_ends = nullptr;
};

// A step's rows grouped by slot (a counting sort): the rows of slot s are
// rows[begin[s] .. begin[s + 1]); rows of slot -1 are left out.
struct LoraRows {
  std::vector<int32_t> rows;
  std::vector<int64_t> begin;  // [S + 1]
  std::vector<float> shrunk;   // [rows, R] scratch: x A^T of each grouped row
  std::vector<float> x;        // [T, in] scratch: x widened to fp32 when it is 16-bit
  std::vector<float> b;        // [S, R, out] scratch: B transposed when it is [out, R]
  struct Chunk {
    int64_t begin, end, band;
  };
  std::vector<Chunk> chunks;  // the expand's column ranges
};

// Fills `grouped` from row_slots [T]; returns the first row whose slot is not in [-1, S), or -1.
int64_t group_rows_by_slot(const int32_t* row_slots, int64_t T, int64_t S, LoraRows& grouped);
int64_t group_rows_by_slot(const int64_t* row_slots, int64_t T, int64_t S, LoraRows& grouped);

// y[t] += scales[s] * B_s (A_s x[t]) for the grouped rows; x [T, in] and y [T, out] fp32 at row
// strides x_stride and y_stride. On `pool` (worker_pool.h), or torch's intra-op threads when null.
void lora_rows(const LoraStack& w, const float* x, int64_t x_stride, float* y, int64_t y_stride, LoraRows& grouped,
               WorkerPool* pool = nullptr);

}  // namespace tokenmill_cpu
