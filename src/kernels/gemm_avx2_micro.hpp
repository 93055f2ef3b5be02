// The AVX2 register block of the avx2 GEMM backend (gemm_avx2.cpp) over the
// blocked GEMM of gemm_blocked.hpp (its contract: gemm_micro.hpp): 6 rows x
// 16 columns of C in 12 ymm f32 accumulators (with the two Y loads and the
// broadcast, 15 of the 16 ymm), per k two loads of Y and six broadcasts of
// X, twelve FMAs. A block is four such groups of rows against the two
// 16-column Y tiles. X and Y are packed as f32 (bf16 widened, exact), so
// every element of C is one FMA chain over k ascending (with bf16 inputs
// the bits of the reference loops and of the avx512fma backend: a product
// of two bf16 values is exact in f32).
//
// Only for translation units compiled with AVX2 and FMA; everything is in
// an unnamed namespace.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kernels/gemm_backend.hpp"
#include "kernels/gemm_epilogue_avx2.hpp"
#include "kernels/gemm_micro.hpp"
#include "kernels/gemm_pack_avx2.hpp"

namespace grpo::kernels::blocked {
namespace {

struct Avx2Micro {
  static constexpr GemmBackendKind kKind = GemmBackendKind::avx2;
  static constexpr const char* kName = "grpo:avx2_fma";
  static constexpr const char* kSwappedName = "grpo:avx2_fma (swapped)";
  static constexpr std::size_t kStateBytes = 0;
  static constexpr std::int64_t kMr = 6;
  static constexpr std::int64_t kNr = 16;
  static constexpr std::int64_t kKr = 2;  // the packed layouts' k pairs (one FMA chain a k)
  // Four groups a block, as the AVX-512 micro's block is four groups.
  static constexpr std::int64_t kPanelRows = 4 * kMr;
  // Half of the 512 KiB L2 of the cores it is the default on (Zen 2 and 3),
  // as the default kYBlockBytes is half of a 2 MiB L2.
  static constexpr std::size_t kYBlockBytes = std::size_t{256} << 10;
  using XLayout = XRowGroups<kMr, F32, false>;
  using YLayout = YVnni<F32>;  // per 16 columns, [kb32][16] f32
  using Packer = Avx2Packer<XLayout, YLayout, kPanelRows>;
  using Epilogue = Avx2Epilogue;
  using Output = DirectGroups;  // finished groups go from registers to C
  // A shared Y stays in L2 blocks: taken whole it would be 16 times such an L2.
  static constexpr bool kWholeSharedY = false;

  static void begin(void* /*state*/) {}
  static void end() {}

  template <class Sink>
  static void block(const MicroBlock& blk, const Sink& sink) {
    // Each Y tile against the panel's groups in turn, so that it is read
    // from L1 after the first group.
    for (std::int64_t h = 0; h < 2; ++h) {
      const auto* y = reinterpret_cast<const float*>(h == 0 ? blk.y0 : blk.y1);
      for (std::int64_t g = 0; g < kPanelRows; g += kMr) {
        // Group g's pairs: per k pair p, row r's k value at [p][r][0], k + 1's at [p][r][1].
        const float* xg = reinterpret_cast<const float*>(blk.x) + g * blk.kb32;
        group(xg, y, blk, blk.acc + g * blk.acc_ld + h * 16, g, h * 16, sink);
      }
    }
  }

 private:
  template <class Sink>
  static void group(const float* xg, const float* y, const MicroBlock& blk, float* acc, std::int64_t row,
                    std::int64_t col, const Sink& sink) {
    const std::int64_t ld = blk.acc_ld;
    const bool first = blk.first;
    // Twelve named accumulators: GCC keeps an array of __m256 in registers
    // but also stores it to the stack on every k (seen in the object code).
    const auto init = [&](std::int64_t r, std::int64_t h) {
      return first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * ld + h * 8);
    };
    __m256 c00 = init(0, 0), c01 = init(0, 1), c10 = init(1, 0), c11 = init(1, 1), c20 = init(2, 0), c21 = init(2, 1);
    __m256 c30 = init(3, 0), c31 = init(3, 1), c40 = init(4, 0), c41 = init(4, 1), c50 = init(5, 0), c51 = init(5, 1);
    // One k: rows' values 2 floats apart at xk, Y's 16 at yk; a row's two
    // accumulators take its broadcast value times each half of Y.
    const auto step = [&](const float* xk, const float* yk) {
      const __m256 b0 = _mm256_loadu_ps(yk);
      const __m256 b1 = _mm256_loadu_ps(yk + 8);
      const auto row = [&](const float* xr, __m256& lo, __m256& hi) {
        const __m256 x = _mm256_broadcast_ss(xr);
        lo = _mm256_fmadd_ps(x, b0, lo);
        hi = _mm256_fmadd_ps(x, b1, hi);
      };
      row(xk, c00, c01);
      row(xk + 2, c10, c11);
      row(xk + 4, c20, c21);
      row(xk + 6, c30, c31);
      row(xk + 8, c40, c41);
      row(xk + 10, c50, c51);
    };
    // k ascending: each pair's k, then its k + 1.
#pragma GCC unroll 2
    for (std::int64_t p = 0; p < blk.kb32 / 2; ++p) {
      step(xg + p * 2 * kMr, y + p * 32);
      step(xg + p * 2 * kMr + 1, y + p * 32 + 16);
    }
    const __m256 sums[kMr][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    if (blk.last) {
      sink.group(row, col, sums);
      return;
    }
    for (std::int64_t r = 0; r < kMr; ++r) {
      _mm256_storeu_ps(acc + r * ld, sums[r][0]);
      _mm256_storeu_ps(acc + r * ld + 8, sums[r][1]);
    }
  }
};

}  // namespace
}  // namespace grpo::kernels::blocked
