// Paged decode attention for the CPU: one query token per sequence, read straight out of
// the paged KV pool through the block table.
//
// The PyTorch path has to gather every sequence's blocks into a padded [B, S, KH, D] copy
// before it can call SDPA, so it moves each K/V byte three times (read, write, read again)
// plus the padding up to the longest context in the batch. Decode attention on a CPU is
// memory-bound, so that copy is most of its cost. This kernel reads each cached K/V row
// once and only the rows a sequence owns.
//
// Work item = one sequence. Two passes over its context: scores q.k for every query head
// at every position (each slot's K row, all kv heads, read once and contiguously; a query
// head reads kv head h / group, so GQA costs no copy), a softmax in a per-sequence buffer,
// then the weighted sum of V (each V row read once). Arithmetic is in fp32 whatever the
// storage dtype. Sequences run in parallel on torch's intra-op thread count. Head dims of 64
// and up vectorize over the head dim; 8, 16 and 32 over tiles of positions
// (decode_sequence_tiled, AVX-512 builds).
//
// Layouts (checked by the Python wrapper, which also holds the reference):
//   out, q:        [B, H, D] contiguous
//   k/v cache:     [num_blocks, block_size, KH, D] contiguous
//   block_tables:  [B, max_blocks] int32 contiguous
//   context_lens:  [B] int32
//   window:        0, or a sliding window of W keys: the query at position p sees positions
//                  p - W + 1 .. p (earlier scores are masked to -inf and their V rows not read)
//   softcap:       0, or Gemma 2's cap c > 0 on the scaled scores: s -> c * tanh(s / c), applied
//                  after the scale (and a quantized pool's K scale), before the softmax
//
// A quantized pool (services/runtime/kernels/kv_quant.py) holds int8 or float8_e4m3fn values and
// one fp16 scale per slot per kv head, [num_blocks, block_size, KH] contiguous: the scale of a
// slot's head sits at slot * KH + head. The kernel reads the values as stored (widened to fp32),
// multiplies each score by its K scale after the dot product and each softmax weight by its V
// scale before the weighted sum, so nothing is dequantized into memory.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "paged_decode.h"
#include "vec_exp.h"
#include "worker_pool.h"

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// Calls visit(t, row, slot) for the context's slots t = 0 .. context_len - 1 in order, where row
// points at slot t's K (or V) row (all kv heads) in its block and slot is its index in the pool.
template <typename cache_t, typename Visit>
inline void for_each_slot(const cache_t* cache, const int32_t* block_table, int64_t context_len,
                          int64_t block_size, int64_t token_stride, Visit&& visit) {
  const int64_t block_stride = block_size * token_stride;
  for (int64_t start = 0, j = 0; start < context_len; start += block_size, ++j) {
    const int64_t first_slot = static_cast<int64_t>(block_table[j]) * block_size;
    const cache_t* block = cache + first_slot * token_stride;
    const int64_t n = std::min(block_size, context_len - start);
    for (int64_t o = 0; o < n; ++o) visit(start + o, block + o * token_stride, first_slot + o);
  }
}

// A stored K/V value as fp32, in a form the compiler vectorizes inside the omp simd loops.
template <typename cache_t>
inline float widen(cache_t x) {
  return static_cast<float>(x);
}

// float8_e4m3fn by bit arithmetic, equal to c10's conversion for every non-NaN byte (c10's is a
// branchy scalar routine: decode over e4m3 measured 18x the fp32 path's time with it): a normal value 2^(e-7) * (1 + m/8) is the fp32 whose exponent|mantissa
// bits are e|m shifted to bit 20 with (127 - 7) added to the exponent; a subnormal (e = 0) is
// m * 2^-9. The pool never holds e4m3's NaN (the write clamps to +-448).
inline float fp8_e4m3_to_float(uint32_t bits) {
  const uint32_t magnitude = bits & 0x7Fu;
  const uint32_t normal = (magnitude << 20) + (120u << 23);
  const uint32_t subnormal = __builtin_bit_cast(uint32_t, static_cast<float>(magnitude) * (1.0f / 512.0f));
  // a mask, not a branch or ?:, so the loop vectorizes (checked with -fopt-info-vec)
  const uint32_t is_normal = 0u - static_cast<uint32_t>(magnitude >= 8u);
  return __builtin_bit_cast(float, (normal & is_normal) | (subnormal & ~is_normal) | ((bits & 0x80u) << 24));
}

template <>
inline float widen<c10::Float8_e4m3fn>(c10::Float8_e4m3fn x) {
  return fp8_e4m3_to_float(x.x);
}

// fp16 scale to fp32: one instruction with F16C (-march=native on x86), c10's routine otherwise.
inline float widen_scale(at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// exp(x) for the softmax's x = score - max <= 0: below -87 (where 2^n would leave fp32's normal
// range, e^x < 1.2e-38) the result is 0, so a masked score (-inf) weighs exactly nothing.
inline float exp_nonpositive(float x) {
  return x < -87.0f ? 0.0f : tokenmill_cpu::exp_in_range(std::max(x, -87.0f));
}

// The largest of n scores, in kLanes running lanes: a max reduction is not vectorized by the
// compiler (std::max is not associative for NaN), and a serial chain of scalar maxes was ~1/3 of
// the tiled path's time.
inline float max_of(const float* s, int64_t n) {
  constexpr int64_t kLanes = 16;
  float lanes[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) lanes[i] = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
#pragma omp simd
    for (int64_t i = 0; i < kLanes; ++i) lanes[i] = std::max(lanes[i], s[t + i]);
  }
  for (int64_t i = 0; t + i < n; ++i) lanes[i] = std::max(lanes[i], s[t + i]);
  float m = lanes[0];
  for (int64_t i = 1; i < kLanes; ++i) m = std::max(m, lanes[i]);
  return m;
}

// A row of scores whose largest is m becomes its softmax numerators exp(s - m) in place; returns
// their sum (the denominator, applied to the output at the end).
inline float softmax_numerators(float* s, int64_t n, float m) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = exp_nonpositive(s[t] - m);
    total += s[t];
  }
  return total;
}

// Per-thread buffers, reused from one sequence to the next.
struct Scratch {
  std::vector<float> q, scores, acc, row_max, row_sum, row, tile, tile_scale;
};

// A quantized slot's row (all kv heads) widened to fp32 in its own loop: fused into the dot
// product's reduction loop the conversion kept it from vectorizing (measured 2x the fp32 path's
// time for int8, 19x for e4m3).
template <typename cache_t>
inline const float* widen_row(const cache_t* row, float* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = widen(row[i]);
  return out;
}

// e4m3 rows read as bytes: the element type's struct wrapper kept the loop scalar.
inline const float* widen_row(const c10::Float8_e4m3fn* row, float* out, int64_t n) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = fp8_e4m3_to_float(bytes[i]);
  return out;
}

// Pass 2 of both paths and the end: the weighted sum of V over the softmax numerators in
// scores (query head h's row at h * row_stride), divided by the denominators. Each V row (all kv
// heads) is read once; query head h reads kv head h / group.
template <typename scalar_t, typename cache_t, int64_t kD>
void weighted_sum_of_v(scalar_t* out, const cache_t* v_cache, const at::Half* v_scale, const int32_t* block_table,
                       int64_t context_len, int64_t H, int64_t num_kv_heads, int64_t D, int64_t block_size,
                       int64_t row_stride, Scratch& scratch, int64_t first = 0) {
  constexpr bool kScaled = !std::is_same_v<scalar_t, cache_t>;
  const int64_t group = H / num_kv_heads, token_stride = num_kv_heads * D;
  const float* scores = scratch.scores.data();
  scratch.acc.assign(H * D, 0.f);
  float* acc = scratch.acc.data();
  if constexpr (kScaled) scratch.row.resize(token_stride);
  float* wide = scratch.row.data();
  for_each_slot(v_cache, block_table, context_len, block_size, token_stride,
                [&](int64_t t, const cache_t* v_row, int64_t slot) {
    if (t < first) return;  // outside the window: weight 0
    float head_scale = 1.f;
    const auto* v_values = [&] {
      if constexpr (kScaled) return widen_row(v_row, wide, token_stride);
      else return v_row;
    }();
    for (int64_t h = 0; h < H; ++h) {
      float p = scores[h * row_stride + t];
      if constexpr (kScaled) {
        if (h % group == 0) head_scale = widen_scale(v_scale[slot * num_kv_heads + h / group]);
        p *= head_scale;
      }
      const auto* v = v_values + (h / group) * D;
      float* a = acc + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(v[d]);
    }
  });
  for (int64_t h = 0; h < H; ++h) {
    const float inv = 1.f / scratch.row_sum[h];
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<scalar_t>(acc[h * D + d] * inv);
  }
}

// kD: the head dim as a compile-time constant for the common sizes (0 = read head_dim), so
// the per-head loops are unrolled and vectorized for their exact length.
// cache_t: the pool's storage (scalar_t for a plain pool; int8_t or Float8_e4m3fn with k_scale and
// v_scale, the fp16 scales, for a quantized one; the scales are null for a plain pool).
// This path (head dims 64 and up; every head dim without AVX-512) takes a score per position and
// head as one dot product over the head dim; decode_sequence_tiled below is the small-head-dim one.
template <typename scalar_t, typename cache_t, int64_t kD>
void decode_sequence(const scalar_t* q, scalar_t* out, const cache_t* k_cache, const cache_t* v_cache,
                     const at::Half* k_scale, const at::Half* v_scale,
                     const int32_t* block_table, int64_t context_len, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, int64_t block_size, float scale, int64_t first, float softcap,
                     Scratch& scratch) {
  constexpr bool kScaled = !std::is_same_v<scalar_t, cache_t>;
  const int64_t D = kD > 0 ? kD : head_dim, H = num_heads, group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * D;  // one slot's K (or V) row: all kv heads
  scratch.q.resize(H * D);
  if constexpr (kScaled) scratch.row.resize(token_stride);
  float* wide = scratch.row.data();
  // Score rows padded to whole vectors with -inf (weight 0): the exp loop then has no scalar
  // remainder, which cost head dims 64/128 ~5% at contexts of ~16.
  const int64_t padded = (context_len + 15) / 16 * 16;
  scratch.scores.resize(H * padded);
  scratch.row_sum.resize(H);
  scratch.row_max.assign(H, -std::numeric_limits<float>::infinity());
  float* q_buf = scratch.q.data();
  float* scores = scratch.scores.data();
  float* row_max = scratch.row_max.data();
  for (int64_t i = 0; i < H * D; ++i) q_buf[i] = static_cast<float>(q[i]) * scale;

  // Pass 1: scores. A slot's row holds every kv head contiguously, so the pass streams
  // through each block once; query head h reads kv head h / group.
  for_each_slot(k_cache, block_table, context_len, block_size, token_stride,
                [&](int64_t t, const cache_t* k_row, int64_t slot) {
    if (t < first) {  // outside a sliding window: masked like the padding
      for (int64_t h = 0; h < H; ++h) scores[h * padded + t] = -std::numeric_limits<float>::infinity();
      return;
    }
    float head_scale = 1.f;
    const auto* k_values = [&] {
      if constexpr (kScaled) return widen_row(k_row, wide, token_stride);
      else return k_row;
    }();
    for (int64_t h = 0; h < H; ++h) {
      const float* qh = q_buf + h * D;
      const auto* k = k_values + (h / group) * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qh[d] * static_cast<float>(k[d]);
      if constexpr (kScaled) {
        if (h % group == 0) head_scale = widen_scale(k_scale[slot * num_kv_heads + h / group]);
        s *= head_scale;
      }
      if (softcap > 0.f) s = softcap * std::tanh(s / softcap);
      scores[h * padded + t] = s;
      row_max[h] = std::max(row_max[h], s);
    }
  });
  for (int64_t h = 0; h < H; ++h) {
    float* row = scores + h * padded;
    for (int64_t t = context_len; t < padded; ++t) row[t] = -std::numeric_limits<float>::infinity();
    scratch.row_sum[h] = softmax_numerators(row, padded, row_max[h]);
  }
  weighted_sum_of_v<scalar_t, cache_t, kD>(out, v_cache, v_scale, block_table, context_len, H, num_kv_heads, D,
                                           block_size, padded, scratch, first);
}

// The tiled path below needs AVX-512 (its transposes); built for a CPU without it (-march=haswell),
// portable loops in their place ran 0.5-0.98x the wide path at head dims 8-32, so such builds
// take the wide path for every head dim.
#if defined(__AVX512F__)
// Positions per tile of the small-head-dim path: one AVX-512 vector of fp32 (two AVX2 ones).
constexpr int64_t kTile = 16;

// r[i] = row i of a 16 x 16 fp32 block; stores its columns c < width at out + c * 16. Within
// 128-bit lanes: unpack pairs of rows, then pick 2 of 4 columns; across lanes: two rounds of
// 128-bit lane selects.
inline void transpose16x16(__m512 r[16], float* out, int64_t width) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);      // per lane: a0 b0 a1 b1
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);  // per lane: a2 b2 a3 b3
  }
  for (int i = 0; i < 4; ++i) {  // rows 4i..4i+3 at column 4 * lane + c, into r[4i + c]
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {  // lane l of r[4i + c] holds column 4l + c of rows 4i..4i+3
    const __m512 u0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88);  // lanes 0, 2 of each
    const __m512 u1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);  // lanes 1, 3
    const __m512 u2 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
    const __m512 u3 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
    _mm512_storeu_ps(out + c * 16, _mm512_shuffle_f32x4(u0, u2, 0x88));  // column c
    _mm512_storeu_ps(out + (4 + c) * 16, _mm512_shuffle_f32x4(u1, u3, 0x88));
    if (width > 8) {
      _mm512_storeu_ps(out + (8 + c) * 16, _mm512_shuffle_f32x4(u0, u2, 0xDD));
      _mm512_storeu_ps(out + (12 + c) * 16, _mm512_shuffle_f32x4(u1, u3, 0xDD));
    }
  }
}

// tile[j * kTile + i] = rows[i][j] for the n < = kTile rows of width w (fp32), zeros in the
// columns i >= n: the positions of a tile become the lanes of its vectors.
inline void transpose_rows(const float* const* rows, int64_t n, int64_t w, float* tile) {
  for (int64_t c0 = 0; c0 < w; c0 += 16) {
    const int64_t width = std::min<int64_t>(16, w - c0);  // 16 or 8: w is a multiple of 8
    const __mmask16 mask = static_cast<__mmask16>((1u << width) - 1);
    __m512 r[16];
    for (int64_t i = 0; i < 16; ++i) r[i] = i < n ? _mm512_maskz_loadu_ps(mask, rows[i] + c0) : _mm512_setzero_ps();
    transpose16x16(r, tile + c0 * kTile, width);
  }
}

// sums[r] = the kTile lanes of row r of acc [rows][kTile] added up, by 16 x 16 transposes and
// vertical adds: a horizontal sum per row was half the time of a one-tile context.
inline void sum_lanes(const float* acc, int64_t rows, float* sums) {
  alignas(64) float columns[16 * 16];
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    __m512 r[16];
    for (int64_t i = 0; i < 16; ++i) r[i] = r0 + i < rows ? _mm512_loadu_ps(acc + (r0 + i) * kTile) : _mm512_setzero_ps();
    transpose16x16(r, columns, 16);
    __m512 total = _mm512_load_ps(columns);
    for (int64_t c = 1; c < 16; ++c) total = _mm512_add_ps(total, _mm512_load_ps(columns + c * 16));
    const int64_t n = std::min<int64_t>(16, rows - r0);
    _mm512_mask_storeu_ps(sums + r0, static_cast<__mmask16>((1u << n) - 1), total);
  }
}

// The tile of positions t0 .. t0 + n - 1 (n <= kTile) of a K or V pool, transposed to
// tile[kv * kD + d][i] in fp32, and for a quantized pool its scales tile_scale[kv][i] (zero past n).
// A quantized or 16-bit row is widened into stage first (contiguous, vectorized); fp32 rows are
// read in place. Slots past the context are never read.
template <typename cache_t>
inline void load_tile(const cache_t* cache, const at::Half* scales, const int32_t* block_table, int64_t block_size,
                      int64_t t0, int64_t n, int64_t num_kv_heads, int64_t token_stride, float* stage, float* tile,
                      float* tile_scale) {
  const float* rows[kTile];
  int64_t j = t0 / block_size, offset = t0 % block_size;
  for (int64_t i = 0; i < n; ++i, ++offset) {
    if (offset == block_size) offset = 0, ++j;
    const int64_t slot = static_cast<int64_t>(block_table[j]) * block_size + offset;
    const cache_t* row = cache + slot * token_stride;
    if constexpr (std::is_same_v<cache_t, float>) {
      rows[i] = row;
    } else {
      rows[i] = widen_row(row, stage + i * token_stride, token_stride);
    }
    if (scales != nullptr) {
      for (int64_t kv = 0; kv < num_kv_heads; ++kv) tile_scale[kv * kTile + i] = widen_scale(scales[slot * num_kv_heads + kv]);
    }
  }
  if (scales != nullptr) {
    for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
      for (int64_t i = n; i < kTile; ++i) tile_scale[kv * kTile + i] = 0.f;
    }
  }
  transpose_rows(rows, n, token_stride, tile);
}

// Head dims 8, 16 and 32: the scores are vectorized over positions, not over the head dim. With
// head_dim 8 a dot product per position and head is 8 lanes wide and ends in a horizontal sum
// (shuffles) for 8 multiply-adds. Here a tile of kTile positions' rows (all kv heads) is
// transposed to tile[kv * kD + d][i] (load_tile); a head's kTile scores are then kD vector
// multiply-adds s[i] += q[d] * K[kv * kD + d][i]. Scores past the context are masked to -inf.
// The weighted sum of V goes the same way where that pays (v_by_positions below): output lanes
// acc[d][i] += p[i] * V[kv * kD + d][i], whose kTile lanes are summed once at the end.
template <typename scalar_t, typename cache_t, int64_t kD>
void decode_sequence_tiled(const scalar_t* q, scalar_t* out, const cache_t* k_cache, const cache_t* v_cache,
                           const at::Half* k_scale, const at::Half* v_scale, const int32_t* block_table,
                           int64_t context_len, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size, float scale, int64_t first, float softcap, Scratch& scratch) {
  static_assert(kD > 0, "the tiled path needs the head dim as a constant");
  constexpr bool kScaled = !std::is_same_v<scalar_t, cache_t>;
  const int64_t H = num_heads, KH = num_kv_heads, group = H / KH;
  const int64_t token_stride = KH * kD;
  const int64_t padded = (context_len + kTile - 1) / kTile * kTile;  // each head's score row
  scratch.q.resize(H * kD);
  scratch.scores.resize(H * padded);
  scratch.row_sum.resize(H);
  scratch.tile.resize(token_stride * kTile);
  scratch.tile_scale.resize(KH * kTile);
  if constexpr (!std::is_same_v<cache_t, float>) scratch.row.resize(token_stride * kTile);
  float* q_buf = scratch.q.data();
  float* scores = scratch.scores.data();
  float* tile = scratch.tile.data();
  float* tile_scale = scratch.tile_scale.data();
  float* stage = scratch.row.data();
  for (int64_t i = 0; i < H * kD; ++i) q_buf[i] = static_cast<float>(q[i]) * scale;

  // Pass 1: scores, tile by tile. Positions before a sliding window's first are masked to -inf;
  // a tile wholly before it is not read.
  for (int64_t t0 = 0; t0 < context_len; t0 += kTile) {
    const int64_t n = std::min(kTile, context_len - t0);
    if (t0 + kTile <= first) {
      for (int64_t h = 0; h < H; ++h) {
        std::fill_n(scores + h * padded + t0, kTile, -std::numeric_limits<float>::infinity());
      }
      continue;
    }
    load_tile(k_cache, k_scale, block_table, block_size, t0, n, KH, token_stride, stage, tile, tile_scale);
    for (int64_t h = 0; h < H; ++h) {
      const float* qh = q_buf + h * kD;
      const float* k = tile + (h / group) * kD * kTile;
      float s[kTile] = {};
      for (int64_t d = 0; d < kD; ++d) {
        const float qd = qh[d];
#pragma omp simd
        for (int64_t i = 0; i < kTile; ++i) s[i] += qd * k[d * kTile + i];
      }
      float* row = scores + h * padded + t0;
      const float* ks = tile_scale + (h / group) * kTile;
#pragma omp simd
      for (int64_t i = 0; i < kTile; ++i) {
        const float scaled = kScaled ? s[i] * ks[i] : s[i];
        row[i] = i < n && t0 + i >= first ? scaled : -std::numeric_limits<float>::infinity();
      }
      if (softcap > 0.f) {  // -inf stays -inf (tanh(-inf) = -1 would give it weight): capped in place
        for (int64_t i = 0; i < n; ++i) {
          if (t0 + i >= first) row[i] = softcap * std::tanh(row[i] / softcap);
        }
      }
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    float* row = scores + h * padded;
    scratch.row_sum[h] = softmax_numerators(row, padded, max_of(row, padded));
  }

  // Pass 2 by lanes over positions pays at head dim 8, and at 16 from contexts of ~128 (the final
  // sum of H * kD rows of kTile lanes costs as much as a few tiles); otherwise, and from head dim 32
  // (a head's V row fills whole vectors), lanes over d as in the wide path (measured on one CPU
  // thread; docs/benchmarks.md).
  const bool v_by_positions = kD < 32 && context_len >= 8 * kD;
  if (!v_by_positions) {
    weighted_sum_of_v<scalar_t, cache_t, kD>(out, v_cache, v_scale, block_table, context_len, H, KH, kD, block_size,
                                             padded, scratch, first);
    return;
  }
  // Pass 2: acc[h][d][i] += p[h][i] * V[kv * kD + d][i] (the V tile's columns past n are zeros).
  scratch.acc.assign(H * kD * kTile, 0.f);
  float* acc = scratch.acc.data();
  for (int64_t t0 = 0; t0 < context_len; t0 += kTile) {
    const int64_t n = std::min(kTile, context_len - t0);
    if (t0 + kTile <= first) continue;  // every weight 0
    load_tile(v_cache, v_scale, block_table, block_size, t0, n, KH, token_stride, stage, tile, tile_scale);
    // A tile straddling the window's start: its earlier rows get weight 0, but 0 * NaN is NaN, so
    // those V values (a freed block may hold anything) are zeroed rather than multiplied.
    const int64_t stale = std::max<int64_t>(0, first - t0);
    if (stale > 0) {
      for (int64_t c = 0; c < token_stride; ++c) std::fill_n(tile + c * kTile, stale, 0.f);
    }
    for (int64_t h = 0; h < H; ++h) {
      float p[kTile];
      const float* ph = scores + h * padded + t0;
      const float* vs = tile_scale + (h / group) * kTile;
#pragma omp simd
      for (int64_t i = 0; i < kTile; ++i) p[i] = i < stale ? 0.f : (kScaled ? ph[i] * vs[i] : ph[i]);
      const float* v = tile + (h / group) * kD * kTile;
      float* a = acc + h * kD * kTile;
      for (int64_t d = 0; d < kD; ++d) {
#pragma omp simd
        for (int64_t i = 0; i < kTile; ++i) a[d * kTile + i] += p[i] * v[d * kTile + i];
      }
    }
  }
  sum_lanes(acc, H * kD, q_buf);  // q_buf is free now: it takes the sums
  for (int64_t h = 0; h < H; ++h) {
    const float inv = 1.f / scratch.row_sum[h];
    for (int64_t d = 0; d < kD; ++d) out[h * kD + d] = static_cast<scalar_t>(q_buf[h * kD + d] * inv);
  }
}

#endif  // __AVX512F__

template <typename scalar_t, typename cache_t>
void decode_batch(const scalar_t* q_ptr, scalar_t* out_ptr, const cache_t* k_ptr, const cache_t* v_ptr,
                  const at::Half* k_scale, const at::Half* v_scale,
                  const int32_t* tables, const int32_t* lens, int64_t B, int64_t max_blocks, int64_t H, int64_t KH,
                  int64_t D, int64_t block_size, float scale, int64_t window, float softcap,
                  tokenmill_cpu::WorkerPool* pool) {
  // Longest contexts first, handed out one at a time: the threads finish together even
  // when lengths differ widely, and a thread the OS takes away for a moment (another
  // process on the same cores) holds up one sequence rather than half the batch, as a
  // static split would.
  std::vector<int64_t> order(B);
  for (int64_t b = 0; b < B; ++b) order[b] = b;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return lens[x] > lens[y]; });
  const int num_threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), B));
#if defined(__AVX512F__)
  auto* decode = D == 8 ? decode_sequence_tiled<scalar_t, cache_t, 8>
               : D == 16 ? decode_sequence_tiled<scalar_t, cache_t, 16>
               : D == 32 ? decode_sequence_tiled<scalar_t, cache_t, 32> : D == 64 ? decode_sequence<scalar_t, cache_t, 64>
#else
  auto* decode = D == 8 ? decode_sequence<scalar_t, cache_t, 8> : D == 16 ? decode_sequence<scalar_t, cache_t, 16>
               : D == 32 ? decode_sequence<scalar_t, cache_t, 32> : D == 64 ? decode_sequence<scalar_t, cache_t, 64>
#endif
               : D == 128 ? decode_sequence<scalar_t, cache_t, 128> : decode_sequence<scalar_t, cache_t, 0>;
  auto run = [&](int64_t i, Scratch& scratch) {
    const int64_t b = order[i];
    // A sliding window of W keys: the query at position lens[b] - 1 sees positions from lens[b] - W.
    const int64_t first = window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0;
    decode(q_ptr + b * H * D, out_ptr + b * H * D, k_ptr, v_ptr, k_scale, v_scale, tables + b * max_blocks, lens[b], H,
           KH, D, block_size, scale, first, softcap, scratch);
  };
  if (pool != nullptr) {  // the fused step's threads (worker_pool.h), a sequence a chunk
    pool->parallel_for(B, 1, [&](int64_t begin, int64_t end) {
      thread_local Scratch scratch;
      for (int64_t i = begin; i < end; ++i) run(i, scratch);
    });
    return;
  }
#pragma omp parallel num_threads(num_threads)
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < B; ++i) run(i, scratch);
  }
}

// The checks both entry points share; the caches' dtype is checked by each.
void check_decode_args(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& context_lens) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [B, H, D] of the same shape");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "k/v cache must be [NB, BS, KH, D]");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q, out and the caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == out.scalar_type(), "q and out must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2,
              "block_tables must be contiguous int32 [B, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous(), "context_lens must be int32");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), KH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "cache head_dim differs from q's");
  TORCH_CHECK(H % KH == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.numel() == B, "one block table and length per sequence");
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t num_pool_blocks = k_cache.size(0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && (lens[b] + block_size - 1) / block_size <= max_blocks,
                "context_lens[", b, "] = ", lens[b], " does not fit its block table");
    // Raw pointer reads follow: a block id outside the pool must be an error, never a read.
    for (int64_t j = 0; j < (lens[b] + block_size - 1) / block_size; ++j) {
      const int32_t block = tables[b * max_blocks + j];
      TORCH_CHECK(block >= 0 && block < num_pool_blocks, "block_tables[", b, "][", j, "] = ", block,
                  " is outside the pool of ", num_pool_blocks, " blocks");
    }
  }
}

// Quantized pools: int8 or float8_e4m3fn values, fp16 scales [NB, BS, KH] (see the top).
void check_scales(const at::Tensor& cache, const at::Tensor& scales) {
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == cache.size(0) && scales.size(1) == cache.size(1) && scales.size(2) == cache.size(2),
              "scales must be contiguous float16 [NB, BS, KH]");
}

template <typename Body>
void dispatch_quantized(at::ScalarType cache_type, Body&& body) {
  if (cache_type == at::kChar) {
    body(int8_t{});
  } else if (cache_type == at::kFloat8_e4m3fn) {
    body(c10::Float8_e4m3fn{});
  } else {
    TORCH_CHECK(false, "a quantized pool holds int8 or float8_e4m3fn values");
  }
}

// Decode attention over a plain pool (null scales) or a quantized one: the checks, then the
// batch in q's dtype and the pool's storage type. Both registered ops and the fused step run it.
void run_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor* k_scale, const at::Tensor* v_scale, const at::Tensor& block_tables,
                const at::Tensor& context_lens, double scale, tokenmill_cpu::WorkerPool* pool, int64_t window = 0,
                double softcap = 0.0) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(softcap >= 0.0 && std::isfinite(softcap), "softcap must be a finite number >= 0 (0: none), got ",
              softcap);
  check_decode_args(out, q, k_cache, v_cache, block_tables, context_lens);
  const bool quantized = k_scale != nullptr;
  if (quantized) {
    TORCH_CHECK(v_scale != nullptr && k_cache.scalar_type() == v_cache.scalar_type(),
                "k and v pools must share a dtype and both have scales");
    check_scales(k_cache, *k_scale);
    check_scales(v_cache, *v_scale);
  } else {
    TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
                "q, out and the caches must share a dtype");
  }
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    auto batch = [&](auto stored) {
      using cache_t = decltype(stored);
      decode_batch<scalar_t, cache_t>(
          q.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), static_cast<const cache_t*>(k_cache.data_ptr()),
          static_cast<const cache_t*>(v_cache.data_ptr()), quantized ? k_scale->data_ptr<at::Half>() : nullptr,
          quantized ? v_scale->data_ptr<at::Half>() : nullptr, block_tables.data_ptr<int32_t>(),
          context_lens.data_ptr<int32_t>(), B, block_tables.size(1), H, k_cache.size(2), D, k_cache.size(1),
          static_cast<float>(scale), window, static_cast<float>(softcap), pool);
    };
    if (quantized) {
      dispatch_quantized(k_cache.scalar_type(), batch);
    } else {
      batch(scalar_t{});
    }
  });
}

void paged_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, int64_t window,
                  double softcap) {
  run_decode(out, q, k_cache, v_cache, nullptr, nullptr, block_tables, context_lens, scale, nullptr, window, softcap);
}

void paged_decode_quantized(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& k_scale, const at::Tensor& v_scale,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t window, double softcap) {
  run_decode(out, q, k_cache, v_cache, &k_scale, &v_scale, block_tables, context_lens, scale, nullptr, window,
             softcap);
}

// Stores a step's new K and V rows, k/v [T, KH, D] (any token and head strides, unit last
// stride, the caches' dtype), at slot_mapping [T] (int64 flat slots) of the caches
// [NB, BS, KH, D]. One call for both pools, where the torch path takes two index_copy_ and
// their dtype and view calls. For callers whose slots come from checked block tables (the
// compiled decode step); the slot check here is a second line.
// The checks both K/V writes share: shapes, layouts, and every slot inside the pool (raw
// pointer writes follow). The dtypes are checked by each.
void check_kv_write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1 &&
                  k.scalar_type() == v.scalar_type(),
              "k and v must be [T, KH, D] of one dtype with unit last stride");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k/v cache must be contiguous [NB, BS, KH, D] of one dtype");
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3), "k/v rows must match the cache's [KH, D]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == k.size(0),
              "slot_mapping must be contiguous int64 [T]");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t],
                " is outside the pool of ", num_slots, " slots");
  }
}

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  check_kv_write(k, v, k_cache, v_cache, slot_mapping);
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type(), "k, v and the caches must share a dtype");
  const int64_t T = k.size(0), KH = k.size(1), D = k.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    const int64_t row = KH * D;
    for (const auto& [src, cache] : {std::pair{&k, &k_cache}, std::pair{&v, &v_cache}}) {
      const scalar_t* from = src->data_ptr<scalar_t>();
      scalar_t* to = cache->data_ptr<scalar_t>();
      const int64_t st = src->stride(0), sh = src->stride(1);
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t h = 0; h < KH; ++h) {
          std::copy_n(from + t * st + h * sh, D, to + slots[t] * row + h * D);
        }
      }
    }
  });
}

// kv_quant.py's rule for one (token, kv head) row of D values: scale = fp16(clamp(amax / qmax)),
// then int8 q = clamp(floor(x / scale + 0.5), -127, 127) or e4m3 q = clamp(x / scale, -448, 448)
// rounded to nearest even. The same fp32 operations in the same order as the torch form, so the
// bytes are the same (tested).
constexpr float kMinScale = 1.0f / 16384.0f;  // 2^-14, fp16's smallest normal
constexpr float kMaxScale = 65504.0f;         // fp16's largest finite value

template <typename scalar_t, typename cache_t>
inline void quantize_row(const scalar_t* x, cache_t* values, at::Half* scale, int64_t D) {
  constexpr bool kInt8 = std::is_same_v<cache_t, int8_t>;
  constexpr float kQmax = kInt8 ? 127.0f : 448.0f;
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::abs(static_cast<float>(x[d])));
  const at::Half stored = at::Half(std::min(std::max(amax / kQmax, kMinScale), kMaxScale));
  const float s = static_cast<float>(stored);
  if constexpr (kInt8) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) {
      values[d] = static_cast<int8_t>(std::min(std::max(std::floor(static_cast<float>(x[d]) / s + 0.5f), -127.0f),
                                               127.0f));
    }
  } else {  // c10's rounding to e4m3 (nearest even), the one torch's .to() uses
    for (int64_t d = 0; d < D; ++d) {
      values[d] = c10::Float8_e4m3fn(std::min(std::max(static_cast<float>(x[d]) / s, -kQmax), kQmax));
    }
  }
  *scale = stored;
}

// write_kv for quantized pools: k/v [T, KH, D] in any float dtype (unit last stride), caches
// [NB, BS, KH, D] int8 or float8_e4m3fn, scales [NB, BS, KH] fp16, all contiguous.
void write_kv_quantized(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                        at::Tensor k_scale, at::Tensor v_scale, const at::Tensor& slot_mapping) {
  check_kv_write(k, v, k_cache, v_cache, slot_mapping);
  check_scales(k_cache, k_scale);
  check_scales(v_cache, v_scale);
  const int64_t T = k.size(0), KH = k.size(1), D = k.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_quantized", [&] {
    dispatch_quantized(k_cache.scalar_type(), [&](auto stored) {
      using cache_t = decltype(stored);
      auto store = [&](const at::Tensor& src, at::Tensor& cache, at::Tensor& scales) {
        const scalar_t* from = static_cast<const scalar_t*>(src.data_ptr());
        cache_t* to = static_cast<cache_t*>(cache.data_ptr());
        at::Half* scale_to = static_cast<at::Half*>(scales.data_ptr());
        const int64_t st = src.stride(0), sh = src.stride(1);
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t h = 0; h < KH; ++h) {
            quantize_row(from + t * st + h * sh, to + (slots[t] * KH + h) * D, scale_to + slots[t] * KH + h, D);
          }
        }
      };
      store(k, k_cache, k_scale);
      store(v, v_cache, v_scale);
    });
  });
}

// The first slot write_kv must not write, without throwing: the index of the first entry of
// slot_mapping (contiguous int64) outside [0, num_slots), or -1.
int64_t find_bad_slot(const at::Tensor& slot_mapping, int64_t num_slots) {
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0, n = slot_mapping.numel(); t < n; ++t) {
    if (slots[t] < 0 || slots[t] >= num_slots) return t;
  }
  return -1;
}

// The first entry the kernel must not read, without throwing (see the Python wrapper: an
// exception does not reach Python on every torch build). Returns {-1, -1} when every
// sequence's length fits its table and every block it reads lies in the pool; {b, -1} when
// context_lens[b] does not fit (< 1, or more blocks than the table has); {b, j} when
// block_tables[b][j] is outside the pool. The caller passes contiguous int32 tensors with
// one length per table row.
std::vector<int64_t> find_bad_table_entry(const at::Tensor& block_tables, const at::Tensor& context_lens,
                                          int64_t num_blocks, int64_t block_size) {
  const int64_t B = context_lens.numel(), max_blocks = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t needed = (static_cast<int64_t>(lens[b]) + block_size - 1) / block_size;
    if (lens[b] < 1 || needed > max_blocks) return {b, -1};
    for (int64_t j = 0; j < needed; ++j) {
      const int32_t block = tables[b * max_blocks + j];
      if (block < 0 || block >= num_blocks) return {b, j};
    }
  }
  return {-1, -1};
}

}  // namespace

// Entry points for the other C++ files of this extension (paged_decode.h): the fused decode step
// calls the attention and the K/V write directly, without a trip through the dispatcher.
namespace tokenmill_cpu {

void decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor* k_scale, const at::Tensor* v_scale, const at::Tensor& block_tables,
                      const at::Tensor& context_lens, double scale, WorkerPool* pool, int64_t window,
                      double softcap) {
  run_decode(out, q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale, pool, window, softcap);
}

void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor* k_scale,
              at::Tensor* v_scale, const at::Tensor& slot_mapping) {
  if (k_scale == nullptr) {
    write_kv(k, v, k_cache, v_cache, slot_mapping);
  } else {
    write_kv_quantized(k, v, k_cache, v_cache, *k_scale, *v_scale, slot_mapping);
  }
}

}  // namespace tokenmill_cpu

TORCH_LIBRARY(tokenmill_cpu, m) {
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("find_bad_slot(Tensor slot_mapping, int num_slots) -> int");
  m.def("find_bad_table_entry(Tensor block_tables, Tensor context_lens, int num_blocks, int block_size) -> int[]");
  m.def(
      "paged_decode(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, int window=0, float softcap=0.) -> ()");
  m.def(
      "write_kv_quantized(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scale, "
      "Tensor(d!) v_scale, Tensor slot_mapping) -> ()");
  m.def(
      "paged_decode_quantized(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scale, "
      "Tensor v_scale, Tensor block_tables, Tensor context_lens, float scale, int window=0, float softcap=0.) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("find_bad_table_entry", &find_bad_table_entry);
  m.impl("write_kv", &write_kv);
  m.impl("find_bad_slot", &find_bad_slot);
  m.impl("write_kv_quantized", &write_kv_quantized);
  m.impl("paged_decode_quantized", &paged_decode_quantized);
}
