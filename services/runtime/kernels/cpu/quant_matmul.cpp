// Weight-only quantized matmul for the CPU in fp32: y[m, n] = sum_k x[m, k] * (d[n, g] * q[n, k] + z[n, g]).
//
// PyTorch's CPU int4/int8 operators are fast only with bf16 activations and return bf16, and a
// bf16 logit is too coarse to sample from (at a logit of 25 its step is 0.125: two candidates
// 0.08 apart tie). This kernel keeps fp32 activations and outputs and the stored numbers (d, q, z
// per group g = k / group), so it computes the dequantized model's product up to the order
// and rounding of the fp32 sums.
//
// Work item = a range of output rows n. Each 32-value block of a row is unpacked into float
// vectors (two of 16 with AVX-512, four of 8 with AVX2, a portable loop otherwise; the
// instruction set is chosen at run time, cpu_isa.h) and multiplied with 8 (AVX2: 4) input rows
// at a time, whose accumulators stay in registers:
// sum_j (d q[j]) x[j], plus z * sum_j x[j] from per-block sums of x computed once per call
// (llama.cpp's arrangement of the same sum), lanes added last.
//
// Layouts (checked by the Python wrapper, services/runtime/model/quant/linear.py):
//   x:       [M, K] fp32 contiguous
//   qweight: 4-bit: [N, K/2] uint8, in each 32-value block byte j holds value j (low nibble)
//            and value j + 16 (high nibble), values 0..15;  8-bit: [N, K] int8
//   scales:  [N, K/group] fp32;  zeros: [N, K/group] fp32 or an empty tensor (no offset)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu_isa.h"
#include "quant_kernels.h"

namespace tokenmill_cpu {
namespace {

// The blocks b (32 values each) and their group g = b / per_group, walked together: a division
// per block cost as much as the block's arithmetic.
struct GroupWalk {
  explicit GroupWalk(int64_t per_group) : per_group(per_group), left(per_group) {}
  void next() {
    if (--left == 0) left = per_group, ++g;
  }
  int64_t per_group, left, g = 0;
};

// ---------------------------------------------------------------------------- portable

void rows_portable(const QuantWeight& w, const float* x, const float* xsum, int64_t m0, int64_t rows, int64_t n,
                   float* out, int64_t out_stride) {
  constexpr int64_t kLanes = 16, kMaxRows = 8;
  const int64_t K = w.K, groups = K / w.group, blocks = K / 32, per_group = w.group / 32;
  const int64_t row_bytes = w.q4 ? K / 2 : K;
  float zsum[kMaxRows] = {0};
  float acc[kMaxRows][kLanes] = {{0}};
  float q[32];
  GroupWalk walk(per_group);
  for (int64_t b = 0; b < blocks; ++b, walk.next()) {
    const int64_t g = walk.g;
    for (int64_t j = 0; j < 16; ++j) {
      if (w.q4) {
        const uint8_t byte = w.q4[n * row_bytes + b * 16 + j];
        q[j] = static_cast<float>(byte & 0x0F);
        q[j + 16] = static_cast<float>(byte >> 4);
      } else {
        q[j] = static_cast<float>(w.q8[n * row_bytes + b * 32 + j]);
        q[j + 16] = static_cast<float>(w.q8[n * row_bytes + b * 32 + 16 + j]);
      }
    }
    const float d = w.scales[n * groups + g];
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + (m0 + r) * K + b * 32;
      for (int64_t l = 0; l < kLanes; ++l) acc[r][l] += d * (q[l] * xr[l] + q[l + 16] * xr[l + 16]);
    }
    if (w.zeros) {
      const float z = w.zeros[n * groups + g];
      for (int64_t r = 0; r < rows; ++r) zsum[r] += z * xsum[(m0 + r) * blocks + b];
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float sum = zsum[r];
    for (int64_t l = 0; l < kLanes; ++l) sum += acc[r][l];
    out[(m0 + r) * out_stride + n] = sum;
  }
}

void matmul_rows_portable(const QuantWeight& w, const float* x, const float* xsum, int64_t M, float* out,
                          int64_t out_stride, int64_t n_begin, int64_t n_end) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    for (int64_t m0 = 0; m0 < M; m0 += 8) rows_portable(w, x, xsum, m0, std::min<int64_t>(8, M - m0), n, out, out_stride);
  }
}

// d * q + z of rows [n_begin, n_end) into dst (row stride K), rounded as the reference dequantization.
void dequantize_rows_portable(const QuantWeight& w, int64_t n_begin, int64_t n_end, float* dst) {
  const int64_t K = w.K, groups = K / w.group, per_group = w.group / 32, row_bytes = w.q4 ? K / 2 : K;
  for (int64_t n = n_begin; n < n_end; ++n) {
    GroupWalk walk(per_group);
    for (int64_t b = 0; b < K / 32; ++b, walk.next()) {
      const int64_t g = walk.g;
      const float d = w.scales[n * groups + g], z = w.zeros ? w.zeros[n * groups + g] : 0.0f;
      float* o = dst + (n - n_begin) * K + b * 32;
      for (int64_t j = 0; j < 16; ++j) {
        const float a = w.q4 ? static_cast<float>(w.q4[n * row_bytes + b * 16 + j] & 0x0F)
                             : static_cast<float>(w.q8[n * row_bytes + b * 32 + j]);
        const float c = w.q4 ? static_cast<float>(w.q4[n * row_bytes + b * 16 + j] >> 4)
                             : static_cast<float>(w.q8[n * row_bytes + b * 32 + 16 + j]);
        o[j] = d * a + z;
        o[j + 16] = d * c + z;
      }
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------- AVX2

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace {

// A 32-value block as four vectors of 8 floats (values 0-7, 8-15, 16-23, 24-31), times d.
inline void unpack_block_avx2(const QuantWeight& w, int64_t n, int64_t b, float d, __m256 v[4]) {
  __m128i lo, hi;  // values 0..15 and 16..31 as bytes
  if (w.q4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.q4 + n * (w.K / 2) + b * 16));
    const __m128i mask = _mm_set1_epi8(0x0F);
    lo = _mm_and_si128(bytes, mask);
    hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  } else {
    const int8_t* p = w.q8 + n * w.K + b * 32;
    lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
  }
  // d * q is exact in fp32 (an fp16 d times an integer of at most 8 bits): the weights' own numbers.
  const __m256 dv = _mm256_set1_ps(d);
  for (int i = 0; i < 4; ++i) v[i] = _mm256_mul_ps(v[i], dv);
}

// R input rows against weight row n; two accumulators a row (two independent FMA chains).
template <int R>
inline void rows_avx2(const QuantWeight& w, const float* x, const float* xsum, int64_t m0, int64_t n, float* out,
                      int64_t out_stride) {
  const int64_t K = w.K, blocks = K / 32, groups = K / w.group, per_group = w.group / 32;
  __m256 acc[R], acc_hi[R];
  float zsum[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), acc_hi[r] = _mm256_setzero_ps(), zsum[r] = 0.0f;
  GroupWalk walk(per_group);
  for (int64_t b = 0; b < blocks; ++b, walk.next()) {
    const int64_t g = walk.g;
    __m256 v[4];
    unpack_block_avx2(w, n, b, w.scales[n * groups + g], v);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const float* xr = x + (m0 + r) * K + b * 32;
      acc[r] = _mm256_fmadd_ps(v[0], _mm256_loadu_ps(xr), acc[r]);
      acc_hi[r] = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xr + 8), acc_hi[r]);
      acc[r] = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xr + 16), acc[r]);
      acc_hi[r] = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xr + 24), acc_hi[r]);
    }
    if (w.zeros) {
      const float z = w.zeros[n * groups + g];
      for (int r = 0; r < R; ++r) zsum[r] += z * xsum[(m0 + r) * blocks + b];
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 s8 = _mm256_add_ps(acc[r], acc_hi[r]);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    out[(m0 + r) * out_stride + n] = zsum[r] + _mm_cvtss_f32(s);
  }
}

void matmul_rows_avx2(const QuantWeight& w, const float* x, const float* xsum, int64_t M, float* out,
                      int64_t out_stride, int64_t n_begin, int64_t n_end) {
  constexpr int64_t kRows = 4;  // 8 accumulators + 4 weight vectors fit AVX2's 16 registers
  for (int64_t n = n_begin; n < n_end; ++n) {
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      switch (std::min(kRows, M - m0)) {
        case 1: rows_avx2<1>(w, x, xsum, m0, n, out, out_stride); break;
        case 2: rows_avx2<2>(w, x, xsum, m0, n, out, out_stride); break;
        case 3: rows_avx2<3>(w, x, xsum, m0, n, out, out_stride); break;
        default: rows_avx2<4>(w, x, xsum, m0, n, out, out_stride); break;
      }
    }
  }
}

}  // namespace
#pragma GCC pop_options

// ---------------------------------------------------------------------------- AVX-512

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
namespace {

// A 32-value block as two float vectors: values 0..15 and 16..31.
inline void unpack_block_avx512(const QuantWeight& w, int64_t n, int64_t b, __m512& lo, __m512& hi) {
  if (w.q4) {  // byte j: value j in the low nibble, value j + 16 in the high one
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.q4 + n * (w.K / 2) + b * 16));
    const __m128i mask = _mm_set1_epi8(0x0F);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
  } else {
    const int8_t* p = w.q8 + n * w.K + b * 32;
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  }
}

// R input rows (x: [R, K] at row stride K) against one weight row; out at row stride out_stride.
template <int R>
inline void rows_avx512(const QuantWeight& w, const float* x, const float* xsum, int64_t m0, int64_t n, float* out,
                        int64_t out_stride) {
  const int64_t K = w.K, blocks = K / 32, groups = K / w.group, per_group = w.group / 32;
  // Two accumulators per row (values 0..15 and 16..31 of each block): two independent FMA chains.
  __m512 acc[R], acc_hi[R];
  float zsum[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), acc_hi[r] = _mm512_setzero_ps(), zsum[r] = 0.0f;
  GroupWalk walk(per_group);
  for (int64_t b = 0; b < blocks; ++b, walk.next()) {
    const int64_t g = walk.g;
    __m512 lo, hi;
    unpack_block_avx512(w, n, b, lo, hi);
    // d * q is exact in fp32 (an fp16 d times an integer of at most 8 bits): the weights' own numbers.
    const __m512 d = _mm512_set1_ps(w.scales[n * groups + g]);
    lo = _mm512_mul_ps(lo, d);
    hi = _mm512_mul_ps(hi, d);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float* xr = x + (m0 + r) * K + b * 32;
      acc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[r]);
      acc_hi[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc_hi[r]);
    }
    if (w.zeros) {
      const float z = w.zeros[n * groups + g];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) zsum[r] += z * xsum[(m0 + r) * blocks + b];
    }
  }
  for (int r = 0; r < R; ++r) out[(m0 + r) * out_stride + n] = zsum[r] + _mm512_reduce_add_ps(_mm512_add_ps(acc[r], acc_hi[r]));
}

void matmul_rows_avx512(const QuantWeight& w, const float* x, const float* xsum, int64_t M, float* out,
                        int64_t out_stride, int64_t n_begin, int64_t n_end) {
  constexpr int64_t kRows = 8;  // input rows per pass over a weight row: 8 accumulator pairs stay in registers
  for (int64_t n = n_begin; n < n_end; ++n) {
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      switch (std::min(kRows, M - m0)) {  // a compile-time row count keeps the accumulators in registers
        case 1: rows_avx512<1>(w, x, xsum, m0, n, out, out_stride); break;
        case 2: rows_avx512<2>(w, x, xsum, m0, n, out, out_stride); break;
        case 3: rows_avx512<3>(w, x, xsum, m0, n, out, out_stride); break;
        case 4: rows_avx512<4>(w, x, xsum, m0, n, out, out_stride); break;
        case 5: rows_avx512<5>(w, x, xsum, m0, n, out, out_stride); break;
        case 6: rows_avx512<6>(w, x, xsum, m0, n, out, out_stride); break;
        case 7: rows_avx512<7>(w, x, xsum, m0, n, out, out_stride); break;
        default: rows_avx512<8>(w, x, xsum, m0, n, out, out_stride); break;
      }
    }
  }
}

void dequantize_rows_avx512(const QuantWeight& w, int64_t n_begin, int64_t n_end, float* dst) {
  const int64_t K = w.K, groups = K / w.group, per_group = w.group / 32;
  for (int64_t n = n_begin; n < n_end; ++n) {
    GroupWalk walk(per_group);
    for (int64_t b = 0; b < K / 32; ++b, walk.next()) {
      const int64_t g = walk.g;
      __m512 lo, hi;
      unpack_block_avx512(w, n, b, lo, hi);
      const __m512 dv = _mm512_set1_ps(w.scales[n * groups + g]);
      const __m512 zv = _mm512_set1_ps(w.zeros ? w.zeros[n * groups + g] : 0.0f);
      float* o = dst + (n - n_begin) * K + b * 32;
      _mm512_storeu_ps(o, _mm512_add_ps(_mm512_mul_ps(lo, dv), zv));  // d * q + z, rounded as the reference
      _mm512_storeu_ps(o + 16, _mm512_add_ps(_mm512_mul_ps(hi, dv), zv));
    }
  }
}

}  // namespace
#pragma GCC pop_options

void quant_matmul_rows(const QuantWeight& w, const float* x, const float* xsum, int64_t M, float* out,
                       int64_t out_stride, int64_t n_begin, int64_t n_end, Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni: matmul_rows_avx512(w, x, xsum, M, out, out_stride, n_begin, n_end); break;
    case Isa::kAvx2: matmul_rows_avx2(w, x, xsum, M, out, out_stride, n_begin, n_end); break;
    default: matmul_rows_portable(w, x, xsum, M, out, out_stride, n_begin, n_end); break;
  }
}

}  // namespace tokenmill_cpu

namespace {

using tokenmill_cpu::Isa;
using tokenmill_cpu::QuantWeight;

// The weight's rows in fp32 (BLAS's panels); AVX2 builds vectorize the portable loop themselves.
void dequantize_rows(const QuantWeight& w, int64_t n_begin, int64_t n_end, float* dst) {
  if (tokenmill_cpu::active_isa() == Isa::kAvx512Vnni) {
    tokenmill_cpu::dequantize_rows_avx512(w, n_begin, n_end, dst);
  } else {
    tokenmill_cpu::dequantize_rows_portable(w, n_begin, n_end, dst);
  }
}

QuantWeight check_weight(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& zeros, int64_t bits,
                         int64_t group) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "qweight must be 2-D contiguous");
  TORCH_CHECK(qweight.scalar_type() == (bits == 4 ? at::kByte : at::kChar), "qweight dtype");
  const int64_t N = qweight.size(0), K = bits == 4 ? qweight.size(1) * 2 : qweight.size(1);
  TORCH_CHECK(group > 0 && K % group == 0 && K % 32 == 0 && group % 32 == 0, "bad group size");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * (K / group),
              "scales must be [N, K / group] fp32");
  const bool has_zeros = zeros.numel() > 0;
  TORCH_CHECK(!has_zeros || (zeros.scalar_type() == at::kFloat && zeros.is_contiguous() &&
                             zeros.numel() == scales.numel()), "zeros must be like scales");
  QuantWeight w;
  w.q4 = bits == 4 ? qweight.data_ptr<uint8_t>() : nullptr;
  w.q8 = bits == 8 ? qweight.data_ptr<int8_t>() : nullptr;
  w.scales = scales.data_ptr<float>();
  w.zeros = has_zeros ? zeros.data_ptr<float>() : nullptr;
  w.N = N, w.K = K, w.group = group;
  return w;
}

// x [M, K] fp32 contiguous times the weight, exactly: [M, N].
at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const at::Tensor& zeros, int64_t bits, int64_t group) {
  const QuantWeight w = check_weight(qweight, scales, zeros, bits, group);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == w.K,
              "x must be [M, K] fp32 contiguous");
  const int64_t M = x.size(0), K = w.K;
  at::Tensor out = at::empty({M, w.N}, x.options());
  if (M == 0 || w.N == 0) return out;
  // Sums of x over every 32 values, for the zero terms: [M, K / 32].
  at::Tensor xsum = w.zeros ? x.view({M, K / 32, 32}).sum(-1).contiguous() : at::empty({0}, x.options());
  const float* xs = w.zeros ? xsum.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const Isa isa = tokenmill_cpu::active_isa();
  at::parallel_for(0, w.N, 16, [&](int64_t begin, int64_t end) {
    tokenmill_cpu::quant_matmul_rows(w, xp, xs, M, op, w.N, begin, end, isa);
  });
  return out;
}

// The weight itself, [N, K] fp32.
at::Tensor quant_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& zeros,
                            int64_t bits, int64_t group) {
  const QuantWeight w = check_weight(qweight, scales, zeros, bits, group);
  at::Tensor out = at::empty({w.N, w.K}, scales.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, w.N, 16, [&](int64_t begin, int64_t end) { dequantize_rows(w, begin, end, op + begin * w.K); });
  return out;
}

// Many input rows make the product compute-bound: then the weight is dequantized a panel of
// `panel` output columns at a time into a buffer that stays in L2, and BLAS multiplies all rows
// by it (out[:, panel] = x @ W[panel]^T, written in place through the output's row stride). The
// whole fp32 weight never goes to memory, and each weight is unpacked once, not once per 8 rows.
at::Tensor quant_matmul_panels(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                               const at::Tensor& zeros, int64_t bits, int64_t group, int64_t panel) {
  const QuantWeight w = check_weight(qweight, scales, zeros, bits, group);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == w.K,
              "x must be [M, K] fp32 contiguous");
  TORCH_CHECK(panel > 0, "panel must be positive");
  const int64_t M = x.size(0), N = w.N, K = w.K;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const int64_t panels = (N + panel - 1) / panel;
  // The pool's other threads do not inherit the caller's inference mode, and writing into an
  // inference tensor (``out``, made here under it) outside it is refused: carry it over.
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode guard(inference);
    at::Tensor buffer = at::empty({panel, K}, x.options());  // one per thread, reused across its panels
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * panel, cols = std::min(panel, N - n0);
      dequantize_rows(w, n0, n0 + cols, buffer.data_ptr<float>());
      at::Tensor dst = out.narrow(1, n0, cols);  // [M, cols] at row stride N: BLAS writes it in place
      at::mm_out(dst, x, buffer.narrow(0, 0, cols).t());
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenmill_quant, m) {
  m.def("quant_matmul(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int bits, int group) -> Tensor");
  m.def("quant_dequantize(Tensor qweight, Tensor scales, Tensor zeros, int bits, int group) -> Tensor");
  m.def("quant_matmul_panels(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int bits, int group, int panel) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill_quant, CPU, m) {
  m.impl("quant_matmul", &quant_matmul);
  m.impl("quant_dequantize", &quant_dequantize);
  m.impl("quant_matmul_panels", &quant_matmul_panels);
}
