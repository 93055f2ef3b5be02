// The blocked GEMM's epilogue (gemm_blocked.hpp): finished accumulators into
// C, transposed back when the product ran swapped, + bias (f32, bf16 or f16),
// + C when accumulating, rounded to bf16 (nearest even) for a bf16 C, to f16
// (nearest even, saturating at +-65504 and counted: f16.hpp's
// float_to_f16_saturated, bit for bit) for an f16 C; rows and columns past
// C's edges dropped. A StagedTiles micro's tiles come through store(),
// a DirectGroups micro's row groups through store_group() (from registers:
// docs/benchmarks.md, "Finished groups straight to C").
//
// Only for translation units compiled with AVX-512F/BW/DQ/VL; in an unnamed
// namespace (one copy per such unit).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>

#include "kernels/bf16_avx512.hpp"
#include "kernels/f16.hpp"
#include "kernels/gemm_blocking.hpp"
#include "kernels/gemm_lanes_avx512.hpp"

namespace grpo::kernels::blocked {
namespace {

class Avx512Epilogue : EpilogueTarget {
 public:
  using EpilogueTarget::EpilogueTarget;

  // One finished 16 x 16 accumulator tile (tmp, X rows xr0.., Y columns yc0..)
  // into C: transposed back when swapped; + bias, + C when accumulating;
  // rounded to bf16 (nearest even) for a bf16 C. Rows and columns past C's
  // edges are dropped.
  void store(float* tmp, std::int64_t xr0, std::int64_t yc0, void* c, const void* bias) const {
    if (xr0 >= mx_ || yc0 >= ny_) return;
    std::int64_t rows = 0;  // of C
    std::int64_t cols = 0;
    std::int64_t r0 = 0;
    std::int64_t c0 = 0;
    if (swapped_) {
      // tmp[i][j] = C[yc0 + j][xr0 + i]: transpose in place through a copy.
      alignas(64) float t[kTile * kTile];
      std::memcpy(t, tmp, sizeof(t));
      const __m512i idx = column_offsets(kTile);
      for (std::int64_t j = 0; j < kTile; ++j) {
        _mm512_store_ps(tmp + j * kTile,
                        _mm512_i32gather_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(static_cast<int>(j))), t, 4));
      }
      r0 = yc0;
      c0 = xr0;
      rows = std::min(kTile, ny_ - yc0);
      cols = std::min(kTile, mx_ - xr0);
    } else {
      r0 = xr0;
      c0 = yc0;
      rows = std::min(kTile, mx_ - xr0);
      cols = std::min(kTile, ny_ - yc0);
    }
    const __mmask16 cmask = mask16(cols);
    const __m512 bv = spec_.has_bias ? bias_at(bias, c0, cmask) : _mm512_setzero_ps();
    for (std::int64_t r = 0; r < rows; ++r) put(_mm512_load_ps(tmp + r * kTile), r0 + r, c0, cmask, bv, c);
  }

  // A finished group straight from registers (a DirectGroups micro): X rows
  // [xr0, xr0 + g) x Y columns [yc0, yc0 + 32), acc[r][h] holding row r's
  // columns 16 h .. 16 h + 15; clipped to C's edges.
  template <std::int64_t g>
  void store_group(std::int64_t xr0, std::int64_t yc0, const __m512 (&acc)[g][2], void* c, const void* bias) const {
    static_assert(g == 8, "the swapped store transposes 8 rows");
    if (xr0 >= mx_ || yc0 >= ny_) return;
    if (!swapped_) {
      for (std::int64_t h = 0; h < 2 && yc0 + h * kTile < ny_; ++h) {
        const std::int64_t c0 = yc0 + h * kTile;
        const __mmask16 cmask = mask16(ny_ - c0);
        const __m512 bv = spec_.has_bias ? bias_at(bias, c0, cmask) : _mm512_setzero_ps();
        for (std::int64_t r = 0; r < std::min(g, mx_ - xr0); ++r) put(acc[r][h], xr0 + r, c0, cmask, bv, c);
      }
      return;
    }
    // Swapped: C row yc0 + j, columns [xr0, xr0 + 8) is column j of the
    // group: an 8 x 16 transpose per half (two unpack rounds, then each
    // 128-bit quarter's rows 0-3 and 4-7 side by side).
    const __mmask16 cmask = mask16(std::min<std::int64_t>(g, mx_ - xr0));  // 8 columns of C
    const __m512 bv = spec_.has_bias ? bias_at(bias, xr0, cmask) : _mm512_setzero_ps();
    const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    for (std::int64_t h = 0; h < 2 && yc0 + h * kTile < ny_; ++h) {
      __m512 t[8];
      for (int r = 0; r < 8; r += 2) {
        t[r] = _mm512_unpacklo_ps(acc[r][h], acc[r + 1][h]);
        t[r + 1] = _mm512_unpackhi_ps(acc[r][h], acc[r + 1][h]);
      }
      const auto pd = [](__m512 v) { return _mm512_castps_pd(v); };
      const auto ps = [](__m512d v) { return _mm512_castpd_ps(v); };
      // u[q] / w[q], quarter l: column 4 l + q's rows 0-3 / 4-7.
      const __m512 u[4] = {ps(_mm512_unpacklo_pd(pd(t[0]), pd(t[2]))), ps(_mm512_unpackhi_pd(pd(t[0]), pd(t[2]))),
                           ps(_mm512_unpacklo_pd(pd(t[1]), pd(t[3]))), ps(_mm512_unpackhi_pd(pd(t[1]), pd(t[3])))};
      const __m512 w[4] = {ps(_mm512_unpacklo_pd(pd(t[4]), pd(t[6]))), ps(_mm512_unpackhi_pd(pd(t[4]), pd(t[6]))),
                           ps(_mm512_unpacklo_pd(pd(t[5]), pd(t[7]))), ps(_mm512_unpackhi_pd(pd(t[5]), pd(t[7])))};
      const std::int64_t rows = std::min(kTile, ny_ - (yc0 + h * kTile));
      for (int q = 0; q < 4; ++q) {
        // Columns q and 4 + q of the group (low / high 256 bits), then 8 + q and 12 + q.
        const __m512 a = _mm512_permutex2var_ps(u[q], lo_idx, w[q]);
        const __m512 b = _mm512_permutex2var_ps(u[q], hi_idx, w[q]);
        const __m512 cols[4] = {a, _mm512_shuffle_f32x4(a, a, 0xee), b, _mm512_shuffle_f32x4(b, b, 0xee)};
        for (int l = 0; l < 4; ++l) {
          const std::int64_t j = 4 * l + q;
          if (j < rows) put(cols[l], yc0 + h * kTile + j, xr0, cmask, bv, c);
        }
      }
    }
  }

  // The bias of C's columns [c0, c0 + 16) under cmask, as f32.
  __m512 bias_at(const void* bias, std::int64_t c0, __mmask16 cmask) const {
    if (spec_.bias_dtype == DType::f32) return _mm512_maskz_loadu_ps(cmask, static_cast<const float*>(bias) + c0);
    const __m256i h = _mm256_maskz_loadu_epi16(cmask, static_cast<const std::uint16_t*>(bias) + c0);
    if (spec_.bias_dtype == DType::f16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }

  // 16 f32 -> f16 as float_to_f16_saturated: rounded to nearest even
  // (vcvtps2ph), but +-65504 where that would give an infinity, and a NaN as
  // the quiet NaN sign | 0x7e00 whatever its payload. The lanes under cmask
  // that saturated are counted (take_f16_saturations). One compare finds
  // both cases (|v| >= 65520, or unordered); only a store that has one pays
  // for the clamp, the NaN fix and the count.
  static __m256i to_f16_saturated(__m512 v, __mmask16 cmask) {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    // 65520 = 65504 + half an f16 ulp there: the first magnitude that rounds to infinity.
    const __mmask16 odd = _mm512_mask_cmp_ps_mask(cmask, _mm512_abs_ps(v), _mm512_set1_ps(65520.0F), _CMP_NLT_UQ);
    if (odd == 0) return _mm512_cvtps_ph(v, kRound);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    detail::add_f16_saturations(std::popcount(static_cast<unsigned>(odd & ~nan)));
    // min and max return their second operand when either is NaN: v's NaN
    // stays. Clamping to 65504 equals rounding first for 65504 <= |v| < 65520.
    v = _mm512_max_ps(_mm512_set1_ps(-kF16Max), _mm512_min_ps(_mm512_set1_ps(kF16Max), v));
    const __m256i h = _mm512_cvtps_ph(v, kRound);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(v), 16), _mm512_set1_epi32(0x8000));
    const __m256i quiet = _mm512_cvtepi32_epi16(_mm512_or_si512(sign, _mm512_set1_epi32(0x7e00)));
    return _mm256_mask_mov_epi16(h, nan, quiet);
  }

  // 16 f32 -> bf16, rounded to nearest even: vcvtneps2bf16 where the unit
  // is compiled for AVX512-BF16; else in integer instructions, a NaN to the
  // quiet NaN 0x7fc0 (the two differ only on NaN payloads and subnormals,
  // which vcvtneps2bf16 takes as zero).
  static __m256i to_bf16(__m512 v) {
#ifdef __AVX512BF16__
    return std::bit_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
    return float_to_bf16x16<Bf16Nan::canonical>(v);
#endif
  }

  // C[r][c0 + j] (+)= v[j] + bv[j] for the columns under cmask (bv only with
  // a bias); rounded to bf16 (nearest even) for a bf16 C, to f16 (saturating)
  // for an f16 one.
  void put(__m512 v, std::int64_t r, std::int64_t c0, __mmask16 cmask, __m512 bv, void* c) const {
    if (spec_.has_bias) v = _mm512_add_ps(v, bv);
    const GemmOperand& co = spec_.c;
    const std::int64_t at = r * co.row_stride + c0;
    if (co.dtype == DType::f32) {
      float* dst = static_cast<float*>(c) + at;
      if (spec_.accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(cmask, dst), v);
      _mm512_mask_storeu_ps(dst, cmask, v);
    } else if (co.dtype == DType::f16) {
      std::uint16_t* dst = static_cast<std::uint16_t*>(c) + at;
      if (spec_.accumulate) v = _mm512_add_ps(_mm512_cvtph_ps(_mm256_maskz_loadu_epi16(cmask, dst)), v);
      _mm256_mask_storeu_epi16(dst, cmask, to_f16_saturated(v, cmask));
    } else {
      std::uint16_t* dst = static_cast<std::uint16_t*>(c) + at;
      if (spec_.accumulate) {
        const __m256i old = _mm256_maskz_loadu_epi16(cmask, dst);
        v = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(old), 16)), v);
      }
      _mm256_mask_storeu_epi16(dst, cmask, to_bf16(v));
    }
  }
};

}  // namespace
}  // namespace grpo::kernels::blocked
