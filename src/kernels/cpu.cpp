#include "kernels/cpu.hpp"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace grpo::kernels {
namespace {

// arch_prctl codes and the XSAVE feature number of the AMX tile data
// (linux/arch/x86/include/uapi/asm/prctl.h; Intel SDM vol. 1, 13.2).
constexpr int kArchGetXcompPerm = 0x1022;
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;
// XCR0 bits the OS sets when it saves a register state on context switch
// (the same masks libgcc's __builtin_cpu_supports applies).
constexpr std::uint64_t kXcr0Ymm = (1U << 1) | (1U << 2);              // SSE, AVX (ymm upper halves)
constexpr std::uint64_t kXcr0Zmm = (1U << 5) | (1U << 6) | (1U << 7);  // opmask, zmm0-15 upper, zmm16-31
constexpr std::uint64_t kXcr0Tiles = (1U << 17) | (1U << 18);          // XTILECFG, XTILEDATA

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

// Linux keeps the tile data state off until a process asks (Linux >= 5.16).
const char* request_tiles() {
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    return "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)";
  }
  unsigned long granted = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) != 0 || ((granted >> kXfeatureXtiledata) & 1U) == 0) {
    return "Linux did not grant the AMX tile state";
  }
  return nullptr;
}

CpuFeatures probe() {
  CpuFeatures f;
  const Regs leaf0 = cpuid(0, 0);
  const Regs leaf1 = cpuid(1, 0);
  const Regs leaf7 = leaf0.a >= 7 ? cpuid(7, 0) : Regs{};
  const Regs leaf7_1 = leaf0.a >= 7 && leaf7.a >= 1 ? cpuid(7, 1) : Regs{};
  char vendor[13] = {};
  std::memcpy(vendor, &leaf0.b, 4);
  std::memcpy(vendor + 4, &leaf0.d, 4);
  std::memcpy(vendor + 8, &leaf0.c, 4);
  f.intel = std::strcmp(vendor, "GenuineIntel") == 0;

  const std::uint64_t xcr = bit(leaf1.c, 27) ? xcr0() : 0;  // OSXSAVE
  f.os_ymm = (xcr & kXcr0Ymm) == kXcr0Ymm;
  f.os_zmm = f.os_ymm && (xcr & kXcr0Zmm) == kXcr0Zmm;
  f.os_tiles = (xcr & kXcr0Tiles) == kXcr0Tiles;

  f.cpuid_avx2_fma = bit(leaf1.c, 12) && bit(leaf7.b, 5);
  f.cpuid_avx512f = bit(leaf7.b, 16);
  f.cpuid_avx512_bf16 = bit(leaf7_1.a, 5);
  f.cpuid_amx_bf16 = bit(leaf7.d, 22) && bit(leaf7.d, 24);

  f.avx2 = bit(leaf7.b, 5) && f.os_ymm;
  f.fma = bit(leaf1.c, 12) && f.os_ymm;
  f.f16c = bit(leaf1.c, 29);
  // F, DQ, BW, VL.
  f.avx512 = bit(leaf7.b, 16) && bit(leaf7.b, 17) && bit(leaf7.b, 30) && bit(leaf7.b, 31) && f.os_zmm;
  f.avx512_bf16 = f.avx512 && f.cpuid_avx512_bf16;

  return f;
}

AmxState probe_amx() {
  const CpuFeatures& f = cpu_features();
  if (!f.cpuid_amx_bf16) return {false, "the CPU has no AMX-BF16"};
  if (!f.cpuid_avx512f || !f.cpuid_avx512_bf16) return {false, "the CPU has no AVX512-BF16"};
  if (!f.avx512_bf16) return {false, "the OS does not save the AVX-512 state"};
  if (!f.os_tiles) return {false, "the OS does not save the AMX tile state"};
  if (const char* refused = request_tiles(); refused != nullptr) return {false, refused};
  return {true, ""};
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = probe();
  return f;
}

const AmxState& amx_state() {
  static const AmxState s = probe_amx();
  return s;
}

}  // namespace grpo::kernels
