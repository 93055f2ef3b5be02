// What the CPU and the OS let this process execute, read at run time (cpuid
// and xgetbv), for the machine-peak probe: a unit is only measured when the
// CPU has it AND the OS saves its registers (XCR0) AND, for AMX, the kernel
// granted this process the tile data state.
#pragma once

#include <string>

namespace grpo::bench {

struct CpuFeatures {
  bool avx2_fma = false;     // vfmadd231ps ymm
  bool avx512f = false;      // vfmadd231ps zmm
  bool avx512_bf16 = false;  // vdpbf16ps zmm
  bool amx_bf16 = false;     // tdpbf16ps (AMX-TILE + AMX-BF16, tile state enabled and permitted)
  // Why a unit is unavailable, e.g. "amx_bf16: not in cpuid"; empty when all are.
  std::string missing;
};

// Reads cpuid / XCR0 and, when the CPU has AMX, asks the kernel for the tile
// data state (arch_prctl ARCH_REQ_XCOMP_PERM; Linux >= 5.16). The permission
// is process-wide and idempotent, so calling this again is harmless.
CpuFeatures detect_cpu_features();

}  // namespace grpo::bench
