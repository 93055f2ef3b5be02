// Scalar eltwise ops: the fallback, and the comparison target of the AVX-512 ones.
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/eltwise.hpp"

namespace grpo::kernels {
namespace {

float load(const void* z, Elem type, std::int64_t i) {
  return type == Elem::f32 ? static_cast<const float*>(z)[i] : bf16_to_float(static_cast<const std::uint16_t*>(z)[i]);
}

float max_scalar(const void* z, Elem type, std::int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (std::int64_t i = 0; i < n; ++i) m = std::fmax(m, load(z, type, i));
  return m;
}

// Sums over a row in kLanes partial sums (element i into lane i % kLanes),
// then the lanes in a fixed order, as the AVX-512 ops and an eager
// framework's vectorized reductions do: one running f32 sum over a
// 151936-entry row was measured to put logp 6e-4 off the double oracle
// (gradcheck at V=151936 on a CPU without AVX-512), 16 of them 4e-5.
constexpr std::int64_t kLanes = 16;
template <class Term>
float lane_sum(std::int64_t n, Term term) {
  float lanes[kLanes] = {};
  for (std::int64_t i = 0; i < n; ++i) lanes[i % kLanes] += term(i);
  float s = 0.0F;
  for (const float v : lanes) s += v;
  return s;
}

float sum_exp_scalar(const void* z, Elem type, std::int64_t n, float scale, float shift) {
  return lane_sum(n, [&](std::int64_t i) { return std::exp(load(z, type, i) * scale + shift); });
}

void affine_scalar(const void* z, Elem type, std::int64_t n, float scale, float shift, float* out) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = load(z, type, i) * scale + shift;
}

void exp_scalar(const float* in, std::int64_t n, float* out) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = std::exp(in[i]);
}

float dot_scalar(const float* p, const float* logp, std::int64_t n) {
  return lane_sum(n, [&](std::int64_t i) { return p[i] == 0.0F ? 0.0F : p[i] * logp[i]; });
}

void onehot_minus_scalar(const float* p, std::int64_t n, float a, std::int64_t target, void* out, Elem out_type) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float g = a * ((i == target ? 1.0F : 0.0F) - p[i]);
    if (out_type == Elem::f32) {
      static_cast<float*>(out)[i] = g;
    } else {
      static_cast<std::uint16_t*>(out)[i] = float_to_bf16(g);
    }
  }
}

}  // namespace

const EltwiseKernels& scalar_eltwise() {
  static const EltwiseKernels k{"scalar",   max_scalar, sum_exp_scalar,     affine_scalar,
                                exp_scalar, dot_scalar, onehot_minus_scalar};
  return k;
}

const EltwiseKernels& eltwise() {
  static const EltwiseKernels& chosen = []() -> const EltwiseKernels& {
    // AVX-512 exactly when the stage kernels are: their CPU check (dispatch.cpp)
    // answers for eltwise_avx512.cpp, compiled with the same flags
    // (GRPO_SIMD=scalar or avx2 turns both off).
    return std::strcmp(kernels().name, "avx512") == 0 ? *avx512_eltwise_table() : scalar_eltwise();
  }();
  return chosen;
}

}  // namespace grpo::kernels
