// bf16.hpp's rounding on 16 lanes, in AVX-512F/BW integer instructions (no
// AVX512-BF16 needed), bit for bit the scalar float_to_bf16<kNan>. Only for
// translation units compiled with AVX-512F/BW.
#pragma once

#include <immintrin.h>

#include "kernels/bf16.hpp"

namespace grpo::kernels {
namespace {  // one copy per translation unit: each is compiled for its own ISA

template <Bf16Nan kNan>
inline __m256i float_to_bf16x16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
  if constexpr (kNan == Bf16Nan::quiet) {
    // 0x00400000 is the bf16 quiet bit (0x40) before the shift.
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000)));
  }
  r = _mm512_srli_epi32(r, 16);
  if constexpr (kNan == Bf16Nan::canonical) {
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  }
  return _mm512_cvtepi32_epi16(r);
}

}  // namespace
}  // namespace grpo::kernels
