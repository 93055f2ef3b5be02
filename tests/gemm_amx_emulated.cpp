// A scalar emulation of the AMX tile instructions the amx backend uses
// (LDTILECFG, TILERELEASE, TILEZERO, TILELOADD, TILESTORED, TDPBF16PS), as the
// Intel SDM (vol. 2, chapter 3) defines them for palette 1: tiles of up to 16
// rows x 64 bytes; a load fills the configured rows and columns and zeroes
// the rest of the tile; TDPBF16PS adds, for each row m and f32 column n of
// C, over the k pairs in order, the products of A's (2k, 2k + 1) bf16 pair
// and B's k-th row's pair n, one product at a time, with bf16 inputs whose
// exponent is zero taken as zero and results flushed to zero when subnormal
// (round to nearest even, the f32 additions of this translation unit).
// Misuse the hardware would fault on (a tile used before LDTILECFG or after
// TILERELEASE, shapes TDPBF16PS does not accept, a palette other than 1)
// aborts with a message. The sums follow the SDM's order; whether the
// hardware's internal order matches bit for bit was not checked (the
// machines that wrote this had no AMX), and nothing here relies on it: the
// tester compares with a double reference within the f32 error bound.
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

namespace grpo::kernels {
namespace {

struct EmulatedTiles {
  static constexpr const char* kName = "grpo:amx_bf16 (emulated)";
  static constexpr const char* kSwappedName = "grpo:amx_bf16 (emulated, swapped)";
  static constexpr int kTiles = 8;
  static constexpr int kRows = 16;
  static constexpr int kRowBytes = 64;

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
  static State& configured() {
    State& s = state();
    if (!s.configured) fault("a tile instruction without a tile configuration (LDTILECFG)");
    return s;
  }

  static void load_config(const TileConfig* cfg) {
    if (cfg->palette != 1) fault("palette other than 1");
    State& s = state();
    for (int t = 0; t < kTiles; ++t) {
      if (cfg->rows[t] > kRows || cfg->colsb[t] > kRowBytes || cfg->colsb[t] % 4 != 0) fault("tile shape");
      s.rows[t] = cfg->rows[t];
      s.colsb[t] = cfg->colsb[t];
    }
    std::memset(s.tile, 0, sizeof(s.tile));  // LDTILECFG zeroes the tiles
    s.configured = true;
  }
  static void release() {
    State& s = state();
    s = State{};
  }
  template <int t>
  static void zero() {
    std::memset(configured().tile[t], 0, sizeof(State::tile[t]));
  }
  template <int t>
  static void load(const void* base, long stride) {
    State& s = configured();
    std::memset(s.tile[t], 0, sizeof(State::tile[t]));
    for (int r = 0; r < s.rows[t]; ++r) std::memcpy(s.tile[t][r], static_cast<const char*>(base) + r * stride, s.colsb[t]);
  }
  template <int t>
  static void store(void* base, long stride) {
    State& s = configured();
    for (int r = 0; r < s.rows[t]; ++r) std::memcpy(static_cast<char*>(base) + r * stride, s.tile[t][r], s.colsb[t]);
  }

  static float bf16_daz(const std::uint8_t* at) {
    std::uint16_t h = 0;
    std::memcpy(&h, at, 2);
    if ((h & 0x7f80U) == 0) h &= 0x8000U;  // a zero exponent: a denormal (or zero) input, taken as zero
    return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
  }
  static float ftz(float v) { return std::fabs(v) < FLT_MIN ? std::copysign(0.0F, v) : v; }

  template <int c, int a, int b>
  static void dpbf16ps() {
    State& s = configured();
    const int m_rows = s.rows[c];
    const int n_cols = s.colsb[c] / 4;
    const int k_pairs = s.colsb[a] / 4;
    if (s.rows[a] != m_rows || s.colsb[b] != s.colsb[c] || s.rows[b] != k_pairs) fault("TDPBF16PS tile shapes");
    // The bf16 inputs as f32 (DAZ), [row][element]; then per row of C, the
    // k pairs in order, each element of the row a sum of its own.
    float av[kRows][kRowBytes / 2];
    float bv[kRows][kRowBytes / 2];
    for (int r = 0; r < kRows; ++r) {
      for (int e = 0; e < kRowBytes / 2; ++e) {
        av[r][e] = bf16_daz(s.tile[a][r] + 2 * e);
        bv[r][e] = bf16_daz(s.tile[b][r] + 2 * e);
      }
    }
    for (int m = 0; m < m_rows; ++m) {
      float acc[kRowBytes / 4];
      std::memcpy(acc, s.tile[c][m], sizeof(acc));
      for (int k = 0; k < k_pairs; ++k) {
        for (int n = 0; n < n_cols; ++n) {
          acc[n] = ftz(acc[n] + av[m][2 * k] * bv[k][2 * n]);
          acc[n] = ftz(acc[n] + av[m][2 * k + 1] * bv[k][2 * n + 1]);
        }
      }
      std::memcpy(s.tile[c][m], acc, sizeof(acc));
    }
  }
};

}  // namespace

namespace testing {

std::unique_ptr<GemmBackend> make_emulated_amx_gemm(const GemmSpec& spec) {
  if (!serves(spec)) return nullptr;
  return std::make_unique<BlockedGemm<AmxMicro<EmulatedTiles>>>(spec);
}

}  // namespace testing
}  // namespace grpo::kernels
