// The blocked GEMM's AVX-512 packing (gemm_blocked.hpp), chosen by the
// micro's declared layouts (gemm_micro.hpp): X panels of 32 rows as XTiles or
// XRowGroups, Y blocks as YVnni. bf16 sources are packed as bf16, or for an
// F32 layout widened to f32 after packing; f16 sources (F32 layouts alone)
// are packed as 16-bit pairs the same way and widened with vcvtph2ps; f32
// sources (F32 layouts alone: an f32 operand beside an f16 one) are written
// into the same f32 layouts directly. Each operand by its own View's dtype.
// Every packed block is zero-padded to whole panels and k steps. Tested alone
// against the layouts' index arithmetic (tests/test_gemm_packing.cpp).
//
// Only for translation units compiled with AVX-512F/BW/DQ/VL; in an unnamed
// namespace (one copy per such unit).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/gemm_lanes_avx512.hpp"
#include "kernels/gemm_micro.hpp"
#include "kernels/prefetch.hpp"

namespace grpo::kernels::blocked {
namespace {

// (k, k + 1) pairs of 32 elements: r0 holds k's, r1 k + 1's; lo gets the
// pairs of elements 0-15 (k's in the low halves), hi those of 16-31.
inline void interleave_pairs(__m512i r0, __m512i r1, __m512i& lo, __m512i& hi) {
  const __m512i lo_idx =
      _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005, 0x00260006, 0x00270007,
                        0x00280008, 0x00290009, 0x002a000a, 0x002b000b, 0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  lo = _mm512_permutex2var_epi16(r0, lo_idx, r1);
  hi = _mm512_permutex2var_epi16(r0, hi_idx, r1);
}

// The mask of the first n lanes, for an n that may be 0 or negative (a k
// step of 16 past a short k block's end).
__mmask16 mask16_from(std::int64_t n) { return n <= 0 ? __mmask16{0} : mask16(n); }

// An n x n transpose in registers (8 u64 lanes of __m512d, or 16 f32):
// log2(n) perfect shuffles, each interleaving the lanes of r[i] and
// r[i + n / 2] into t[2 i] (their first halves) and t[2 i + 1].
template <int kN, class V, class Interleave>
void transpose_square(V (&r)[kN], const Interleave& interleave) {
  for (int round = 1; round < kN; round *= 2) {
    V t[kN];
    for (int i = 0; i < kN / 2; ++i) interleave(r[i], r[i + kN / 2], t[2 * i], t[2 * i + 1]);
    for (int i = 0; i < kN; ++i) r[i] = t[i];
  }
}
inline void transpose8_u64(__m512d (&r)[8]) {
  const __m512i lo = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11);
  const __m512i hi = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
  transpose_square<8>(r, [&](__m512d a, __m512d b, __m512d& l, __m512d& h) {
    l = _mm512_permutex2var_pd(a, lo, b);
    h = _mm512_permutex2var_pd(a, hi, b);
  });
}
inline void transpose16_ps(__m512 (&r)[16]) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  transpose_square<16>(r, [&](__m512 a, __m512 b, __m512& l, __m512& h) {
    l = _mm512_permutex2var_ps(a, lo, b);
    h = _mm512_permutex2var_ps(a, hi, b);
  });
}

// Packs X (the strides and dtype x) and Y (y) of one orientation
// (gemm_blocking.hpp) into XLayout panels and YLayout blocks.
template <class XLayout, class YLayout>
class Avx512Packer {
  static constexpr bool kXF32 = std::is_same_v<typename XLayout::Elem, F32>;
  static constexpr bool kYF32 = std::is_same_v<typename YLayout::Elem, F32>;

 public:
  Avx512Packer(View x, View y) : x_(x), y_(y), x_kcontig_(x.cs == 1) {}

  // X rows [m0, m0 + rows) x k [k0, k0 + kb) -> panels of 32 rows, each
  // [kb32 / 32 k steps][2 tiles][16 rows][32 k] bf16, zero-padded.
  static std::int64_t panel_at(std::int64_t r, std::int64_t kk, std::int64_t kb32) {
    return (r / kPanel) * kPanel * kb32 + kk * kPanel + (r % kPanel) * kKStep;
  }
  // src: X's elements, of x_.dtype: bf16 for a Bf16 layout (serves() took
  // bf16 A and B); bf16, f16 or f32 for an F32 one.
  void pack_x(const void* src, std::int64_t m0, std::int64_t rows, std::int64_t k0, std::int64_t kb, std::int64_t kb32,
              std::uint16_t* out) const {
    const auto* x = static_cast<const std::uint16_t*>(src);
    if constexpr (!std::is_same_v<XLayout, XTiles>) {
      if constexpr (kXF32) {
        if (x_.dtype == DType::f32) {
          pack_x_groups_f32(static_cast<const float*>(src), m0, rows, k0, kb, kb32, reinterpret_cast<float*>(out));
          return;
        }
      }
      pack_x_groups(x, m0, rows, k0, kb, kb32, out);
      if constexpr (kXF32) {
        if (x_.dtype == DType::f16) {
          widen_f16_pairs(out, kPanel * kb32 / 2);
        } else {
          widen_pairs(out, kPanel * kb32 / 2);
        }
      }
      return;
    }
    const std::int64_t rows32 = round_up(rows, kPanel);
    if (x_kcontig_) {  // rows K-contiguous: copy
      // The rows are short runs (kb elements) of rows far apart (W's 8 KiB):
      // the hardware prefetchers do not follow; ask for kPrefetchRows ahead.
      constexpr std::int64_t kPrefetchRows = 4;
      for (std::int64_t r = 0; r < rows32; ++r) {
        if (r + kPrefetchRows < rows) prefetch_row(x, m0 + r + kPrefetchRows, k0, kb);
        for (std::int64_t kk = 0; kk < kb32; kk += 32) {
          const __m512i v = r < rows ? _mm512_maskz_loadu_epi16(mask32(kb - kk), x + (m0 + r) * x_.rs + k0 + kk)
                                     : _mm512_setzero_si512();
          _mm512_store_si512(out + panel_at(r, kk, kb32), v);
        }
      }
      return;
    }
    // Columns contiguous (x_.rs == 1): per 16 rows x 32 k, pair k and k + 1
    // of each row into a u32 ([kp][row] in tmp), then gather the transpose.
    alignas(64) std::uint32_t pairs[kTile * kTile];
    const __m512i cols = column_offsets(kTile);
    for (std::int64_t r0 = 0; r0 < rows32; r0 += kTile) {
      const std::int64_t rn = std::clamp<std::int64_t>(rows - r0, 0, kTile);
      const __mmask16 rmask = mask16(rn);
      for (std::int64_t kk = 0; kk < kb32; kk += 32) {
        for (std::int64_t kp = 0; kp < kTile; ++kp) {
          const std::int64_t k = kk + 2 * kp;
          const __m256i lo =
              k < kb ? _mm256_maskz_loadu_epi16(rmask, x + (m0 + r0) + (k0 + k) * x_.cs) : _mm256_setzero_si256();
          const __m256i hi = k + 1 < kb ? _mm256_maskz_loadu_epi16(rmask, x + (m0 + r0) + (k0 + k + 1) * x_.cs)
                                        : _mm256_setzero_si256();
          const __m512i v =
              _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
          _mm512_store_si512(pairs + kp * kTile, v);
        }
        for (std::int64_t r = 0; r < kTile; ++r) {
          const __m512i row =
              _mm512_i32gather_epi32(_mm512_add_epi32(cols, _mm512_set1_epi32(static_cast<int>(r))), pairs, 4);
          _mm512_store_si512(out + panel_at(r0 + r, kk, kb32), row);
        }
      }
    }
  }

  // pack_x for an XRowGroups layout: each 8 rows x kb k of the panel
  // as [kb32 / 2 k pairs][8 rows] u32, the groups one after another.
  void pack_x_groups(const std::uint16_t* x, std::int64_t m0, std::int64_t rows, std::int64_t k0, std::int64_t kb,
                     std::int64_t kb32, std::uint16_t* out) const {
    constexpr std::int64_t kG = XLayout::kGroupRows;
    static_assert(kG == 8, "the group packing below transposes 8 rows");
    auto* pairs = reinterpret_cast<std::uint32_t*>(out);
    const std::int64_t kp32 = kb32 / 2;
    if (x_kcontig_) {
      // Per group and 32 k: 8 rows of 16 pairs -> 16 pairs of 8 rows, an
      // 8 x 16 u32 transpose (two unpack rounds, then 128-bit quarters).
      for (std::int64_t g = 0; g < kPanel; g += kG) {
        std::uint32_t* og = pairs + g * kp32;  // group g's pairs (the group of panel row g)
        // The next group's rows into L2 while this one is copied, when the
        // rows lie apart (dhidden's dlogits rows, V elements apart, each a
        // separate stream); the forward's W tile rows are one run the
        // hardware prefetchers follow (docs/benchmarks.md, "Where the GEMM
        // layer's constants came from": the X row prefetch into L2).
        if (x_.rs > kb) {
          for (std::int64_t r = g + kG; r < std::min(rows, g + 2 * kG); ++r) prefetch_row<true>(x, m0 + r, k0, kb);
        }
        for (std::int64_t kk = 0; kk < kb32; kk += kKStep) {
          __m512i v[kG];
          for (std::int64_t r = 0; r < kG; ++r) {
            v[r] = g + r < rows ? _mm512_maskz_loadu_epi16(mask32(kb - kk), x + (m0 + g + r) * x_.rs + k0 + kk)
                                : _mm512_setzero_si512();
          }
          __m512i t[kG];
          for (std::int64_t r = 0; r < kG; r += 2) {
            t[r] = _mm512_unpacklo_epi32(v[r], v[r + 1]);
            t[r + 1] = _mm512_unpackhi_epi32(v[r], v[r + 1]);
          }
          // lo[j] / hi[j], 128-bit quarter q: pair 4q + j of rows 0-3 / 4-7.
          const __m512i lo[4] = {_mm512_unpacklo_epi64(t[0], t[2]), _mm512_unpackhi_epi64(t[0], t[2]),
                                 _mm512_unpacklo_epi64(t[1], t[3]), _mm512_unpackhi_epi64(t[1], t[3])};
          const __m512i hi[4] = {_mm512_unpacklo_epi64(t[4], t[6]), _mm512_unpackhi_epi64(t[4], t[6]),
                                 _mm512_unpacklo_epi64(t[5], t[7]), _mm512_unpackhi_epi64(t[5], t[7])};
          std::uint32_t* o = og + (kk / 2) * kG;
          for (int j = 0; j < 4; ++j) {
            // Pair 4q + j: rows 0-3 then 4-7 (the quarter index must be a literal).
            const auto put = [&](int q, __m128i rows03, __m128i rows47) {
              auto* at = reinterpret_cast<__m128i*>(o + (4 * q + j) * kG);
              _mm_store_si128(at, rows03);
              _mm_store_si128(at + 1, rows47);
            };
            put(0, _mm512_extracti32x4_epi32(lo[j], 0), _mm512_extracti32x4_epi32(hi[j], 0));
            put(1, _mm512_extracti32x4_epi32(lo[j], 1), _mm512_extracti32x4_epi32(hi[j], 1));
            put(2, _mm512_extracti32x4_epi32(lo[j], 2), _mm512_extracti32x4_epi32(hi[j], 2));
            put(3, _mm512_extracti32x4_epi32(lo[j], 3), _mm512_extracti32x4_epi32(hi[j], 3));
          }
        }
      }
      return;
    }
    // Columns contiguous (x_.rs == 1): per k pair, the panel's 32 rows at k
    // and at k + 1 interleaved into 32 pairs, 8 to each group.
    const __mmask32 rmask = mask32(rows);
    for (std::int64_t kp = 0; kp < kp32; ++kp) {
      const std::int64_t k = 2 * kp;
      const __m512i r0 = k < kb ? _mm512_maskz_loadu_epi16(rmask, x + m0 + (k0 + k) * x_.cs) : _mm512_setzero_si512();
      const __m512i r1 =
          k + 1 < kb ? _mm512_maskz_loadu_epi16(rmask, x + m0 + (k0 + k + 1) * x_.cs) : _mm512_setzero_si512();
      __m512i lo;  // rows 0-15
      __m512i hi;  // 16-31
      interleave_pairs(r0, r1, lo, hi);
      std::uint32_t* o = pairs + kp * kG;
      _mm256_store_si256(reinterpret_cast<__m256i*>(o), _mm512_extracti64x4_epi64(lo, 0));
      _mm256_store_si256(reinterpret_cast<__m256i*>(o + kp32 * kG), _mm512_extracti64x4_epi64(lo, 1));
      _mm256_store_si256(reinterpret_cast<__m256i*>(o + 2 * kp32 * kG), _mm512_extracti64x4_epi64(hi, 0));
      _mm256_store_si256(reinterpret_cast<__m256i*>(o + 3 * kp32 * kG), _mm512_extracti64x4_epi64(hi, 1));
    }
  }

  // n (k, k + 1) bf16 pairs at out (u32 each, n a multiple of 16) -> 2 n
  // f32 in place, each pair's k value first: exact (a bf16 is the top half
  // of an f32). From the end, so no pair is overwritten before it is read.
  static void widen_pairs(std::uint16_t* out, std::int64_t n) {
    const auto* pairs = reinterpret_cast<const std::uint32_t*>(out);
    auto* f = reinterpret_cast<float*>(out);
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000U));
    const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    for (std::int64_t i = n - 16; i >= 0; i -= 16) {
      const __m512i v = _mm512_load_si512(pairs + i);
      const __m512i k0 = _mm512_slli_epi32(v, 16);
      const __m512i k1 = _mm512_and_si512(v, high);
      _mm512_store_si512(f + 2 * i, _mm512_permutex2var_epi32(k0, lo_idx, k1));
      _mm512_store_si512(f + 2 * i + 16, _mm512_permutex2var_epi32(k0, hi_idx, k1));
    }
  }

  // widen_pairs for f16 pairs: each pair's k value is already first, so the
  // 32 halves of 16 pairs convert in place order (exact: every f16 is an f32).
  static void widen_f16_pairs(std::uint16_t* out, std::int64_t n) {
    const auto* pairs = reinterpret_cast<const std::uint32_t*>(out);
    auto* f = reinterpret_cast<float*>(out);
    for (std::int64_t i = n - 16; i >= 0; i -= 16) {
      const __m512i v = _mm512_load_si512(pairs + i);
      _mm512_store_ps(f + 2 * i, _mm512_cvtph_ps(_mm512_castsi512_si256(v)));
      _mm512_store_ps(f + 2 * i + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1)));
    }
  }

  // pack_x for XRowGroups<8, F32> from f32 X: per group of 8 rows,
  // [kb32 / 2 k pairs][8 rows][2] f32, zero-padded.
  void pack_x_groups_f32(const float* x, std::int64_t m0, std::int64_t rows, std::int64_t k0, std::int64_t kb,
                         std::int64_t kb32, float* out) const {
    constexpr std::int64_t kG = XLayout::kGroupRows;
    static_assert(kG == 8, "the f32 group packing transposes 8 rows");
    if (x_kcontig_) {
      // Per group and 16 k: a row's (k, k + 1) pair is one u64, so 8 rows
      // of 8 pairs -> 8 pairs of 8 rows is an 8 x 8 u64 transpose.
      for (std::int64_t g = 0; g < kPanel; g += kG) {
        float* og = out + g * kb32;
        if (x_.rs > kb) {  // the next group's rows, as pack_x_groups does
          for (std::int64_t r = g + kG; r < std::min(rows, g + 2 * kG); ++r) prefetch_f32_row(x, m0 + r, k0, kb);
        }
        for (std::int64_t kk = 0; kk < kb32; kk += kTile) {
          const __mmask16 kmask = mask16_from(kb - kk);
          __m512d v[kG];
          for (std::int64_t r = 0; r < kG; ++r) {
            v[r] = g + r < rows ? _mm512_castps_pd(_mm512_maskz_loadu_ps(kmask, x + (m0 + g + r) * x_.rs + k0 + kk))
                                : _mm512_setzero_pd();
          }
          transpose8_u64(v);
          for (std::int64_t j = 0; j < kG; ++j) {
            _mm512_store_pd(reinterpret_cast<double*>(og + (kk + 2 * j) * kG), v[j]);
          }
        }
      }
      return;
    }
    // Columns contiguous (x_.rs == 1): per k pair, the panel's 32 rows at k
    // and at k + 1 interleaved, 8 rows' pairs (16 f32) to each group.
    const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    const __mmask16 rmask[2] = {mask16_from(rows), mask16_from(rows - kTile)};
    for (std::int64_t k = 0; k < kb32; k += 2) {
      for (std::int64_t h = 0; h < 2; ++h) {  // rows 16 h .. 16 h + 15: groups 2 h and 2 h + 1
        const float* at = x + m0 + h * kTile + (k0 + k) * x_.cs;
        const __m512 r0 = k < kb ? _mm512_maskz_loadu_ps(rmask[h], at) : _mm512_setzero_ps();
        const __m512 r1 = k + 1 < kb ? _mm512_maskz_loadu_ps(rmask[h], at + x_.cs) : _mm512_setzero_ps();
        float* o = out + 2 * h * kG * kb32 + k * kG;
        _mm512_store_ps(o, _mm512_permutex2var_ps(r0, lo_idx, r1));
        _mm512_store_ps(o + kG * kb32, _mm512_permutex2var_ps(r0, hi_idx, r1));
      }
    }
  }

  // X row `row`'s k [k0, k0 + kb) of f32 (K-contiguous) into L2.
  void prefetch_f32_row(const float* x, std::int64_t row, std::int64_t k0, std::int64_t kb) const {
    const auto* at = reinterpret_cast<const char*>(x + row * x_.rs + k0);
    for (std::int64_t b = 0; b < kb * 4; b += 64) prefetch_l2(at + b);
  }

  // X row `row`'s k [k0, k0 + kb) (K-contiguous) into L1, or L2 when kIntoL2.
  template <bool kIntoL2 = false>
  void prefetch_row(const std::uint16_t* x, std::int64_t row, std::int64_t k0, std::int64_t kb) const {
    const auto* at = reinterpret_cast<const char*>(x + row * x_.rs + k0);
    for (std::int64_t b = 0; b < kb * 2; b += 64) {
      if constexpr (kIntoL2) {
        prefetch_l2(at + b);
      } else {
        prefetch_l1(at + b);
      }
    }
  }

  // Y k [k0, k0 + kb) x columns [n0, n0 + nb) -> VNNI tiles: for each 16
  // columns t, kb32 / 2 rows of 16 (k, k + 1) pairs; zero-padded.
  // y: Y's elements, of y_.dtype (as pack_x's).
  void pack_y(const void* y, std::int64_t k0, std::int64_t kb, std::int64_t kb32, std::int64_t n0, std::int64_t nb,
              std::int64_t nb32, std::uint16_t* out) const {
    if constexpr (kYF32) {
      if (y_.dtype == DType::f32) {
        pack_y_f32(static_cast<const float*>(y), k0, kb, kb32, n0, nb, nb32, reinterpret_cast<float*>(out));
        return;
      }
    }
    pack_y_vnni(static_cast<const std::uint16_t*>(y), k0, kb, kb32, n0, nb, nb32, out);
    if constexpr (kYF32) {
      if (y_.dtype == DType::f16) {
        widen_f16_rows(out, nb32 * kb32 / 2);
      } else {
        widen_rows(out, nb32 * kb32 / 2);
      }
    }
  }
  // widen_rows for f16 pairs: the 32 halves of a row of 16 pairs put in
  // order k, k, ..., k + 1, k + 1, ... (one vpermw), then converted.
  static void widen_f16_rows(std::uint16_t* out, std::int64_t n) {
    const auto* pairs = reinterpret_cast<const std::uint32_t*>(out);
    auto* f = reinterpret_cast<float*>(out);
    const __m512i split = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1,  //
                                           30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    for (std::int64_t i = n - 16; i >= 0; i -= 16) {
      const __m512i v = _mm512_permutexvar_epi16(split, _mm512_loadu_si512(pairs + i));
      _mm512_storeu_ps(f + 2 * i, _mm512_cvtph_ps(_mm512_castsi512_si256(v)));
      _mm512_storeu_ps(f + 2 * i + 16, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1)));
    }
  }
  // pack_y for YVnni<F32> from f32 Y: per 16 columns, [kb32][16] f32 (a
  // VNNI row's 16 k values, then its 16 k + 1 values, are rows k and k + 1).
  void pack_y_f32(const float* y, std::int64_t k0, std::int64_t kb, std::int64_t kb32, std::int64_t n0, std::int64_t nb,
                  std::int64_t nb32, float* out) const {
    if (y_.cs == 1) {  // rows (k) N-contiguous: copies of 16 columns
      for (std::int64_t k = 0; k < kb32; ++k) {
        for (std::int64_t nn = 0; nn < nb32; nn += kTile) {
          const __m512 row = k < kb ? _mm512_maskz_loadu_ps(mask16_from(nb - nn), y + (k0 + k) * y_.rs + n0 + nn)
                                    : _mm512_setzero_ps();
          _mm512_storeu_ps(out + nn * kb32 + k * kTile, row);
        }
      }
      return;
    }
    // Columns K-contiguous (y_.rs == 1): a 16 x 16 transpose per 16 columns
    // x 16 k.
    for (std::int64_t nn = 0; nn < nb32; nn += kTile) {
      float* t = out + nn * kb32;
      for (std::int64_t kk = 0; kk < kb32; kk += kTile) {
        const __mmask16 kmask = mask16_from(kb - kk);
        __m512 v[kTile];
        for (std::int64_t j = 0; j < kTile; ++j) {
          v[j] = nn + j < nb ? _mm512_maskz_loadu_ps(kmask, y + (n0 + nn + j) * y_.cs + k0 + kk) : _mm512_setzero_ps();
        }
        transpose16_ps(v);
        for (std::int64_t i = 0; i < kTile; ++i) _mm512_storeu_ps(t + (kk + i) * kTile, v[i]);
      }
    }
  }
  // n VNNI u32 at out (rows of 16 (k, k + 1) pairs, n a multiple of 16) ->
  // 2 n f32 in place: each row of 16 pairs becomes the 16 k values, then the
  // 16 k + 1 values. From the end, as widen_pairs.
  static void widen_rows(std::uint16_t* out, std::int64_t n) {
    const auto* pairs = reinterpret_cast<const std::uint32_t*>(out);
    auto* f = reinterpret_cast<float*>(out);
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000U));
    for (std::int64_t i = n - 16; i >= 0; i -= 16) {
      const __m512i v = _mm512_loadu_si512(pairs + i);
      _mm512_storeu_si512(f + 2 * i, _mm512_slli_epi32(v, 16));
      _mm512_storeu_si512(f + 2 * i + 16, _mm512_and_si512(v, high));
    }
  }
  void pack_y_vnni(const std::uint16_t* y, std::int64_t k0, std::int64_t kb, std::int64_t kb32, std::int64_t n0,
                   std::int64_t nb, std::int64_t nb32, std::uint16_t* out) const {
    const std::int64_t rows_per_tile = kb32 / 2;
    if (y_.cs == 1) {  // rows (k) N-contiguous: interleave row pairs, each pair's columns in one run
      for (std::int64_t kp = 0; kp < rows_per_tile; ++kp) {
        const std::int64_t k = 2 * kp;
        for (std::int64_t nn = 0; nn < nb32; nn += 32) {
          const __mmask32 cmask = mask32(nb - nn);
          std::uint16_t* t0 = out + (nn / kTile) * rows_per_tile * 32;
          std::uint16_t* t1 = t0 + rows_per_tile * 32;
          const __m512i r0 = k < kb && nn < nb ? _mm512_maskz_loadu_epi16(cmask, y + (k0 + k) * y_.rs + n0 + nn)
                                               : _mm512_setzero_si512();
          const __m512i r1 = k + 1 < kb && nn < nb ? _mm512_maskz_loadu_epi16(cmask, y + (k0 + k + 1) * y_.rs + n0 + nn)
                                                   : _mm512_setzero_si512();
          __m512i lo;  // columns 0-15
          __m512i hi;  // 16-31
          interleave_pairs(r0, r1, lo, hi);
          _mm512_storeu_si512(t0 + kp * 32, lo);
          _mm512_storeu_si512(t1 + kp * 32, hi);
        }
      }
      return;
    }
    // Columns K-contiguous (y_.rs == 1): a (k, k + 1) pair is one u32 of a
    // column; a 16 x 16 u32 transpose per 16 columns x 32 k.
    alignas(64) std::uint32_t block[kTile * kTile];
    const __m512i cols = column_offsets(kTile);
    for (std::int64_t nn = 0; nn < nb32; nn += kTile) {
      std::uint16_t* t = out + (nn / kTile) * rows_per_tile * 32;
      for (std::int64_t kk = 0; kk < kb32; kk += 32) {
        const __mmask32 kmask = mask32(kb - kk);
        for (std::int64_t j = 0; j < kTile; ++j) {
          const __m512i v = nn + j < nb ? _mm512_maskz_loadu_epi16(kmask, y + (n0 + nn + j) * y_.cs + k0 + kk)
                                        : _mm512_setzero_si512();
          _mm512_store_si512(block + j * kTile, v);
        }
        for (std::int64_t kp = 0; kp < kTile; ++kp) {
          const __m512i row =
              _mm512_i32gather_epi32(_mm512_add_epi32(cols, _mm512_set1_epi32(static_cast<int>(kp))), block, 4);
          _mm512_storeu_si512(t + (kk / 2 + kp) * 32, row);
        }
      }
    }
  }

 private:
  View x_, y_;
  bool x_kcontig_ = false;  // X's rows are K-contiguous: packing is a copy
};

}  // namespace
}  // namespace grpo::kernels::blocked
