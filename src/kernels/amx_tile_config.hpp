// The 64-byte LDTILECFG operand (Intel SDM vol. 1, 3.4 "AMX"): palette, start
// row, 14 reserved bytes, then bytes per row of tiles 0-15 (u16 each) and
// rows of tiles 0-15 (u8 each). Plain data: no AMX instruction here, so the
// AMX GEMM backend (gemm_amx_micro.hpp), its emulation in the tests and the
// machine-peak probe (microbench/peak_kernels_amx.cpp) share it.
#pragma once

#include <cstdint>

namespace grpo::kernels {

struct alignas(64) TileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};

  static constexpr int kMaxRows = 16;
  static constexpr int kMaxRowBytes = 64;
  static constexpr int kPalette1Tiles = 8;

  // Palette 1 with its 8 tiles full: 16 rows x 64 bytes each.
  static TileConfig full() {
    TileConfig cfg;
    for (int t = 0; t < kPalette1Tiles; ++t) {
      cfg.colsb[t] = kMaxRowBytes;
      cfg.rows[t] = kMaxRows;
    }
    return cfg;
  }
};
static_assert(sizeof(TileConfig) == 64);

}  // namespace grpo::kernels
