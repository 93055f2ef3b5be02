// The AMX-BF16 GEMM backend: the blocked GEMM of gemm_blocked.hpp with the
// tdpbf16ps register block of gemm_amx_micro.hpp, on the AMX instructions.
//
// This file alone is compiled with -mamx-tile -mamx-bf16 -mavx512bf16 (and
// AVX-512F/BW/VL); nothing here runs unless amx_usable() said yes: the probe
// and the gate are in gemm_dispatch.cpp, compiled for any x86-64 (a compiler
// may use the wider ISA anywhere in this file, even before a check: an
// ASan build did, and a Zen 3 died of SIGILL in make_amx_gemm's prologue).
#include <immintrin.h>

#include <cstdint>

#include "kernels/gemm_amx_micro.hpp"
#include "kernels/gemm_blocked.hpp"

namespace grpo::kernels {
namespace {

// GCC's tile intrinsics paste their tile number into the instruction text
// ("%%tmm" #t), so each takes a literal: the template argument picks one.
#define GRPO_FOR_TILE(t, OP)       \
  if constexpr ((t) == 0) {        \
    OP(0);                         \
  } else if constexpr ((t) == 1) { \
    OP(1);                         \
  } else if constexpr ((t) == 2) { \
    OP(2);                         \
  } else if constexpr ((t) == 3) { \
    OP(3);                         \
  } else if constexpr ((t) == 4) { \
    OP(4);                         \
  } else if constexpr ((t) == 5) { \
    OP(5);                         \
  } else if constexpr ((t) == 6) { \
    OP(6);                         \
  } else {                         \
    static_assert((t) == 7);       \
    OP(7);                         \
  }

// GCC 12's tileloadd and ldtilecfg intrinsics tell the compiler nothing of
// the memory they read (tileloadd passes only the address, in a register;
// ldtilecfg declares 8 of its 64 bytes), so the stores that packed a panel
// or filled the configuration could in principle be moved past them. A
// compiler barrier before each keeps them in order (tilestored declares its
// memory clobber itself). It costs no instruction.
inline void memory_barrier() { __asm__ volatile("" ::: "memory"); }

struct AmxTiles {
  static constexpr const char* kName = "grpo:amx_bf16";
  static constexpr const char* kSwappedName = "grpo:amx_bf16 (swapped)";
  static void load_config(const TileConfig* cfg) {
    memory_barrier();
    _tile_loadconfig(cfg);
  }
  static void release() { _tile_release(); }
  template <int t>
  static void zero() {
#define GRPO_OP(n) _tile_zero(n)
    GRPO_FOR_TILE(t, GRPO_OP)
#undef GRPO_OP
  }
  template <int t>
  static void load(const void* base, long stride) {
    memory_barrier();
#define GRPO_OP(n) _tile_loadd(n, base, stride)
    GRPO_FOR_TILE(t, GRPO_OP)
#undef GRPO_OP
  }
  template <int t>
  static void store(void* base, long stride) {
#define GRPO_OP(n) _tile_stored(n, base, stride)
    GRPO_FOR_TILE(t, GRPO_OP)
#undef GRPO_OP
  }
  // The block's four products: C tile c from X tile a and Y tile b.
  template <int c, int a, int b>
  static void dpbf16ps() {
    if constexpr (c == 0 && a == 4 && b == 6) {
      _tile_dpbf16ps(0, 4, 6);
    } else if constexpr (c == 1 && a == 4 && b == 7) {
      _tile_dpbf16ps(1, 4, 7);
    } else if constexpr (c == 2 && a == 5 && b == 6) {
      _tile_dpbf16ps(2, 5, 6);
    } else {
      static_assert(c == 3 && a == 5 && b == 7, "a tile triple the block does not use");
      _tile_dpbf16ps(3, 5, 7);
    }
  }
};
#undef GRPO_FOR_TILE

}  // namespace

std::unique_ptr<GemmBackend> detail::make_amx_gemm_on_cpu(const GemmSpec& spec) {
  if (!blocked::serves(spec)) return nullptr;
  return std::make_unique<blocked::BlockedGemm<blocked::AmxMicro<AmxTiles>>>(spec);
}

}  // namespace grpo::kernels
