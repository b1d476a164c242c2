// The all-reduce of a CPU tensor-parallel group over one shared memory segment.
//
// The ranks of a CPU tensor-parallel executor are processes of one host. gloo's all-reduce
// over loopback costs ~340 us for a [1, 768] fp32 tensor (two socket round trips through the
// kernel, docs/benchmarks.md); here it is a copy into the segment, a wait on a sequence number
// and a sum read from the segment.
//
// Layout: a control line (magic, world, capacity, abort flag), one cache line per rank (the
// sequence number it has arrived at, how many ranks sleep on it, its pid), then two sets of
// `world` buffers of `capacity` floats, taken in turn by consecutive calls (seq & 1).
//
// One call (a chunk of at most `capacity` floats at a time; a longer tensor is several):
//   1. copy my values into my buffer of set seq & 1, publish arrived = seq;
//   2. wait until every rank has arrived at seq;
//   3. sum every rank's buffer in rank order 0, 1, ..., world - 1 into my tensor.
// Every rank adds the same numbers in the same order, so all get bit-identical sums, the same
// from run to run. Why two sets are enough: a rank writes set seq & 1 again at seq + 2, which
// it reaches only after every rank arrived at seq + 1, and a rank arrives at seq + 1 only after
// it has finished reading set seq & 1.
//
// All-to-all (expert parallelism's token exchange): each rank's stream is a header (how many
// rows it sends to each rank, world int64s) and its rows, concatenated in destination order;
// the stream goes through the rank's buffer a chunk per sequence number, and each rank copies
// out of every peer's chunk the part of that peer's rows addressed to it. The first chunk's
// headers tell every rank the longest stream, hence the same number of chunks for all.
//
// The same segment carries rank 0's step inputs to the others (broadcast: rank 0's buffer of
// the set, read by all), which gloo's loopback round trips took a millisecond or more to do.
//
// Waiting: spin (pause) for spin_us, then sched_yield until yield_us, then sleep on a futex on
// the peer's sequence word (woken by its arrival; slices of 1 ms growing to 100 ms), so a wait that is long, on a
// machine whose cores are shared, gives the core back rather than steal it. While asleep it
// checks the abort flag, whether the peer's process is gone, and the deadline: a failed wait
// returns a status (never throws: an exception thrown here does not reach Python on every torch
// build) and the caller raises with last_error().
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <functional>
#include <string>
#include <tuple>

namespace tokenmill_cpu {

enum ReduceStatus : int64_t { kReduceOk = 0, kReduceTimeout = 1, kReducePeerGone = 2, kReduceAborted = 3 };

struct ShmAllReduce : torch::CustomClassHolder {
  // Rank 0 creates the file at `path` (it must not exist); the others open it.
  ShmAllReduce(std::string path, int64_t rank, int64_t world, int64_t capacity, double timeout_s, double spin_us,
               double yield_us);
  ~ShmAllReduce() override;

  // x[0:n] = the sum over the ranks of their x[0:n], in place; a ReduceStatus.
  int64_t reduce(float* x, int64_t n);
  // out[r * n : (r + 1) * n] = rank r's x[0:n], on rank 0 only (the others' out is untouched).
  int64_t gather(const float* x, int64_t n, float* out);

  // data[0:nbytes] = rank 0's data[0:nbytes], on every rank. `idle`: the others may wait for
  // rank 0 without a deadline (the next step of an executor that has no work may be hours
  // away); rank 0's death still ends the wait.
  int64_t broadcast(uint8_t* data, int64_t nbytes, bool idle);

  // Rows of `row_bytes` bytes: send[0:sum(send_counts)] goes, in runs of send_counts[r] rows,
  // to rank r; the rows every rank sends this rank come back concatenated by source rank,
  // with recv_counts[r] (world int64s, filled here) rows from rank r, into the bytes
  // `allocate(total bytes)` returns once recv_counts is known. A ReduceStatus.
  int64_t exchange(const uint8_t* send, const int64_t* send_counts, int64_t row_bytes, int64_t* recv_counts,
                   const std::function<uint8_t*(int64_t)>& allocate);

  // Torch-facing: fp32 contiguous CPU tensors (the broadcast and the all-to-all: any dtype).
  int64_t all_reduce(at::Tensor t);
  int64_t gather_to_first(at::Tensor local, at::Tensor out);
  int64_t broadcast_from_first(at::Tensor t, bool idle);
  // send [N, ...] contiguous, send_counts int64 [world] summing to N, recv_counts int64 [world]
  // (filled) -> (status, the received rows [sum(recv_counts), ...] in send's dtype).
  std::tuple<int64_t, at::Tensor> all_to_all(at::Tensor send, at::Tensor send_counts, at::Tensor recv_counts);

  // Make every rank's current and later waits fail at once (the leader calls it when a rank dies).
  void abort();
  int64_t status() const { return status_; }
  std::string last_error() const { return error_; }
  double seconds() const { return static_cast<double>(nanos_) * 1e-9; }
  void reset_seconds() { nanos_ = 0; }
  int64_t rank() const { return rank_; }
  int64_t world() const { return world_; }

 private:
  int64_t arrive_and_wait(bool idle);
  int64_t wait_for(int64_t peer, uint32_t seq, int64_t deadline_ns);
  int64_t fail(int64_t status, std::string message);
  float* buffer(uint32_t seq, int64_t rank) const;

  int64_t rank_, world_, capacity_;
  double timeout_s_, spin_us_, yield_us_;
  uint8_t* base_ = nullptr;
  size_t bytes_ = 0;
  uint32_t seq_ = 0;
  int64_t status_ = kReduceOk;
  std::string error_;
  int64_t nanos_ = 0;
};

// Registers the class in the tokenmill_cpu library. Called from fused_decode.cpp's registration,
// before the decoder whose set_all_reduce takes it: static registrations of two files run in no
// fixed order, and a method's argument type must be registered first.
void register_shm_all_reduce(torch::Library& m);

}  // namespace tokenmill_cpu
