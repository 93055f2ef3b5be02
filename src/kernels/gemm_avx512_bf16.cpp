// The avx512bf16 GEMM backend: vdpbf16ps register blocks
// (gemm_avx512_micro.hpp) over the blocked GEMM of gemm_blocked.hpp.
//
// This file alone is compiled with AVX-512F/BW/DQ/VL and AVX512-BF16; the
// CPU probe and the gate are in gemm_dispatch.cpp.
#include "kernels/gemm_avx512_micro.hpp"
#include "kernels/gemm_blocked.hpp"

namespace grpo::kernels {

std::unique_ptr<GemmBackend> detail::make_avx512_bf16_gemm_on_cpu(const GemmSpec& spec) {
  if (!blocked::serves(spec)) return nullptr;
  return std::make_unique<blocked::BlockedGemm<blocked::Avx512Micro<false>>>(spec);
}

}  // namespace grpo::kernels
