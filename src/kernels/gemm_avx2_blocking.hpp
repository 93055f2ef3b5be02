// The avx2 GEMM backend's blocking (gemm_avx2.cpp) as a pure function of
// the spec, as gemm_blocking.hpp is the blocked bf16 GEMM's: BLIS's loops
// sized for a Zen 3 core (32 KiB L1, 512 KiB L2), C's columns split into one
// run of whole panels per thread for a spec with threads > 1. No ISA and no
// memory: tests/test_gemm_blocking.cpp checks it on any CPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/gemm.hpp"

namespace grpo::kernels::avx2 {

inline constexpr std::int64_t kMr = 6;   // rows of the register block
inline constexpr std::int64_t kNr = 16;  // columns of the register block (2 ymm)
// K up to kKcSingle is one k block: at the step's dW shape (K = the token
// block, 512-768 rows) no partial-sum buffer of [tile x H] is needed. Longer
// K (the forward's H, dhidden's V) goes in equal blocks of at most kKcMax,
// whose [kc][16] B panel (32 KiB) stays nearer L1: measured on a Zen 3,
// interleaved single-thread runs, dhidden ~8% faster than at 768 and the
// forward as fast.
inline constexpr std::int64_t kKcSingle = 768;
inline constexpr std::int64_t kKcMax = 512;
inline constexpr std::int64_t kMc = 72;       // rows of A per packed block (<= 216 KiB of L2 at kc = 768)
inline constexpr std::int64_t kNcMax = 1024;  // columns of B per packed block (<= 3 MiB, L3)
inline constexpr std::size_t kAlign = 64;

constexpr std::int64_t round_up(std::int64_t v, std::int64_t q) { return (v + q - 1) / q * q; }
constexpr std::size_t align_up(std::size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

struct Blocking {
  std::int64_t m = 0, n = 0, k = 0;
  std::int64_t kc = 0, mc = 0, nc = 0;  // k block; rows of A and columns of B per packed block
  int threads = 1;                      // column runs (each with its own packing buffers)
  std::int64_t cols_per_thread = 0;     // whole panels of kNr
  std::int64_t acc_ld = 0;              // floats between partial-sum rows
  // Scratch: [partial sums][per thread: B block, A block, one register tile].
  std::size_t b_bytes = 0, a_bytes = 0, tile_bytes = 0, acc_bytes = 0, per_thread = 0;

  std::size_t scratch_bytes() const { return acc_bytes + per_thread * static_cast<std::size_t>(threads); }
};

Blocking plan_blocking(const GemmSpec& spec);

}  // namespace grpo::kernels::avx2
