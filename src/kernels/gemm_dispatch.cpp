// The GEMM backends' CPU gates (on cpu.hpp's one probe), compiled for any x86-64 (as
// dispatch.cpp is for the stage kernels): a backend's own file is compiled
// for its ISA, and the compiler may use that ISA anywhere in it, before any
// check (an ASan build used AVX-512 in make_amx_gemm's prologue, and a Zen 3
// died of SIGILL there). So nothing of those files runs until a gate here
// said the CPU (and the OS) has what they need.
#include "kernels/cpu.hpp"
#include "kernels/gemm.hpp"
#include "kernels/gemm_backend.hpp"

namespace grpo::kernels {

bool amx_usable() { return amx_state().usable; }
const char* amx_unusable_reason() { return amx_state().reason; }
bool avx512_bf16_usable() { return cpu_features().avx512_bf16; }
bool avx512_fma_usable() { return cpu_features().avx512; }

bool avx512_fma_is_default() {
  // Intel's cores run vdpbf16ps zmm at a quarter of their f32 FMA
  // instruction rate, half its FLOP rate: on a Xeon of model 207 (Emerald
  // Rapids) without AMX, one thread measured 92.6-103 GFLOP/s of vdpbf16ps
  // against 191-207 of FMA. AMD's Zen 4 and Zen 5 run it at twice the FMA's
  // FLOPs. Intel's AVX-512 CPUs without AVX512-BF16 (Skylake to Ice Lake)
  // had oneDNN 2.6 here.
  return cpu_features().avx512 && cpu_features().intel;
}

bool avx2_gemm_usable() { return cpu_features().avx2 && cpu_features().fma; }

bool avx2_gemm_is_default() { return avx2_gemm_usable() && !(cpu_features().cpuid_avx512f && cpu_features().os_zmm); }

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
