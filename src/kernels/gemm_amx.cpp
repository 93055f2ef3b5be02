// The AMX-BF16 GEMM backend: the blocked GEMM of gemm_blocked.hpp with
// tdpbf16ps register tiles. Register blocking: 2 x 2 accumulator tiles
// (32 x 32 f32 of C), 2 X tiles (16 rows x 32 k), 2 Y tiles (32 k x 16
// columns) = the 8 tiles of palette 1.
//
// This file alone is compiled with -mamx-tile -mamx-bf16 -mavx512bf16 (and
// AVX-512F/BW/VL); nothing here runs unless amx_usable() said yes.
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <new>

#include "kernels/gemm_blocked.hpp"

namespace grpo::kernels {
namespace {

// arch_prctl codes and the XSAVE feature number of the AMX tile data
// (linux/arch/x86/include/uapi/asm/prctl.h; Intel SDM vol. 1, 13.2).
constexpr int kArchGetXcompPerm = 0x1022;
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;
constexpr std::uint64_t kXcr0Amx = (1U << 17) | (1U << 18);  // XTILECFG, XTILEDATA
constexpr std::uint64_t kXcr0Avx512 = (1U << 1) | (1U << 2) | (1U << 5) | (1U << 6) | (1U << 7);

struct Cpu {
  bool usable = false;
  const char* reason = "";
};

std::uint64_t xcr0() {
  unsigned lo = 0, hi = 0;
  __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(lo), "=d"(hi) : "c"(0));  // xgetbv
  return (static_cast<std::uint64_t>(hi) << 32) | lo;
}

Cpu probe_cpu() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return {false, "no CPUID leaf 7"};
  const bool avx512 = ((b >> 16) & 1U) != 0 && ((b >> 30) & 1U) != 0;  // F, BW
  const bool amx_bf16 = ((d >> 22) & 1U) != 0;
  const bool amx_tile = ((d >> 24) & 1U) != 0;
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  const bool avx512_bf16 = __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) != 0 && ((a1 >> 5) & 1U) != 0;
  if (!amx_bf16 || !amx_tile) return {false, "the CPU has no AMX-BF16"};
  if (!avx512 || !avx512_bf16) return {false, "the CPU has no AVX512-BF16"};
  unsigned a0 = 0, b0 = 0, c0 = 0, d0 = 0;
  __get_cpuid(1, &a0, &b0, &c0, &d0);
  if (((c0 >> 27) & 1U) == 0) return {false, "the OS does not enable XSAVE"};
  const std::uint64_t x = xcr0();
  if ((x & kXcr0Avx512) != kXcr0Avx512) return {false, "the OS does not save the AVX-512 state"};
  if ((x & kXcr0Amx) != kXcr0Amx) return {false, "the OS does not save the AMX tile state"};
  // Linux keeps the tile data state off until a process asks (Linux >= 5.16);
  // the permission is process-wide.
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) {
    return {false, "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"};
  }
  unsigned long granted = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) != 0 || ((granted >> kXfeatureXtiledata) & 1U) == 0) {
    return {false, "Linux did not grant the AMX tile state"};
  }
  return {true, ""};
}

const Cpu& cpu() {
  static const Cpu c = probe_cpu();
  return c;
}

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

bool amx_usable() { return cpu().usable; }
const char* amx_unusable_reason() { return cpu().reason; }

std::unique_ptr<GemmBackend> make_amx_gemm(const GemmSpec& spec) {
  if (!amx_usable() || !serves(spec)) return nullptr;
  return std::make_unique<BlockedGemm<AmxMicro>>(spec);
}

}  // namespace grpo::kernels
