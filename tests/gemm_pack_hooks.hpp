// The blocked GEMM's packers (src/kernels/gemm_pack_avx512.hpp,
// gemm_pack_avx2.hpp) callable from the packing tests
// (test_gemm_packing.cpp), which are compiled for any x86-64:
// gemm_pack_hooks.cpp alone is compiled with AVX-512, gemm_pack_hooks_avx2.cpp
// with AVX2, FMA and F16C. Call the first's only where
// testing::amx_emulation_runs() (the CPU has AVX-512F/BW/DQ/VL), the
// second's only where avx2_gemm_usable().
#pragma once

#include <cstdint>

#include "grpo/types.hpp"

namespace grpo::kernels::testing {

enum class PackedX : std::uint8_t { tiles, groups_bf16, groups_f32 };
enum class PackedY : std::uint8_t { vnni_bf16, vnni_f32 };

// X rows [0, rows) (<= 32) x k [0, kb) of x (element (r, k) at
// x[r * rs + k * cs], rs or cs 1, of dtype: bf16 for every layout; f16 or
// f32 for the f32 ones) packed as one panel into out.
void pack_x_panel(PackedX layout, const void* x, DType dtype, std::int64_t rs, std::int64_t cs, std::int64_t rows,
                  std::int64_t kb, std::uint16_t* out);
// Y k [0, kb) x columns [0, nb) of y (element (k, n) at y[k * rs + n * cs],
// dtype as pack_x_panel's) packed as one block into out.
void pack_y_block(PackedY layout, const void* y, DType dtype, std::int64_t rs, std::int64_t cs, std::int64_t kb,
                  std::int64_t nb, std::uint16_t* out);

// The avx2 micro's layouts (gemm_avx2_micro.hpp): X rows [0, rows) (<= 24) x
// k [0, kb) as one panel of XRowGroups<6, F32>; Y k [0, kb) x columns
// [0, nb) as one block of YVnni<F32>. Sources of bf16, f16 or f32 elements,
// addressed as above.
void pack_x_panel_avx2(const void* x, DType dtype, std::int64_t rs, std::int64_t cs, std::int64_t rows, std::int64_t kb,
                       float* out);
void pack_y_block_avx2(const void* y, DType dtype, std::int64_t rs, std::int64_t cs, std::int64_t kb, std::int64_t nb,
                       float* out);

}  // namespace grpo::kernels::testing
