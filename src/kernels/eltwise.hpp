// One-pass elementwise operations over whole rows, the building blocks of the
// unfused baseline (each call is one trip through memory, as one eager
// framework op would be). Same dispatch as the stage kernels: AVX-512 when
// the CPU has it, scalar otherwise, so the baseline gets the same ISA the
// fused path gets.
#pragma once

#include <cstdint>

#include "kernels/stage_kernels.hpp"

namespace grpo::kernels {

struct EltwiseKernels {
  const char* name;
  // max_v z_v (z f32 or bf16); -inf for n == 0.
  float (*max)(const void* z, Elem type, std::int64_t n);
  // sum_v exp(z_v * scale + shift).
  float (*sum_exp)(const void* z, Elem type, std::int64_t n, float scale, float shift);
  // out_v = z_v * scale + shift.
  void (*affine)(const void* z, Elem type, std::int64_t n, float scale, float shift, float* out);
  // out_v = exp(in_v).
  void (*exp)(const float* in, std::int64_t n, float* out);
  // sum_v a_v * b_v, where a_v == 0 contributes 0 even if b_v = -inf (p log p -> 0).
  float (*dot_p_logp)(const float* p, const float* logp, std::int64_t n);
  // out_v = a * ([v == target] - p_v), out f32 or bf16.
  void (*onehot_minus)(const float* p, std::int64_t n, float a, std::int64_t target, void* out, Elem out_type);
};

const EltwiseKernels& scalar_eltwise();
const EltwiseKernels* avx512_eltwise_table();  // eltwise_avx512.cpp: only once avx512_kernels() is non-null
const EltwiseKernels& eltwise();               // follows kernels(): AVX-512 when the stage kernels are

}  // namespace grpo::kernels
