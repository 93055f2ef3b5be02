// The AMX chain of peak_kernels.hpp. This file alone is compiled with
// -mamx-tile -mamx-bf16 (microbench/CMakeLists.txt); nothing here runs
// unless the probe found AMX-BF16 and got the tile permission at run time.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/amx_tile_config.hpp"
#include "peak_kernels.hpp"

namespace grpo::bench {
namespace {

using kernels::TileConfig;
constexpr int kTileRows = TileConfig::kMaxRows;
constexpr int kTileBytesPerRow = TileConfig::kMaxRowBytes;  // 16 f32 or 32 bf16 per row

}  // namespace

float amx_bf16_chains(std::int64_t iterations) {
  const TileConfig cfg = TileConfig::full();
  // Sources: bf16 0x3a80 = 2^-10 everywhere (C gains 32 * 2^-20 per
  // instruction, nowhere near overflow in a call).
  alignas(64) std::uint16_t src[kTileRows * kTileBytesPerRow / 2];
  for (std::uint16_t& v : src) v = 0x3a80;
  alignas(64) float out[kTileRows * kTileBytesPerRow / 4];

  _tile_loadconfig(&cfg);
  // tmm0-3 accumulate (independent chains), tmm4-5 hold A, tmm6-7 hold B.
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, src, kTileBytesPerRow);
  _tile_loadd(5, src, kTileBytesPerRow);
  _tile_loadd(6, src, kTileBytesPerRow);
  _tile_loadd(7, src, kTileBytesPerRow);
  for (std::int64_t i = 0; i < iterations; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  float sum = 0.0F;
  _tile_stored(0, out, kTileBytesPerRow);
  sum += out[0];
  _tile_stored(3, out, kTileBytesPerRow);
  sum += out[0];
  _tile_release();
  return sum;
}

}  // namespace grpo::bench
