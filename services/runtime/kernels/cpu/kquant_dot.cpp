// GGUF K-quant weights (q4_k, q5_k, q6_k) and q5_0 / q5_1 times activations quantized to int8:
// integer dot products, llama.cpp's arithmetic (ggml_vec_dot_q4_K_q8_K and its siblings).
//
// The rule and its PyTorch reference are services/runtime/kernels/kquant_act.py: activations
// rounded to int8 per block of 32 values, d_x[g] = amax / 127 (finer than llama.cpp's Q8_K, one
// scale per 256: measured in kquant_act.py). Per 32-value group g (q6_k: per 16-value half) an
// integer dot product times the group's integer scale, and the minimums' term m_g times the
// group's sum of q_x likewise, each scaled by the group's d_x; the fp16 super-block scales last:
//
//   q4_k, q5_k: y += d sum_g d_x[g] sc_g dot_g - dmin sum_g d_x[g] m_g sum_j q_x[g, j]
//   q6_k:       y += d sum_g d_x[g] sum_s sc_s (dot_s - 32 sum_j q_x[s, j])   (s: its 16-value halves)
//   q5_0:       y += d d_x (dot - 16 sum_j q_x[j]);   q5_1: y += d d_x dot + m d_x sum_j q_x[j]
//
// Bounds: |sc dot| <= 63 * 32 * 31 * 127 per group (q6_k: 127 * 16 * 32 * 127 per half): int32.
//
// Layout. As quant_dot.cpp's tiles, vector lanes are 16 outputs, so one vpdpbusd multiplies 4
// consecutive values of 16 outputs by the same 4 activation bytes; the weights are repacked
// once at load (kquant_act.pack_tiles) into tiles of 16 output rows. Per tile and super-block
// (256 values = 8 groups of 32; q5_0 / q5_1: 32 values = 1 group):
//
//   each group: 4 chunks of 64 bytes, chunk j byte 4c + t: low nibble = bits 0-3 of q[c, 8j + t],
//               high nibble = bits 0-3 of q[c, 8j + 4 + t]   (c the output 0..15, t 0..3);
//               then one 64-byte plane per bit above 4 (q5: bit 4; q6_k: bits 4, 5): byte 4c + t,
//               bit 2j = that bit of q[c, 8j + t], bit 2j + 1 = of q[c, 8j + 4 + t]
//   then:       q4_k/q5_k: d[16], dmin[16] fp16, sc[8][16], m[8][16] uint8   (320 bytes)
//               q6_k:      d[16] fp16, sc[16][16] int8                        (288 bytes)
//               q5_0:      d[16] fp16;   q5_1: d[16], m[16] fp16
//
// the file's bytes per output within a few (q4_k 148 for 144, q5_k 180 for 176, the rest equal).
// A unit's values are unsigned (0 .. 2^bits - 1); the offsets (q6_k 32, q5_0 16) come off with
// the activations' sums. AVX2 reads the same tiles as two halves of 8 outputs.
//
// One source holds the three paths; the instruction set is chosen at run time (cpu_isa.h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "cpu_isa.h"
#include "quant_kernels.h"

namespace tokenmill_cpu {
namespace {

enum class KFormat : int { kQ4K = 0, kQ5K = 1, kQ6K = 2, kQ5_0 = 3, kQ5_1 = 4 };

constexpr int64_t kTile = 16;
constexpr float kMinNormal = 1.17549435e-38f;  // below it a block quantizes to zeros (quant_act.py)

struct KLayout {
  int64_t block;        // values per super-block
  int64_t groups;       // 32-value groups per super-block
  int64_t planes;       // 64-byte planes of high bits per group
  int64_t meta_bytes;   // scales after the groups
  constexpr int64_t group_bytes() const { return 256 + 64 * planes; }
  constexpr int64_t super_bytes() const { return groups * group_bytes() + meta_bytes; }
};

constexpr KLayout layout_of(KFormat f) {
  switch (f) {
    case KFormat::kQ4K: return {256, 8, 0, 320};
    case KFormat::kQ5K: return {256, 8, 1, 320};
    case KFormat::kQ6K: return {256, 8, 2, 288};
    case KFormat::kQ5_0: return {32, 1, 1, 32};
    default: return {32, 1, 1, 64};
  }
}

struct KWeight {
  const uint8_t* data = nullptr;
  KFormat format = KFormat::kQ4K;
  int64_t N = 0, K = 0;
};

using KActs = KquantActivations;  // quant_kernels.h

inline uint32_t load_u32(const int8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

void quantize_acts(const float* x, int64_t M, int64_t x_stride, int64_t K, int64_t block, KActs& a) {
  a.M = M, a.K = K, a.block = block;
  a.q.resize(M * K);
  a.d.resize(M * (K / block));
  a.bsum.resize(M * (K / 16));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < K / block; ++b) {
      const float* xb = x + m * x_stride + b * block;
      int8_t* q = a.q.data() + m * K + b * block;
      float amax = 0.f;
      for (int64_t j = 0; j < block; ++j) amax = std::max(amax, std::fabs(xb[j]));
      if (amax < kMinNormal) amax = 0.f;
      a.d[m * (K / block) + b] = amax / 127.0f;
      const float inv = amax > 0.f ? 127.0f / amax : 0.f;
      for (int64_t j = 0; j < block; ++j) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xb[j] * inv));  // half to even, as torch.round
        q[j] = static_cast<int8_t>(std::min(127, std::max(-127, v)));
      }
    }
    for (int64_t s = 0; s < K / 16; ++s) {
      int32_t sum = 0;
      for (int64_t j = 0; j < 16; ++j) sum += a.q[m * K + 16 * s + j];
      a.bsum[m * (K / 16) + s] = sum;
    }
  }
}

// ---------------------------------------------------------------------------- portable

template <KFormat F>
void tiles_portable(const KWeight& w, const KActs& a, float* out, int64_t ldo, int64_t t0, int64_t t1) {
  constexpr KLayout L = layout_of(F);
  const int64_t K = w.K, supers = K / L.block;
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* tile = w.data + t * supers * L.super_bytes();
    const int64_t cols = std::min(kTile, w.N - t * kTile);
    for (int64_t m = 0; m < a.M; ++m) {
      float acc[kTile] = {0};
      for (int64_t sb = 0; sb < supers; ++sb) {
        const uint8_t* s = tile + sb * L.super_bytes();
        const uint8_t* meta = s + L.groups * L.group_bytes();
        const int8_t* x = a.q.data() + m * K + sb * L.block;
        const int32_t* bs = a.bsum.data() + (m * K + sb * L.block) / 16;
        const float* dx = a.d.data() + (m * K + sb * L.block) / 32;  // one per group
        for (int64_t c = 0; c < cols; ++c) {
          float fsum = 0.f, fmin = 0.f;
          for (int64_t g = 0; g < L.groups; ++g) {
            const uint8_t* grp = s + g * L.group_bytes();
            int32_t dot[2] = {0, 0};
            for (int64_t k = 0; k < 32; ++k) {
              const int64_t j = k / 8, half = (k % 8) / 4, tt = k % 4;
              const uint8_t byte = grp[64 * j + 4 * c + tt];
              int32_t v = half ? (byte >> 4) : (byte & 0x0F);
              for (int64_t p = 0; p < L.planes; ++p) v |= ((grp[256 + 64 * p + 4 * c + tt] >> (2 * j + half)) & 1) << (4 + p);
              dot[k / 16] += v * x[32 * g + k];
            }
            const int32_t b0 = bs[2 * g], b1 = bs[2 * g + 1];
            int32_t isum = 0, msum = 0;
            if constexpr (F == KFormat::kQ4K || F == KFormat::kQ5K) {
              isum = meta[64 + 16 * g + c] * (dot[0] + dot[1]);
              msum = meta[192 + 16 * g + c] * (b0 + b1);
            } else if constexpr (F == KFormat::kQ6K) {
              isum = static_cast<int8_t>(meta[32 + 32 * g + c]) * (dot[0] - 32 * b0) +
                     static_cast<int8_t>(meta[48 + 32 * g + c]) * (dot[1] - 32 * b1);
            } else if constexpr (F == KFormat::kQ5_0) {
              isum = dot[0] + dot[1] - 16 * (b0 + b1);
            } else {
              isum = dot[0] + dot[1];
              msum = b0 + b1;
            }
            fsum += dx[g] * static_cast<float>(isum);
            fmin += dx[g] * static_cast<float>(msum);
          }
          acc[c] += half_to_float(meta + 2 * c) * fsum;
          if constexpr (F == KFormat::kQ4K || F == KFormat::kQ5K) {
            acc[c] -= half_to_float(meta + 32 + 2 * c) * fmin;
          } else if constexpr (F == KFormat::kQ5_1) {
            acc[c] += half_to_float(meta + 32 + 2 * c) * fmin;
          }
        }
      }
      for (int64_t c = 0; c < cols; ++c) out[m * ldo + t * kTile + c] = acc[c];
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------- AVX2

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace {

// Bit `bit` of each byte of `plane` moved to bit `to`.
inline __m256i plane_bit_avx2(__m256i plane, int bit, int to) {
  const __m256i one = _mm256_set1_epi8(1);
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(plane, bit), one), to);
}

// R activation rows x the 8 outputs of half `h` of tile `t`.
template <int R, KFormat F>
inline void khalf_avx2(const KWeight& w, const KActs& a, int64_t m0, int64_t t, int64_t h, float* out, int64_t ldo) {
  constexpr KLayout L = layout_of(F);
  const int64_t K = w.K, supers = K / L.block;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const uint8_t* tile = w.data + t * supers * L.super_bytes();
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* s = tile + sb * L.super_bytes();
    const uint8_t* meta = s + L.groups * L.group_bytes();
    __m256 fsum[R], fmin[R];  // the groups' sums, each already times its d_x
    for (int r = 0; r < R; ++r) fsum[r] = fmin[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < L.groups; ++g) {
      const uint8_t* grp = s + g * L.group_bytes();
      __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
      if constexpr (L.planes >= 1) p0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 256 + 32 * h));
      if constexpr (L.planes >= 2) p1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 320 + 32 * h));
      __m256i dot[R][2];
      for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 64 * j + 32 * h));
        __m256i lo = _mm256_and_si256(bytes, low), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
        if constexpr (L.planes >= 1) {
          lo = _mm256_or_si256(lo, plane_bit_avx2(p0, 2 * j, 4));
          hi = _mm256_or_si256(hi, plane_bit_avx2(p0, 2 * j + 1, 4));
        }
        if constexpr (L.planes >= 2) {
          lo = _mm256_or_si256(lo, plane_bit_avx2(p1, 2 * j, 5));
          hi = _mm256_or_si256(hi, plane_bit_avx2(p1, 2 * j + 1, 5));
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = a.q.data() + (m0 + r) * K + sb * L.block + 32 * g + 8 * j;
          // Two products of at most 2 * 63 * 127 each: 32,004 fits int16.
          const __m256i pairs = _mm256_add_epi16(
              _mm256_maddubs_epi16(lo, _mm256_set1_epi32(static_cast<int>(load_u32(xr)))),
              _mm256_maddubs_epi16(hi, _mm256_set1_epi32(static_cast<int>(load_u32(xr + 4)))));
          __m256i& d = dot[r][F == KFormat::kQ6K ? j / 2 : j % 2];
          d = _mm256_add_epi32(d, _mm256_madd_epi16(pairs, ones));
        }
      }
      for (int r = 0; r < R; ++r) {
        const int32_t* bs = a.bsum.data() + ((m0 + r) * K + sb * L.block + 32 * g) / 16;
        const __m256 dx = _mm256_set1_ps(a.d[((m0 + r) * K + sb * L.block) / 32 + g]);
        if constexpr (F == KFormat::kQ4K || F == KFormat::kQ5K) {
          const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(meta + 64 + 16 * g + 8 * h)));
          const __m256i mn = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(meta + 192 + 16 * g + 8 * h)));
          fsum[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(_mm256_add_epi32(dot[r][0], dot[r][1]), sc)), dx, fsum[r]);
          fmin[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(mn, _mm256_set1_epi32(bs[0] + bs[1]))), dx, fmin[r]);
        } else if constexpr (F == KFormat::kQ6K) {
          const __m256i s0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(meta + 32 + 32 * g + 8 * h)));
          const __m256i s1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(meta + 48 + 32 * g + 8 * h)));
          const __m256i t = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_sub_epi32(dot[r][0], _mm256_set1_epi32(32 * bs[0])), s0),
                                            _mm256_mullo_epi32(_mm256_sub_epi32(dot[r][1], _mm256_set1_epi32(32 * bs[1])), s1));
          fsum[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), dx, fsum[r]);
        } else if constexpr (F == KFormat::kQ5_0) {
          fsum[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_add_epi32(dot[r][0], dot[r][1]), _mm256_set1_epi32(16 * (bs[0] + bs[1])))), dx,
                              fsum[r]);
        } else {
          fsum[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(dot[r][0], dot[r][1])), dx, fsum[r]);
          fmin[r] = _mm256_set1_ps(a.d[(m0 + r) * (K / 32) + (sb * L.block) / 32 + g] * static_cast<float>(bs[0] + bs[1]));
        }
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 16 * h)));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(fsum[r], d, acc[r]);
      if constexpr (F == KFormat::kQ4K || F == KFormat::kQ5K) {
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 32 + 16 * h)));
        acc[r] = _mm256_fnmadd_ps(fmin[r], dmin, acc[r]);
      } else if constexpr (F == KFormat::kQ5_1) {
        const __m256 mins = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 32 + 16 * h)));
        acc[r] = _mm256_fmadd_ps(mins, fmin[r], acc[r]);
      }
    }
  }
  const int64_t n0 = t * kTile + 8 * h, cols = std::min<int64_t>(8, w.N - n0);
  for (int r = 0; r < R; ++r) {
    float* o = out + (m0 + r) * ldo + n0;
    if (cols == 8) {
      _mm256_storeu_ps(o, acc[r]);
    } else if (cols > 0) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[r]);
      std::memcpy(o, lanes, sizeof(float) * cols);
    }
  }
}

template <KFormat F>
void tiles_avx2(const KWeight& w, const KActs& a, float* out, int64_t ldo, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t h = 0; h < 2; ++h) {
      if (t * kTile + 8 * h >= w.N) break;  // a padded half
      for (int64_t m0 = 0; m0 < a.M; m0 += 2) {
        if (a.M - m0 >= 2) {
          khalf_avx2<2, F>(w, a, m0, t, h, out, ldo);
        } else {
          khalf_avx2<1, F>(w, a, m0, t, h, out, ldo);
        }
      }
    }
  }
}

}  // namespace
#pragma GCC pop_options

// ---------------------------------------------------------------------------- AVX-512 VNNI

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
namespace {

inline __m512i plane_bit_avx512(__m512i plane, int bit, int to) {
  const __m512i one = _mm512_set1_epi8(1);
  return _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(plane, bit), one), to);
}

// R activation rows x one tile of 16 outputs.
template <int R, KFormat F>
inline void ktile_avx512(const KWeight& w, const KActs& a, int64_t m0, int64_t t, float* out, int64_t ldo) {
  constexpr KLayout L = layout_of(F);
  const int64_t K = w.K, supers = K / L.block;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const uint8_t* tile = w.data + t * supers * L.super_bytes();
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < supers; ++sb) {
    const uint8_t* s = tile + sb * L.super_bytes();
    const uint8_t* meta = s + L.groups * L.group_bytes();
    if constexpr (R <= 2) {
      // A decode step is bound by memory: the next super-block is asked for early.
      for (int64_t o = 0; o < L.super_bytes(); o += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(s + L.super_bytes() + o), _MM_HINT_T0);
      }
    }
    __m512 fsum[R], fmin[R];  // the groups' sums, each already times its d_x
    for (int r = 0; r < R; ++r) fsum[r] = fmin[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < L.groups; ++g) {
      const uint8_t* grp = s + g * L.group_bytes();
      __m512i p0 = _mm512_setzero_si512(), p1 = _mm512_setzero_si512();
      if constexpr (L.planes >= 1) p0 = _mm512_loadu_si512(grp + 256);
      if constexpr (L.planes >= 2) p1 = _mm512_loadu_si512(grp + 320);
      __m512i dot[R][2];
      for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        const __m512i bytes = _mm512_loadu_si512(grp + 64 * j);
        __m512i lo = _mm512_and_si512(bytes, low), hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
        if constexpr (L.planes >= 1) {
          lo = _mm512_or_si512(lo, plane_bit_avx512(p0, 2 * j, 4));
          hi = _mm512_or_si512(hi, plane_bit_avx512(p0, 2 * j + 1, 4));
        }
        if constexpr (L.planes >= 2) {
          lo = _mm512_or_si512(lo, plane_bit_avx512(p1, 2 * j, 5));
          hi = _mm512_or_si512(hi, plane_bit_avx512(p1, 2 * j + 1, 5));
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = a.q.data() + (m0 + r) * K + sb * L.block + 32 * g + 8 * j;
          // q6_k: chunks 0-1 and 2-3 are its two 16-value halves; the others alternate two chains.
          __m512i& d = dot[r][F == KFormat::kQ6K ? j / 2 : j % 2];
          d = _mm512_dpbusd_epi32(d, lo, _mm512_set1_epi32(static_cast<int>(load_u32(xr))));
          d = _mm512_dpbusd_epi32(d, hi, _mm512_set1_epi32(static_cast<int>(load_u32(xr + 4))));
        }
      }
      for (int r = 0; r < R; ++r) {
        const int32_t* bs = a.bsum.data() + ((m0 + r) * K + sb * L.block + 32 * g) / 16;
        const __m512 dx = _mm512_set1_ps(a.d[((m0 + r) * K + sb * L.block) / 32 + g]);
        if constexpr (F == KFormat::kQ4K || F == KFormat::kQ5K) {
          const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 64 + 16 * g)));
          const __m512i mn = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 192 + 16 * g)));
          fsum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(_mm512_add_epi32(dot[r][0], dot[r][1]), sc)), dx, fsum[r]);
          fmin[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(mn, _mm512_set1_epi32(bs[0] + bs[1]))), dx, fmin[r]);
        } else if constexpr (F == KFormat::kQ6K) {
          const __m512i s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 32 + 32 * g)));
          const __m512i s1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 48 + 32 * g)));
          const __m512i t = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_sub_epi32(dot[r][0], _mm512_set1_epi32(32 * bs[0])), s0),
                                            _mm512_mullo_epi32(_mm512_sub_epi32(dot[r][1], _mm512_set1_epi32(32 * bs[1])), s1));
          fsum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), dx, fsum[r]);
        } else if constexpr (F == KFormat::kQ5_0) {
          fsum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(dot[r][0], dot[r][1]), _mm512_set1_epi32(16 * (bs[0] + bs[1])))), dx,
                              fsum[r]);
        } else {
          fsum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(dot[r][0], dot[r][1])), dx, fsum[r]);
          fmin[r] = _mm512_set1_ps(a.d[(m0 + r) * (K / 32) + (sb * L.block) / 32 + g] * static_cast<float>(bs[0] + bs[1]));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta)));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(fsum[r], d, acc[r]);
      if constexpr (F == KFormat::kQ4K || F == KFormat::kQ5K) {
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta + 32)));
        acc[r] = _mm512_fnmadd_ps(fmin[r], dmin, acc[r]);
      } else if constexpr (F == KFormat::kQ5_1) {
        const __m512 mins = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta + 32)));
        acc[r] = _mm512_fmadd_ps(mins, fmin[r], acc[r]);
      }
    }
  }
  const int64_t n0 = t * kTile, cols = std::min(kTile, w.N - n0);
  const __mmask16 mask = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + (m0 + r) * ldo + n0, mask, acc[r]);
}

template <KFormat F>
void tiles_avx512(const KWeight& w, const KActs& a, float* out, int64_t ldo, int64_t t0, int64_t t1) {
  constexpr int64_t kRows = 4;  // per row 2 int32 sums, 2 dot chains and an fp32 accumulator
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t m0 = 0; m0 < a.M; m0 += kRows) {
      switch (std::min(kRows, a.M - m0)) {
        case 1: ktile_avx512<1, F>(w, a, m0, t, out, ldo); break;
        case 2: ktile_avx512<2, F>(w, a, m0, t, out, ldo); break;
        case 3: ktile_avx512<3, F>(w, a, m0, t, out, ldo); break;
        default: ktile_avx512<4, F>(w, a, m0, t, out, ldo); break;
      }
    }
  }
}

}  // namespace
#pragma GCC pop_options

// ---------------------------------------------------------------------------- entry points

namespace {

template <KFormat F>
void tiles(const KWeight& w, const KActs& a, float* out, int64_t ldo, int64_t t0, int64_t t1, Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni: tiles_avx512<F>(w, a, out, ldo, t0, t1); break;
    case Isa::kAvx2: tiles_avx2<F>(w, a, out, ldo, t0, t1); break;
    default: tiles_portable<F>(w, a, out, ldo, t0, t1); break;
  }
}

void ktiles(const KWeight& w, const KActs& a, float* out, int64_t ldo, int64_t t0, int64_t t1, Isa isa) {
  switch (w.format) {
    case KFormat::kQ4K: tiles<KFormat::kQ4K>(w, a, out, ldo, t0, t1, isa); break;
    case KFormat::kQ5K: tiles<KFormat::kQ5K>(w, a, out, ldo, t0, t1, isa); break;
    case KFormat::kQ6K: tiles<KFormat::kQ6K>(w, a, out, ldo, t0, t1, isa); break;
    case KFormat::kQ5_0: tiles<KFormat::kQ5_0>(w, a, out, ldo, t0, t1, isa); break;
    default: tiles<KFormat::kQ5_1>(w, a, out, ldo, t0, t1, isa); break;
  }
}

KFormat kformat_of(int64_t code) {
  TORCH_CHECK(code >= 0 && code <= 4, "format must be 0 (q4_k), 1 (q5_k), 2 (q6_k), 3 (q5_0) or 4 (q5_1)");
  return static_cast<KFormat>(code);
}

// x [M, K] fp32 (unit last stride) times kquant_act.pack_tiles' tiles of an [N, K] weight: [M, N] fp32.
at::Tensor kquant_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t code, int64_t N, int64_t K) {
  KWeight w;
  w.format = kformat_of(code);
  w.N = N, w.K = K;
  const KLayout L = layout_of(w.format);
  TORCH_CHECK(N > 0 && K > 0 && K % L.block == 0, "N and K must be positive, K a multiple of ", L.block);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == (N + kTile - 1) / kTile * (K / L.block) * L.super_bytes(),
              "packed must be pack_tiles' tensor for this format and shape");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) == K,
              "x must be [M, K] fp32 with unit last stride");
  w.data = packed.data_ptr<uint8_t>();
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  // Reused from call to call; a reference, since inside the parallel loop the name would denote
  // each worker thread's own, empty, buffer.
  thread_local KActs buffer;
  KActs& acts = buffer;
  quantize_acts(x.data_ptr<float>(), M, x.stride(0), K, 32, acts);
  const Isa isa = active_isa();
  const int64_t tiles_n = (N + kTile - 1) / kTile;
  const int64_t grain = std::max<int64_t>(1, 65536 / (kTile * K));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, tiles_n, grain, [&](int64_t begin, int64_t end) { ktiles(w, acts, o, N, begin, end, isa); });
  return out;
}

// The activations as kquant_matmul quantizes them, for the tests: (q [M, K] int8, d [M, K / block]
// fp32, sums of q per 16 values [M, K / 16] int32).
std::tuple<at::Tensor, at::Tensor, at::Tensor> kquant_quantize_activations(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(block == 32 || block == 256, "block must be 32 or 256");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) % block == 0,
              "x must be [M, K] fp32, K a multiple of the block");
  const int64_t M = x.size(0), K = x.size(1);
  KActs a;
  quantize_acts(x.data_ptr<float>(), M, x.stride(0), K, block, a);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / block}, x.options());
  at::Tensor bsum = at::empty({M, K / 16}, x.options().dtype(at::kInt));
  std::memcpy(q.data_ptr<int8_t>(), a.q.data(), M * K);
  std::memcpy(d.data_ptr<float>(), a.d.data(), sizeof(float) * a.d.size());
  std::memcpy(bsum.data_ptr<int32_t>(), a.bsum.data(), sizeof(int32_t) * a.bsum.size());
  return {q, d, bsum};
}

}  // namespace

void kquant_quantize_rows(const float* x, int64_t M, int64_t x_stride, int64_t K, KquantActivations& a) {
  quantize_acts(x, M, x_stride, K, 32, a);
}

int64_t kquant_tile_bytes(int64_t code, int64_t K) {
  const KLayout L = layout_of(kformat_of(code));
  return K / L.block * L.super_bytes();
}

int64_t kquant_block(int64_t code) { return layout_of(kformat_of(code)).block; }

void kquant_matmul_tiles(const uint8_t* packed, int64_t code, int64_t N, int64_t K, const KquantActivations& a,
                         float* out, int64_t ldo, int64_t t0, int64_t t1, Isa isa) {
  KWeight w;
  w.data = packed, w.format = kformat_of(code), w.N = N, w.K = K;
  ktiles(w, a, out, ldo, t0, t1, isa);
}

}  // namespace tokenmill_cpu

TORCH_LIBRARY_FRAGMENT(tokenmill_quant, m) {
  m.def("kquant_matmul(Tensor x, Tensor packed, int format, int N, int K) -> Tensor");
  m.def("kquant_quantize_activations(Tensor x, int block) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tokenmill_quant, CPU, m) {
  m.impl("kquant_matmul", &tokenmill_cpu::kquant_matmul);
  m.impl("kquant_quantize_activations", &tokenmill_cpu::kquant_quantize_activations);
}
