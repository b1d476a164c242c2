// Batched LoRA on the CPU (lora.cpp): what the other C++ files of the extension can call.
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

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

// A model's resident adapters for the fused decode step (fused_decode.cpp): per layer, the stacks
// of its q|k|v, o, gate|up and down (services/runtime/lora/stacks.py), read in place (the
// registry writes slots between steps). A step groups its rows by slot once (group), then adds
// each adapted product's update right after the base product (apply), as the eager layer does.
struct ModelLoras : torch::CustomClassHolder {
  static constexpr int64_t kKinds = 4;  // per layer: q|k|v, o, gate|up, down

  // lora_a / lora_b: kKinds per layer, layer-major, as lora_apply takes them (a [S, bands * Rb,
  // in]; b [S, out, Rb], contiguous or the transposed view of [S, Rb, out]), fp32 or bf16;
  // scales [S] fp32 shared by all. bands [kKinds]: each kind's member count; out_splits: their
  // widths, kind after kind.
  ModelLoras(std::vector<at::Tensor> lora_a, std::vector<at::Tensor> lora_b, at::Tensor scales,
             std::vector<int64_t> bands, std::vector<int64_t> out_splits);

  // Groups the step's rows by slot (row_slots [T] int32 or int64; -1: no adapter); false when no
  // row has an adapter. Raises naming the first slot outside [-1, S).
  bool group(const at::Tensor& row_slots);

  // y [T, out] += each grouped row's update of `kind` in `layer`; x [T, in], both fp32 at unit
  // row strides of in and out.
  void apply(int64_t layer, int64_t kind, const float* x, float* y, WorkerPool* pool) {
    const LoraStack& w = stacks_[layer * kKinds + kind];
    lora_rows(w, x, w.in, y, w.out, grouped_, pool);
  }

  int64_t layers() const { return static_cast<int64_t>(stacks_.size()) / kKinds; }
  int64_t in_features(int64_t layer, int64_t kind) const { return stacks_[layer * kKinds + kind].in; }
  int64_t out_features(int64_t layer, int64_t kind) const { return stacks_[layer * kKinds + kind].out; }

 private:
  std::vector<at::Tensor> tensors_;  // keeps the stacks alive
  std::vector<LoraStack> stacks_;
  std::vector<int64_t> band_ends_[kKinds];
  int64_t S_ = 0;
  LoraRows grouped_;  // one step at a time, as the decoder
};

// Registers ModelLoras; called from the fused decoder's library block, whose set_lora names the
// class (static initializers of two files run in no set order).
void register_model_loras(torch::Library& m);

}  // namespace tokenmill_cpu
