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
// storage dtype. Sequences run in parallel on torch's intra-op thread count.
//
// Layouts (checked by the Python wrapper, which also holds the reference):
//   out, q:        [B, H, D] contiguous
//   k/v cache:     [num_blocks, block_size, KH, D] contiguous
//   block_tables:  [B, max_blocks] int32 contiguous
//   context_lens:  [B] int32

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

namespace {

// Calls visit(t, row) for the context's slots t = 0 .. context_len - 1 in order, where row
// points at slot t's K (or V) row (all kv heads) in its block.
template <typename scalar_t, typename Visit>
inline void for_each_slot(const scalar_t* cache, const int32_t* block_table, int64_t context_len,
                          int64_t block_size, int64_t token_stride, Visit&& visit) {
  const int64_t block_stride = block_size * token_stride;
  for (int64_t start = 0, j = 0; start < context_len; start += block_size, ++j) {
    const scalar_t* block = cache + static_cast<int64_t>(block_table[j]) * block_stride;
    const int64_t n = std::min(block_size, context_len - start);
    for (int64_t o = 0; o < n; ++o) visit(start + o, block + o * token_stride);
  }
}

// Per-thread buffers, reused from one sequence to the next.
struct Scratch {
  std::vector<float> q, scores, acc, row_max, row_sum;
};

// kD: the head dim as a compile-time constant for the common sizes (0 = read head_dim), so
// the per-head loops are unrolled and vectorized for their exact length. A small head dim
// pays most: with head_dim 8 a runtime-length loop ran at half the speed.
template <typename scalar_t, int64_t kD>
void decode_sequence(const scalar_t* q, scalar_t* out, const scalar_t* k_cache, const scalar_t* v_cache,
                     const int32_t* block_table, int64_t context_len, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, int64_t block_size, float scale, Scratch& scratch) {
  const int64_t D = kD > 0 ? kD : head_dim, H = num_heads, group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * D;  // one slot's K (or V) row: all kv heads
  std::vector<float>& q_buf = scratch.q;
  std::vector<float>& scores = scratch.scores;
  std::vector<float>& acc = scratch.acc;
  std::vector<float>& row_max = scratch.row_max;
  std::vector<float>& row_sum = scratch.row_sum;
  q_buf.resize(H * D);
  scores.resize(H * context_len);
  acc.assign(H * D, 0.f);
  row_max.assign(H, -std::numeric_limits<float>::infinity());
  row_sum.assign(H, 0.f);
  for (int64_t i = 0; i < H * D; ++i) q_buf[i] = static_cast<float>(q[i]) * scale;

  // Pass 1: scores. A slot's row holds every kv head contiguously, so the pass streams
  // through each block once; query head h reads kv head h / group.
  for_each_slot(k_cache, block_table, context_len, block_size, token_stride, [&](int64_t t, const scalar_t* k_row) {
    for (int64_t h = 0; h < H; ++h) {
      const float* qh = q_buf.data() + h * D;
      const scalar_t* k = k_row + (h / group) * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qh[d] * static_cast<float>(k[d]);
      scores[h * context_len + t] = s;
      row_max[h] = std::max(row_max[h], s);
    }
  });

  // Softmax numerators in place; the denominators divide the output at the end.
  for (int64_t h = 0; h < H; ++h) {
    float* s = scores.data() + h * context_len;
    const float m = row_max[h];
    float total = 0.f;
    for (int64_t t = 0; t < context_len; ++t) {
      s[t] = std::exp(s[t] - m);
      total += s[t];
    }
    row_sum[h] = total;
  }

  // Pass 2: weighted sum of V.
  for_each_slot(v_cache, block_table, context_len, block_size, token_stride, [&](int64_t t, const scalar_t* v_row) {
    for (int64_t h = 0; h < H; ++h) {
      const float p = scores[h * context_len + t];
      const scalar_t* v = v_row + (h / group) * D;
      float* a = acc.data() + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += p * static_cast<float>(v[d]);
    }
  });

  for (int64_t h = 0; h < H; ++h) {
    const float inv = 1.f / row_sum[h];
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = static_cast<scalar_t>(acc[h * D + d] * inv);
  }
}

template <typename scalar_t>
void decode_batch(const scalar_t* q_ptr, scalar_t* out_ptr, const scalar_t* k_ptr, const scalar_t* v_ptr,
                  const int32_t* tables, const int32_t* lens, int64_t B, int64_t max_blocks, int64_t H, int64_t KH,
                  int64_t D, int64_t block_size, float scale) {
  // Longest contexts first, handed out one at a time: the threads finish together even
  // when lengths differ widely, and a thread the OS takes away for a moment (another
  // process on the same cores) holds up one sequence rather than half the batch, as a
  // static split would.
  std::vector<int64_t> order(B);
  for (int64_t b = 0; b < B; ++b) order[b] = b;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return lens[x] > lens[y]; });
  const int num_threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), B));
  auto* decode = D == 8 ? decode_sequence<scalar_t, 8> : D == 16 ? decode_sequence<scalar_t, 16>
               : D == 32 ? decode_sequence<scalar_t, 32> : D == 64 ? decode_sequence<scalar_t, 64>
               : D == 128 ? decode_sequence<scalar_t, 128> : decode_sequence<scalar_t, 0>;
#pragma omp parallel num_threads(num_threads)
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < B; ++i) {
      const int64_t b = order[i];
      decode(q_ptr + b * H * D, out_ptr + b * H * D, k_ptr, v_ptr, tables + b * max_blocks,
                                lens[b], H, KH, D, block_size, scale, scratch);
    }
  }
}

void paged_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [B, H, D] of the same shape");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "k/v cache must be [NB, BS, KH, D]");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q, out and the caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              "q, out and the caches must share a dtype");
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

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_batch<scalar_t>(q.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                           v_cache.data_ptr<scalar_t>(), tables, lens, B, max_blocks, H, KH, D, block_size,
                           static_cast<float>(scale));
  });
}

// Stores a step's new K and V rows, k/v [T, KH, D] (any token and head strides, unit last
// stride, the caches' dtype), at slot_mapping [T] (int64 flat slots) of the caches
// [NB, BS, KH, D]. One call for both pools, where the torch path takes two index_copy_ and
// their dtype and view calls. For callers whose slots come from checked block tables (the
// compiled decode step); the slot check here is a second line.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "k and v must be [T, KH, D] with unit last stride");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "k/v cache must be contiguous [NB, BS, KH, D]");
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3), "k/v rows must match the cache's [KH, D]");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type() &&
                  k.scalar_type() == v.scalar_type(),
              "k, v and the caches must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == k.size(0),
              "slot_mapping must be contiguous int64 [T]");
  const int64_t T = k.size(0), KH = k.size(1), D = k.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t],
                " is outside the pool of ", num_slots, " slots");
  }
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

TORCH_LIBRARY(tokenmill_cpu, m) {
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("find_bad_slot(Tensor slot_mapping, int num_slots) -> int");
  m.def("find_bad_table_entry(Tensor block_tables, Tensor context_lens, int num_blocks, int block_size) -> int[]");
  m.def(
      "paged_decode(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill_cpu, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("find_bad_table_entry", &find_bad_table_entry);
  m.impl("write_kv", &write_kv);
  m.impl("find_bad_slot", &find_bad_slot);
}
