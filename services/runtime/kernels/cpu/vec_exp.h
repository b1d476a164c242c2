// exp(x) in a form the compiler vectorizes inside omp simd loops (glibc's expf is a call per value,
// which at a small model's widths cost about half of a kernel's time), shared by the paged decode
// softmax and the fused decode step's SiLU.
#pragma once

#include <cstdint>

namespace tokenmill_cpu {

// Cephes' expf for x in [-87, 88] (callers clamp): x = n ln2 + r with |r| <= ln2/2, e^r by a
// degree-6 polynomial (within ~2 ulp), 2^n put into the exponent bits. exp(0) is exactly 1.
inline float exp_in_range(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;  // ln 2 split so n * kLn2Hi is exact
  constexpr float kRound = 12582912.0f;                               // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * kLog2e + kRound) - kRound;
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e_r = p * r * r + r + 1.0f;
  return e_r * __builtin_bit_cast(float, static_cast<int32_t>(n + 127.0f) << 23);
}

}  // namespace tokenmill_cpu
