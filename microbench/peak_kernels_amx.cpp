// The AMX chain of peak_kernels.hpp. This file alone is compiled with
// -mamx-tile -mamx-bf16 (microbench/CMakeLists.txt); nothing here runs
// unless the probe found AMX-BF16 and got the tile permission at run time.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "peak_kernels.hpp"

namespace grpo::bench {
namespace {

// The 64-byte LDTILECFG operand (Intel SDM vol. 1, 3.4 "AMX"): palette 1,
// then bytes per row of tiles 0-15 (u16 each) and rows of tiles 0-15 (u8 each).
struct alignas(64) TileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

constexpr int kTileRows = 16;
constexpr int kTileBytesPerRow = 64;  // the maximum: 16 f32 or 32 bf16 per row

}  // namespace

float amx_bf16_chains(std::int64_t iterations) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = kTileBytesPerRow;
    cfg.rows[t] = kTileRows;
  }
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
