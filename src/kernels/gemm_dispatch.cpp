// The GEMM backends' CPU probes and gates, compiled for any x86-64 (as
// dispatch.cpp is for the stage kernels): a backend's own file is compiled
// for its ISA, and the compiler may use that ISA anywhere in it, before any
// check (an ASan build used AVX-512 in make_amx_gemm's prologue, and a Zen 3
// died of SIGILL there). So nothing of those files runs until a probe here
// said the CPU (and the OS) has what they need.
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include "kernels/gemm.hpp"
#include "kernels/gemm_backend.hpp"

namespace grpo::kernels {
namespace {

// arch_prctl codes and the XSAVE feature number of the AMX tile data
// (linux/arch/x86/include/uapi/asm/prctl.h; Intel SDM vol. 1, 13.2).
constexpr int kArchGetXcompPerm = 0x1022;
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;
constexpr std::uint64_t kXcr0Amx = (1U << 17) | (1U << 18);  // XTILECFG, XTILEDATA
constexpr std::uint64_t kXcr0Avx512 = (1U << 1) | (1U << 2) | (1U << 5) | (1U << 6) | (1U << 7);

struct Cpu {
  bool usable = false;
  const char* reason = "";
};

std::uint64_t xcr0() {
  unsigned lo = 0, hi = 0;
  __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(lo), "=d"(hi) : "c"(0));  // xgetbv
  return (static_cast<std::uint64_t>(hi) << 32) | lo;
}

Cpu probe_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return {false, "no CPUID leaf 7"};
  const bool avx512 = ((b >> 16) & 1U) != 0 && ((b >> 30) & 1U) != 0;  // F, BW
  const bool amx_bf16 = ((d >> 22) & 1U) != 0;
  const bool amx_tile = ((d >> 24) & 1U) != 0;
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  const bool avx512_bf16 = __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) != 0 && ((a1 >> 5) & 1U) != 0;
  if (!amx_bf16 || !amx_tile) return {false, "the CPU has no AMX-BF16"};
  if (!avx512 || !avx512_bf16) return {false, "the CPU has no AVX512-BF16"};
  unsigned a0 = 0, b0 = 0, c0 = 0, d0 = 0;
  __get_cpuid(1, &a0, &b0, &c0, &d0);
  if (((c0 >> 27) & 1U) == 0) return {false, "the OS does not enable XSAVE"};
  const std::uint64_t x = xcr0();
  if ((x & kXcr0Avx512) != kXcr0Avx512) return {false, "the OS does not save the AVX-512 state"};
  if ((x & kXcr0Amx) != kXcr0Amx) return {false, "the OS does not save the AMX tile state"};
  // Linux keeps the tile data state off until a process asks (Linux >= 5.16);
  // the permission is process-wide.
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    return {false, "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"};
  }
  unsigned long granted = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) != 0 || ((granted >> kXfeatureXtiledata) & 1U) == 0) {
    return {false, "Linux did not grant the AMX tile state"};
  }
  return {true, ""};
}

const Cpu& amx_cpu() {
  static const Cpu c = probe_amx();
  return c;
}

// AVX-512F/DQ/BW/VL, and the OS saves the zmm state.
bool probe_avx512() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
  const bool f = ((b >> 16) & 1U) != 0, dq = ((b >> 17) & 1U) != 0, bw = ((b >> 30) & 1U) != 0,
             vl = ((b >> 31) & 1U) != 0;
  // libgcc's check that the OS saves the zmm state (XCR0) comes with avx512f.
  return f && dq && bw && vl && __builtin_cpu_supports("avx512f");
}

bool probe_avx512_bf16() {
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  const bool bf16 = __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) != 0 && ((a1 >> 5) & 1U) != 0;
  return bf16 && probe_avx512();
}

}  // namespace

bool amx_usable() { return amx_cpu().usable; }
const char* amx_unusable_reason() { return amx_cpu().reason; }

bool avx512_bf16_usable() {
  static const bool usable = probe_avx512_bf16();
  return usable;
}

bool avx512_fma_usable() {
  static const bool usable = probe_avx512();
  return usable;
}

bool avx512_fma_is_default() {
  // Intel's cores run vdpbf16ps zmm at a quarter of their f32 FMA
  // instruction rate, half its FLOP rate: on a Xeon of model 207 (Emerald
  // Rapids) without AMX, one thread measured 92.6-103 GFLOP/s of vdpbf16ps
  // against 191-207 of FMA. AMD's Zen 4 and Zen 5 run it at twice the FMA's
  // FLOPs. Intel's AVX-512 CPUs without AVX512-BF16 (Skylake to Ice Lake)
  // had oneDNN 2.6 here.
  static const bool preferred = avx512_fma_usable() && __builtin_cpu_is("intel");
  return preferred;
}

bool avx2_gemm_usable() {
  // libgcc's checks include the OS saving the ymm state (XCR0).
  static const bool usable = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return usable;
}

bool avx2_gemm_is_default() {
  static const bool preferred = avx2_gemm_usable() && !__builtin_cpu_supports("avx512f");
  return preferred;
}

std::unique_ptr<GemmBackend> make_amx_gemm(const GemmSpec& spec) {
  return amx_usable() ? detail::make_amx_gemm_on_cpu(spec) : nullptr;
}

std::unique_ptr<GemmBackend> make_avx512_bf16_gemm(const GemmSpec& spec) {
  return avx512_bf16_usable() ? detail::make_avx512_bf16_gemm_on_cpu(spec) : nullptr;
}

std::unique_ptr<GemmBackend> make_avx512_fma_gemm(const GemmSpec& spec) {
  return avx512_fma_usable() ? detail::make_avx512_fma_gemm_on_cpu(spec) : nullptr;
}

std::unique_ptr<GemmBackend> make_avx2_gemm(const GemmSpec& spec) {
  return avx2_gemm_usable() ? detail::make_avx2_gemm_on_cpu(spec) : nullptr;
}

}  // namespace grpo::kernels
