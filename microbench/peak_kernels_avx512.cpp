// The AVX-512 chains of peak_kernels.hpp. This file alone is compiled with
// -mavx512f -mavx512bf16 (microbench/CMakeLists.txt); nothing here runs
// unless the probe found those units at run time.
#include <immintrin.h>

#include "peak_kernels.hpp"

namespace grpo::bench {
namespace {

// Stored and summed in scalar code: _mm512_reduce_add_ps trips GCC 12's
// -Wuninitialized false positive on its own _mm512_undefined_* helpers.
float lane_sum(const __m512 (&acc)[kZmmChains]) {
  __m512 s = acc[0];
  for (int k = 1; k < kZmmChains; ++k) s = _mm512_add_ps(s, acc[k]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, s);
  float sum = 0.0F;
  for (float v : lanes) sum += v;
  return sum;
}

}  // namespace

float f32_fma_chains(std::int64_t iterations) {
  // acc = acc * 0.999 + 0.001 converges to 1: no overflow and no subnormals
  // however long it runs, and no multiplier the compiler could fold away.
  const __m512 mul = _mm512_set1_ps(0.999F);
  const __m512 add = _mm512_set1_ps(0.001F);
  __m512 acc[kZmmChains];
  for (int k = 0; k < kZmmChains; ++k) acc[k] = _mm512_set1_ps(static_cast<float>(k));
  for (std::int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 12
    for (int k = 0; k < kZmmChains; ++k) acc[k] = _mm512_fmadd_ps(acc[k], mul, add);
  }
  return lane_sum(acc);
}

float avx512_bf16_chains(std::int64_t iterations) {
  // Each lane gains 2 * 2^-10 * 2^-10 per instruction: ~2e-6, so a few
  // million trips per call stay far from overflow.
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0x1p-10F), _mm512_set1_ps(0x1p-10F));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0x1p-10F), _mm512_set1_ps(0x1p-10F));
  __m512 acc[kZmmChains];
  for (int k = 0; k < kZmmChains; ++k) acc[k] = _mm512_set1_ps(static_cast<float>(k));
  for (std::int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 12
    for (int k = 0; k < kZmmChains; ++k) acc[k] = _mm512_dpbf16_ps(acc[k], a, b);
  }
  return lane_sum(acc);
}

}  // namespace grpo::bench
