// bf16.hpp's rounding on 8 lanes, in AVX2 integer instructions, bit for bit
// the scalar float_to_bf16<kNan>: each 32-bit lane holds its bf16 in the low
// half (the callers pack them). Only for translation units compiled with AVX2.
#pragma once

#include <immintrin.h>

#include "kernels/bf16.hpp"

namespace grpo::kernels {
namespace {  // one copy per translation unit: each is compiled for its own ISA

template <Bf16Nan kNan>
inline __m256i float_to_bf16x8_epi32(__m256 v) {
  static_assert(kNan != Bf16Nan::unchecked, "no AVX2 caller takes unchecked values");
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  if constexpr (kNan == Bf16Nan::quiet) {
    // 0x00400000 is the bf16 quiet bit (0x40) before the shift.
    const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000));
    return _mm256_srli_epi32(
        _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet), nan)), 16);
  } else {
    return _mm256_blendv_epi8(_mm256_srli_epi32(rounded, 16), _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
  }
}

}  // namespace
}  // namespace grpo::kernels
