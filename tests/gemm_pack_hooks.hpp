// The blocked GEMM's packers (src/kernels/gemm_pack_avx512.hpp) callable
// from the packing tests (test_gemm_packing.cpp), which are compiled for any
// x86-64: gemm_pack_hooks.cpp alone is compiled with AVX-512. Call only where
// testing::amx_emulation_runs() (the CPU has AVX-512F/BW/DQ/VL).
#pragma once

#include <cstdint>

namespace grpo::kernels::testing {

enum class PackedX : std::uint8_t { tiles, groups_bf16, groups_f32 };
enum class PackedY : std::uint8_t { vnni_bf16, vnni_f32 };

// X rows [0, rows) (<= 32) x k [0, kb) of x (element (r, k) at
// x[r * rs + k * cs], rs or cs 1) packed as one panel into out.
void pack_x_panel(PackedX layout, const std::uint16_t* x, std::int64_t rs, std::int64_t cs, std::int64_t rows,
                  std::int64_t kb, std::uint16_t* out);
// Y k [0, kb) x columns [0, nb) of y (element (k, n) at y[k * rs + n * cs])
// packed as one block into out.
void pack_y_block(PackedY layout, const std::uint16_t* y, std::int64_t rs, std::int64_t cs, std::int64_t kb,
                  std::int64_t nb, std::uint16_t* out);

}  // namespace grpo::kernels::testing
