// What paged_decode.cpp offers the other C++ files of the extension (the fused decode step).
// Same layouts, dtypes and checks as the registered ops of the same meaning; a null scale
// pointer means a plain pool, a pair of scales a quantized one (kv_quant.py).
#pragma once

#include <ATen/ATen.h>

namespace tokenmill_cpu {

class WorkerPool;

// Decode attention, one query per sequence: out, q [B, H, D] over the pool through block_tables;
// the sequences on `pool` (worker_pool.h), or on OpenMP's threads when null; window: 0, or a
// sliding window of that many keys per query; softcap: 0, or Gemma 2's cap c on the scaled scores.
void decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor* k_scale, const at::Tensor* v_scale, const at::Tensor& block_tables,
                      const at::Tensor& context_lens, double scale, WorkerPool* pool = nullptr, int64_t window = 0,
                      double softcap = 0.0);

// Stores k, v [T, KH, D] (unit last stride) at slot_mapping [T] int64 of the pools.
void store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor* k_scale,
              at::Tensor* v_scale, const at::Tensor& slot_mapping);

}  // namespace tokenmill_cpu
