// What quant_matmul.cpp and quant_dot.cpp offer the other C++ files of the extension (the fused
// decode step): products with a quantized weight, with fp32 activations (exact) or with
// activations quantized to int8 per block of 32 (llama.cpp's arithmetic).
#pragma once

#include <cstdint>
#include <vector>

#include "cpu_isa.h"

namespace tokenmill_cpu {

class WorkerPool;

// A quantized [N, K] weight as the exact kernels read it: w = d * q + z per group of `group`
// values along K (services/runtime/model/quant/linear.py, cpu_kernel_operands).
//   4-bit: q4 [N, K/2], byte j of a 32-value block holds value j (low nibble) and j + 16 (high)
//   8-bit: q8 [N, K] int8
//   scales [N, K/group] fp32; zeros [N, K/group] fp32 or null (no offset)
struct QuantWeight {
  const uint8_t* q4 = nullptr;
  const int8_t* q8 = nullptr;
  const float* scales = nullptr;
  const float* zeros = nullptr;
  int64_t N = 0, K = 0, group = 0;
};

// Exact path: out[m, n] (row stride out_stride) = x[m] . dequantized row n, for n in
// [n_begin, n_end); x [M, K] fp32 contiguous; xsum [M, K/32] the per-32 sums of x (only read
// when w has zeros). One thread's share; the caller splits N.
void quant_matmul_rows(const QuantWeight& w, const float* x, const float* xsum, int64_t M, float* out,
                       int64_t out_stride, int64_t n_begin, int64_t n_end, Isa isa);

// ---------------------------------------------------------------------------- int8 activations

enum class QuantFormat : int { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };

constexpr int64_t kInt8TileRows = 16;  // outputs per tile of a repacked weight (quant_dot.cpp)

// A GGUF block-quantized weight repacked for the integer kernels (quant_dot.cpp's layout):
// ceil(N / 16) tiles of K / 32 blocks of block_bytes each.
struct PackedInt8Weight {
  const uint8_t* data = nullptr;
  QuantFormat format = QuantFormat::kQ4_0;
  int64_t N = 0, K = 0, block_bytes = 0;
};

int64_t int8_block_bytes(QuantFormat format);

// Activations quantized per block of 32: x = d * q, d = amax / 127, q = round-half-even(x * 127 /
// amax) in [-127, 127]; the reference is services/runtime/kernels/quant_act.py.
struct QuantizedActivations {
  int64_t M = 0, K = 0;
  std::vector<int8_t> q;       // [M, K]
  std::vector<float> d;        // [M, K/32]
  std::vector<int32_t> qsum;   // [M, K/32]: sum of the block's q
  std::vector<float> sums;     // [M, K/32]: d * qsum, for q4_1's minimums
};

void quantize_activations(const float* x, int64_t M, int64_t x_stride, int64_t K, Isa isa,
                          QuantizedActivations& out);

// Tiles [tile_begin, tile_end) of out[m, n] (row stride out_stride) = x[m] . w[n] with x quantized
// in `a`. One thread's share.
void int8_matmul_tiles(const PackedInt8Weight& w, const QuantizedActivations& a, float* out, int64_t out_stride,
                       int64_t tile_begin, int64_t tile_end, Isa isa);

// The whole product: x [M, K] (row stride x_stride) quantized into `scratch`, then out [M, N]
// (row stride out_stride), on `pool` (worker_pool.h), or torch's intra-op threads when null.
void int8_matmul(const PackedInt8Weight& w, const float* x, int64_t M, int64_t x_stride, float* out,
                 int64_t out_stride, QuantizedActivations& scratch, WorkerPool* pool = nullptr);

// ---------------------------------------------------------------------------- K-quants (kquant_dot.cpp)

// Activations for the K-quant tiles: q [M, K] int8, d [M, K / block] fp32, bsum [M, K / 16]
// (sum of q per 16 values). The products take blocks of 32; 256 (llama.cpp's Q8_K) is offered to
// the tests alone.
struct KquantActivations {
  int64_t M = 0, K = 0, block = 0;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> bsum;
};

// Rows of x quantized per 32 values (kernels/kquant_act.py's rule).
void kquant_quantize_rows(const float* x, int64_t M, int64_t x_stride, int64_t K, KquantActivations& a);

// Bytes of one 16-output tile of kquant_act.pack_tiles' layout for format `code` (KQUANT_FORMAT_CODES), and the
// values per super-block (K must be a multiple).
int64_t kquant_tile_bytes(int64_t code, int64_t K);
int64_t kquant_block(int64_t code);

// Tiles [t0, t1) of out[m, n] (row stride ldo) = x[m] . w[n], x quantized in `a`. One thread's share.
void kquant_matmul_tiles(const uint8_t* packed, int64_t code, int64_t N, int64_t K, const KquantActivations& a,
                         float* out, int64_t ldo, int64_t t0, int64_t t1, Isa isa);

}  // namespace tokenmill_cpu
