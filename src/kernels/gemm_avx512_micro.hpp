// The AVX-512 register blocks of the avx512bf16 and avx512fma GEMM backends
// (gemm_avx512_bf16.cpp, gemm_avx512_fma.cpp) over the blocked GEMM of
// gemm_blocked.hpp (its contract: gemm_micro.hpp). Each 32 x 32 block is four 8-row groups; a
// group keeps 8 rows x 2 x 16 columns of f32 accumulators (16 zmm), and per
// pair of k takes the two packed Y rows (16 columns x one (k, k + 1) pair
// each) and each row's X pair. Every element is summed over k in ascending
// order, whatever M or N. A finished group goes from its registers to C
// (gemm_epilogue_avx512.hpp's store_group, transposed when swapped) while the next
// group computes. Two register blocks:
//
// avx512bf16: vdpbf16ps, 16 per 2 loads and 8 broadcasts of X pairs, from
// the packed group or, for K-contiguous X rows, from the rows in place.
// The default for bf16 GEMMs on AMD CPUs with AVX512-BF16 (no AMX): on a
// Zen 4 (docs/benchmarks.md) the headline step takes 8-10% less time than
// with oneDNN 2.6 (92.5-92.6% of the vdpbf16ps peak at the default 640 MiB
// workspace budget) and the T=512 step 11-20%.
//
// avx512fma: f32 FMAs, 32 per 4 loads of Y and 16 broadcasts of X, on X and
// Y widened to f32 as they are packed (exact: a bf16 is the top half of an
// f32, and a product of two is exact in f32; an f16 is an f32 too, f32
// operands beside f16 ones are packed as they are). The default on Intel CPUs
// with AVX-512 where AMX does not serve: their vdpbf16ps runs at half the
// FLOP rate of their FMAs, or they have none (gemm_registry.cpp); and for
// an f16 A or B on every AVX-512 CPU. Its bits differ from
// avx512bf16's (vdpbf16ps adds a pair's two products before the
// accumulator; here each product goes to the accumulator in turn).
//
// GRPO_GEMM=avx512bf16 or avx512fma (or the microbench's gemm_backend)
// forces one, and the GEMM tester holds both to the double reference
// wherever the CPU can run them.
//
// Only for translation units compiled with AVX-512F/BW/DQ/VL (and
// AVX512-BF16 for Avx512Micro<false>); everything is in an unnamed namespace.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/gemm_backend.hpp"
#include "kernels/gemm_epilogue_avx512.hpp"
#include "kernels/gemm_micro.hpp"
#include "kernels/gemm_pack_avx512.hpp"

namespace grpo::kernels::blocked {
namespace {

constexpr std::int64_t kGroupRows = 8;  // rows of C per register group (16 accumulators + 2 Y + 1 broadcast of 32 zmm)

// kWiden false: avx512bf16, vdpbf16ps on bf16 pairs. kWiden true:
// avx512fma, the same register block in f32 FMAs on X and Y packed as f32
// (each X value a broadcast from memory). Widening Y in registers instead
// (a shift and a mask per zmm, shared by the group's 8 rows) measured
// 151-153 GFLOP/s at the step's three shapes against 151-165 (Xeon model
// 207, one thread).
template <bool kWiden>
struct Avx512Micro {
  static constexpr GemmBackendKind kKind = kWiden ? GemmBackendKind::avx512_fma : GemmBackendKind::avx512_bf16;
  static constexpr const char* kName = kWiden ? "grpo:avx512_fma" : "grpo:avx512_bf16";
  static constexpr const char* kSwappedName = kWiden ? "grpo:avx512_fma (swapped)" : "grpo:avx512_bf16 (swapped)";
  static constexpr std::size_t kStateBytes = 0;
  // A group: 8 rows x 32 columns, one (k, k + 1) pair a step.
  static constexpr std::int64_t kMr = kGroupRows;
  static constexpr std::int64_t kNr = 2 * kTile;
  static constexpr std::int64_t kKr = 2;
  static constexpr std::int64_t kPanelRows = kPanel;  // four groups
  static constexpr std::size_t kYBlockBytes = blocked::kYBlockBytes;
  using Elem = std::conditional_t<kWiden, F32, Bf16>;  // X and Y packed as f32 when widening
  // X as [k pair][8 rows] per group; vdpbf16ps also reads K-contiguous X
  // rows where they are (MicroBlock::x_rs).
  using XLayout = XRowGroups<kGroupRows, Elem, !kWiden>;
  using YLayout = YVnni<Elem>;
  using Packer = Avx512Packer<XLayout, YLayout>;
  using Epilogue = Avx512Epilogue;
  using Output = DirectGroups;  // finished groups go from registers to C
  static constexpr bool kWholeSharedY = true;

  static void begin(void* /*state*/) {}
  static void end() {}

  // Row r's (k, k + 1) pair p of a group: x_at(r, p) -> its u32 (bf16), or
  // its two f32 (kWiden).
  template <class XAt>
  static void group(__m512 (&acc)[kGroupRows][2], const XAt& x_at, const std::uint16_t* y0, const std::uint16_t* y1,
                    std::int64_t kb32) {
    for (std::int64_t p = 0; p < kb32 / 2; ++p) {
      if constexpr (kWiden) {
        const float* fa = reinterpret_cast<const float*>(y0) + p * 32;
        const float* fb = reinterpret_cast<const float*>(y1) + p * 32;
        const __m512 ya0 = _mm512_loadu_ps(fa);
        const __m512 yb0 = _mm512_loadu_ps(fb);
        const __m512 ya1 = _mm512_loadu_ps(fa + 16);
        const __m512 yb1 = _mm512_loadu_ps(fb + 16);
        for (int r = 0; r < kGroupRows; ++r) {
          const __m512 x = _mm512_set1_ps(x_at(r, p)[0]);
          acc[r][0] = _mm512_fmadd_ps(x, ya0, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(x, yb0, acc[r][1]);
        }
        for (int r = 0; r < kGroupRows; ++r) {
          const __m512 x = _mm512_set1_ps(x_at(r, p)[1]);
          acc[r][0] = _mm512_fmadd_ps(x, ya1, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(x, yb1, acc[r][1]);
        }
      } else {
        const __m512i ya = _mm512_loadu_si512(y0 + p * 32);
        const __m512i yb = _mm512_loadu_si512(y1 + p * 32);
        for (int r = 0; r < kGroupRows; ++r) {
          std::uint32_t pair = 0;
          std::memcpy(&pair, x_at(r, p), sizeof(pair));
          const auto xb = std::bit_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, std::bit_cast<__m512bh>(ya));
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, std::bit_cast<__m512bh>(yb));
        }
      }
    }
  }

  // blk.x_rs 0: blk.x is a packed panel, [kb32 / 2][8 rows] u32 (or 2 f32)
  // per group (XRowGroups); else blk.x is X's first row in place, rows x_rs
  // elements apart.
  template <class Sink>
  static void block(const MicroBlock& blk, const Sink& sink) {
    const std::uint16_t* xp = blk.x;
    const std::int64_t x_rs = blk.x_rs;
    const std::uint16_t* y0 = blk.y0;
    const std::uint16_t* y1 = blk.y1;
    const std::int64_t kb32 = blk.kb32;
    float* acc_at = blk.acc;
    const std::int64_t acc_ld = blk.acc_ld;
    const bool first = blk.first;
    const bool last = blk.last;
    for (std::int64_t g = 0; g < kPanel; g += kGroupRows) {
      __m512 acc[kGroupRows][2];
      for (int r = 0; r < kGroupRows; ++r) {
        for (int h = 0; h < 2; ++h) {
          acc[r][h] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_at + (g + r) * acc_ld + h * kTile);
        }
      }
      if (kWiden || x_rs == 0) {
        // A group's pairs: 2 bf16 (u32) or 2 f32 each, kb32 elements per row.
        using XElem = std::conditional_t<kWiden, float, std::uint16_t>;
        const XElem* xg = reinterpret_cast<const XElem*>(xp) + g * kb32;
        const auto packed = [xg](int r, std::int64_t p) { return xg + (p * kGroupRows + r) * 2; };
        group(acc, packed, y0, y1, kb32);
      } else {
        const std::uint16_t* xr = xp + g * x_rs;
        const auto in_place = [xr, x_rs](int r, std::int64_t p) { return xr + r * x_rs + 2 * p; };
        group(acc, in_place, y0, y1, kb32);
      }
      if (last) {
        sink.group(g, 0, acc);
        continue;
      }
      for (int r = 0; r < kGroupRows; ++r) {
        for (int h = 0; h < 2; ++h) _mm512_storeu_ps(acc_at + (g + r) * acc_ld + h * kTile, acc[r][h]);
      }
    }
  }
};

}  // namespace
}  // namespace grpo::kernels::blocked
