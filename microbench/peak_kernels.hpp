// Independent register chains that keep one arithmetic unit busy, for the
// machine-peak probe. Each function runs `iterations` loop trips and returns a
// value read from its accumulators (so the compiler cannot drop the work);
// the k*Flop constants are the FLOPs one trip executes. Only call a function
// when detect_cpu_features() reports its unit: each lives in a file compiled
// for that ISA alone.
#pragma once

#include <cstdint>

namespace grpo::bench {

// 12 zmm accumulators: enough to cover the FMA latency (4 cycles) times two
// FMA ports on current Intel and AMD cores, with registers to spare.
inline constexpr int kZmmChains = 12;
// vfmadd231ps zmm: 16 lanes x (mul + add).
inline constexpr double kF32FmaFlopPerIteration = kZmmChains * 16.0 * 2.0;
// vfmadd231ps ymm, the same 12 chains (16 ymm registers: 12 + 2 constants).
inline constexpr double kF32FmaYmmFlopPerIteration = kZmmChains * 8.0 * 2.0;
// vdpbf16ps zmm: 16 f32 lanes, each += 2 bf16 products: 16 x 2 x (mul + add).
inline constexpr double kBf16DotFlopPerIteration = kZmmChains * 16.0 * 2.0 * 2.0;
// tdpbf16ps on full tiles: C[16 x 16] f32 += A[16 x 32] bf16 * B[32 x 16] bf16,
// 16 * 16 * 32 * 2 = 16384 FLOP; four independent accumulator tiles per trip
// (its latency is several times its issue interval on Sapphire Rapids).
inline constexpr int kAmxChains = 4;
inline constexpr double kAmxBf16FlopPerIteration = kAmxChains * 16.0 * 16.0 * 32.0 * 2.0;

float f32_fma_chains(std::int64_t iterations);      // peak_kernels_avx512.cpp
float f32_fma_ymm_chains(std::int64_t iterations);  // peak_kernels_avx2.cpp
float avx512_bf16_chains(std::int64_t iterations);  // peak_kernels_avx512.cpp
// Configures the calling thread's tiles, runs, releases them. The process
// needs the tile data permission (detect_cpu_features asks for it).
float amx_bf16_chains(std::int64_t iterations);  // peak_kernels_amx.cpp

}  // namespace grpo::bench
