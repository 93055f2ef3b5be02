// The AMX register block of the amx GEMM backend (gemm_amx.cpp) over the
// blocked GEMM of gemm_blocked.hpp (its contract: gemm_micro.hpp): 2 x 2 accumulator tiles (32 x 32 f32 of
// C), 2 X tiles (16 rows x 32 k), 2 Y tiles (32 k x 16 columns) = the 8
// tiles of palette 1. Per k step of 32: 4 tile loads, 4 tdpbf16ps.
//
// The tile instructions come from a Tiles policy: AmxTiles (gemm_amx.cpp,
// the AMX intrinsics) in the library, and in the tests a scalar emulation of
// the same instructions (tests/gemm_amx_emulated.cpp), so that the GEMM tester
// runs this block, with the blocked GEMM's packing and stores around it, on
// every CPU with AVX-512, not only where AMX is. A Tiles policy has
// kName and kSwappedName; load_config(const TileConfig*); release();
// zero<t>(); load<t>(base, stride_bytes); store<t>(base, stride_bytes);
// dpbf16ps<c, a, b>() (tile numbers t, c, a, b as template arguments: the
// intrinsics take them as immediates).
//
// Only for translation units compiled with AVX-512F/BW/DQ/VL (and AMX-TILE,
// AMX-BF16 for AmxTiles); everything is in an unnamed namespace.
#pragma once

#include <cstdint>
#include <new>

#include "kernels/amx_tile_config.hpp"
#include "kernels/gemm_backend.hpp"
#include "kernels/gemm_epilogue_avx512.hpp"
#include "kernels/gemm_micro.hpp"
#include "kernels/gemm_pack_avx512.hpp"

namespace grpo::kernels::blocked {
namespace {

template <class Tiles>
struct AmxMicro {
  static constexpr GemmBackendKind kKind = GemmBackendKind::amx;
  static constexpr const char* kName = Tiles::kName;
  static constexpr const char* kSwappedName = Tiles::kSwappedName;
  static constexpr std::size_t kStateBytes = sizeof(TileConfig);
  // Each tdpbf16ps: a 16-row X tile by a 16-column Y tile over 32 k.
  static constexpr std::int64_t kMr = kTile;
  static constexpr std::int64_t kNr = kTile;
  static constexpr std::int64_t kKr = kKStep;
  static constexpr std::int64_t kPanelRows = kPanel;  // 2 x 2 accumulator tiles
  static constexpr std::size_t kYBlockBytes = blocked::kYBlockBytes;
  using XLayout = XTiles;  // X always packed into 16 x 32 tiles
  using YLayout = YVnni<Bf16>;
  using Packer = Avx512Packer<XLayout, YLayout>;
  using Epilogue = Avx512Epilogue;
  using Output = StagedTiles;                   // finished tiles leave through tile stores
  static constexpr bool kWholeSharedY = false;  // measured on a Xeon with the L2-sized Y blocks

  static void begin(void* state) { Tiles::load_config(new (state) TileConfig(TileConfig::full())); }
  static void end() { Tiles::release(); }

  template <class Sink>
  static void block(const MicroBlock& blk, const Sink& sink) {
    const std::uint16_t* xp = blk.x;
    const std::uint16_t* y0 = blk.y0;
    const std::uint16_t* y1 = blk.y1;
    const std::int64_t kb32 = blk.kb32;
    float* acc_at = blk.acc;
    const std::int64_t acc_ld = blk.acc_ld;
    const auto acc_stride = static_cast<long>(acc_ld * sizeof(float));
    if (blk.first) {
      Tiles::template zero<0>();
      Tiles::template zero<1>();
      Tiles::template zero<2>();
      Tiles::template zero<3>();
    } else {
      Tiles::template load<0>(acc_at, acc_stride);
      Tiles::template load<1>(acc_at + kTile, acc_stride);
      Tiles::template load<2>(acc_at + kTile * acc_ld, acc_stride);
      Tiles::template load<3>(acc_at + kTile * acc_ld + kTile, acc_stride);
    }
    for (std::int64_t kk = 0; kk < kb32; kk += kKStep) {
      Tiles::template load<4>(xp + kk * kPanel, 64);
      Tiles::template load<5>(xp + kk * kPanel + kTile * kKStep, 64);
      Tiles::template load<6>(y0 + kk * 16, 64);
      Tiles::template load<7>(y1 + kk * 16, 64);
      Tiles::template dpbf16ps<0, 4, 6>();
      Tiles::template dpbf16ps<1, 4, 7>();
      Tiles::template dpbf16ps<2, 5, 6>();
      Tiles::template dpbf16ps<3, 5, 7>();
    }
    if (!blk.last) {
      Tiles::template store<0>(acc_at, acc_stride);
      Tiles::template store<1>(acc_at + kTile, acc_stride);
      Tiles::template store<2>(acc_at + kTile * acc_ld, acc_stride);
      Tiles::template store<3>(acc_at + kTile * acc_ld + kTile, acc_stride);
      return;
    }
    float* staged = sink.staged();
    Tiles::template store<0>(staged, 64);
    Tiles::template store<1>(staged + kTile * kTile, 64);
    Tiles::template store<2>(staged + 2 * kTile * kTile, 64);
    Tiles::template store<3>(staged + 3 * kTile * kTile, 64);
  }
};

}  // namespace
}  // namespace grpo::kernels::blocked
