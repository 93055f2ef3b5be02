// The blocked GEMM's AVX2 epilogue (gemm_blocked.hpp): a DirectGroups
// micro's finished groups (rows x 16 columns of f32, two ymm a row:
// gemm_avx2_micro.hpp) into C from registers, transposed back when the
// product ran swapped, + bias (f32, bf16 or f16), + C when accumulating,
// rounded to bf16 (nearest even, a NaN to 0x7fc0) for a bf16 C, to f16
// (nearest even, saturating at +-65504 and counted: f16.hpp's
// float_to_f16_saturated, bit for bit) for an f16 C; rows and columns past
// C's edges dropped.
//
// Only for translation units compiled with AVX2, FMA and F16C; in an
// unnamed namespace (one copy per such unit).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstdint>

#include "kernels/bf16_avx2.hpp"
#include "kernels/f16.hpp"
#include "kernels/gemm_blocking.hpp"
#include "kernels/gemm_pack_avx2.hpp"

namespace grpo::kernels::blocked {
namespace {

class Avx2Epilogue : EpilogueTarget {
 public:
  using EpilogueTarget::EpilogueTarget;

  // A finished group: X rows [xr0, xr0 + g) x Y columns [yc0, yc0 + 16),
  // acc[r][h] holding row r's columns 8 h .. 8 h + 7.
  template <std::int64_t g>
  void store_group(std::int64_t xr0, std::int64_t yc0, const __m256 (&acc)[g][2], void* c, const void* bias) const {
    static_assert(g <= 8, "the swapped store transposes 8 rows");
    if (xr0 >= mx_ || yc0 >= ny_) return;
    if (!swapped_) {
      for (std::int64_t r = 0; r < std::min(g, mx_ - xr0); ++r) {
        for (std::int64_t h = 0; h < 2 && yc0 + 8 * h < ny_; ++h) {
          put(acc[r][h], xr0 + r, yc0 + 8 * h, std::min<std::int64_t>(8, ny_ - yc0 - 8 * h), c, bias);
        }
      }
      return;
    }
    // Swapped: C row yc0 + j, columns [xr0, xr0 + g) is column j of the
    // group: an 8 x 8 transpose per half (zero rows below g).
    const std::int64_t cols = std::min(g, mx_ - xr0);
    for (std::int64_t h = 0; h < 2; ++h) {
      __m256 t[8];
      for (std::int64_t r = 0; r < 8; ++r) t[r] = r < g ? acc[r][h] : _mm256_setzero_ps();
      transpose8(t);
      for (std::int64_t j = 0; j < 8 && yc0 + 8 * h + j < ny_; ++j) put(t[j], yc0 + 8 * h + j, xr0, cols, c, bias);
    }
  }

 private:
  // C[r][c0 + j] (+)= v[j] + bias[c0 + j] for j < cols (<= 8); rounded to
  // bf16 (nearest even) for a bf16 C, to f16 (saturating) for an f16 one.
  void put(__m256 v, std::int64_t r, std::int64_t c0, std::int64_t cols, void* c, const void* bias) const {
    if (spec_.has_bias) v = _mm256_add_ps(v, bias_at(bias, c0, cols));
    const GemmOperand& co = spec_.c;
    const std::int64_t at = r * co.row_stride + c0;
    if (cols == 8) {
      if (co.dtype == DType::f32) {
        float* dst = static_cast<float*>(c) + at;
        if (spec_.accumulate) v = _mm256_add_ps(_mm256_loadu_ps(dst), v);
        _mm256_storeu_ps(dst, v);
      } else if (co.dtype == DType::f16) {
        auto* dst = reinterpret_cast<F16*>(static_cast<std::uint16_t*>(c) + at);
        if (spec_.accumulate) v = _mm256_add_ps(load8(dst), v);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), to_f16_saturated(v));
      } else {
        std::uint16_t* dst = static_cast<std::uint16_t*>(c) + at;
        if (spec_.accumulate) v = _mm256_add_ps(load8(dst), v);
        const __m256i w = float_to_bf16x8_epi32<Bf16Nan::canonical>(v);  // 8 values < 2^16 in 32-bit lanes
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), packed);
      }
      return;
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    std::int64_t saturated = 0;
    for (std::int64_t j = 0; j < cols; ++j) {
      if (co.dtype == DType::f32) {
        float* dst = static_cast<float*>(c) + at + j;
        *dst = spec_.accumulate ? *dst + lanes[j] : lanes[j];
      } else if (co.dtype == DType::f16) {
        std::uint16_t* dst = static_cast<std::uint16_t*>(c) + at + j;
        const float old = spec_.accumulate ? load1(reinterpret_cast<const F16*>(dst)) : 0.0F;
        *dst = float_to_f16_saturated(spec_.accumulate ? old + lanes[j] : lanes[j], &saturated);
      } else {
        std::uint16_t* dst = static_cast<std::uint16_t*>(c) + at + j;
        *dst = float_to_bf16<Bf16Nan::canonical>(spec_.accumulate ? load1(dst) + lanes[j] : lanes[j]);
      }
    }
    if (saturated != 0) detail::add_f16_saturations(saturated);
  }

  // 8 f32 -> f16 as float_to_f16_saturated (gemm_epilogue_avx512.hpp's
  // to_f16_saturated, in AVX2): one compare finds the lanes that would round
  // to an infinity or are NaN; only a store that has one pays for the clamp,
  // the NaN fix and the count.
  static __m128i to_f16_saturated(__m256 v) {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0F), v);
    // 65520 = 65504 + half an f16 ulp there: the first magnitude that rounds to infinity.
    const int odd = _mm256_movemask_ps(_mm256_cmp_ps(magnitude, _mm256_set1_ps(65520.0F), _CMP_NLT_UQ));
    if (odd == 0) return _mm256_cvtps_ph(v, kRound);
    const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    detail::add_f16_saturations(std::popcount(static_cast<unsigned>(odd & ~_mm256_movemask_ps(nan))));
    // min and max return their second operand when either is NaN: v's NaN
    // stays. Clamping to 65504 equals rounding first for 65504 <= |v| < 65520.
    v = _mm256_max_ps(_mm256_set1_ps(-kF16Max), _mm256_min_ps(_mm256_set1_ps(kF16Max), v));
    const __m128i h = _mm256_cvtps_ph(v, kRound);
    // A NaN lane: sign | 0x7e00, packed from the 32-bit lanes as the mask is.
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(v), 16), _mm256_set1_epi32(0x8000));
    const __m256i quiet32 = _mm256_or_si256(sign, _mm256_set1_epi32(0x7e00));
    const __m128i quiet = _mm_packus_epi32(_mm256_castsi256_si128(quiet32), _mm256_extracti128_si256(quiet32, 1));
    const __m256i nan32 = _mm256_castps_si256(nan);
    const __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan32), _mm256_extracti128_si256(nan32, 1));
    return _mm_blendv_epi8(h, quiet, nan16);
  }

  // The bias of C's columns [c0, c0 + cols) as f32, zeros past cols.
  __m256 bias_at(const void* bias, std::int64_t c0, std::int64_t cols) const {
    alignas(32) float b[8] = {};
    for (std::int64_t j = 0; j < cols; ++j) {
      switch (spec_.bias_dtype) {
        case DType::f32: b[j] = static_cast<const float*>(bias)[c0 + j]; break;
        case DType::bf16: b[j] = load1(static_cast<const std::uint16_t*>(bias) + c0 + j); break;
        case DType::f16: b[j] = load1(static_cast<const F16*>(bias) + c0 + j); break;
      }
    }
    return _mm256_load_ps(b);
  }
};

}  // namespace
}  // namespace grpo::kernels::blocked
