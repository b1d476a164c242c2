// The fused CPU step's threads: a caller and helpers sharing each parallel loop's chunks.
//
// A fused decode step of SmolLM2 runs ~150 parallel loops (four products and the attention per
// layer), 10-100 us each. Through OpenMP's fork-join (at::parallel_for) every loop ends at a
// barrier that waits for every thread to arrive: on a machine whose cores other processes also
// use, a helper the OS has descheduled holds up each loop for a time slice, and two threads ran
// a step 1.5-4x slower than one (docs/benchmarks.md). Here the loop's chunks are claimed one at
// a time from a counter, by the caller too, and the caller waits only for chunks some thread has
// claimed: a helper that is away while the loop runs leaves its share to the caller.
//
// Waiting: a helper that finds no work spins (pause) for at most kSpinMicros, long enough to
// catch the next loop of the same step, then sleeps on a futex until the next loop is posted,
// so between steps it gives the core back (to the scheduler and the tokenizer, on a machine
// with two) instead of spinning as OpenMP's default wait policy does for milliseconds.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

namespace tokenmill_cpu {

class WorkerPool {
 public:
  static constexpr int64_t kSpinMicros = 50;

  // `threads` counts the caller: threads - 1 helpers are started.
  explicit WorkerPool(int threads) {
    for (int i = 1; i < threads; ++i) helpers_.emplace_back([this] { help(); });
  }

  ~WorkerPool() {
    stop_.store(true);
    posted_.fetch_add(1);
    posted_.notify_all();
    for (auto& t : helpers_) t.join();
  }

  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int threads() const { return static_cast<int>(helpers_.size()) + 1; }

  // fn(begin, end) over [0, n) in chunks of `grain`, each chunk run once, on the caller and the
  // helpers; returns when every chunk has run. Not reentrant: one caller at a time.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
    if (n <= 0) return;
    grain = std::max<int64_t>({1, grain, (n + kMaxChunks - 1) / kMaxChunks});
    const int64_t chunks = (n + grain - 1) / grain;
    if (helpers_.empty() || chunks == 1) {
      fn(0, n);
      return;
    }
    // Publish the job, then the ticket that opens it. A thread reads the job only after
    // claiming one of its chunks, and the next job is written only once every chunk of this one
    // is done, so no thread runs a stale job.
    job_ = {&fn, n, grain};
    done_.store(0, std::memory_order_relaxed);
    generation_ = (generation_ + 1) & kGenerationMask;
    ticket_.store(generation_ << (2 * kIndexBits) | static_cast<uint64_t>(chunks) << kIndexBits,
                  std::memory_order_release);
    posted_.fetch_add(1, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) posted_.notify_all();
    run_chunks();
    // Chunks other threads claimed may still run; past a few thousand spins the one running
    // has likely been descheduled, and yielding may hand it the core back.
    for (int spins = 0; done_.load(std::memory_order_acquire) < chunks; ++spins) {
      if (spins < 4096) {
        _mm_pause();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr int kIndexBits = 20;
  static constexpr int64_t kMaxChunks = (int64_t{1} << kIndexBits) - 1;
  static constexpr uint64_t kIndexMask = (uint64_t{1} << kIndexBits) - 1;
  static constexpr uint64_t kGenerationMask = (uint64_t{1} << (64 - 2 * kIndexBits)) - 1;

  struct Job {
    const std::function<void(int64_t, int64_t)>* fn = nullptr;
    int64_t n = 0, grain = 1;
  };

  // Claims and runs chunks of the posted job until none is left to claim. The ticket holds the
  // generation, the job's chunk count and the next chunk: a claim is one compare-and-swap that
  // fails if another thread claimed first or a new job replaced the ticket.
  void run_chunks() {
    uint64_t ticket = ticket_.load(std::memory_order_acquire);
    while (true) {
      const uint64_t chunks = (ticket >> kIndexBits) & kIndexMask, chunk = ticket & kIndexMask;
      if (chunk >= chunks) return;
      if (!ticket_.compare_exchange_weak(ticket, ticket + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        continue;
      }
      const Job job = job_;  // stable: this chunk is claimed and not done, so no new job is written
      const int64_t begin = static_cast<int64_t>(chunk) * job.grain;
      (*job.fn)(begin, std::min(job.n, begin + job.grain));
      done_.fetch_add(1, std::memory_order_acq_rel);
      ticket = ticket_.load(std::memory_order_acquire);
    }
  }

  void help() {
    while (!stop_.load(std::memory_order_relaxed)) {
      const uint32_t seen = posted_.load(std::memory_order_seq_cst);
      run_chunks();
      // Wait for the next job: spin a little, then sleep.
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
      bool posted = false;
      for (int i = 0; !posted; ++i) {
        posted = posted_.load(std::memory_order_acquire) != seen;
        if (posted) break;
        if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) break;
        _mm_pause();
      }
      if (!posted) {
        sleeping_.fetch_add(1, std::memory_order_seq_cst);
        posted_.wait(seen, std::memory_order_seq_cst);
        sleeping_.fetch_sub(1, std::memory_order_seq_cst);
      }
    }
  }

  std::vector<std::thread> helpers_;
  Job job_;
  uint64_t generation_ = 0;           // the caller's alone
  std::atomic<uint64_t> ticket_{0};  // generation | chunk count | next chunk
  std::atomic<int64_t> done_{0};
  std::atomic<uint32_t> posted_{0};  // bumped per job: what sleeping helpers wait on
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
};

// fn(begin, end) over [0, n) in chunks of `grain`: on `pool` when there is one, else on torch's
// intra-op threads (at::parallel_for).
inline void parallel_for(WorkerPool* pool, int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (pool != nullptr) {
    pool->parallel_for(n, grain, fn);
  } else {
    at::parallel_for(0, n, grain, fn);
  }
}

}  // namespace tokenmill_cpu
