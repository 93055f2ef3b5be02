// The 256-bit FMA chain of peak_kernels.hpp, for CPUs without AVX-512 (and
// for those whose 512-bit FMA runs at a lower clock or on one port only,
// where ymm can retire as many FLOPs). This file alone is compiled with
// -mavx2 -mfma (microbench/CMakeLists.txt).
#include <immintrin.h>

#include "peak_kernels.hpp"

namespace grpo::bench {

float f32_fma_ymm_chains(std::int64_t iterations) {
  // As f32_fma_chains: acc = acc * 0.999 + 0.001 stays normal forever.
  const __m256 mul = _mm256_set1_ps(0.999F);
  const __m256 add = _mm256_set1_ps(0.001F);
  __m256 acc[kZmmChains];
  for (int k = 0; k < kZmmChains; ++k) acc[k] = _mm256_set1_ps(static_cast<float>(k));
  for (std::int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 12
    for (int k = 0; k < kZmmChains; ++k) acc[k] = _mm256_fmadd_ps(acc[k], mul, add);
  }
  __m256 s = acc[0];
  for (int k = 1; k < kZmmChains; ++k) s = _mm256_add_ps(s, acc[k]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, s);
  float sum = 0.0F;
  for (float v : lanes) sum += v;
  return sum;
}

}  // namespace grpo::bench
