// The instruction set the quantized-weight kernels run, chosen at run time.
//
// The extension is compiled for the machine it runs on, but the kernels for each instruction
// set sit in the same build under `#pragma GCC target` sections, so one build holds them all
// and the CPU's own flags (cpuid) pick the best at the first call. A cap lowers the choice
// (set_isa, from TOKENMILL_CPU_ISA in Python): tests run every path the CPU has in one
// process, and an AVX-512 machine measures the AVX2 path.
#pragma once

#include <atomic>
#include <string>

namespace tokenmill_cpu {

enum class Isa : int {
  kPortable = 0,    // plain C++ loops
  kAvx2 = 1,        // AVX2 + FMA: 256-bit, integer dot products by vpmaddubsw
  kAvx512Vnni = 2,  // AVX-512 F/BW/VL + VNNI: 512-bit, integer dot products by vpdpbusd
};

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Vnni: return "avx512_vnni";
    case Isa::kAvx2: return "avx2";
    default: return "portable";
  }
}

// The best instruction set this CPU (and its OS, for the wide registers' state) supports.
inline Isa supported_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni")) {
    return Isa::kAvx512Vnni;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kPortable;
}

inline std::atomic<int>& isa_slot() {
  static std::atomic<int> slot{static_cast<int>(supported_isa())};
  return slot;
}

// What the kernels run now: the supported one unless capped lower.
inline Isa active_isa() { return static_cast<Isa>(isa_slot().load(std::memory_order_relaxed)); }

// Sets the instruction set by name; false (nothing changed) for an unknown name or one the
// CPU lacks.
inline bool set_isa(const std::string& name) {
  for (Isa isa : {Isa::kPortable, Isa::kAvx2, Isa::kAvx512Vnni}) {
    if (name == isa_name(isa)) {
      if (static_cast<int>(isa) > static_cast<int>(supported_isa())) return false;
      isa_slot().store(static_cast<int>(isa), std::memory_order_relaxed);
      return true;
    }
  }
  return false;
}

}  // namespace tokenmill_cpu
