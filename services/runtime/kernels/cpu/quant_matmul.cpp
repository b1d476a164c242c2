// Weight-only quantized matmul for the CPU in fp32: y[m, n] = sum_k x[m, k] * (d[n, g] * q[n, k] + z[n, g]).
//
// PyTorch's CPU int4/int8 operators are fast only with bf16 activations and return bf16, and a
// bf16 logit is too coarse to sample from (at a logit of 25 its step is 0.125: two candidates
// 0.08 apart tie). This kernel keeps fp32 activations and outputs and the stored numbers (d, q, z
// per group g = k / group), so it computes the dequantized model's product up to the order
// and rounding of the fp32 sums.
//
// Work item = a range of output rows n. Each 32-value block of a row is unpacked into two
// float vectors (AVX-512; a portable loop otherwise) and multiplied with 8 input rows at a
// time, whose accumulators stay in registers:
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

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kRows = 8;  // input rows per pass over a weight row: 8 accumulators stay in registers

#if defined(__AVX512F__) && defined(__AVX512BW__)
// A 32-value block as two float vectors: values 0..15 and 16..31.
inline void unpack_block(const uint8_t* q4, const int8_t* q8, __m512& lo, __m512& hi) {
  if (q4) {  // byte j: value j in the low nibble, value j + 16 in the high one
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q4));
    const __m128i mask = _mm_set1_epi8(0x0F);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask)));
  } else {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q8))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q8 + 16))));
  }
}

// R input rows (x: [R, K] at row stride K) against one weight row; out at row stride N.
template <int R>
inline void rows_avx512(const float* __restrict x, const float* __restrict xsum, const uint8_t* __restrict q4,
                        const int8_t* __restrict q8, const float* __restrict scales, const float* __restrict zeros,
                        float* __restrict out, int64_t N, int64_t K, int64_t per_group) {
  const int64_t blocks = K / 32;
  // Two accumulators per row (values 0..15 and 16..31 of each block): two independent FMA chains.
  __m512 acc[R], acc_hi[R];
  float zsum[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), acc_hi[r] = _mm512_setzero_ps(), zsum[r] = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t g = b / per_group;
    __m512 lo, hi;
    unpack_block(q4 ? q4 + b * 16 : nullptr, q8 ? q8 + b * 32 : nullptr, lo, hi);
    // d * q is exact in fp32 (an fp16 d times an integer of at most 8 bits): the weights' own numbers.
    const __m512 d = _mm512_set1_ps(scales[g]);
    lo = _mm512_mul_ps(lo, d);
    hi = _mm512_mul_ps(hi, d);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K + b * 32;
      acc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), acc[r]);
      acc_hi[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + 16), acc_hi[r]);
    }
    if (zeros) {
      const float z = zeros[g];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) zsum[r] += z * xsum[r * blocks + b];
    }
  }
  for (int r = 0; r < R; ++r) out[r * N] = zsum[r] + _mm512_reduce_add_ps(_mm512_add_ps(acc[r], acc_hi[r]));
}
#endif

void quant_matmul_rows(const float* __restrict x, const float* __restrict xsum, const uint8_t* __restrict q4,
                       const int8_t* __restrict q8, const float* __restrict scales, const float* __restrict zeros,
                       float* __restrict out, int64_t M, int64_t N, int64_t K, int64_t group, int64_t n_begin,
                       int64_t n_end) {
  // The zero z of a group adds z * sum(x over the group) to the row's sum: xsum [M, K / 32] holds
  // those sums per 32 values, so a group of any multiple of 32 adds its blocks' sums.
  const int64_t groups = K / group, blocks = K / 32, per_group = group / 32;
  const int64_t row_bytes = q4 ? K / 2 : K;
  for (int64_t n = n_begin; n < n_end; ++n) {
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int64_t rows = std::min(kRows, M - m0);
#if defined(__AVX512F__) && defined(__AVX512BW__)
      const uint8_t* q4row = q4 ? q4 + n * row_bytes : nullptr;
      const int8_t* q8row = q8 ? q8 + n * row_bytes : nullptr;
      const float* xs = xsum ? xsum + m0 * blocks : nullptr;
      float* o = out + m0 * N + n;
      switch (rows) {  // a compile-time row count keeps the accumulators in registers
        case 1: rows_avx512<1>(x + m0 * K, xs, q4row, q8row, scales + n * groups, zeros ? zeros + n * groups : nullptr, o, N, K, per_group); break;
        case 2: rows_avx512<2>(x + m0 * K, xs, q4row, q8row, scales + n * groups, zeros ? zeros + n * groups : nullptr, o, N, K, per_group); break;
        case 3: rows_avx512<3>(x + m0 * K, xs, q4row, q8row, scales + n * groups, zeros ? zeros + n * groups : nullptr, o, N, K, per_group); break;
        case 4: rows_avx512<4>(x + m0 * K, xs, q4row, q8row, scales + n * groups, zeros ? zeros + n * groups : nullptr, o, N, K, per_group); break;
        case 5: rows_avx512<5>(x + m0 * K, xs, q4row, q8row, scales + n * groups, zeros ? zeros + n * groups : nullptr, o, N, K, per_group); break;
        case 6: rows_avx512<6>(x + m0 * K, xs, q4row, q8row, scales + n * groups, zeros ? zeros + n * groups : nullptr, o, N, K, per_group); break;
        case 7: rows_avx512<7>(x + m0 * K, xs, q4row, q8row, scales + n * groups, zeros ? zeros + n * groups : nullptr, o, N, K, per_group); break;
        default: rows_avx512<8>(x + m0 * K, xs, q4row, q8row, scales + n * groups, zeros ? zeros + n * groups : nullptr, o, N, K, per_group); break;
      }
#else
      float zsum[kRows] = {0};
      float acc[kRows][kLanes] = {{0}};
      float q[32];
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t g = b / per_group;
        for (int64_t j = 0; j < 16; ++j) {
          if (q4) {
            const uint8_t byte = q4[n * row_bytes + b * 16 + j];
            q[j] = static_cast<float>(byte & 0x0F);
            q[j + 16] = static_cast<float>(byte >> 4);
          } else {
            q[j] = static_cast<float>(q8[n * row_bytes + b * 32 + j]);
            q[j + 16] = static_cast<float>(q8[n * row_bytes + b * 32 + 16 + j]);
          }
        }
        const float d = scales[n * groups + g];
        for (int64_t r = 0; r < rows; ++r) {
          const float* xr = x + (m0 + r) * K + b * 32;
          for (int64_t l = 0; l < kLanes; ++l) acc[r][l] += d * (q[l] * xr[l] + q[l + 16] * xr[l + 16]);
        }
        if (zeros) {
          const float z = zeros[n * groups + g];
          for (int64_t r = 0; r < rows; ++r) zsum[r] += z * xsum[(m0 + r) * blocks + b];
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float sum = zsum[r];
        for (int64_t l = 0; l < kLanes; ++l) sum += acc[r][l];
        out[(m0 + r) * N + n] = sum;
      }
#endif
    }
  }
}

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const at::Tensor& zeros, int64_t bits, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [M, K] fp32 contiguous");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(group > 0 && K % group == 0 && (bits == 8 || group % 32 == 0), "bad group size");
  TORCH_CHECK(qweight.is_contiguous() && qweight.size(1) == (bits == 4 ? K / 2 : K), "qweight shape");
  TORCH_CHECK(qweight.scalar_type() == (bits == 4 ? at::kByte : at::kChar), "qweight dtype");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * (K / group),
              "scales must be [N, K / group] fp32");
  const bool has_zeros = zeros.numel() > 0;
  TORCH_CHECK(!has_zeros || (zeros.scalar_type() == at::kFloat && zeros.is_contiguous() &&
                             zeros.numel() == scales.numel()), "zeros must be like scales");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  // Sums of x over every 32 values, for the zero terms: [M, K / 32].
  at::Tensor xsum = has_zeros ? x.view({M, K / 32, 32}).sum(-1).contiguous() : at::empty({0}, x.options());
  const float* xs = has_zeros ? xsum.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const uint8_t* q4 = bits == 4 ? qweight.data_ptr<uint8_t>() : nullptr;
  const int8_t* q8 = bits == 8 ? qweight.data_ptr<int8_t>() : nullptr;
  const float* sp = scales.data_ptr<float>();
  const float* zp = has_zeros ? zeros.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    quant_matmul_rows(xp, xs, q4, q8, sp, zp, op, M, N, K, group, begin, end);
  });
  return out;
}

// Rows [n_begin, n_end) of the weight in fp32 into dst (row stride K): d * q + z per group, the
// numbers the reference dequantization forms (bitwise: one multiply and one add, rounded as it does).
void dequantize_rows(const uint8_t* __restrict q4, const int8_t* __restrict q8, const float* __restrict sp,
                     const float* __restrict zp, int64_t K, int64_t group, int64_t n_begin, int64_t n_end,
                     float* __restrict dst) {
  const int64_t groups = K / group, per_group = group / 32, row_bytes = q4 ? K / 2 : K;
  for (int64_t n = n_begin; n < n_end; ++n) {
    for (int64_t b = 0; b < K / 32; ++b) {
      const int64_t g = b / per_group;
      const float d = sp[n * groups + g], z = zp ? zp[n * groups + g] : 0.0f;
      float* w = dst + (n - n_begin) * K + b * 32;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      __m512 lo, hi;
      unpack_block(q4 ? q4 + n * row_bytes + b * 16 : nullptr, q8 ? q8 + n * row_bytes + b * 32 : nullptr, lo, hi);
      const __m512 dv = _mm512_set1_ps(d), zv = _mm512_set1_ps(z);
      _mm512_storeu_ps(w, _mm512_add_ps(_mm512_mul_ps(lo, dv), zv));  // d * q + z, rounded as the reference
      _mm512_storeu_ps(w + 16, _mm512_add_ps(_mm512_mul_ps(hi, dv), zv));
#else
      for (int64_t j = 0; j < 16; ++j) {
        const float a = q4 ? static_cast<float>(q4[n * row_bytes + b * 16 + j] & 0x0F)
                           : static_cast<float>(q8[n * row_bytes + b * 32 + j]);
        const float c = q4 ? static_cast<float>(q4[n * row_bytes + b * 16 + j] >> 4)
                           : static_cast<float>(q8[n * row_bytes + b * 32 + 16 + j]);
        w[j] = d * a + z;
        w[j + 16] = d * c + z;
      }
#endif
    }
  }
}

struct Operands {
  const uint8_t* q4;
  const int8_t* q8;
  const float* scales;
  const float* zeros;
  int64_t N, K;
};

Operands check_weight(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& zeros, int64_t bits,
                      int64_t group) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "qweight must be 2-D contiguous");
  TORCH_CHECK(qweight.scalar_type() == (bits == 4 ? at::kByte : at::kChar), "qweight dtype");
  const int64_t N = qweight.size(0), K = bits == 4 ? qweight.size(1) * 2 : qweight.size(1);
  TORCH_CHECK(group > 0 && K % group == 0 && K % 32 == 0 && (bits == 8 || group % 32 == 0), "bad group size");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * (K / group),
              "scales must be [N, K / group] fp32");
  const bool has_zeros = zeros.numel() > 0;
  TORCH_CHECK(!has_zeros || (zeros.scalar_type() == at::kFloat && zeros.is_contiguous() &&
                             zeros.numel() == scales.numel()), "zeros must be like scales");
  return {bits == 4 ? qweight.data_ptr<uint8_t>() : nullptr, bits == 8 ? qweight.data_ptr<int8_t>() : nullptr,
          scales.data_ptr<float>(), has_zeros ? zeros.data_ptr<float>() : nullptr, N, K};
}

// The weight itself, [N, K] fp32.
at::Tensor quant_dequantize(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& zeros,
                            int64_t bits, int64_t group) {
  const Operands w = check_weight(qweight, scales, zeros, bits, group);
  at::Tensor out = at::empty({w.N, w.K}, scales.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, w.N, 16, [&](int64_t begin, int64_t end) {
    dequantize_rows(w.q4, w.q8, w.scales, w.zeros, w.K, group, begin, end, op + begin * w.K);
  });
  return out;
}

// Many input rows make the product compute-bound: then the weight is dequantized a panel of
// `panel` output columns at a time into a buffer that stays in L2, and BLAS multiplies all rows
// by it (out[:, panel] = x @ W[panel]^T, written in place through the output's row stride). The
// whole fp32 weight never goes to memory, and each weight is unpacked once, not once per 8 rows.
at::Tensor quant_matmul_panels(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                               const at::Tensor& zeros, int64_t bits, int64_t group, int64_t panel) {
  const Operands w = check_weight(qweight, scales, zeros, bits, group);
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
      dequantize_rows(w.q4, w.q8, w.scales, w.zeros, K, group, n0, n0 + cols, buffer.data_ptr<float>());
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
