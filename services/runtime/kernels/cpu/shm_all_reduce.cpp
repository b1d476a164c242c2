// The shared-memory all-reduce of a CPU tensor-parallel group (shm_all_reduce.h says how).

#include "shm_all_reduce.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <vector>

namespace tokenmill_cpu {
namespace {

constexpr uint32_t kMagic = 0x746d5352;  // "tmSR"
constexpr size_t kLine = 64;
constexpr size_t kDataOffset = 4096;

struct Control {
  uint32_t magic;
  uint32_t world;
  uint64_t capacity;
  uint32_t abort;
};

struct RankLine {
  uint32_t arrived;  // the last sequence number this rank has published its buffer for
  uint32_t waiters;  // ranks asleep on `arrived`: an arrival wakes them only when there are some
  int32_t pid;
};

static_assert(sizeof(Control) <= kLine && sizeof(RankLine) <= kLine, "one cache line each");

inline Control* control(uint8_t* base) { return reinterpret_cast<Control*>(base); }
inline RankLine* line(uint8_t* base, int64_t rank) { return reinterpret_cast<RankLine*>(base + kLine * (1 + rank)); }

size_t segment_bytes(int64_t world, int64_t capacity) {
  return kDataOffset + 2 * static_cast<size_t>(world) * static_cast<size_t>(capacity) * sizeof(float);
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Whether sequence number `have` is at or past `want` (they wrap at 2^32).
inline bool reached(uint32_t have, uint32_t want) { return static_cast<int32_t>(have - want) >= 0; }

void futex_wait(uint32_t* word, uint32_t expected, int64_t timeout_ns) {
#if defined(__linux__)
  struct timespec ts = {static_cast<time_t>(timeout_ns / 1000000000), static_cast<long>(timeout_ns % 1000000000)};
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
#else
  (void)word, (void)expected;
  struct timespec ts = {0, static_cast<long>(std::min<int64_t>(timeout_ns, 100000))};
  nanosleep(&ts, nullptr);
#endif
}

void futex_wake_all(uint32_t* word) {
#if defined(__linux__)
  syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
#else
  (void)word;
#endif
}

// A process that has ended: no such pid, or a zombie not yet reaped.
bool process_gone(int32_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
#if defined(__linux__)
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  if (paren != std::string::npos && paren + 2 < text.size()) return text[paren + 2] == 'Z' || text[paren + 2] == 'X';
#endif
  return false;
}

void check_tensor(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), what,
              " must be a contiguous fp32 CPU tensor");
}

}  // namespace

ShmAllReduce::ShmAllReduce(std::string path, int64_t rank, int64_t world, int64_t capacity, double timeout_s,
                           double spin_us, double yield_us)
    : rank_(rank), world_(world), capacity_(capacity), timeout_s_(timeout_s), spin_us_(spin_us), yield_us_(yield_us) {
  TORCH_CHECK(world >= 1 && world <= 62 && rank >= 0 && rank < world, "rank ", rank, " of world ", world);
  TORCH_CHECK(capacity >= 16 && capacity % 16 == 0, "capacity must be a positive multiple of 16 floats");
  bytes_ = segment_bytes(world, capacity);
  const int fd = rank == 0 ? open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600) : open(path.c_str(), O_RDWR);
  TORCH_CHECK(fd >= 0, "cannot ", rank == 0 ? "create " : "open ", path, ": ", std::strerror(errno));
  if (rank == 0 && ftruncate(fd, static_cast<off_t>(bytes_)) != 0) {
    const int err = errno;
    close(fd);
    TORCH_CHECK(false, "cannot size ", path, " to ", bytes_, " bytes: ", std::strerror(err));
  }
  struct stat st;
  TORCH_CHECK(fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == bytes_, path, " is not ", bytes_, " bytes");
  void* mem = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  TORCH_CHECK(mem != MAP_FAILED, "cannot map ", path, ": ", std::strerror(errno));
  base_ = static_cast<uint8_t*>(mem);
  Control* c = control(base_);
  if (rank == 0) {
    c->world = static_cast<uint32_t>(world);
    c->capacity = static_cast<uint64_t>(capacity);
    __atomic_store_n(&c->magic, kMagic, __ATOMIC_RELEASE);
  } else {
    TORCH_CHECK(__atomic_load_n(&c->magic, __ATOMIC_ACQUIRE) == kMagic && c->world == world &&
                    c->capacity == static_cast<uint64_t>(capacity),
                path, " is not a segment of ", world, " ranks of ", capacity, " floats");
  }
  __atomic_store_n(&line(base_, rank)->pid, static_cast<int32_t>(getpid()), __ATOMIC_RELEASE);
}

ShmAllReduce::~ShmAllReduce() {
  if (base_ != nullptr) munmap(base_, bytes_);
}

float* ShmAllReduce::buffer(uint32_t seq, int64_t rank) const {
  return reinterpret_cast<float*>(base_ + kDataOffset) + ((seq & 1u) * world_ + rank) * capacity_;
}

int64_t ShmAllReduce::fail(int64_t status, std::string message) {
  status_ = status;
  error_ = std::move(message);
  return status;
}

void ShmAllReduce::abort() {
  __atomic_store_n(&control(base_)->abort, 1u, __ATOMIC_SEQ_CST);
  for (int64_t r = 0; r < world_; ++r) futex_wake_all(&line(base_, r)->arrived);
}

int64_t ShmAllReduce::wait_for(int64_t peer, uint32_t seq, int64_t deadline_ns) {
  RankLine* l = line(base_, peer);
  uint32_t* arrived = &l->arrived;
  if (reached(__atomic_load_n(arrived, __ATOMIC_ACQUIRE), seq)) return kReduceOk;
  const int64_t start = now_ns();
  const int64_t spin_until = start + static_cast<int64_t>(spin_us_ * 1e3);
  const int64_t yield_until = start + static_cast<int64_t>(yield_us_ * 1e3);
  for (int i = 0;; ++i) {  // spin: the peer is most likely a few microseconds away
    for (int j = 0; j < 64; ++j) {
      if (reached(__atomic_load_n(arrived, __ATOMIC_ACQUIRE), seq)) return kReduceOk;
      cpu_relax();
    }
    if (now_ns() >= spin_until) break;
  }
  while (now_ns() < yield_until) {  // then give the core to whoever wants it, the peer perhaps
    sched_yield();
    if (reached(__atomic_load_n(arrived, __ATOMIC_ACQUIRE), seq)) return kReduceOk;
  }
  int64_t next_check = 0;
  // The arrival wakes a sleeper (it sees `waiters`), so the slices only pace the checks below;
  // they grow to 100 ms, so a rank idle for hours between steps wakes ten times a second.
  int64_t slice_ns = 1000000;
  for (;;) {  // then sleep until it arrives, checking what could keep it from ever arriving
    __atomic_fetch_add(&l->waiters, 1u, __ATOMIC_SEQ_CST);
    const uint32_t have = __atomic_load_n(arrived, __ATOMIC_SEQ_CST);
    if (!reached(have, seq)) futex_wait(arrived, have, slice_ns);
    slice_ns = std::min<int64_t>(2 * slice_ns, 100000000);
    __atomic_fetch_sub(&l->waiters, 1u, __ATOMIC_SEQ_CST);
    if (reached(__atomic_load_n(arrived, __ATOMIC_ACQUIRE), seq)) return kReduceOk;
    if (__atomic_load_n(&control(base_)->abort, __ATOMIC_ACQUIRE)) {
      return fail(kReduceAborted, "the shared-memory all-reduce was aborted: a tensor-parallel rank is gone");
    }
    const int64_t now = now_ns();
    if (now >= next_check) {
      next_check = now + 100000000;  // every 100 ms: a /proc read
      const int32_t pid = __atomic_load_n(&l->pid, __ATOMIC_ACQUIRE);
      if (process_gone(pid)) {
        return fail(kReducePeerGone, "tensor-parallel rank " + std::to_string(peer) + " (pid " + std::to_string(pid) +
                                         ") ended while rank " + std::to_string(rank_) +
                                         " waited for it in the shared-memory all-reduce");
      }
    }
    if (deadline_ns >= 0 && now >= deadline_ns) {
      char seconds[32];
      std::snprintf(seconds, sizeof(seconds), "%.1f", timeout_s_);
      return fail(kReduceTimeout, "tensor-parallel rank " + std::to_string(peer) + " did not reach the all-reduce "
                                      "within " + seconds + " s (rank " + std::to_string(rank_) + " waited)");
    }
  }
}

int64_t ShmAllReduce::arrive_and_wait(bool idle) {
  if (status_ != kReduceOk) return status_;
  if (__atomic_load_n(&control(base_)->abort, __ATOMIC_ACQUIRE)) {
    return fail(kReduceAborted, "the shared-memory all-reduce was aborted: a tensor-parallel rank is gone");
  }
  RankLine* mine = line(base_, rank_);
  __atomic_store_n(&mine->arrived, seq_, __ATOMIC_SEQ_CST);
  if (__atomic_load_n(&mine->waiters, __ATOMIC_SEQ_CST) != 0) futex_wake_all(&mine->arrived);
  const int64_t deadline = idle ? -1 : now_ns() + static_cast<int64_t>(timeout_s_ * 1e9);
  for (int64_t peer = 0; peer < world_; ++peer) {
    if (peer == rank_) continue;
    const int64_t st = wait_for(peer, seq_, deadline);
    if (st != kReduceOk) return st;
  }
  return kReduceOk;
}

int64_t ShmAllReduce::reduce(float* x, int64_t n) {
  const int64_t start = now_ns();
  for (int64_t off = 0; off < n; off += capacity_) {
    const int64_t m = std::min(capacity_, n - off);
    ++seq_;
    std::memcpy(buffer(seq_, rank_), x + off, sizeof(float) * m);
    const int64_t st = arrive_and_wait(false);
    if (st != kReduceOk) return st;
    // The sum in rank order, the same adds on every rank.
    float* out = x + off;
    std::memcpy(out, buffer(seq_, 0), sizeof(float) * m);
    for (int64_t r = 1; r < world_; ++r) {
      const float* b = buffer(seq_, r);
#pragma omp simd
      for (int64_t i = 0; i < m; ++i) out[i] += b[i];
    }
  }
  nanos_ += now_ns() - start;
  return kReduceOk;
}

int64_t ShmAllReduce::gather(const float* x, int64_t n, float* out) {
  const int64_t start = now_ns();
  for (int64_t off = 0; off < n; off += capacity_) {
    const int64_t m = std::min(capacity_, n - off);
    ++seq_;
    std::memcpy(buffer(seq_, rank_), x + off, sizeof(float) * m);
    const int64_t st = arrive_and_wait(false);
    if (st != kReduceOk) return st;
    if (rank_ == 0) {
      for (int64_t r = 0; r < world_; ++r) std::memcpy(out + r * n + off, buffer(seq_, r), sizeof(float) * m);
    }
  }
  nanos_ += now_ns() - start;
  return kReduceOk;
}

int64_t ShmAllReduce::broadcast(uint8_t* data, int64_t nbytes, bool idle) {
  // Every rank arrives at every chunk's sequence number, as in reduce: the two-set argument
  // holds (rank 0 rewrites a set only after every rank has moved past reading it).
  const int64_t chunk = capacity_ * static_cast<int64_t>(sizeof(float));
  for (int64_t off = 0; off < nbytes; off += chunk) {
    const int64_t m = std::min(chunk, nbytes - off);
    ++seq_;
    uint8_t* slot = reinterpret_cast<uint8_t*>(buffer(seq_, 0));
    if (rank_ == 0) std::memcpy(slot, data + off, m);
    const int64_t st = arrive_and_wait(idle && off == 0);
    if (st != kReduceOk) return st;
    if (rank_ != 0) std::memcpy(data + off, slot, m);
  }
  return kReduceOk;
}

int64_t ShmAllReduce::exchange(const uint8_t* send, const int64_t* send_counts, int64_t row_bytes,
                               int64_t* recv_counts, const std::function<uint8_t*(int64_t)>& allocate) {
  const int64_t start_ns = now_ns();
  const int64_t chunk = capacity_ * static_cast<int64_t>(sizeof(float));
  const int64_t header = world_ * static_cast<int64_t>(sizeof(int64_t));
  int64_t sent_rows = 0;
  for (int64_t r = 0; r < world_; ++r) sent_rows += send_counts[r];
  const int64_t length = header + sent_rows * row_bytes;  // my stream: header, then my rows
  // Per peer: where my rows start in its stream, how many bytes, where they go in `recv`.
  std::vector<int64_t> from(world_), size(world_), to(world_), stream(world_);
  uint8_t* recv = nullptr;
  int64_t rounds = 1;
  for (int64_t round = 0; round < rounds; ++round) {
    const int64_t off = round * chunk;
    ++seq_;
    uint8_t* mine = reinterpret_cast<uint8_t*>(buffer(seq_, rank_));
    for (int64_t i = off; i < std::min(length, off + chunk);) {  // my stream's bytes [off, off + chunk)
      const int64_t end = std::min(length, off + chunk);
      if (i < header) {
        const int64_t n = std::min(header, end) - i;
        std::memcpy(mine + (i - off), reinterpret_cast<const uint8_t*>(send_counts) + i, n);
        i += n;
      } else {
        std::memcpy(mine + (i - off), send + (i - header), end - i);
        i = end;
      }
    }
    const int64_t st = arrive_and_wait(false);
    if (st != kReduceOk) return st;
    if (round == 0) {  // every peer's header is in its first chunk (a chunk holds 1 MiB, 62 ranks at most)
      int64_t total = 0;
      for (int64_t r = 0; r < world_; ++r) {
        const int64_t* counts = reinterpret_cast<const int64_t*>(buffer(seq_, r));
        int64_t before = 0, all = 0;
        for (int64_t d = 0; d < world_; ++d) {
          if (d < rank_) before += counts[d];
          all += counts[d];
        }
        recv_counts[r] = counts[rank_];
        from[r] = header + before * row_bytes;
        size[r] = counts[rank_] * row_bytes;
        to[r] = total;
        total += size[r];
        stream[r] = header + all * row_bytes;
        rounds = std::max(rounds, (stream[r] + chunk - 1) / chunk);
      }
      recv = allocate(total);
    }
    for (int64_t r = 0; r < world_; ++r) {  // the overlap of my part of r's stream with this chunk
      const int64_t lo = std::max(from[r], off), hi = std::min(from[r] + size[r], off + chunk);
      if (lo < hi) {
        std::memcpy(recv + to[r] + (lo - from[r]), reinterpret_cast<uint8_t*>(buffer(seq_, r)) + (lo - off),
                    hi - lo);
      }
    }
  }
  nanos_ += now_ns() - start_ns;
  return kReduceOk;
}

std::tuple<int64_t, at::Tensor> ShmAllReduce::all_to_all(at::Tensor send, at::Tensor send_counts,
                                                         at::Tensor recv_counts) {
  TORCH_CHECK(send.device().is_cpu() && send.is_contiguous() && send.dim() >= 1,
              "the all-to-all's rows must be a contiguous CPU tensor of at least one dimension");
  for (const at::Tensor* counts : {&send_counts, &recv_counts}) {
    TORCH_CHECK(counts->device().is_cpu() && counts->scalar_type() == at::kLong && counts->is_contiguous() &&
                    counts->numel() == world_,
                "the all-to-all's counts must be contiguous int64 CPU tensors of ", world_, " (the world)");
  }
  const int64_t* counts = send_counts.data_ptr<int64_t>();
  int64_t rows = 0;
  for (int64_t r = 0; r < world_; ++r) {
    TORCH_CHECK(counts[r] >= 0, "the all-to-all's send_counts must not be negative");
    rows += counts[r];
  }
  TORCH_CHECK(rows == send.size(0), "the all-to-all's send_counts add up to ", rows, " rows, the tensor has ",
              send.size(0));
  int64_t row_bytes = send.element_size();
  for (int64_t d = 1; d < send.dim(); ++d) row_bytes *= send.size(d);
  std::vector<int64_t> shape = send.sizes().vec();
  at::Tensor out;
  int64_t* received = recv_counts.data_ptr<int64_t>();
  const int64_t st = exchange(static_cast<const uint8_t*>(send.data_ptr()), counts, row_bytes, received,
                              [&](int64_t) {
                                shape[0] = 0;
                                for (int64_t r = 0; r < world_; ++r) shape[0] += received[r];
                                out = at::empty(shape, send.options());
                                return static_cast<uint8_t*>(out.data_ptr());
                              });
  if (st != kReduceOk) return {st, at::empty({0}, send.options())};
  return {kReduceOk, out};
}

int64_t ShmAllReduce::broadcast_from_first(at::Tensor t, bool idle) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "the broadcast's tensor must be a contiguous CPU tensor");
  return broadcast(static_cast<uint8_t*>(t.data_ptr()), static_cast<int64_t>(t.nbytes()), idle);
}

int64_t ShmAllReduce::all_reduce(at::Tensor t) {
  check_tensor(t, "the all-reduce's tensor");
  return reduce(t.data_ptr<float>(), t.numel());
}

int64_t ShmAllReduce::gather_to_first(at::Tensor local, at::Tensor out) {
  check_tensor(local, "the gather's tensor");
  if (rank_ == 0) {
    check_tensor(out, "the gather's output");
    TORCH_CHECK(out.numel() == world_ * local.numel(), "the gather's output must hold world x ", local.numel(),
                " floats");
  }
  return gather(local.data_ptr<float>(), local.numel(), rank_ == 0 ? out.data_ptr<float>() : nullptr);
}

void register_shm_all_reduce(torch::Library& m) {
  m.class_<tokenmill_cpu::ShmAllReduce>("ShmAllReduce")
      .def(torch::init<std::string, int64_t, int64_t, int64_t, double, double, double>())
      .def("all_reduce", &tokenmill_cpu::ShmAllReduce::all_reduce)
      .def("gather_to_first", &tokenmill_cpu::ShmAllReduce::gather_to_first)
      .def("broadcast_from_first", &tokenmill_cpu::ShmAllReduce::broadcast_from_first)
      .def("all_to_all", &tokenmill_cpu::ShmAllReduce::all_to_all)
      .def("abort", &tokenmill_cpu::ShmAllReduce::abort)
      .def("status", &tokenmill_cpu::ShmAllReduce::status)
      .def("last_error", &tokenmill_cpu::ShmAllReduce::last_error)
      .def("seconds", &tokenmill_cpu::ShmAllReduce::seconds)
      .def("reset_seconds", &tokenmill_cpu::ShmAllReduce::reset_seconds);
}

}  // namespace tokenmill_cpu
