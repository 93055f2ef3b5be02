// The avx512fma GEMM backend: f32 FMA register blocks on widened bf16 or
// f16 (gemm_avx512_micro.hpp) over the blocked GEMM of gemm_blocked.hpp:
// bf16 A and B (serves()), and A and B each f32, bf16 or f16 with at least
// one f16 (serves_f16_mix()), each operand packed into the same f32 layouts
// from its own dtype (gemm_pack_avx512.hpp). f32 A and B are not taken: they
// stay with oneDNN, as before f16 came.
//
// This file alone is compiled with AVX-512F/BW/DQ/VL and without
// AVX512-BF16, so it runs on AVX-512 CPUs that lack it (a bf16 C is rounded
// in integer instructions there, gemm_epilogue_avx512.hpp's put); the CPU probe and
// the gate are in gemm_registry.cpp.
#include "kernels/gemm_avx512_micro.hpp"
#include "kernels/gemm_blocked.hpp"

namespace grpo::kernels {

std::unique_ptr<GemmBackend> detail::make_avx512_fma_gemm_on_cpu(const GemmSpec& spec) {
  if (!blocked::serves(spec) && !blocked::serves_f16_mix(spec)) return nullptr;
  return std::make_unique<blocked::BlockedGemm<blocked::Avx512Micro<true>>>(spec);
}

}  // namespace grpo::kernels
