// The CPU probe: what the CPU and the OS let this process execute, read once
// (cpuid, xgetbv, and for AMX the arch_prctl tile-state request) and shared
// by every ISA gate: the stage-kernel sets (dispatch.cpp), the GEMM backends
// (gemm_registry.cpp) and the microbench's peak probe. Compiled for any
// x86-64; nothing here uses the ISAs it looks for.
#pragma once

namespace grpo::kernels {

struct CpuFeatures {
  // In cpuid alone (whether or not the OS saves the registers).
  bool cpuid_avx2_fma = false;     // AVX2 and FMA
  bool cpuid_avx512f = false;      // AVX-512F
  bool cpuid_avx512_bf16 = false;  // AVX512-BF16
  bool cpuid_amx_bf16 = false;     // AMX-TILE and AMX-BF16
  // The OS saves the state (XCR0): ymm; opmask and zmm; the AMX tiles.
  bool os_ymm = false;
  bool os_zmm = false;
  bool os_tiles = false;

  // Usable: in cpuid and saved by the OS.
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512 = false;  // AVX-512F/BW/DQ/VL
  bool avx512_bf16 = false;
  bool intel = false;  // GenuineIntel (the avx512fma backend's default, gemm_registry.cpp)
};

// Read once, on the first call; no side effect.
const CpuFeatures& cpu_features();

// AMX-BF16 with AVX512-BF16 and the tile state saved and granted to this
// process; else why not. Asks Linux for the tile state (arch_prctl
// ARCH_REQ_XCOMP_PERM, Linux >= 5.16) on the first call, so only the AMX
// gates call it; the permission is process-wide.
struct AmxState {
  bool usable = false;
  const char* reason = "";
};
const AmxState& amx_state();

}  // namespace grpo::kernels
