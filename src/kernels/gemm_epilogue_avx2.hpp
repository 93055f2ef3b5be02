// The blocked GEMM's AVX2 epilogue (gemm_blocked.hpp): a DirectGroups
// micro's finished groups (rows x 16 columns of f32, two ymm a row:
// gemm_avx2_micro.hpp) into C from registers, transposed back when the
// product ran swapped, + bias, + C when accumulating, rounded to bf16
// (nearest even, a NaN to 0x7fc0) for a bf16 C; rows and columns past C's
// edges dropped.
//
// Only for translation units compiled with AVX2 and FMA; in an unnamed
// namespace (one copy per such unit).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels/bf16_avx2.hpp"
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
  // bf16 (nearest even) for a bf16 C.
  void put(__m256 v, std::int64_t r, std::int64_t c0, std::int64_t cols, void* c, const void* bias) const {
    if (spec_.has_bias) v = _mm256_add_ps(v, bias_at(bias, c0, cols));
    const GemmOperand& co = spec_.c;
    const std::int64_t at = r * co.row_stride + c0;
    if (cols == 8) {
      if (co.dtype == DType::f32) {
        float* dst = static_cast<float*>(c) + at;
        if (spec_.accumulate) v = _mm256_add_ps(_mm256_loadu_ps(dst), v);
        _mm256_storeu_ps(dst, v);
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
    for (std::int64_t j = 0; j < cols; ++j) {
      if (co.dtype == DType::f32) {
        float* dst = static_cast<float*>(c) + at + j;
        *dst = spec_.accumulate ? *dst + lanes[j] : lanes[j];
      } else {
        std::uint16_t* dst = static_cast<std::uint16_t*>(c) + at + j;
        *dst = float_to_bf16<Bf16Nan::canonical>(spec_.accumulate ? load1(dst) + lanes[j] : lanes[j]);
      }
    }
  }

  // The bias of C's columns [c0, c0 + cols) as f32, zeros past cols.
  __m256 bias_at(const void* bias, std::int64_t c0, std::int64_t cols) const {
    alignas(32) float b[8] = {};
    for (std::int64_t j = 0; j < cols; ++j) {
      b[j] = spec_.bias_dtype == DType::f32 ? static_cast<const float*>(bias)[c0 + j]
                                            : load1(static_cast<const std::uint16_t*>(bias) + c0 + j);
    }
    return _mm256_load_ps(b);
  }
};

}  // namespace
}  // namespace grpo::kernels::blocked
