// The avx2 GEMM backend: A and B each f32, bf16 or f16 on CPUs with AVX2, FMA
// and F16C and no AVX-512, 6 x 16 f32 FMA register blocks
// (gemm_avx2_micro.hpp) over the blocked GEMM of gemm_blocked.hpp. There oneDNN 2.6 has no bf16 matmul at
// all ("could not create a primitive descriptor" on a Zen 2/3 or an
// AVX2-only Intel part), its f16 one needs AVX512-FP16, and its f32 matmul's
// result for a row depends on the row's place in the call (measured on a
// Zen 3: BatchInvariance fails), so all run here.
//
// bf16 and f16 operands are widened to f32 while they are packed (a bf16
// value is the top half of an f32: a shift, exact; an f16 is an f32 too:
// vcvtph2ps), and the product runs as an f32 GEMM with FMA: every product of
// two bf16 values is exact in f32, so this is the bf16 GEMM with f32
// accumulation the other backends compute. Each element
// of C is one FMA chain over k ascending, then + bias, then + C when
// accumulating, whatever M, N, the blocking or the element's position: a
// row's result does not depend on its batch (GemmTraits::m_independent).
// Like every backend of ours it runs on the calling thread; a caller that
// wants threads splits C (the unfused baseline splits its columns).
//
// This file alone is compiled with AVX2, FMA and F16C; nothing here runs unless
// avx2_gemm_usable() (gemm_registry.cpp, compiled for any x86-64) found them.
#include "kernels/gemm_avx2_micro.hpp"
#include "kernels/gemm_blocked.hpp"

namespace grpo::kernels {

std::unique_ptr<GemmBackend> detail::make_avx2_gemm_on_cpu(const GemmSpec& spec) {
  if (!blocked::serves_widened(spec)) return nullptr;
  return std::make_unique<blocked::BlockedGemm<blocked::Avx2Micro>>(spec);
}

}  // namespace grpo::kernels
