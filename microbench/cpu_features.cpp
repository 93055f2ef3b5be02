#include "cpu_features.hpp"

#include "kernels/cpu.hpp"

namespace grpo::bench {
namespace {

void note(std::string& missing, const char* unit, const char* why) {
  if (!missing.empty()) missing += "; ";
  missing += std::string(unit) + ": " + why;
}

}  // namespace

// On the library's one probe (src/kernels/cpu.hpp), with the peak probe's
// own wording of what is missing.
CpuFeatures detect_cpu_features() {
  const kernels::CpuFeatures& cpu = kernels::cpu_features();
  CpuFeatures f;
  f.avx2_fma = cpu.avx2 && cpu.fma;
  if (!cpu.cpuid_avx2_fma) note(f.missing, "f32 FMA ymm (avx2, fma)", "not in cpuid");
  if (cpu.cpuid_avx2_fma && !cpu.os_ymm) {
    note(f.missing, "f32 FMA ymm (avx2, fma)", "ymm state not enabled by the OS (XCR0)");
  }
  f.avx512f = cpu.cpuid_avx512f && cpu.os_zmm;
  if (!cpu.cpuid_avx512f) note(f.missing, "f32 FMA zmm (avx512f)", "not in cpuid");
  if (cpu.cpuid_avx512f && !cpu.os_zmm)
    note(f.missing, "f32 FMA zmm (avx512f)", "zmm state not enabled by the OS (XCR0)");
  f.avx512_bf16 = f.avx512f && cpu.cpuid_avx512_bf16;
  if (!cpu.cpuid_avx512_bf16) note(f.missing, "avx512_bf16", "not in cpuid");
  if (!cpu.cpuid_amx_bf16) {
    note(f.missing, "amx_bf16", "not in cpuid");
  } else if (!cpu.os_tiles) {
    note(f.missing, "amx_bf16", "tile state not enabled by the OS (XCR0)");
  } else if (!kernels::amx_state().usable) {
    note(f.missing, "amx_bf16", kernels::amx_state().reason);
  } else {
    f.amx_bf16 = true;
  }
  return f;
}

}  // namespace grpo::bench
