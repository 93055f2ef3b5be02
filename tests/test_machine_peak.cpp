// The machine-peak probe (microbench/machine_peak.hpp): it finds the units
// the kernel reports, measures each one it finds, and its numbers are
// physically possible. A short probe (1 thread, ~0.4 s in all) keeps the
// fast tier fast.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>

#include "cpu_features.hpp"
#include "machine_peak.hpp"

namespace grpo::bench {
namespace {

// The kernel's view of the CPU: the "flags" line of /proc/cpuinfo (it lists
// an ISA extension only when it also enabled its register state).
bool cpuinfo_has(const std::string& flag) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::string w;
    while (words >> w) {
      if (w == flag) return true;
    }
    return false;
  }
  return false;
}

// No x86 core issues more than two 512-bit FMA-class instructions per cycle
// or runs above 6 GHz; AMX retires at most one tdpbf16ps per 16 cycles on
// Sapphire / Granite Rapids, and 8 leaves room for a faster successor. A
// probe that miscounts FLOPs per instruction or per trip lands above these.
constexpr double kMaxGhz = 6.0;
constexpr double kMaxF32FmaGflopsPerThread = 2 * 32 * kMaxGhz;
constexpr double kMaxBf16DotGflopsPerThread = 2 * 64 * kMaxGhz;
constexpr double kMaxAmxGflopsPerThread = 16384.0 / 8 * kMaxGhz;

TEST(MachinePeak, FeaturesMatchTheKernelsFlags) {
  const CpuFeatures f = detect_cpu_features();
  EXPECT_EQ(f.avx2_fma, cpuinfo_has("avx2") && cpuinfo_has("fma")) << f.missing;
  EXPECT_EQ(f.avx512f, cpuinfo_has("avx512f")) << f.missing;
  EXPECT_EQ(f.avx512_bf16, cpuinfo_has("avx512_bf16")) << f.missing;
  // AMX also needs the per-process permission; a refusal must say so.
  const bool amx_listed = cpuinfo_has("amx_bf16") && cpuinfo_has("amx_tile");
  if (f.amx_bf16) EXPECT_TRUE(amx_listed);
  if (amx_listed && !f.amx_bf16) EXPECT_NE(f.missing.find("amx_bf16"), std::string::npos);
  EXPECT_EQ(f.missing.empty(), f.avx2_fma && f.avx512f && f.avx512_bf16 && f.amx_bf16) << f.missing;
}

TEST(MachinePeak, MeasuresEveryPresentUnitWithinPhysicalBounds) {
  const CpuFeatures f = detect_cpu_features();
  const MachinePeak p = measure_machine_peak({.threads = 1, .seconds = 0.05, .repetitions = 2});
  EXPECT_EQ(p.threads, 1);
  EXPECT_EQ(p.missing, f.missing);
  // Present -> measured (a broken chain reports 0, see machine_peak.cpp);
  // absent -> exactly 0.
  EXPECT_EQ(p.f32_fma_gflops > 0.0, f.avx512f || f.avx2_fma) << p.f32_fma_gflops;
  EXPECT_EQ(p.avx512_bf16_gflops > 0.0, f.avx512_bf16) << p.avx512_bf16_gflops;
  EXPECT_EQ(p.amx_bf16_gflops > 0.0, f.amx_bf16) << p.amx_bf16_gflops;
  EXPECT_LE(p.f32_fma_gflops, kMaxF32FmaGflopsPerThread);
  EXPECT_LE(p.avx512_bf16_gflops, kMaxBf16DotGflopsPerThread);
  EXPECT_LE(p.amx_bf16_gflops, kMaxAmxGflopsPerThread);
  // One tdpbf16ps is 256 times the work of one vdpbf16ps; even at a sixteenth
  // of the issue rate (16 cycles against 1) AMX must come out far ahead.
  if (f.amx_bf16 && f.avx512_bf16) EXPECT_GT(p.amx_bf16_gflops, 4 * p.avx512_bf16_gflops);
  // No check that vdpbf16ps beats vfmadd231ps: it does twice the FLOPs per
  // instruction, but Sapphire Rapids issues it at about a quarter of the FMA
  // rate (measured here: ~124 against ~247 GFLOP/s on one thread).
  // f32 runs are measured against FMA, bf16 runs against the fastest unit
  // that could run them (widened to f32, FMA can).
  EXPECT_EQ(p.for_dtype(DType::bf16), std::max({p.avx512_bf16_gflops, p.amx_bf16_gflops, p.f32_fma_gflops}));
  EXPECT_EQ(p.for_dtype(DType::f32), p.f32_fma_gflops);
}

}  // namespace
}  // namespace grpo::bench
