// The blocked GEMM's AVX2 packing (gemm_blocked.hpp), for the layouts the
// avx2 micro declares (gemm_avx2_micro.hpp, gemm_micro.hpp): X panels as
// XRowGroups<rows, F32> (per group of rows, each (k, k + 1) pair's two f32 per
// row) and Y blocks as YVnni<F32> (per 16 columns, [kb32][16] f32: each VNNI
// row of 16 pairs is its 16 k values, then its 16 k + 1 values), from bf16
// or f16 sources, widened as they are read (exact: a bf16 is the top half of
// an f32, and every f16 is an f32: vcvtph2ps), or from f32 ones. Every
// packed block is zero-padded to whole panels and k steps. Tested alone against the layouts written as index arithmetic
// (tests/test_gemm_packing.cpp, through tests/gemm_pack_hooks_avx2.cpp).
//
// Only for translation units compiled with AVX2, FMA and F16C; in an unnamed
// namespace (one copy per such unit).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/gemm_micro.hpp"

namespace grpo::kernels::blocked {
namespace {

// An f16 element: its own type, as a std::uint16_t here is a bf16.
struct F16 {
  std::uint16_t bits;
};

// An operand's elements as f32: bf16 and f16 widened, f32 as they are.
inline float load1(const F16* p) { return _cvtsh_ss(p->bits); }
inline __m256 load8(const F16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// 6 elements as f32 in lanes 0-5, zeros in 6 and 7; reads nothing past them.
inline __m256 load6(const F16* p) {
  std::int32_t last = 0;  // elements 4 and 5
  std::memcpy(&last, p + 4, sizeof(last));
  return _mm256_cvtph_ps(_mm_insert_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), last, 2));
}
inline float load1(const std::uint16_t* p) {
  const std::uint32_t bits = static_cast<std::uint32_t>(*p) << 16;
  float v = 0.0F;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}
inline float load1(const float* p) { return *p; }
inline __m256 load8(const std::uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
// 6 elements as f32 in lanes 0-5, zeros in 6 and 7; reads nothing past them.
inline __m256 load6(const std::uint16_t* p) {
  std::int32_t last = 0;  // elements 4 and 5
  std::memcpy(&last, p + 4, sizeof(last));
  const __m128i h = _mm_insert_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), last, 2);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load6(const float* p) { return _mm256_maskload_ps(p, _mm256_setr_epi32(-1, -1, -1, -1, -1, -1, 0, 0)); }

// Two rows of 8 f32 (a, b: row k and row k + 1 of 8 X rows) -> their first 6
// lanes as 6 (k, k + 1) pairs, 12 f32 at o: unpacklo / unpackhi give lanes
// 0, 1, 4, 5 and 2, 3, 6, 7 of a pair.
inline void store_pairs6(float* o, __m256 a, __m256 b) {
  const __m256 lo = _mm256_unpacklo_ps(a, b);
  const __m256 hi = _mm256_unpackhi_ps(a, b);
  _mm256_storeu_ps(o, _mm256_permute2f128_ps(lo, hi, 0x20));
  _mm_storeu_ps(o + 8, _mm256_extractf128_ps(lo, 1));
}

// 8 x 8 f32 transpose in registers.
inline void transpose8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  __m256 u[8];
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// Packs X (the strides and dtype x) and Y (y) of one orientation
// (gemm_blocking.hpp) into XLayout panels of kPanelRows rows and YLayout
// blocks.
template <class XLayout, class YLayout, std::int64_t kPanelRows>
class Avx2Packer {
  static_assert(std::is_same_v<typename XLayout::Elem, F32> && !XLayout::kInPlace, "X packed as f32 groups");
  static_assert(std::is_same_v<typename YLayout::Elem, F32>, "Y packed as f32");
  static constexpr std::int64_t kG = XLayout::kGroupRows;
  static_assert(kG == 6 && kPanelRows % kG == 0, "pack_x_as's pair stores are written for groups of 6 rows");

 public:
  Avx2Packer(View x, View y) : x_(x), y_(y) {}

  // X rows [m0, m0 + rows) x k [k0, k0 + kb) -> a panel of kPanelRows rows:
  // per group of kG rows, [kb32 / 2 k pairs][kG rows][2] f32.
  void pack_x(const void* x, std::int64_t m0, std::int64_t rows, std::int64_t k0, std::int64_t kb, std::int64_t kb32,
              std::uint16_t* out) const {
    auto* f = reinterpret_cast<float*>(out);
    switch (x_.dtype) {
      case DType::bf16: pack_x_as(static_cast<const std::uint16_t*>(x), m0, rows, k0, kb, kb32, f); return;
      case DType::f16: pack_x_as(static_cast<const F16*>(x), m0, rows, k0, kb, kb32, f); return;
      case DType::f32: pack_x_as(static_cast<const float*>(x), m0, rows, k0, kb, kb32, f); return;
    }
  }

  // Y k [k0, k0 + kb) x columns [n0, n0 + nb) -> per 16 columns (nb32 / 16
  // of them), [kb32][16] f32.
  void pack_y(const void* y, std::int64_t k0, std::int64_t kb, std::int64_t kb32, std::int64_t n0, std::int64_t nb,
              std::int64_t nb32, std::uint16_t* out) const {
    auto* f = reinterpret_cast<float*>(out);
    switch (y_.dtype) {
      case DType::bf16: pack_y_as(static_cast<const std::uint16_t*>(y), k0, kb, kb32, n0, nb, nb32, f); return;
      case DType::f16: pack_y_as(static_cast<const F16*>(y), k0, kb, kb32, n0, nb, nb32, f); return;
      case DType::f32: pack_y_as(static_cast<const float*>(y), k0, kb, kb32, n0, nb, nb32, f); return;
    }
  }

 private:
  // Where element (row r of the group, k) of a group goes.
  static std::int64_t group_at(std::int64_t r, std::int64_t k) { return (k / 2) * kG * 2 + r * 2 + k % 2; }

  template <class T>
  void pack_x_as(const T* x, std::int64_t m0, std::int64_t rows, std::int64_t k0, std::int64_t kb, std::int64_t kb32,
                 float* out) const {
    // Columns contiguous (dW's dlogits^T): a k's rows are adjacent. Per k
    // pair, each whole group's 6 rows, the panel's rows of a k read together
    // (X's rows of consecutive k lie a power of two apart, so reading them a
    // group at a time would evict them from L1 and L2 between the groups).
    const std::int64_t whole_groups = x_.rs == 1 && x_.cs != 1 ? std::min(rows, kPanelRows) / kG : 0;
    const std::int64_t pairs_end = whole_groups > 0 ? kb / 2 * 2 : 0;
    for (std::int64_t k = 0; k < pairs_end; k += 2) {
      const T* at = x + m0 + (k0 + k) * x_.cs;
      for (std::int64_t g = 0; g < whole_groups * kG; g += kG) {
        store_pairs6(out + g * kb32 + group_at(0, k), load6(at + g), load6(at + x_.cs + g));
      }
    }
    for (std::int64_t g = 0; g < kPanelRows; g += kG) {
      float* og = out + g * kb32;
      const std::int64_t gr = std::clamp<std::int64_t>(rows - g, 0, kG);  // the group's rows that exist
      const T* at = x + (m0 + g) * x_.rs + k0 * x_.cs;
      std::int64_t k = g < whole_groups * kG ? pairs_end : 0;
      if (gr > 0 && x_.cs == 1) {
        // Rows K-contiguous: 8 k of the group's rows (zero rows below), an
        // 8 x 8 transpose, then each (k, k + 1) pair's rows interleaved.
        for (; k + 8 <= kb; k += 8) {
          __m256 r[8];
          for (std::int64_t i = 0; i < 8; ++i) r[i] = i < gr ? load8(at + i * x_.rs + k) : _mm256_setzero_ps();
          transpose8(r);
          for (std::int64_t j = 0; j < 4; ++j) store_pairs6(og + group_at(0, k + 2 * j), r[2 * j], r[2 * j + 1]);
        }
      }
      for (std::int64_t r = 0; r < kG; ++r) {  // the rest, element by element, zeros past the edges
        for (std::int64_t kk = k; kk < kb32; ++kk) {
          og[group_at(r, kk)] = r < gr && kk < kb ? load1(at + r * x_.rs + kk * x_.cs) : 0.0F;
        }
      }
    }
  }

  template <class T>
  void pack_y_as(const T* y, std::int64_t k0, std::int64_t kb, std::int64_t kb32, std::int64_t n0, std::int64_t nb,
                 std::int64_t nb32, float* out) const {
    constexpr std::int64_t kCols = 16;
    for (std::int64_t nn = 0; nn < nb32; nn += kCols) {
      float* tile = out + nn * kb32;
      const std::int64_t cols = std::clamp<std::int64_t>(nb - nn, 0, kCols);
      const T* at = y + k0 * y_.rs + (n0 + nn) * y_.cs;
      std::int64_t k = 0;
      if (cols == kCols && y_.cs == 1) {  // rows of Y N-contiguous: 16 at a time
        for (; k < kb; ++k) {
          _mm256_storeu_ps(tile + k * kCols, load8(at + k * y_.rs));
          _mm256_storeu_ps(tile + k * kCols + 8, load8(at + k * y_.rs + 8));
        }
      } else if (cols == kCols && y_.rs == 1) {  // columns K-contiguous: 8 x 8 transposes
        for (; k + 8 <= kb; k += 8) {
          for (std::int64_t h = 0; h < 2; ++h) {
            __m256 r[8];
            for (std::int64_t j = 0; j < 8; ++j) r[j] = load8(at + (h * 8 + j) * y_.cs + k);
            transpose8(r);
            for (std::int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(tile + (k + i) * kCols + h * 8, r[i]);
          }
        }
      }
      for (; k < kb32; ++k) {  // the rest, element by element, zeros past the edges
        for (std::int64_t j = 0; j < kCols; ++j) {
          tile[k * kCols + j] = j < cols && k < kb ? load1(at + k * y_.rs + j * y_.cs) : 0.0F;
        }
      }
    }
  }

  View x_, y_;
};

}  // namespace
}  // namespace grpo::kernels::blocked
