// A scalar emulation of the AMX tile instructions the amx backend uses
// (LDTILECFG, TILERELEASE, TILEZERO, TILELOADD, TILESTORED, TDPBF16PS), after
// their pseudocode in the Intel SDM (vol. 2A for LDTILECFG, 2B for the
// others), palette 1: 8 tiles of up to 16 rows x 64 bytes.
// - LDTILECFG zeroes every tile; palette 0 returns to the unconfigured state.
// - A load fills the configured rows and bytes and zeroes the rest of the
//   tile; TDPBF16PS zeroes what lies past C's configured rows and bytes.
// - TDPBF16PS, per row m of C: over the k pairs in order, the products of
//   A's bf16 element 2k (2k + 1) and B's row k element 2n (2n + 1) summed
//   into an even (odd) f32 sum of its own that starts at zero; then C[m][n]
//   += even + odd. bf16 inputs and C whose exponent is zero are taken as
//   zero (DAZ), results that come out subnormal are flushed (FTZ), rounding
//   to nearest even. A product of two bf16 values is exact in f32, so a
//   multiply-add here rounds once whether or not the compiler fuses it,
//   except for products below f32's normal range (FTZ'd either way).
// Misuse the SDM says faults aborts with a message: LDTILECFG with nonzero
// reserved bytes, a palette other than 0 or 1, a tile past the palette's 8
// or larger than it, rows or bytes zero but not both, start_row nonzero (a
// restart this emulation does not do); a tile instruction before
// LDTILECFG, after TILERELEASE, or on an unconfigured tile; TDPBF16PS on
// tiles that are not three distinct ones or whose shapes do not fit.
// The order is the SDM's; whether the hardware's own order and rounding
// match it bit for bit was not checked (the machines that wrote this had no
// AMX), and nothing here relies on it: the tester compares with a double
// reference within the f32 error bound.
//
// Compiled with AVX-512F/BW/DQ/VL (tests/CMakeLists.txt), like the blocked
// GEMM it instantiates; test_gemm.cpp calls in only where
// amx_emulation_runs().
#include "gemm_amx_emulated.hpp"

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kernels/gemm_amx_micro.hpp"
#include "kernels/gemm_blocked.hpp"

namespace grpo::kernels {
namespace {

struct EmulatedTiles {
  static constexpr const char* kName = "grpo:amx_bf16 (emulated)";
  static constexpr const char* kSwappedName = "grpo:amx_bf16 (emulated, swapped)";
  static constexpr int kTiles = TileConfig::kPalette1Tiles;
  static constexpr int kRows = TileConfig::kMaxRows;
  static constexpr int kRowBytes = TileConfig::kMaxRowBytes;

  struct State {
    bool configured = false;
    std::uint8_t rows[kTiles] = {};
    std::uint16_t colsb[kTiles] = {};
    alignas(64) std::uint8_t tile[kTiles][kRows][kRowBytes] = {};
  };
  static State& state() {
    thread_local State s;
    return s;
  }
  [[noreturn]] static void fault(const char* what) {
    std::fprintf(stderr, "emulated AMX: %s\n", what);
    std::abort();
  }

  static void load_config(const TileConfig* cfg) {
    const auto* bytes = reinterpret_cast<const std::uint8_t*>(cfg);
    for (int i = 2; i < 16; ++i) {
      if (bytes[i] != 0) fault("LDTILECFG: reserved bytes 2-15 not zero");
    }
    if (cfg->palette == 0) {  // back to the INIT state
      release();
      return;
    }
    if (cfg->palette != 1) fault("LDTILECFG: palette other than 0 or 1");
    if (cfg->start_row != 0) fault("LDTILECFG: start_row not zero (a restart, not emulated)");
    for (int t = 0; t < 16; ++t) {
      const bool rows_zero = cfg->rows[t] == 0;
      const bool cols_zero = cfg->colsb[t] == 0;
      if (t >= kTiles && !(rows_zero && cols_zero)) fault("LDTILECFG: a tile past palette 1's 8");
      if (rows_zero != cols_zero) fault("LDTILECFG: rows or bytes of a tile zero, but not both");
      if (t < kTiles && (cfg->rows[t] > kRows || cfg->colsb[t] > kRowBytes)) fault("LDTILECFG: tile too large");
    }
    State& s = state();
    for (int t = 0; t < kTiles; ++t) {
      s.rows[t] = cfg->rows[t];
      s.colsb[t] = cfg->colsb[t];
    }
    std::memset(s.tile, 0, sizeof(s.tile));  // LDTILECFG zeroes the tiles
    s.configured = true;
  }
  static void release() { state() = State{}; }
  // The state, configured, with tile t configured.
  static State& with_tile(int t) {
    State& s = state();
    if (!s.configured) fault("a tile instruction without a tile configuration (LDTILECFG)");
    if (s.rows[t] == 0) fault("a tile instruction on an unconfigured tile");
    return s;
  }
  template <int t>
  static void zero() {
    std::memset(with_tile(t).tile[t], 0, sizeof(State::tile[t]));
  }
  template <int t>
  static void load(const void* base, long stride) {
    State& s = with_tile(t);
    std::memset(s.tile[t], 0, sizeof(State::tile[t]));
    for (int r = 0; r < s.rows[t]; ++r)
      std::memcpy(s.tile[t][r], static_cast<const char*>(base) + r * stride, s.colsb[t]);
  }
  template <int t>
  static void store(void* base, long stride) {
    State& s = with_tile(t);
    for (int r = 0; r < s.rows[t]; ++r) std::memcpy(static_cast<char*>(base) + r * stride, s.tile[t][r], s.colsb[t]);
  }

  // DAZ: a zero exponent (a denormal or zero) is zero.
  static float daz(float v) { return std::fabs(v) < FLT_MIN ? std::copysign(0.0F, v) : v; }
  static float bf16_daz(const std::uint8_t* at) {
    std::uint16_t h = 0;
    std::memcpy(&h, at, 2);
    return daz(std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16));
  }
  // FTZ: a subnormal result is zero (the same test).
  static float ftz(float v) { return daz(v); }

  template <int c, int a, int b>
  static void dpbf16ps() {
    static_assert(c != a && c != b && a != b, "TDPBF16PS takes three distinct tiles");
    State& s = with_tile(c);
    with_tile(a);
    with_tile(b);
    const int m_rows = s.rows[c];
    const int n_cols = s.colsb[c] / 4;
    const int k_pairs = s.colsb[a] / 4;
    if (s.colsb[c] % 4 != 0 || s.colsb[a] % 4 != 0 || s.rows[a] != m_rows || s.colsb[b] != s.colsb[c] ||
        s.rows[b] != k_pairs) {
      fault("TDPBF16PS: tile shapes");
    }
    // The bf16 inputs as f32 (DAZ), [row][element].
    float av[kRows][kRowBytes / 2];
    float bv[kRows][kRowBytes / 2];
    for (int r = 0; r < kRows; ++r) {
      for (int e = 0; e < kRowBytes / 2; ++e) {
        av[r][e] = bf16_daz(s.tile[a][r] + 2 * e);
        bv[r][e] = bf16_daz(s.tile[b][r] + 2 * e);
      }
    }
    for (int m = 0; m < m_rows; ++m) {
      float even[kRowBytes / 4] = {};
      float odd[kRowBytes / 4] = {};
      for (int k = 0; k < k_pairs; ++k) {
        for (int n = 0; n < n_cols; ++n) {
          even[n] = ftz(even[n] + av[m][2 * k] * bv[k][2 * n]);
          odd[n] = ftz(odd[n] + av[m][2 * k + 1] * bv[k][2 * n + 1]);
        }
      }
      float row[kRowBytes / 4] = {};
      std::memcpy(row, s.tile[c][m], sizeof(row));
      for (int n = 0; n < n_cols; ++n) row[n] = ftz(daz(row[n]) + ftz(even[n] + odd[n]));
      for (int n = n_cols; n < kRowBytes / 4; ++n) row[n] = 0.0F;  // past C's bytes: zeroed
      std::memcpy(s.tile[c][m], row, sizeof(row));
    }
    for (int m = m_rows; m < kRows; ++m) std::memset(s.tile[c][m], 0, kRowBytes);  // past C's rows: zeroed
  }
};

}  // namespace

namespace testing {

std::unique_ptr<GemmBackend> make_emulated_amx_gemm(const GemmSpec& spec) {
  if (!blocked::serves(spec)) return nullptr;
  return std::make_unique<blocked::BlockedGemm<blocked::AmxMicro<EmulatedTiles>>>(spec);
}

}  // namespace testing
}  // namespace grpo::kernels
