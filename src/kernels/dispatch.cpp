// Run-time choice of the stage-kernel set, and the two version queries of
// <grpo/version.hpp>. The choice is made once (a function-local static, so
// thread-safe) and never changes afterwards: every call in a process, and so
// every result, comes from the same ISA path.
#include <cstdlib>
#include <string_view>

#include "grpo/version.hpp"
#include "kernels/cpu.hpp"
#include "kernels/stage_kernels.hpp"

namespace grpo {
namespace kernels {
namespace detail {
// The function tables, defined next to their kernels. avx512_table() may
// only be called once the CPU is known to support AVX-512F/BW/DQ/VL, and
// avx2_table() once it is known to support AVX2, FMA and F16C.
const StageKernels& scalar_table();  // stage_kernels_scalar.cpp
const StageKernels& avx512_table();  // stage_kernels_avx512.cpp
const StageKernels& avx2_table();    // stage_kernels_avx2.cpp
}  // namespace detail

const StageKernels& scalar_kernels() { return detail::scalar_table(); }

const StageKernels* avx512_kernels() {
  // BW for the 16-bit masked loads/stores, DQ for vfpclassps, VL for the
  // 256-bit masked forms; FMA and F16C come with every AVX-512F CPU but the
  // file is compiled with -mfma -mf16c, so check them too (a VM may mask
  // flags). cpu.avx512 includes the OS saving the zmm state (XCR0).
  const CpuFeatures& cpu = cpu_features();
  const bool supported = cpu.avx512 && cpu.fma && cpu.f16c;
  return supported ? &detail::avx512_table() : nullptr;
}

const StageKernels* avx2_kernels() {
  // cpu.avx2 includes the OS saving the ymm state (XCR0).
  const CpuFeatures& cpu = cpu_features();
  const bool supported = cpu.avx2 && cpu.fma && cpu.f16c;
  return supported ? &detail::avx2_table() : nullptr;
}

const StageKernels& kernels() {
  static const StageKernels& chosen = []() -> const StageKernels& {
    const char* forced = std::getenv("GRPO_SIMD");
    const std::string_view force = forced != nullptr ? forced : "";
    if (force == "scalar") return scalar_kernels();
    const StageKernels* avx512 = force == "avx2" ? nullptr : avx512_kernels();
    if (avx512 != nullptr) return *avx512;
    const StageKernels* avx2 = avx2_kernels();
    return avx2 != nullptr ? *avx2 : scalar_kernels();
  }();
  return chosen;
}

}  // namespace kernels

const char* version() { return GRPO_VERSION_STRING; }

const char* simd_path() { return kernels::kernels().name; }

}  // namespace grpo
