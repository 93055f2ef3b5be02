#include "cpu_features.hpp"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace grpo::bench {
namespace {

// arch_prctl codes and the XSAVE feature number of the AMX tile data
// (linux/arch/x86/include/uapi/asm/prctl.h; Intel SDM vol. 1, 13.2).
constexpr int kArchGetXcompPerm = 0x1022;
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

// XCR0 bits the OS sets when it saves a register state on context switch.
constexpr std::uint64_t kXcr0Avx = (1U << 1) | (1U << 2);                 // SSE, AVX (ymm upper halves)
constexpr std::uint64_t kXcr0Avx512 = (1U << 5) | (1U << 6) | (1U << 7);  // opmask, zmm0-15 upper, zmm16-31
constexpr std::uint64_t kXcr0Amx = (1U << 17) | (1U << 18);               // XTILECFG, XTILEDATA

struct Regs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};

Regs cpuid(unsigned leaf, unsigned subleaf) {
  Regs r;
  if (__get_cpuid_count(leaf, subleaf, &r.a, &r.b, &r.c, &r.d) == 0) return {};
  return r;
}

std::uint64_t xcr0() {
  unsigned lo = 0, hi = 0;
  // xgetbv by its encoding: no -mxsave needed on this file.
  __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<std::uint64_t>(hi) << 32) | lo;
}

bool bit(unsigned reg, int n) { return ((reg >> n) & 1U) != 0; }

void note(std::string& missing, const char* unit, const char* why) {
  if (!missing.empty()) missing += "; ";
  missing += std::string(unit) + ": " + why;
}

// Linux keeps the AMX tile data state off until a process asks for it (the
// first tile instruction would otherwise fault).
bool amx_permitted() {
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
  unsigned long granted = 0;
  return syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) == 0 && ((granted >> kXfeatureXtiledata) & 1U) != 0;
}

}  // namespace

CpuFeatures detect_cpu_features() {
  CpuFeatures f;
  const Regs leaf1 = cpuid(1, 0);
  const bool osxsave = bit(leaf1.c, 27);
  const std::uint64_t xcr = osxsave ? xcr0() : 0;
  const bool os_avx512 = (xcr & (kXcr0Avx | kXcr0Avx512)) == (kXcr0Avx | kXcr0Avx512);
  const bool os_amx = (xcr & kXcr0Amx) == kXcr0Amx;
  const unsigned max_leaf = cpuid(0, 0).a;
  const Regs leaf7 = max_leaf >= 7 ? cpuid(7, 0) : Regs{};
  const Regs leaf7_1 = max_leaf >= 7 && leaf7.a >= 1 ? cpuid(7, 1) : Regs{};

  const bool os_avx = (xcr & kXcr0Avx) == kXcr0Avx;
  const bool cpu_avx2_fma = bit(leaf1.c, 12) && bit(leaf7.b, 5);  // FMA, AVX2
  const bool cpu_avx512f = bit(leaf7.b, 16);
  const bool cpu_avx512_bf16 = bit(leaf7_1.a, 5);
  const bool cpu_amx = bit(leaf7.d, 22) && bit(leaf7.d, 24);  // AMX-BF16, AMX-TILE

  f.avx2_fma = cpu_avx2_fma && os_avx;
  if (!cpu_avx2_fma) note(f.missing, "f32 FMA ymm (avx2, fma)", "not in cpuid");
  if (cpu_avx2_fma && !os_avx) note(f.missing, "f32 FMA ymm (avx2, fma)", "ymm state not enabled by the OS (XCR0)");
  f.avx512f = cpu_avx512f && os_avx512;
  if (!cpu_avx512f) note(f.missing, "f32 FMA zmm (avx512f)", "not in cpuid");
  if (cpu_avx512f && !os_avx512) note(f.missing, "f32 FMA zmm (avx512f)", "zmm state not enabled by the OS (XCR0)");
  f.avx512_bf16 = f.avx512f && cpu_avx512_bf16;
  if (!cpu_avx512_bf16) note(f.missing, "avx512_bf16", "not in cpuid");
  if (!cpu_amx) {
    note(f.missing, "amx_bf16", "not in cpuid");
  } else if (!os_amx) {
    note(f.missing, "amx_bf16", "tile state not enabled by the OS (XCR0)");
  } else if (!amx_permitted()) {
    note(f.missing, "amx_bf16", "arch_prctl(ARCH_REQ_XCOMP_PERM) refused");
  } else {
    f.amx_bf16 = true;
  }
  return f;
}

}  // namespace grpo::bench
