// The AMX-BF16 GEMM backend: the blocked GEMM of gemm_blocked.hpp with
// tdpbf16ps register tiles. Register blocking: 2 x 2 accumulator tiles
// (32 x 32 f32 of C), 2 X tiles (16 rows x 32 k), 2 Y tiles (32 k x 16
// columns) = the 8 tiles of palette 1.
//
// This file alone is compiled with -mamx-tile -mamx-bf16 -mavx512bf16 (and
// AVX-512F/BW/VL); nothing here runs unless amx_usable() said yes: the probe
// and the gate are in gemm_dispatch.cpp, compiled for any x86-64 (a compiler
// may use the wider ISA anywhere in this file, even before a check: an
// ASan build did, and a Zen 3 died of SIGILL in make_amx_gemm's prologue).
#include <immintrin.h>

#include <cstdint>
#include <new>

#include "kernels/gemm_blocked.hpp"

namespace grpo::kernels {
namespace {

// The 64-byte LDTILECFG operand (Intel SDM vol. 1, 3.4): palette 1, bytes per
// row and rows of tiles 0-15. Every tile used here is full: 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

struct AmxMicro {
  static constexpr GemmBackendKind kKind = GemmBackendKind::amx;
  static constexpr const char* kName = "grpo:amx_bf16";
  static constexpr const char* kSwappedName = "grpo:amx_bf16 (swapped)";
  static constexpr std::size_t kStateBytes = sizeof(TileConfig);
  static constexpr std::int64_t kXGroupRows = 0;  // X packed as 16 x 32 tiles
  static constexpr bool kWholeSharedY = false;    // measured on a Xeon with the L2-sized Y blocks
  static constexpr bool kDirectC = false;         // finished tiles leave through tile stores (staged)
  static constexpr bool kXInPlace = false;        // X always packed into tiles
  static constexpr bool kXF32 = false;            // X packed as bf16
  static constexpr bool kYF32 = false;            // Y packed as bf16

  static void begin(void* state) {
    auto* cfg = new (state) TileConfig{};
    for (int t = 0; t < 8; ++t) {
      cfg->colsb[t] = 64;
      cfg->rows[t] = kTile;
    }
    _tile_loadconfig(cfg);
  }
  static void end() { _tile_release(); }

  static void block(const std::uint16_t* xp, const std::uint16_t* y0, const std::uint16_t* y1, std::int64_t kb32,
                    float* acc_at, std::int64_t acc_ld, bool first, bool last, float* staged) {
    const auto acc_stride = static_cast<long>(acc_ld * sizeof(float));
    if (first) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    } else {
      _tile_loadd(0, acc_at, acc_stride);
      _tile_loadd(1, acc_at + kTile, acc_stride);
      _tile_loadd(2, acc_at + kTile * acc_ld, acc_stride);
      _tile_loadd(3, acc_at + kTile * acc_ld + kTile, acc_stride);
    }
    for (std::int64_t kk = 0; kk < kb32; kk += kKStep) {
      _tile_loadd(4, xp + kk * kPanel, 64);
      _tile_loadd(5, xp + kk * kPanel + kTile * kKStep, 64);
      _tile_loadd(6, y0 + kk * 16, 64);
      _tile_loadd(7, y1 + kk * 16, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    if (!last) {
      _tile_stored(0, acc_at, acc_stride);
      _tile_stored(1, acc_at + kTile, acc_stride);
      _tile_stored(2, acc_at + kTile * acc_ld, acc_stride);
      _tile_stored(3, acc_at + kTile * acc_ld + kTile, acc_stride);
      return;
    }
    _tile_stored(0, staged, 64);
    _tile_stored(1, staged + kTile * kTile, 64);
    _tile_stored(2, staged + 2 * kTile * kTile, 64);
    _tile_stored(3, staged + 3 * kTile * kTile, 64);
  }
};

}  // namespace

std::unique_ptr<GemmBackend> detail::make_amx_gemm_on_cpu(const GemmSpec& spec) {
  if (!serves(spec)) return nullptr;
  return std::make_unique<BlockedGemm<AmxMicro>>(spec);
}

}  // namespace grpo::kernels
