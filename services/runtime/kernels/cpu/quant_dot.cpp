// GGUF block-quantized weights (q4_0, q4_1, q8_0) times activations quantized to int8:
// integer dot products, llama.cpp's arithmetic (its Q8_0 / Q8_1 activations).
//
// Every row of the activations is quantized per block of 32 values (x = d q, d = amax / 127,
// q in -127..127, and the block's sum of q), and a weight block's product with it is one
// integer dot product, exact in int32, scaled once. Per output:
//
//   y[m, n] = sum_b d_w[n, b] d_x[m, b] dot_b + z[n, b] d_x[m, b] sum_j q_x[m, b, j]
//   dot_b   = sum_j q_w[n, b, j] q_x[m, b, j]     (q4_0: q_w - 8; q8_0: signed q_w)
//
// with z the q4_1 minimum (0 otherwise). The reference is services/runtime/kernels/quant_act.py;
// the kernels differ from it in the order of their fp32 sums only.
//
// Layout. With lanes over the K values of one output, every block ends in a horizontal sum and
// a vector of 16 lanes carries only two distinct scales: four vector instructions per 64
// multiply-adds, no more than fp32's FMAs do. So the weights are repacked once, at load, into
// tiles of 16 output rows whose vector lanes are the 16 outputs (llama.cpp's "repack" kernels
// share the idea): one vpdpbusd multiplies 4 consecutive K values of 16 outputs by the same 4
// activation bytes (broadcast), eight of them finish a block for 16 outputs in int32, and one
// conversion, one scale multiply and one FMA apply the 16 outputs' scales. Per tile and block:
//
//   q4_0 / q4_1: 4 chunks of 64 bytes; chunk j, byte 4c + t: low nibble = q[c, 8j + t],
//                high nibble = q[c, 8j + 4 + t] (c the tile's output, 0..15; t 0..3)
//   q8_0:        8 chunks of 64 bytes; chunk s, byte 4c + t = q[c, 4s + t] (signed)
//   then 16 fp16 scales d[c], then (q4_1) 16 fp16 minimums m[c]
//
// the GGUF file's bytes per block and output (18, 20, 34), in an order that streams once per
// product. An output count that is not a multiple of 16 is padded with zero weights and scales.
// AVX2 reads the same tiles as two halves of 8 outputs (bytes 0-31 and 32-63 of every chunk).
//
// The integer instructions take one unsigned and one signed byte. 4-bit weights (0..15) are the
// unsigned side, x the signed one; q4_0's -8 is taken out exactly afterwards (dot - 8 sum q_x).
// 8-bit weights are signed: AVX-512 flips their top bit (w + 128, unsigned) and subtracts
// 128 sum q_x; AVX2 multiplies |w| by x carrying w's sign (vpsignb, as llama.cpp does), since
// its vpmaddubsw would saturate 255 x 127 pairs. AVX2 adds a 4-bit block's eight vpmaddubsw in
// int16 (at most 8 x 2 x 15 x 127 = 30,480) and widens once.
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

#include "cpu_isa.h"
#include "quant_kernels.h"
#include "worker_pool.h"

namespace tokenmill_cpu {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = kInt8TileRows;
// A block whose largest magnitude is below fp32's smallest normal quantizes to zeros (d = 0):
// 127 / amax would overflow to infinity there.
constexpr float kMinNormal = 1.17549435e-38f;

inline uint32_t load_u32(const int8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// A decode step's one or two rows leave the product bound by memory: the weight streams once.
// The blocks 8 ahead (2.3-4.3 KiB) are asked for early; measured 15-25% faster at one row on one
// core (SmolLM2's 66 MB of Q4_1 layers, 7.8-9.1 ms -> 6.5-8.1 ms). Past a weight's end the
// addresses are not read: a prefetch never faults.
inline void prefetch_ahead(const uint8_t* block, int64_t block_bytes) {
  for (int64_t o = 0; o < block_bytes; o += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(block + 8 * block_bytes + o), _MM_HINT_T0);
  }
}

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// ---------------------------------------------------------------------------- portable

// One block: d and the quantized values; returns sum(q).
inline int32_t quantize_block_portable(const float* x, int8_t* q, float& d) {
  float amax = 0.f;
  for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  if (amax < kMinNormal) amax = 0.f;
  d = amax / 127.0f;
  const float inv = amax > 0.f ? 127.0f / amax : 0.f;
  int32_t sum = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(x[j] * inv));  // half to even, as torch.round
    q[j] = static_cast<int8_t>(std::min(127, std::max(-127, v)));
    sum += q[j];
  }
  return sum;
}

void int8_tiles_portable(const PackedInt8Weight& w, const QuantizedActivations& a, float* out, int64_t out_stride,
                         int64_t tile_begin, int64_t tile_end) {
  const int64_t blocks = w.K / kBlock;
  const int64_t weight_bytes = w.format == QuantFormat::kQ8_0 ? 512 : 256;
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    const uint8_t* tile = w.data + t * blocks * w.block_bytes;
    const int64_t cols = std::min(kTile, w.N - t * kTile);
    for (int64_t m = 0; m < a.M; ++m) {
      float acc[kTile] = {0};
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* block = tile + b * w.block_bytes;
        const int8_t* x = a.q.data() + m * w.K + b * kBlock;
        const uint16_t* d16 = reinterpret_cast<const uint16_t*>(block + weight_bytes);
        for (int64_t c = 0; c < cols; ++c) {
          int32_t dot = 0;
          for (int64_t k = 0; k < kBlock; ++k) {
            int32_t q;
            if (w.format == QuantFormat::kQ8_0) {
              q = static_cast<int8_t>(block[(k / 4) * 64 + 4 * c + k % 4]);
            } else {  // chunk k / 8; the low nibble holds k % 8 < 4, the high one the rest
              const uint8_t byte = block[(k / 8) * 64 + 4 * c + k % 4];
              q = (k % 8) < 4 ? (byte & 0x0F) : (byte >> 4);
              if (w.format == QuantFormat::kQ4_0) q -= 8;
            }
            dot += q * x[k];
          }
          const float dx = a.d[m * blocks + b];
          acc[c] += half_to_float(d16[c]) * dx * static_cast<float>(dot);
          if (w.format == QuantFormat::kQ4_1) acc[c] += half_to_float(d16[kTile + c]) * a.sums[m * blocks + b];
        }
      }
      for (int64_t c = 0; c < cols; ++c) out[m * out_stride + t * kTile + c] = acc[c];
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------- AVX2

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace {

inline int32_t quantize_block_avx2(const float* x, int8_t* q, float& d) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8), v2 = _mm256_loadu_ps(x + 16),
         v3 = _mm256_loadu_ps(x + 24);
  __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                           _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  float amax = _mm_cvtss_f32(m4);
  if (amax < kMinNormal) amax = 0.f;
  d = amax / 127.0f;
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.0f / amax : 0.f);
  // cvtps rounds half to even (the default rounding mode); |x * inv| <= 127 up to rounding.
  const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
  const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
  // Packs work within 128-bit lanes: the permute restores the values' order.
  __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_max_epi8(packed, _mm256_set1_epi8(-127)));
  return _mm_cvtsi128_si32(s4);
}

// R activation rows x the 8 outputs of half `h` of a tile: acc[r] lanes are the outputs.
template <int R, QuantFormat F>
inline void int8_half_tile_avx2(const PackedInt8Weight& w, const QuantizedActivations& a, int64_t m0, int64_t t,
                                int64_t h, float* out, int64_t out_stride) {
  const int64_t K = w.K, blocks = K / kBlock;
  constexpr int64_t kWeightBytes = F == QuantFormat::kQ8_0 ? 512 : 256;
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
  const uint8_t* tile = w.data + t * blocks * w.block_bytes;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = tile + b * w.block_bytes;
    const int8_t* x = a.q.data() + m0 * K + b * kBlock;
    if constexpr (R <= 2) {
      if (h == 0) prefetch_ahead(block, w.block_bytes);
    }
    __m256i dot[R];
    if constexpr (F == QuantFormat::kQ8_0) {
      for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
      for (int s = 0; s < 8; ++s) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * s + 32 * h));
        const __m256i magnitude = _mm256_sign_epi8(wv, wv);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          // x with w's sign, times |w|: w x (vpmaddubsw takes one unsigned side)
          const __m256i xv = _mm256_sign_epi8(_mm256_set1_epi32(static_cast<int>(load_u32(x + r * K + 4 * s))), wv);
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, xv), ones));
        }
      }
    } else {
      __m256i pairs[R];  // int16 sums of the block's vpmaddubsw: at most 30,480
      for (int r = 0; r < R; ++r) pairs[r] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j + 32 * h));
        const __m256i lo = _mm256_and_si256(bytes, low), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = x + r * K + 8 * j;
          pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(static_cast<int>(load_u32(xr)))));
          pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(static_cast<int>(load_u32(xr + 4)))));
        }
      }
      for (int r = 0; r < R; ++r) dot[r] = _mm256_madd_epi16(pairs[r], ones);
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kWeightBytes + 16 * h)));
    __m256 mins;
    if constexpr (F == QuantFormat::kQ4_1) {
      mins = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kWeightBytes + 32 + 16 * h)));
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (m0 + r) * blocks + b;
      __m256i exact = dot[r];
      if constexpr (F == QuantFormat::kQ4_0) exact = _mm256_sub_epi32(exact, _mm256_set1_epi32(8 * a.qsum[rb]));
      const __m256 scale = _mm256_mul_ps(dw, _mm256_broadcast_ss(&a.d[rb]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), scale, acc[r]);
      if constexpr (F == QuantFormat::kQ4_1) acc[r] = _mm256_fmadd_ps(mins, _mm256_broadcast_ss(&a.sums[rb]), acc[r]);
    }
  }
  const int64_t n0 = t * kTile + 8 * h, cols = std::min<int64_t>(8, w.N - n0);
  for (int r = 0; r < R; ++r) {
    float* o = out + (m0 + r) * out_stride + n0;
    if (cols == 8) {
      _mm256_storeu_ps(o, acc[r]);
    } else if (cols > 0) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[r]);
      std::memcpy(o, lanes, sizeof(float) * cols);
    }
  }
}

template <QuantFormat F>
void int8_tiles_avx2(const PackedInt8Weight& w, const QuantizedActivations& a, float* out, int64_t out_stride,
                     int64_t tile_begin, int64_t tile_end) {
  constexpr int64_t kRows = 4;  // 4 int16 + 4 fp32 accumulators beside the operands: AVX2's 16 registers
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    for (int64_t h = 0; h < 2; ++h) {
      if (t * kTile + 8 * h >= w.N) break;  // a padded half
      for (int64_t m0 = 0; m0 < a.M; m0 += kRows) {
        switch (std::min(kRows, a.M - m0)) {  // a compile-time row count keeps the accumulators in registers
          case 1: int8_half_tile_avx2<1, F>(w, a, m0, t, h, out, out_stride); break;
          case 2: int8_half_tile_avx2<2, F>(w, a, m0, t, h, out, out_stride); break;
          case 3: int8_half_tile_avx2<3, F>(w, a, m0, t, h, out, out_stride); break;
          default: int8_half_tile_avx2<4, F>(w, a, m0, t, h, out, out_stride); break;
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

inline int32_t quantize_block_avx512(const float* x, int8_t* q, float& d) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  if (amax < kMinNormal) amax = 0.f;
  d = amax / 127.0f;
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.0f / amax : 0.f);
  const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
  const __m512i lo = _mm512_max_epi32(i0, _mm512_set1_epi32(-127)), hi = _mm512_max_epi32(i1, _mm512_set1_epi32(-127));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_set_m128i(_mm512_cvtsepi32_epi8(hi), _mm512_cvtsepi32_epi8(lo)));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi));
}

// R activation rows x one tile of 16 outputs: acc[r] lanes are the outputs. Up to 4 rows, each
// row's block sum runs in two int32 chains (even and odd steps), so a decode step's single row
// does not wait on one chain of eight dependent vpdpbusd.
template <int R, QuantFormat F>
inline void int8_tile_avx512(const PackedInt8Weight& w, const QuantizedActivations& a, int64_t m0, int64_t t,
                             float* out, int64_t out_stride) {
  constexpr int kChains = R <= 4 ? 2 : 1;
  constexpr int64_t kWeightBytes = F == QuantFormat::kQ8_0 ? 512 : 256;
  const int64_t K = w.K, blocks = K / kBlock;
  const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const uint8_t* tile = w.data + t * blocks * w.block_bytes;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = tile + b * w.block_bytes;
    const int8_t* x = a.q.data() + m0 * K + b * kBlock;
    if constexpr (R <= 2) prefetch_ahead(block, w.block_bytes);
    __m512i dot[R][kChains];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kChains; ++c) dot[r][c] = _mm512_setzero_si512();
    if constexpr (F == QuantFormat::kQ8_0) {
      for (int s = 0; s < 8; ++s) {
        // w + 128 as unsigned bytes; the 128 sum(q_x) it adds comes off below.
        const __m512i wv = _mm512_xor_si512(_mm512_loadu_si512(block + 64 * s), flip);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          __m512i& d = dot[r][s % kChains];
          d = _mm512_dpbusd_epi32(d, wv, _mm512_set1_epi32(static_cast<int>(load_u32(x + r * K + 4 * s))));
        }
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        const __m512i bytes = _mm512_loadu_si512(block + 64 * j);
        const __m512i lo = _mm512_and_si512(bytes, low), hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = x + r * K + 8 * j;
          dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], lo, _mm512_set1_epi32(static_cast<int>(load_u32(xr))));
          dot[r][kChains - 1] = _mm512_dpbusd_epi32(dot[r][kChains - 1], hi,
                                                    _mm512_set1_epi32(static_cast<int>(load_u32(xr + 4))));
        }
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kWeightBytes)));
    __m512 mins;
    if constexpr (F == QuantFormat::kQ4_1) {
      mins = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kWeightBytes + 32)));
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (m0 + r) * blocks + b;
      __m512i exact = kChains == 2 ? _mm512_add_epi32(dot[r][0], dot[r][kChains - 1]) : dot[r][0];
      if constexpr (F == QuantFormat::kQ4_0) exact = _mm512_sub_epi32(exact, _mm512_set1_epi32(8 * a.qsum[rb]));
      if constexpr (F == QuantFormat::kQ8_0) exact = _mm512_sub_epi32(exact, _mm512_set1_epi32(128 * a.qsum[rb]));
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[rb]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), scale, acc[r]);
      if constexpr (F == QuantFormat::kQ4_1) acc[r] = _mm512_fmadd_ps(mins, _mm512_set1_ps(a.sums[rb]), acc[r]);
    }
  }
  const int64_t n0 = t * kTile, cols = std::min(kTile, w.N - n0);
  const __mmask16 mask = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + (m0 + r) * out_stride + n0, mask, acc[r]);
}

template <QuantFormat F>
void int8_tiles_avx512(const PackedInt8Weight& w, const QuantizedActivations& a, float* out, int64_t out_stride,
                       int64_t tile_begin, int64_t tile_end) {
  constexpr int64_t kRows = 8;  // 8 fp32 + 8 int32 accumulators of 32 registers
  for (int64_t t = tile_begin; t < tile_end; ++t) {
    for (int64_t m0 = 0; m0 < a.M; m0 += kRows) {
      switch (std::min(kRows, a.M - m0)) {
        case 1: int8_tile_avx512<1, F>(w, a, m0, t, out, out_stride); break;
        case 2: int8_tile_avx512<2, F>(w, a, m0, t, out, out_stride); break;
        case 3: int8_tile_avx512<3, F>(w, a, m0, t, out, out_stride); break;
        case 4: int8_tile_avx512<4, F>(w, a, m0, t, out, out_stride); break;
        case 5: int8_tile_avx512<5, F>(w, a, m0, t, out, out_stride); break;
        case 6: int8_tile_avx512<6, F>(w, a, m0, t, out, out_stride); break;
        case 7: int8_tile_avx512<7, F>(w, a, m0, t, out, out_stride); break;
        default: int8_tile_avx512<8, F>(w, a, m0, t, out, out_stride); break;
      }
    }
  }
}

}  // namespace
#pragma GCC pop_options

// ---------------------------------------------------------------------------- entry points

int64_t int8_block_bytes(QuantFormat format) {
  switch (format) {
    case QuantFormat::kQ4_0: return 256 + 32;
    case QuantFormat::kQ4_1: return 256 + 64;
    default: return 512 + 32;
  }
}

void quantize_activations(const float* x, int64_t M, int64_t x_stride, int64_t K, Isa isa,
                          QuantizedActivations& out) {
  const int64_t blocks = K / kBlock;
  out.M = M, out.K = K;
  out.q.resize(M * K);
  out.d.resize(M * blocks);
  out.qsum.resize(M * blocks);
  out.sums.resize(M * blocks);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + m * x_stride + b * kBlock;
      int8_t* q = out.q.data() + m * K + b * kBlock;
      float d;
      const int32_t sum = isa == Isa::kAvx512Vnni ? quantize_block_avx512(xb, q, d)
                          : isa == Isa::kAvx2     ? quantize_block_avx2(xb, q, d)
                                                  : quantize_block_portable(xb, q, d);
      out.d[m * blocks + b] = d;
      out.qsum[m * blocks + b] = sum;
      out.sums[m * blocks + b] = d * static_cast<float>(sum);
    }
  }
}

void int8_matmul_tiles(const PackedInt8Weight& w, const QuantizedActivations& a, float* out, int64_t out_stride,
                       int64_t tile_begin, int64_t tile_end, Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni:
      switch (w.format) {
        case QuantFormat::kQ4_0: int8_tiles_avx512<QuantFormat::kQ4_0>(w, a, out, out_stride, tile_begin, tile_end); break;
        case QuantFormat::kQ4_1: int8_tiles_avx512<QuantFormat::kQ4_1>(w, a, out, out_stride, tile_begin, tile_end); break;
        default: int8_tiles_avx512<QuantFormat::kQ8_0>(w, a, out, out_stride, tile_begin, tile_end); break;
      }
      break;
    case Isa::kAvx2:
      switch (w.format) {
        case QuantFormat::kQ4_0: int8_tiles_avx2<QuantFormat::kQ4_0>(w, a, out, out_stride, tile_begin, tile_end); break;
        case QuantFormat::kQ4_1: int8_tiles_avx2<QuantFormat::kQ4_1>(w, a, out, out_stride, tile_begin, tile_end); break;
        default: int8_tiles_avx2<QuantFormat::kQ8_0>(w, a, out, out_stride, tile_begin, tile_end); break;
      }
      break;
    default: int8_tiles_portable(w, a, out, out_stride, tile_begin, tile_end); break;
  }
}

void int8_matmul(const PackedInt8Weight& w, const float* x, int64_t M, int64_t x_stride, float* out,
                 int64_t out_stride, QuantizedActivations& scratch, WorkerPool* pool) {
  const Isa isa = active_isa();
  quantize_activations(x, M, x_stride, w.K, isa, scratch);
  const int64_t tiles = (w.N + kTile - 1) / kTile;
  // Grain: a thread's share is at least ~64 K multiply-adds per row, so small products stay on
  // the calling thread instead of paying the pool's wake-up.
  const int64_t grain = std::max<int64_t>(1, 65536 / (kTile * w.K));
  parallel_for(pool, tiles, grain, [&](int64_t begin, int64_t end) {
    int8_matmul_tiles(w, scratch, out, out_stride, begin, end, isa);
  });
}

}  // namespace tokenmill_cpu

namespace {

using tokenmill_cpu::Isa;
using tokenmill_cpu::PackedInt8Weight;
using tokenmill_cpu::QuantFormat;
using tokenmill_cpu::QuantizedActivations;

QuantFormat format_of(int64_t code) {
  TORCH_CHECK(code >= 0 && code <= 2, "format must be 0 (q4_0), 1 (q4_1) or 2 (q8_0)");
  return static_cast<QuantFormat>(code);
}

// qweight (4-bit [N, K/2] uint8 in GGUF's nibble order, or 8-bit [N, K] int8), scales [N, K/32]
// fp16, mins [N, K/32] fp16 (q4_1; else empty) -> the tiles described at the top, uint8.
at::Tensor repack_int8(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins, int64_t code) {
  const QuantFormat format = format_of(code);
  const bool q8 = format == QuantFormat::kQ8_0;
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous() && qweight.scalar_type() == (q8 ? at::kChar : at::kByte),
              "qweight must be contiguous [N, K/2] uint8 (4-bit) or [N, K] int8 (8-bit)");
  const int64_t N = qweight.size(0), K = q8 ? qweight.size(1) : 2 * qweight.size(1), blocks = K / 32;
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == N * blocks,
              "scales must be [N, K / 32] fp16");
  TORCH_CHECK((format == QuantFormat::kQ4_1) == (mins.numel() > 0), "mins are q4_1's alone");
  TORCH_CHECK(mins.numel() == 0 || (mins.scalar_type() == at::kHalf && mins.is_contiguous() && mins.numel() == N * blocks),
              "mins must be [N, K / 32] fp16");
  const int64_t tiles = (N + 15) / 16, block_bytes = tokenmill_cpu::int8_block_bytes(format);
  const int64_t weight_bytes = q8 ? 512 : 256;
  at::Tensor packed = at::zeros({tiles * blocks * block_bytes}, qweight.options().dtype(at::kByte));
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const int8_t* src8 = q8 ? qweight.data_ptr<int8_t>() : nullptr;
  const uint8_t* src4 = q8 ? nullptr : qweight.data_ptr<uint8_t>();
  const uint16_t* d16 = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  const uint16_t* m16 = mins.numel() ? reinterpret_cast<const uint16_t*>(mins.data_ptr()) : nullptr;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t c = 0; c < 16 && t * 16 + c < N; ++c) {
        const int64_t n = t * 16 + c;
        for (int64_t b = 0; b < blocks; ++b) {
          uint8_t* block = dst + (t * blocks + b) * block_bytes;
          for (int64_t k = 0; k < 32; ++k) {
            if (q8) {
              block[(k / 4) * 64 + 4 * c + k % 4] = static_cast<uint8_t>(src8[n * K + b * 32 + k]);
            } else {
              // GGUF: byte j of a block holds value j (low nibble) and j + 16 (high nibble)
              const uint8_t byte = src4[n * (K / 2) + b * 16 + k % 16];
              const uint8_t value = k < 16 ? (byte & 0x0F) : (byte >> 4);
              uint8_t& slot = block[(k / 8) * 64 + 4 * c + k % 4];
              slot |= (k % 8) < 4 ? value : static_cast<uint8_t>(value << 4);
            }
          }
          uint16_t* s = reinterpret_cast<uint16_t*>(block + weight_bytes);
          s[c] = d16[n * blocks + b];
          if (m16) s[16 + c] = m16[n * blocks + b];
        }
      }
    }
  });
  return packed;
}

PackedInt8Weight packed_of(const at::Tensor& packed, int64_t code, int64_t N, int64_t K) {
  PackedInt8Weight w;
  w.format = format_of(code);
  w.N = N, w.K = K;
  w.block_bytes = tokenmill_cpu::int8_block_bytes(w.format);
  TORCH_CHECK(N > 0 && K > 0 && K % 32 == 0, "N and K must be positive, K a multiple of 32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == (N + 15) / 16 * (K / 32) * w.block_bytes,
              "packed must be repack_int8's tensor for this format and shape");
  w.data = packed.data_ptr<uint8_t>();
  return w;
}

// x [M, K] fp32 (unit last stride) times a repacked weight, x quantized per 32 values: [M, N] fp32.
at::Tensor quant_matmul_int8(const at::Tensor& x, const at::Tensor& packed, int64_t code, int64_t N, int64_t K) {
  const PackedInt8Weight w = packed_of(packed, code, N, K);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) == K,
              "x must be [M, K] fp32 with unit last stride");
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  // Reused from call to call (no allocation per product). A reference, since inside the
  // parallel loop the name would denote each worker thread's own, empty, buffer.
  thread_local QuantizedActivations buffer;
  QuantizedActivations& scratch = buffer;
  tokenmill_cpu::int8_matmul(w, x.data_ptr<float>(), M, x.stride(0), out.data_ptr<float>(), N, scratch);
  return out;
}

// The activations as the kernels quantize them, for the tests: (q [M, K] int8, d [M, K / 32]
// fp32, block sums d * sum(q) [M, K / 32] fp32).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations_op(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) % 32 == 0,
              "x must be [M, K] fp32, K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), blocks = K / 32;
  QuantizedActivations a;
  tokenmill_cpu::quantize_activations(x.data_ptr<float>(), M, x.stride(0), K, tokenmill_cpu::active_isa(), a);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, blocks}, x.options());
  at::Tensor sums = at::empty({M, blocks}, x.options());
  std::memcpy(q.data_ptr<int8_t>(), a.q.data(), M * K);
  std::memcpy(d.data_ptr<float>(), a.d.data(), sizeof(float) * M * blocks);
  std::memcpy(sums.data_ptr<float>(), a.sums.data(), sizeof(float) * M * blocks);
  return {q, d, sums};
}

std::string cpu_isa() { return tokenmill_cpu::isa_name(tokenmill_cpu::active_isa()); }

std::string supported_cpu_isa() { return tokenmill_cpu::isa_name(tokenmill_cpu::supported_isa()); }

// Caps the instruction set (names: portable, avx2, avx512_vnni); returns whether it was taken.
bool set_cpu_isa(const std::string& name) { return tokenmill_cpu::set_isa(name); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill_quant, m) {
  m.def("repack_int8(Tensor qweight, Tensor scales, Tensor mins, int format) -> Tensor");
  m.def("quant_matmul_int8(Tensor x, Tensor packed, int format, int N, int K) -> Tensor");
  m.def("quantize_activations(Tensor x) -> (Tensor, Tensor, Tensor)");
  // No tensor to dispatch on: one implementation for every backend.
  m.def("cpu_isa() -> str", &cpu_isa);
  m.def("supported_cpu_isa() -> str", &supported_cpu_isa);
  m.def("set_cpu_isa(str name) -> bool", &set_cpu_isa);
}

TORCH_LIBRARY_IMPL(tokenmill_quant, CPU, m) {
  m.impl("repack_int8", &repack_int8);
  m.impl("quant_matmul_int8", &quant_matmul_int8);
  m.impl("quantize_activations", &quantize_activations_op);
}
